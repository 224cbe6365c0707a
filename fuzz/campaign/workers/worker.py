"""The worker process of a supervised campaign (:mod:`kvfuzz.fuzz.campaign.workers.supervisor`; docs/campaigns.md).

A worker builds the campaign's targets and a :class:`~kvfuzz.fuzz.campaign.engine.Campaign` per target, then
runs the tasks the supervisor sends over its pipe (replay the database for a target, explore a chunk of seeds,
re-run one example), reporting every example as it happens (begin, phase, end, new failures: a
:class:`PipeListener`). It dies with its supervisor (``PR_SET_PDEATHSIG`` plus a watchdog on its parent pid),
ignores Ctrl-C (the supervisor stops it) and stops on SIGTERM after the example in flight. The pipe's messages,
worker to supervisor: ``ready``, ``begin``, ``phase``, ``end``, ``seen``, ``failure``, ``done``, ``warning``,
``fatal``, ``disk_full``, ``bye``; supervisor to worker: ``replay``, ``chunk``, ``retry``, ``stop``.
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
#: and returned on free.
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


class PipeListener:
    """The Campaign listener of a worker: every event goes to the supervisor."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def begin(self, target, example) -> None:
        self.conn.send(("begin", target, example.to_dict()))

    def phase(self, name) -> None:
        self.conn.send(("phase", name))

    def end(self, target, outcome) -> None:
        self.conn.send(("end", target, attrs.asdict(outcome)))

    def failure(self, record) -> None:
        self.conn.send(("failure", record.target, attrs.asdict(record)))

    def seen(self, record) -> None:
        self.conn.send(("seen", record.target, attrs.asdict(record)))


def gpu_environment(gpu: int, env) -> None:
    """Put a worker on the campaign's GPU ``gpu`` in ``env`` (os.environ): ``CUDA_VISIBLE_DEVICES`` that GPU's
    device (the ``gpu``-th of the campaign's own ``CUDA_VISIBLE_DEVICES`` when it has one: a campaign on devices
    2,3 puts GPU 0 on "2"; it had put it on "0"), and under per-GPU MPS daemons (kvfuzz.fuzz.campaign.workers.mps,
    ``KVFUZZ_MPS_PIPES``) that GPU's daemon's pipe as ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES=0``:
    the daemon was started seeing only its GPU, which is its clients' device 0. Without a mask the client's torch
    counted the host's GPUs through NVML (4 on a 4-GPU host) while CUDA gave it one, and every worker not on the
    first GPU died at CUDA's lazy init ("device=1, num_gpus=1", torch.cuda._check_capability; a two- and a
    four-GPU campaign on an H200 host ran 10 examples each).
    Under one daemon kvfuzz started for all the campaign's GPUs (``KVFUZZ_MPS_SHARED``), which sees only the
    campaign's devices, the index ``gpu`` itself: a one-GPU campaign on device "3" is the server's device 0 (with
    "3" its workers found no GPU; found on a 4-GPU H200 host, one campaign per GPU). ``KVFUZZ_DEVICE`` keeps the
    physical device in every case (a sanitized child runs outside MPS: kvfuzz.fuzz.harness.sanitizer)."""
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
    _die_with_parent(spec.parent_pid)
    tune_malloc()
    log = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    if spec.gpu is not None:
        gpu_environment(spec.gpu, os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us

    # set up: the heavy imports may come (the comment at the top)
    from kvfuzz.fuzz.harness.isolation import ISOLATED, STOP, exit_if_mps_busy

    ISOLATED.set()  # a kernel that breaks the device ends this process (harness.isolation)

    def term(signum, frame):
        STOP.set()  # checked at every example, in case kernel code swallows the KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, term)
    try:
        import torch

        from kvfuzz.contracts.model.example import Example
        from kvfuzz.fuzz.campaign.config import config_from_dict
        from kvfuzz.fuzz.campaign.engine import Campaign
        from kvfuzz.fuzz.campaign.records import example_key
        from kvfuzz.fuzz.campaign.steering import Plan
        from kvfuzz.fuzz.campaign.store.database import DatabaseError
        from kvfuzz.fuzz.targets import get_target

        torch.set_num_threads(spec.threads)
        config = config_from_dict(spec.config)
        targets = {t.name: t for t in (get_target(n) for n in spec.targets)}
        try:
            config.db()
        except DatabaseError as e:
            conn.send(("fatal", str(e)))
            return
        listener = PipeListener(conn)
        campaigns: dict[str, Campaign] = {}
        observing = _observing(spec)
        conn.send(("ready", os.getpid()))
        with observing:
            while True:
                task = conn.recv()
                if task[0] == "stop":
                    break
                kind, tid, name, *args = task
                c = campaigns.get(name) or campaigns.setdefault(name, Campaign(targets[name], config, listener))
                c.known |= {tuple(s) for s in args[-1]["signatures"]}
                c.ended.update((example_key(e), tuple(sig)) for sig, e in args[-1]["ended"])
                c.deadline = args[-1].get("deadline")
                cut = len(c.cut_short)
                if kind == "replay":
                    c.replay_database()
                elif kind == "chunk":
                    plan = args[-1].get("plan")
                    c.run_chunk(args[0], args[1], None if plan is None else Plan.from_dict(plan))
                elif kind == "retry":
                    c.check_one(Example.from_dict(args[0]))
                for what in dict.fromkeys(c.cut_short[cut:]):
                    if what == "generating":  # every --duration campaign ends so: nothing was cut short
                        continue
                    if what.startswith("shrinking past"):  # a failure found in time, shrunk within the grace
                        conn.send(("warning", f"{name}: kept {what}: a failure found before the deadline"))
                        continue
                    conn.send(("warning", f"{name}: --duration ran out while {what}; what it found is recorded "
                                          "as shrunk so far"))
                conn.send(("done", tid))
    except KeyboardInterrupt:
        pass  # stopped: say goodbye below
    except OutOfSpace as e:  # a full disk: the supervisor ends the campaign (exit 3), keeping what was written
        conn.send(("disk_full", str(e)))
        _quiet_streams()
    except Exception as e:  # kvfuzz itself broke outside any example: tell the supervisor, with the traceback
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
        return
    _report_database_errors(conn, locals().get("config"))
    conn.send(("bye",))


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


__all__ = ["PipeListener", "WorkerSpec", "gpu_environment", "worker_main"]
