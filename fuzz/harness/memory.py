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


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory: ``torch.OutOfMemoryError``, or a RuntimeError whose
    text says CUDA ran out of memory where it is not one: Triton's module load ("CUDA driver error: out of
    memory", a flex_attention kernel on an H200 other processes had filled), torch's AcceleratorError
    ("CUDA error: out of memory")."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "CUDA" in text and "out of memory" in text.lower())


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


__all__ = ["BIG_EXAMPLE_BYTES", "DEVICE_FULL_FREE_SHARE", "LOCK_NAME", "RETRIES_OUT_OF_MEMORY", "cache_bytes",
           "device_full", "device_label", "device_memory_lock", "file_lock", "is_big", "is_out_of_memory", "lock_path",
           "release_device_memory"]
