"""The worker process of a supervised campaign (:mod:`kvfuzz.fuzz.campaign.workers.supervisor`; docs/campaigns.md).

A worker builds the campaign's targets and a :class:`~kvfuzz.fuzz.campaign.engine.Campaign` per target, then
runs the tasks the supervisor sends over its pipe (replay the database for a target, explore a chunk of seeds,
re-run one example), reporting every example as it happens (begin, phase, end, new failures: a
:class:`PipeListener`). It dies with its supervisor (``PR_SET_PDEATHSIG`` plus a watchdog on its parent pid),
ignores Ctrl-C (the supervisor stops it) and stops on SIGTERM after the example in flight. The pipe's messages,
worker to supervisor: ``ready``, ``begin``, ``phase``, ``end``, ``seen``, ``failure``, ``spent``,
``memory``, ``done``, ``warning``, ``fatal``, ``disk_full``, ``bye``; supervisor to worker: ``replay``, ``chunk``,
``retry``, ``stop``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import attrs

from kvfuzz.fuzz.campaign.store.journal import OutOfSpace, disk_full
from kvfuzz.fuzz.campaign.workers.mps import PIPES_ENV, SHARED_ENV, visible_devices

# This module is what a spawned worker imports first (it unpickles worker_main): it imports neither torch nor
# Hypothesis nor kvfuzz's harness, so that the worker sets up (its log, dying with its parent, ignoring Ctrl-C,
# its GPU) before anything heavy loads. worker_main imports the rest once that is done.


@attrs.frozen
class WorkerSpec:
    """Everything a worker needs, picklable: the target names/specs as the user gave them, the campaign config
    as plain values (``config``: CampaignConfig fields, fault by name), its index and GPU, torch threads, and
    where to write Hypothesis observations (None: not at all)."""

    targets: tuple[str, ...]
    config: dict
    index: int
    parent_pid: int
    log: str
    gpu: int | None = None
    threads: int = 1
    observe_dir: str | None = None
    #: the campaign's workers on this worker's GPU (memory.Releases: the share of the GPU each may keep cached)
    gpu_workers: int = 1


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, and watch the parent pid besides (the
    prctl fires when the parent *thread* exits, and not at all if the parent died before it was set)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    if os.getppid() != parent_pid:
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="kvfuzz-parent-watch").start()


#: glibc malloc settings of a worker (``mallopt``): an example allocates and frees tensors of up to ~100 MiB
#: (caches, ground truth, the fp64 reference's intermediates), which glibc's defaults hand back to the kernel on
#: free (blocks over the 32 MiB at most that its mmap threshold rises to, a heap top over the trim threshold),
#: so each example paid again for page faults and zeroed pages (a fifth of a vllm.cpu_attention worker's time
#: was system time). Blocks under ``M_MMAP_THRESHOLD`` come from the heap and up to ``M_TRIM_THRESHOLD`` bytes
#: of freed heap stay with the process; larger blocks (``--big-cache``'s caches of several GiB) are still mapped
#: and returned on free. Between tasks, :func:`trim_heap` gives back what a rare big example left past
#: :data:`HEAP_KEEP`.
MALLOC_SETTINGS = {"M_TRIM_THRESHOLD": (-1, 1 << 30), "M_TOP_PAD": (-2, 64 << 20), "M_MMAP_THRESHOLD": (-3, 1 << 30)}


def tune_malloc() -> bool:
    """Apply :data:`MALLOC_SETTINGS` with glibc's ``mallopt``; returns whether every setting was taken
    (False, changing nothing more, where the C library is not glibc). Never raises."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl, macOS: leave their allocator alone
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in MALLOC_SETTINGS.values()])


#: Bytes of freed heap a worker may keep resident between tasks (:func:`trim_heap`). Under
#: :data:`MALLOC_SETTINGS` every freed block stays in the heap, so a worker's RSS is the high-water mark of the
#: largest example it has run: the fp64 reference and envelope of a vllm.cpu_attention batch of 119 query tokens,
#: 64 heads and head size 512 take ~460 MiB for a moment, and a worker that met it kept ~1.2 GiB of freed heap
#: for the rest of its life (docs/campaigns.md, "What a long campaign costs"). An ordinary example reuses far
#: less than this.
HEAP_KEEP = 256 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_retained() -> int | None:
    """Bytes of this process's anonymous resident memory (``RssAnon``, /proc/self/status) beyond what malloc has
    handed out and not freed (glibc's ``mallinfo2``: ``uordblks`` in its arenas, ``hblkhd`` mapped apart): the
    freed heap glibc keeps resident, plus the few tens of MiB of anonymous memory malloc does not manage (Python's
    object arenas, thread stacks). None without glibc 2.33 or /proc."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        status = Path("/proc/self/status").read_text()
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2
    anon = next((int(line.split()[1]) << 10 for line in status.splitlines() if line.startswith("RssAnon:")), None)
    if anon is None:
        return None
    info = mallinfo2()
    return anon - info.uordblks - info.hblkhd


def trim_heap(keep: int = HEAP_KEEP) -> bool:
    """Between tasks: when more than ``keep`` bytes of freed heap are resident (:func:`heap_retained`), give every
    freed page back to the kernel (glibc's ``malloc_trim(0)``: the heap's free top and the free pages inside it);
    returns whether it did. The next examples fault in again what they use, once; a worker's RSS stays near what
    it uses rather than the largest example it ever ran. Never raises; False where the C library is not glibc."""
    retained = heap_retained()
    if retained is None or retained <= keep:
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


#: Seconds between a worker's reports of the CUDA memory it holds (``memory``, after an example ends).
MEMORY_SECONDS = 5.0


def gpu_memory() -> tuple[int, int] | None:
    """The bytes of CUDA memory this process's caching allocator reserves and has allocated
    (``torch.cuda.memory_reserved``, ``memory_allocated``), or None where CUDA is not in use here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


class PipeListener:
    """The Campaign listener of a worker: every event goes to the supervisor, and after an example, at most every
    :data:`MEMORY_SECONDS`, the CUDA memory it holds (``memory``; nothing off CUDA)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._memory_at = -MEMORY_SECONDS

    def begin(self, target, example) -> None:
        self.conn.send(("begin", target, example.to_dict()))

    def phase(self, name) -> None:
        self.conn.send(("phase", name))

    def end(self, target, outcome) -> None:
        self.conn.send(("end", target, attrs.asdict(outcome)))
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_SECONDS:
            self._memory_at = now
            held = gpu_memory()
            if held is not None:
                self.conn.send(("memory", *held))

    def failure(self, record) -> None:
        self.conn.send(("failure", record.target, attrs.asdict(record)))

    def seen(self, record) -> None:
        self.conn.send(("seen", record.target, attrs.asdict(record)))

    def spent(self, target, tier, seconds) -> None:
        self.conn.send(("spent", target, tier, seconds))


def gpu_environment(gpu: int, env) -> None:
    """Put a worker on the campaign's GPU ``gpu`` in ``env`` (os.environ): ``CUDA_VISIBLE_DEVICES`` that GPU's
    device (the ``gpu``-th of the campaign's own ``CUDA_VISIBLE_DEVICES`` when it has one: a campaign on devices
    2,3 puts GPU 0 on "2"), and under per-GPU MPS daemons (kvfuzz.fuzz.campaign.workers.mps, ``KVFUZZ_MPS_PIPES``)
    that GPU's daemon's pipe as ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES=0``: the daemon was started
    seeing only its GPU, which is its clients' device 0. Without that mask the client's torch counts the host's
    GPUs through NVML while CUDA gives it one, and a worker not on the first GPU dies at CUDA's lazy init
    (torch.cuda._check_capability). Under one daemon kvfuzz started for all the campaign's GPUs
    (``KVFUZZ_MPS_SHARED``), which sees only the campaign's devices, the index ``gpu`` itself: a one-GPU campaign
    on device "3" is the server's device 0 (naming "3" there, its workers would find no GPU). ``KVFUZZ_DEVICE``
    keeps the physical device in every case (a sanitized child runs outside MPS: kvfuzz.fuzz.harness.sanitizer)."""
    pipes = [p for p in env.get(PIPES_ENV, "").split(",") if p]
    env["KVFUZZ_DEVICE"] = visible_devices(gpu + 1, env)[gpu]  # its physical GPU, outside MPS too
    if gpu < len(pipes):
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipes[gpu]
        env["CUDA_VISIBLE_DEVICES"] = "0"
        return
    if env.get(SHARED_ENV) and env.get("CUDA_MPS_PIPE_DIRECTORY"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        return
    env["CUDA_VISIBLE_DEVICES"] = env["KVFUZZ_DEVICE"]


def worker_main(spec: WorkerSpec, conn) -> None:
    """A worker's life: set up, say ready, run tasks until told to stop, say goodbye."""
    _set_up(spec)
    # set up: the heavy imports may come (the comment at the top)
    from kvfuzz.fuzz.harness.isolation import ISOLATED, STOP

    ISOLATED.set()  # a kernel that breaks the device ends this process (harness.isolation)
    signal.signal(signal.SIGTERM, stop_on_term(STOP))
    try:
        _serve(spec, conn)
    finally:  # a SIGTERM now (the group's, then the supervisor's) must not raise in an atexit callback
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_on_term(stop):
    """The worker's SIGTERM handler: set ``stop`` (checked at every example, in case kernel code swallows the
    KeyboardInterrupt) and raise KeyboardInterrupt, once: a second SIGTERM (the process group's, then the
    supervisor's own) finds the worker already stopping and only sets ``stop``, so it never lands in the handling
    of the first or in an atexit callback ("Exception ignored in atexit callback ... KeyboardInterrupt")."""

    def term(signum, frame):
        if stop.is_set():
            return
        stop.set()
        raise KeyboardInterrupt

    return term


def _serve(spec: WorkerSpec, conn) -> None:
    """Load the campaign, say ready, run tasks until told to stop, say goodbye (:func:`worker_main`'s body)."""
    config = releases = None
    try:
        import torch

        from kvfuzz.fuzz.campaign.config import config_from_dict
        from kvfuzz.fuzz.campaign.store.database import DatabaseError

        torch.set_num_threads(spec.threads)
        if spec.gpu is not None:  # a CUDA campaign: listen for Triton's compiles from the first kernel call on
            _import_triton()
        config = config_from_dict(spec.config)
        try:
            config.db()
        except DatabaseError as e:
            conn.send(("fatal", str(e)))
            return
        campaign, releases = _campaigns(spec, config, PipeListener(conn))
        observing = _observing(spec)
        conn.send(("ready", os.getpid()))
        with observing:
            _run_tasks(conn, campaign, releases)
    except KeyboardInterrupt:
        pass  # stopped: say goodbye below
    except OutOfSpace as e:  # a full disk: the supervisor ends the campaign (exit 3), keeping what was written
        conn.send(("disk_full", str(e)))
        _quiet_streams()
    except Exception as e:  # kvfuzz itself broke outside any example: tell the supervisor, with the traceback
        _broke(spec, conn, e)
        return
    _report_database_errors(conn, config)
    if releases is not None:
        releases.close()
    conn.send(("bye",))


def _campaigns(spec: WorkerSpec, config, listener):
    """``(campaign, releases)``: ``campaign(name)``, the worker's one Campaign per target (made on first use), and
    the worker's :class:`~kvfuzz.fuzz.harness.memory.Releases`, shared by them (it gives back this process's
    cached device memory and every target's kernel library's pools)."""
    from kvfuzz.fuzz.campaign.engine import Campaign
    from kvfuzz.fuzz.harness.memory import Releases, release_device_memory
    from kvfuzz.fuzz.targets import get_target

    targets = {t.name: t for t in (get_target(n) for n in spec.targets)}
    campaigns: dict = {}

    def release() -> None:
        release_device_memory()
        for t in targets.values():
            t.release_memory()

    releases = Releases(config.out, release=release)

    def campaign(name: str):
        return campaigns.get(name) or campaigns.setdefault(name, Campaign(targets[name], config, listener,
                                                                           releases=releases))

    return campaign, releases


def _set_up(spec: WorkerSpec) -> None:
    """Before anything heavy loads: die with the supervisor, write stdout and stderr to the worker's log, take
    the campaign's GPU, leave Ctrl-C to the supervisor (which stops the worker)."""
    _die_with_parent(spec.parent_pid)
    tune_malloc()
    log = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    if spec.gpu is not None:
        gpu_environment(spec.gpu, os.environ)
        os.environ["KVFUZZ_GPU_WORKERS"] = str(spec.gpu_workers)
    for s in (signal.SIGINT, signal.SIGHUP):  # Ctrl-C, a closed terminal: they reach the supervisor, which stops us
        signal.signal(s, signal.SIG_IGN)


def _run_tasks(conn, campaign, releases) -> None:
    """Run the supervisor's tasks until it says ``stop``: each on its target's Campaign (``campaign(name)``),
    knowing the signatures found and the examples that ended workers elsewhere and the deadline; then what it cut
    short and ``done``."""
    from kvfuzz.contracts.model.example import Example  # loaded with the engine already
    from kvfuzz.fuzz.campaign.steering import Plan

    while True:
        trim_heap()  # a big example's freed heap goes back to the system (HEAP_KEEP)
        releases.idle()  # waiting for a task: nothing kept cached, and nobody waits on this worker
        task = conn.recv()
        if task[0] == "stop":
            return
        kind, tid, name, *args = task
        c = campaign(name)
        c.ledger.learn(args[-1]["signatures"], args[-1]["ended"])
        c.deadline = args[-1].get("deadline")
        cut = len(c.cut_short)
        if kind == "replay":
            c.replay_database()
        elif kind == "chunk":
            plan = args[-1].get("plan")
            c.run_chunk(args[0], args[1], None if plan is None else Plan.from_dict(plan))
        elif kind == "retry":
            c.check_one(Example.from_dict(args[0]))
        _warn_cut_short(conn, name, c.cut_short[cut:])
        conn.send(("done", tid))


def _warn_cut_short(conn, name: str, cut_short: list[str]) -> None:
    """Warn of what a task's ``--duration`` cut short (each once), but a generation (every --duration campaign ends
    so: nothing was cut short)."""
    for what in dict.fromkeys(cut_short):
        if what == "generating":
            continue
        if what.startswith("shrinking past"):  # a failure found in time, shrunk within the grace
            conn.send(("warning", f"{name}: kept {what}: a failure found before the deadline"))
            continue
        conn.send(("warning", f"{name}: --duration ran out while {what}; what it found is recorded "
                              "as shrunk so far"))


def _broke(spec: WorkerSpec, conn, e: Exception) -> None:
    """kvfuzz itself broke outside any example: a full disk ends the campaign (exit 3: ``disk_full``, then
    ``bye``); an MPS server not yet taking clients ends this worker for another; anything else is ``fatal``,
    with the traceback in the worker's log."""
    from kvfuzz.fuzz.harness.isolation import exit_if_mps_busy

    if disk_full(e):
        conn.send(("disk_full", str(OutOfSpace(getattr(e, "filename", None) or spec.config["out"], e))))
        _quiet_streams()
        conn.send(("bye",))
        return
    exit_if_mps_busy(e)  # the MPS server is not taking clients yet: the supervisor starts another worker
    conn.send(("fatal", f"worker {spec.index}: {type(e).__name__}: {e} (traceback in {spec.log})"))
    try:
        traceback.print_exc()
    except OSError:
        pass


def _import_triton() -> None:
    """Import Triton where it is installed, so that the first kernel call's compiles are told apart from its time
    (kvfuzz.fuzz.harness.kernel_clock hooks Triton once it is imported)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    from kvfuzz.fuzz.harness.kernel_clock import COMPILES

    COMPILES.listen()


def _quiet_streams() -> None:
    """After a full disk: the log (stdout, stderr) cannot take what it still buffers; drop it, so the worker's
    exit does not fail flushing it."""
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except (OSError, ValueError):
            setattr(sys, name, open(os.devnull, "w"))


def _report_database_errors(conn, config) -> None:
    """Tell the supervisor how many operations of a shared (Redis) database failed in this worker."""
    if config is None or config.database is None:
        return
    from kvfuzz.fuzz.campaign.store.database import remote_errors  # loaded by worker_main already

    n, last = remote_errors(config.database)
    if n:
        try:
            conn.send(("warning", f"the shared example database failed {n} time(s) (last: {last}); every failure "
                                  f"is also in {config.out / 'hypothesis-db'}"))
        except (OSError, ValueError):
            pass


def _observing(spec: WorkerSpec):
    if spec.observe_dir is None:
        return contextlib.nullcontext()
    from kvfuzz.fuzz.campaign.observability import observe_to  # loads Hypothesis: after the set-up

    return observe_to(Path(spec.observe_dir), prefix=f"w{spec.index}_")


__all__ = ["HEAP_KEEP", "MALLOC_SETTINGS", "MEMORY_SECONDS", "PipeListener", "WorkerSpec", "gpu_environment",
           "gpu_memory", "heap_retained", "stop_on_term", "trim_heap", "tune_malloc", "worker_main"]
