"""Device memory around big examples: a campaign's workers share one GPU, and a big-cache example's caches are
several GiB each (at fp16 at least 4 GiB per cache, :func:`kvfuzz.strategies.batches.big_cache_examples`).

Measured on an H100 (2026-11-25, benchmarks/results/tiers-h100.json's first run): a 160 s ``--tier auto``
campaign of vllm.unified_attention with 14 workers raised ``torch.OutOfMemoryError`` in kvfuzz's own checks of
two big-cache examples. Three things put it there: several workers in a big-cache chunk at once, PyTorch's caching
allocator keeping each worker's freed caches reserved for that process, and the CUDA-graph padding snapshot's full
copy of both caches. So an example whose caches exceed :data:`BIG_EXAMPLE_BYTES` runs holding the campaign's
device-memory lock (:func:`device_memory_lock`: one such example at a time per GPU of a ``--out``) and gives its memory
back to the device after it passes (:func:`release_device_memory`); the padding snapshot digests a big cache
instead of copying it (:mod:`kvfuzz.fuzz.harness.padding`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import re
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from kvfuzz.contracts.caches.materialize import FULL_POISON_MAX_BYTES
from kvfuzz.contracts.model.batch import Batch

#: Caches (keys and values together) above this many bytes make an example big: the size above which
#: materialization poisons only the referenced blocks (1 GiB).
BIG_EXAMPLE_BYTES = FULL_POISON_MAX_BYTES
#: The lock file of each GPU (:func:`device_label`), in the campaign's ``--out``.
LOCK_NAME = "device-memory-gpu-{}.lock"


def cache_bytes(batch: Batch) -> int:
    """Bytes of ``batch``'s key and value caches together, as the paged layouts allocate them:
    ``2 * num_blocks * block_size * num_kv_heads * head_size`` elements of the cache dtype (1 byte for an fp8
    ``kv_cache_dtype``). An estimate for the latent (MLA) layout, which holds one cache: twice its size."""
    elements = batch.num_blocks * batch.block_size * batch.num_kv_heads * batch.head_size
    return 2 * elements * torch.empty((), dtype=batch.cache_dtype).element_size()


def is_big(batch: Batch) -> bool:
    """Whether ``batch``'s caches exceed :data:`BIG_EXAMPLE_BYTES`."""
    return cache_bytes(batch) > BIG_EXAMPLE_BYTES


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock on file ``path`` (``fcntl.flock``: released by the kernel when the holder dies, so a
    worker killed while holding it blocks nobody) and yield True; ``wait`` False: yield False at once when another
    process holds it. OSError if the file cannot be opened."""
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def device_label(env=None) -> str:
    """This worker's physical GPU, as a file-name-safe label: ``KVFUZZ_DEVICE`` (set for each campaign worker by
    kvfuzz.fuzz.campaign.workers.worker.gpu_environment; under MPS ``CUDA_VISIBLE_DEVICES`` is 0 in every worker),
    else the first of ``CUDA_VISIBLE_DEVICES``, else "0". ``env``: default ``os.environ``."""
    env = os.environ if env is None else env
    device = env.get("KVFUZZ_DEVICE") or env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return re.sub(r"[^A-Za-z0-9_-]", "_", device)


def lock_path(directory: Path, env=None) -> Path:
    """The device-memory lock file of this worker's GPU (:func:`device_label`) in ``directory``."""
    return Path(directory) / LOCK_NAME.format(device_label(env))


@contextlib.contextmanager
def device_memory_lock(directory: Path) -> Iterator[None]:
    """Hold the exclusive lock of this worker's GPU, ``directory/device-memory-gpu-<device>.lock``
    (:func:`lock_path`, :func:`file_lock`). Waits for it; OSError if the file cannot be opened.

    Per GPU, not per campaign: a big example fills its own GPU's memory, not another's. One lock for all GPUs of a
    campaign had its big examples wait on each other across GPUs: on a 4x H200 host (16 cores a GPU,
    benchmarks/results/gpu-multi-scaling-h200x4.txt) four GPUs ran 3.1x one GPU's examples/s but 0.85x its KV
    tokens/s, the big-cache tier's share of each worker's time going to the wait."""
    with file_lock(lock_path(directory)):
        yield


#: Set while a campaign (kvfuzz.fuzz.campaign.runner) runs an example without the device-memory lock, which it
#: re-runs holding the lock if the device runs out of memory: a kernel's ``torch.OutOfMemoryError`` then goes to
#: the campaign instead of becoming a finding (kvfuzz.fuzz.harness.run.run_kernel); alone on the device (the
#: lock held, this clear) it is the kernel's finding. Clear everywhere else (a replay, a user's own check).
RETRIES_OUT_OF_MEMORY = threading.Event()


def release_device_memory(collect: bool = False) -> None:
    """Give this process's unused cached device memory back to the device (``torch.cuda.empty_cache``; with
    ``collect``, after a garbage collection, for tensors only a reference cycle still holds); nothing where CUDA
    was never initialized."""
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


#: An allocation that failed inside an extension built on torch's stable ABI (FA3's ``_vllm_fa3_C.fwd``, torch 2.11's
#: ``torch/csrc/stable/ops.h``): the shim turns the allocator's OutOfMemoryError into an error code, and the extension
#: raises a RuntimeError that names only the failed operator. Seen on an H100 (2026-11-28) for an FA3 call whose
#: split accumulators took 7.9 GB while 15 other workers shared the GPU.
_STABLE_ABI_ALLOCATION = re.compile(
    r'torch_call_dispatcher\(\s*"aten::(new_empty|empty|new_zeros|zeros|empty_strided|new_empty_strided|full)"'
    r'.*API call failed', re.S)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory: ``torch.OutOfMemoryError``, or a RuntimeError whose
    text says CUDA ran out of memory where it is not one: Triton's module load ("CUDA driver error: out of
    memory", a flex_attention kernel on an H200 other processes had filled), torch's AcceleratorError
    ("CUDA error: out of memory"); or, once CUDA is in use, a stable-ABI extension's failed allocation
    (:data:`_STABLE_ABI_ALLOCATION`: its text lost the cause). Each is re-run alone on the device before anything
    is decided (kvfuzz.fuzz.harness.run.run_kernel): an allocation that fails there too on a device that is not
    full is the kernel's finding."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    if "CUDA" in text and "out of memory" in text.lower():
        return True
    return bool(_STABLE_ABI_ALLOCATION.search(text)) and torch.cuda.is_available() and torch.cuda.is_initialized()


#: A kernel call that ran out of memory on its last retry (holding the device-memory lock) is the kernel's finding
#: only while at least this share of its GPU is free (:func:`device_full`): less, and other processes (another
#: campaign, a test suite) had filled the device, which the kernel cannot be blamed for.
DEVICE_FULL_FREE_SHARE = 0.1


def device_full() -> bool:
    """Whether less than :data:`DEVICE_FULL_FREE_SHARE` of this process's GPU is free once this process has given
    back its cached memory (``torch.cuda.mem_get_info``); False off CUDA or when CUDA cannot say."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
    except RuntimeError:
        return False
    return free < DEVICE_FULL_FREE_SHARE * total


#: The release-request file of each GPU (:func:`device_label`), in the campaign's ``--out``: its size is the number
#: of requests made so far (:class:`Releases`).
RELEASE_NAME = "device-memory-gpu-{}.release"
#: Each worker's answer to the requests of its GPU: ``device-memory-gpu-<gpu>.ack-<pid>`` holds "<requests seen>
#: <holding>" (holding 0: it keeps no cached device memory now, as between tasks).
ACK_NAME = "device-memory-gpu-{}.ack-{}"
#: Seconds a worker that asked for memory waits for every other live worker of its GPU to answer (one finishing a
#: long example answers after it); past it, it goes on with what was given back.
RELEASE_WAIT_SECONDS = float(os.environ.get("KVFUZZ_RELEASE_WAIT", "20"))
#: Share of its GPU's memory the workers on it may keep cached between examples, all together
#: (:meth:`Releases.trim`): each keeps at most ``WORKER_CACHE_SHARE * total / workers``.
WORKER_CACHE_SHARE = 0.5


class Releases:
    """The cached device memory of a campaign's workers sharing one GPU, given back on request.

    PyTorch's caching allocator keeps what a worker's largest example used reserved for that worker, freed or
    not; with 14 workers on one GPU, memory that nobody is using fills the device and an example that needs
    room finds none, although the GPU is idle (issue 49). So a worker that needs room (before it takes the
    device-memory lock, and before it runs again an example that ran out of memory) :meth:`request` s it:
    every other worker of the GPU gives its cached memory back at its next :meth:`poll` (between examples, and
    when it waits for a task or the lock) and says so; the requester waits for their answers (at most
    :data:`RELEASE_WAIT_SECONDS`). And between examples each worker keeps at most its share of the GPU cached
    (:meth:`trim`).

    ``directory``: the campaign's ``--out`` (None: no other worker to ask; only this process's memory is given
    back). ``release``: what giving back means for this process (default :func:`release_device_memory`; a
    target whose kernel library pools memory of its own adds its own). ``workers``: the campaign's workers on
    this GPU (the supervisor's ``KVFUZZ_GPU_WORKERS``). The files: :data:`RELEASE_NAME`, :data:`ACK_NAME`
    (each worker removes its own when it ends; a dead worker's is ignored)."""

    def __init__(self, directory: Path | None, release=None, workers: int | None = None, env=None) -> None:
        env = os.environ if env is None else env
        self.directory = None if directory is None else Path(directory)
        self.release = release or release_device_memory
        self.workers = max(1, workers or int(env.get("KVFUZZ_GPU_WORKERS") or 1))
        self.label = device_label(env)
        self.seen = self._requests()
        self._holding = True
        self._cap: int | None = None

    def _path(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / name

    def _requests(self) -> int:
        path = self._path(RELEASE_NAME.format(self.label))
        try:
            return 0 if path is None else path.stat().st_size
        except OSError:
            return 0

    def _answer(self, holding: bool) -> None:
        path = self._path(ACK_NAME.format(self.label, os.getpid()))
        if path is None:
            return
        self._holding = holding
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{self.seen} {int(holding)}")
            os.replace(tmp, path)
        except OSError:
            pass  # no --out yet, or a full disk: nobody waits on this worker for long (RELEASE_WAIT_SECONDS)

    def poll(self) -> bool:
        """Between examples: give this process's cached memory back if another worker asked since the last poll,
        and answer; returns whether it gave memory back."""
        requests = self._requests()
        if requests == self.seen:
            if not self._holding:
                self._answer(True)  # it runs examples again
            return False
        self.seen = requests
        self.release()
        self._answer(True)
        return True

    def idle(self) -> None:
        """Waiting (for a task, for the lock): give everything cached back and say so, so that no request waits
        on this worker while it runs nothing."""
        self.seen = self._requests()
        self.release()
        self._answer(False)

    def request(self, wait: bool = True) -> int:
        """Ask every other worker of this GPU to give its cached memory back, give this process's back, and (with
        ``wait``) wait until each live one has answered or holds nothing, for at most
        :data:`RELEASE_WAIT_SECONDS`; returns how many did not answer in time."""
        self.release()
        path = self._path(RELEASE_NAME.format(self.label))
        if path is None:
            return 0
        try:
            with open(path, "ab") as f:  # one byte a request: the file's size counts them
                f.write(b".")
        except OSError:
            return 0
        wanted = self.seen = self._requests()
        self._answer(True)
        deadline = time.monotonic() + (RELEASE_WAIT_SECONDS if wait else 0.0)
        while True:
            late = self._late(wanted)
            if not late or time.monotonic() >= deadline:
                return len(late)
            time.sleep(0.02)

    def _late(self, wanted: int) -> list[Path]:
        """The answer files of other live workers of this GPU that saw fewer than ``wanted`` requests while
        holding memory."""
        late = []
        for path in self.directory.glob(ACK_NAME.format(self.label, "*")):
            pid = path.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            if not _alive(int(pid)):  # a worker killed before it could remove its answer
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            try:
                seen, holding = (int(x) for x in path.read_text().split())
            except (OSError, ValueError):
                continue  # being replaced, or a partial file of a worker that died writing it
            if holding and seen < wanted:
                late.append(path)
        return late

    def trim(self) -> bool:
        """Between examples: give this process's cached device memory back when it keeps more than its share
        (:data:`WORKER_CACHE_SHARE` of the GPU over its workers) unused; returns whether it did. Nothing off
        CUDA."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return False
        if self._cap is None:
            self._cap = int(WORKER_CACHE_SHARE * torch.cuda.get_device_properties(0).total_memory / self.workers)
        if torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= self._cap:
            return False
        self.release()
        return True

    def close(self) -> None:
        """Remove this worker's answer file (it holds nothing once it ends)."""
        path = self._path(ACK_NAME.format(self.label, os.getpid()))
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def footprint(batch: Batch) -> dict[str, int]:
    """What an example of ``batch`` holds on the device, in bytes, for the skipped-for-memory diagnosis: its caches
    (:func:`cache_bytes`) and this process's allocator (``reserved``, ``allocated``) and device (``free``,
    ``total``) when CUDA is in use."""
    out = {"cache_bytes": cache_bytes(batch)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with contextlib.suppress(RuntimeError):
            free, total = torch.cuda.mem_get_info()
            out |= {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
                    "free": free, "total": total}
    return out


__all__ = ["ACK_NAME", "RELEASE_NAME", "RELEASE_WAIT_SECONDS", "WORKER_CACHE_SHARE", "Releases", "footprint",
           "BIG_EXAMPLE_BYTES", "DEVICE_FULL_FREE_SHARE", "LOCK_NAME", "RETRIES_OUT_OF_MEMORY", "cache_bytes",
           "device_full", "device_label", "device_memory_lock", "file_lock", "is_big", "is_out_of_memory", "lock_path",
           "release_device_memory"]
