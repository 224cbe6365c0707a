"""Supervised campaigns: every ``kvfuzz fuzz`` runs its examples in worker processes (one or more) under a
supervisor, so a kernel that segfaults, aborts, exits or hangs costs one worker, never the campaign, and
every example is accounted for.

Process model (docs/campaigns.md has the full table):

- Workers are standard ``multiprocessing`` processes (spawn). Each builds the campaign's targets and a
  :class:`~kvfuzz.fuzz.campaign.engine.Campaign` per target, then runs tasks the supervisor sends: replay the
  database for a target, explore a chunk of seeds, re-run one example. It reports every example over its pipe
  as it happens (begin, phase, end, new failures), so the supervisor knows at each moment which example each
  worker runs and in which phase, and counts every example exactly, including those of a worker that dies.
- The budget is global: ``--max-examples`` and ``--duration`` are per target for the whole campaign, shared by
  the workers; the supervisor hands out chunks until they are spent.
- A worker dies with its supervisor (``PR_SET_PDEATHSIG`` plus a watchdog on its parent pid), ignores Ctrl-C
  (the supervisor stops it) and stops on SIGTERM after the example in flight.
- When a worker ends, :mod:`kvfuzz.fuzz.campaign.endings` classifies how: a crash or exit inside the kernel is
  a kernel crash, a timeout inside the kernel a kernel hang, either outside the kernel a harness error (each
  written as a reproducer by the supervisor); a worker killed from outside gets its example retried once by a
  fresh worker, and counts it lost if killed again. A target that crashes or hangs ``max_crashes`` times gets
  no more work (said in the summary). Workers that cannot start, or a database that fails, end the campaign.
- The supervisor writes ``OUT/status.json`` and ``OUT/state.json`` (chunks started per target, the examples in
  flight) atomically every couple of seconds, so a campaign killed outright resumes with new seeds and retries
  what it had in flight.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import attrs

from kvfuzz.fuzz.campaign.endings import EndingKind, classify, finding_for
from kvfuzz.fuzz.campaign.journal import CampaignState, OutOfSpace, disk_full, read_json, write_json

#: Seconds between status/state snapshots.
SNAPSHOT_SECONDS = 2.0
#: Seconds workers get to finish their example after a stop before they are killed.
STOP_GRACE_SECONDS = 20.0
#: A worker that dies without a word while ``--out`` has less free space than this died of the full disk (its
#: log is on it too): the supervisor ends the campaign as out of space instead of blaming the example.
FULL_BELOW_BYTES = 1 << 20


# ---- the worker -------------------------------------------------------------------------------------------------
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


class _PipeListener:
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


def worker_main(spec: WorkerSpec, conn) -> None:
    """A worker's life: set up, say ready, run tasks until told to stop, say goodbye."""
    _die_with_parent(spec.parent_pid)
    log = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    if spec.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us

    from kvfuzz.fuzz.harness.run import STOP

    def term(signum, frame):
        STOP.set()  # checked at every example, in case kernel code swallows the KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, term)
    try:
        import torch

        from kvfuzz.contracts.model.example import Example
        from kvfuzz.fuzz.campaign.database import DatabaseError
        from kvfuzz.fuzz.campaign.engine import Campaign, example_key
        from kvfuzz.fuzz.targets import get_target

        torch.set_num_threads(spec.threads)
        config = config_from_dict(spec.config)
        targets = {t.name: t for t in (get_target(n) for n in spec.targets)}
        try:
            config.db()
        except DatabaseError as e:
            conn.send(("fatal", str(e)))
            return
        listener = _PipeListener(conn)
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
                if kind == "replay":
                    c.replay_database()
                elif kind == "chunk":
                    c.run_chunk(args[0], args[1])
                elif kind == "retry":
                    c.check_one(Example.from_dict(args[0]))
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
        import traceback

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
    from kvfuzz.fuzz.campaign.database import remote_errors

    n, last = remote_errors(config.database)
    if n:
        try:
            conn.send(("warning", f"the shared example database failed {n} time(s) (last: {last}); every failure "
                                  f"is also in {config.out / 'hypothesis-db'}"))
        except (OSError, ValueError):
            pass


def _observing(spec: WorkerSpec):
    import contextlib

    if spec.observe_dir is None:
        return contextlib.nullcontext()
    from kvfuzz.fuzz.campaign.observability import observe_to

    return observe_to(Path(spec.observe_dir), prefix=f"w{spec.index}_")


def config_to_dict(config) -> dict:
    """The picklable values of a CampaignConfig (the fault by name; no open database)."""
    d = {f.name: getattr(config, f.name) for f in attrs.fields(type(config)) if f.name != "database"}
    d["fault"] = config.fault.name if config.fault else None
    d["poisons"] = [p.value for p in config.poisons]
    d["limits"] = attrs.asdict(config.limits)
    d["out"] = str(config.out)
    return d


def config_from_dict(d: dict):
    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.campaign.engine import CampaignConfig
    from kvfuzz.fuzz.harness.faults import get_fault
    from kvfuzz.strategies.limits import Limits

    d = dict(d)
    d["fault"] = get_fault(d["fault"]) if d["fault"] else None
    d["poisons"] = tuple(Poison(p) for p in d["poisons"])
    d["limits"] = Limits(**d["limits"])
    d["out"] = Path(d["out"])
    d["run_unsafe"] = True  # a worker is isolated: calls that may read out of bounds run (and may crash it)
    return CampaignConfig(**d)


# ---- the supervisor --------------------------------------------------------------------------------------------
@attrs.define
class _Task:
    id: int
    kind: str  # "replay", "chunk", "retry"
    target: str
    n: int = 0
    chunk: int = -1
    example: dict | None = None
    counted: int = 0  # examples of this task counted so far


@attrs.define
class _Slot:
    """One worker position; its process is replaced when it dies."""

    index: int
    proc: Any = None
    conn: Any = None
    ready: bool = False
    goodbye: bool = False
    task: _Task | None = None
    in_flight: dict | None = None  # {"target", "example", "phase", "since"}
    killed_for_hang: bool = False
    starts: int = 0
    startup_failures: int = 0
    retired: bool = False
    #: distinct failures the worker saw and is shrinking (unshrunk reproducers written), by signature
    pending: dict = attrs.field(factory=dict)


@attrs.define
class _Target:
    """The supervisor's view of one target."""

    target: Any
    stats: Any
    start: float | None = None
    replayed: bool = False
    replay_issued: bool = False
    retries: list = attrs.Factory(list)  # examples to re-run once (their worker was killed from outside)
    #: [signature, example] of examples that crashed or hung a worker: workers count them, never re-run them
    #: (every chunk starts with the simplest example; one that hangs would otherwise hang every chunk)
    ended: list = attrs.Factory(list)
    warm: list = attrs.Factory(list)  # configurations still to warm up (CampaignConfig.warmup)
    crashes: int = 0
    in_flight: list = attrs.Factory(list)  # tasks

    @property
    def name(self) -> str:
        return self.target.name


@attrs.define
class SupervisorResult:
    """targets: TargetStats per target. problems: what went wrong besides findings (workers that could not
    start, examples lost; any of them makes the campaign's exit status 3). interrupted: the user stopped the
    campaign. warnings: worth knowing, lost nothing (a shared database's outage). disk_full: why the campaign
    stopped for want of space and what it kept (also the first problem; exit status 3, findings or not)."""

    targets: list
    problems: list[str]
    interrupted: bool
    workers: int
    restarts: int
    warnings: list[str] = attrs.Factory(list)
    disk_full: str | None = None


class Supervisor:
    """Runs a campaign of ``workers`` processes over ``targets`` (see the module docstring).

    ``target_names``: how the user named each target (names or file/module specs), so workers load the same
    code. ``on_event``: a line for the console (crashes, restarts, retries). ``on_progress``: called with the
    list of TargetStats at most every second. ``resume=False``: start at chunk 0 and ignore what an earlier
    campaign in ``config.out`` left (the deterministic gate)."""

    def __init__(self, targets: list, target_names: list[str], config, *, workers: int = 1,
                 example_timeout: float = 300.0, max_crashes: int = 10, threads: int = 1,
                 observe: bool = False, gpus: int = 0, resume: bool = True,
                 on_event: Callable[[str], None] = lambda m: None,
                 on_progress: Callable[[list], None] = lambda s: None) -> None:
        from kvfuzz.fuzz.campaign.engine import TargetStats

        self.config = config
        self.names = list(target_names)
        self.workers = workers
        self.example_timeout = example_timeout
        self.max_crashes = max_crashes
        self.threads = threads
        self.observe = observe
        self.gpus = gpus
        self.on_event = on_event
        self.on_progress = on_progress
        self.out = Path(config.out)
        self.targets = [_Target(t, TargetStats(t.name)) for t in targets]
        self.by_name = {t.name: t for t in self.targets}
        self.slots = [_Slot(i) for i in range(workers)]
        self.ctx = mp.get_context("spawn")
        self.state = (CampaignState.load(self.out, config.seed, warn=on_event) if resume
                      else CampaignState(self.out / "state.json", config.seed))
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.stopping = False
        self.fatal: str | None = None
        #: what could not be written when the disk filled (None: it did not); the campaign then stops
        self.disk_full: str | None = None
        #: examples in flight when the disk filled: state.json keeps them, so a rerun with space retries them
        self._unfinished: dict[str, dict] = {}
        self._state_saved = True  # whether the final state.json was written (False: the last snapshot stands)
        self.restarts = 0
        self._task_ids = 0
        self._snapshot_at = 0.0
        self._progress_at = 0.0
        (self.out / "workers").mkdir(parents=True, exist_ok=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def run(self) -> SupervisorResult:
        self._resume()
        old = {s: signal.signal(s, self._stop_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._snapshot(force=True)
            for slot in self.slots if self.disk_full is None else ():
                self._start(slot)
            self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._reap_all()
            self._snapshot(final=True)
        lost = sum(t.stats.lost for t in self.targets)
        if lost:
            self.problems.append(f"{lost} example(s) lost: their workers were killed from outside twice")
        if self.fatal:
            self.problems.insert(0, self.fatal)
        full = self._disk_full_report() if self.disk_full else None
        if full:
            self.problems.insert(0, full)
        return SupervisorResult([t.stats for t in self.targets], self.problems,
                                self.stopping and not self.fatal and not self.disk_full,
                                self.workers, self.restarts, self.warnings, full)

    def _out_of_space(self, message: str) -> None:
        """The disk of ``--out`` is full: stop the campaign, keeping the examples in flight for a rerun."""
        if self.disk_full is None:
            self.disk_full = message  # said once, at the end (_disk_full_report), with what was kept
        self.stopping = True  # each worker's example in flight is kept as it ends (_ended)

    def _keep_unfinished(self, s: _Slot, flight: dict | None) -> None:
        if flight is not None:
            self._unfinished[str(s.index)] = {"target": flight["target"], "example": flight["example"],
                                              "phase": flight["phase"]}

    def _out_nearly_full(self) -> bool:
        try:
            st = os.statvfs(self.out)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES

    def _disk_full_report(self) -> str:
        """The one message of a campaign stopped by a full disk: what failed, what was kept, how to go on."""
        found = [f.reproducer for t in self.targets for f in t.stats.failures.values() if f.reproducer]
        kept = [f"{self.state.path.name} as of its last snapshot" + ("" if self._state_saved else
                                                                     " (not updated at the end: no space)")]
        if found:
            kept.append(f"{len(found)} reproducer(s): " + ", ".join(str(p) for p in found))
        kept.append("the example database (hypothesis-db/)")
        retry = (f"retries the {len(self._unfinished)} example(s) that were in flight and "
                 if self._unfinished and self._state_saved else "")
        return (f"{self.disk_full}; the campaign stopped. Kept in "
                f"{self.out}: {'; '.join(kept)}. Free some space and run the same command again: it {retry}"
                f"continues with new seeds")

    def _stop_signal(self, signum, frame) -> None:
        if not self.stopping:
            self.on_event(f"stopping ({signal.Signals(signum).name}): workers finish their example in flight")
        self.stopping = True

    def _resume(self) -> None:
        """Warm-up for a fresh target (CampaignConfig.warmup); a campaign killed outright left examples in
        flight: retry them first."""
        from kvfuzz.fuzz.campaign.engine import pins_configs

        for t in self.targets:
            if self.config.warmup and not self.state.chunks.get(t.name) and pins_configs(t.target, self.config):
                t.warm = list(range(self.config.warmup))
        if not (self.state.running and self.state.in_flight):
            return
        n = 0
        for entry in self.state.in_flight.values():
            t = self.by_name.get(entry.get("target"))
            if t is not None and isinstance(entry.get("example"), dict):
                t.retries.append(entry["example"])
                n += 1
        if n:
            self.on_event(f"the last campaign in {self.out} was killed; retrying the {n} example(s) it had in flight")

    def _start(self, slot: _Slot) -> None:
        from kvfuzz.fuzz.campaign.workers import WorkerSpec, worker_main  # picklable by module path

        parent, child = self.ctx.Pipe()
        spec = WorkerSpec(tuple(self.names), config_to_dict(self.config), slot.index, os.getpid(),
                          str(self.out / "workers" / f"w{slot.index}.log"),
                          gpu=(slot.index % self.gpus) if self.gpus else None, threads=self.threads,
                          observe_dir=str(self.out / "observed") if self.observe else None)
        proc = self.ctx.Process(target=worker_main, args=(spec, child), name=f"kvfuzz-worker-{slot.index}")
        proc.start()
        child.close()
        slot.proc, slot.conn = proc, parent
        slot.ready = slot.goodbye = slot.killed_for_hang = False
        slot.task = slot.in_flight = None
        slot.starts += 1

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        stop_sent_at = None
        while True:
            if self.stopping and stop_sent_at is None:
                stop_sent_at = time.monotonic()
                for s in self.slots:
                    if s.proc is not None and s.proc.is_alive():
                        s.proc.terminate()  # SIGTERM: finish the example in flight, say goodbye
            if stop_sent_at is not None and time.monotonic() - stop_sent_at > STOP_GRACE_SECONDS:
                for s in self.slots:
                    if s.proc is not None and s.proc.is_alive():
                        s.proc.kill()
            if not self.stopping and self.fatal is None:
                for s in self.slots:
                    if s.proc is not None and s.ready and s.task is None and not s.retired:
                        self._assign(s)
            live = [s for s in self.slots if s.proc is not None]
            if not live:
                return
            waitables = [s.conn for s in live] + [s.proc.sentinel for s in live]
            ready = wait(waitables, timeout=0.5)
            for s in live:
                if s.conn in ready:
                    self._drain(s)
            for s in live:
                if s.proc is not None and s.proc.sentinel in ready or (s.proc is not None and not s.proc.is_alive()):
                    s.proc.join()
                    self._drain(s)
                    self._ended(s)
            self._check_hangs()
            self._snapshot()
            self._progress()

    def _next_task(self) -> _Task | None:
        from kvfuzz.fuzz.campaign.engine import WARMUP_EXAMPLES, chunk_size, examples_per_chunk

        now = time.monotonic()
        for t in self.targets:
            if t.stats.stopped:
                continue
            if not t.replayed and not t.replay_issued:
                t.replay_issued = True
                t.start = t.start or now
                return self._task("replay", t)
            if t.warm:  # compiles in parallel with the replay: configurations the chunks will visit
                return self._task("chunk", t, n=WARMUP_EXAMPLES, chunk=-1 - t.warm.pop(0))
            if not t.replayed:
                continue  # the others wait for the database replay of this target
            if t.retries:
                return self._task("retry", t, example=t.retries.pop(0))
            elapsed = now - (t.start or now)
            if self.config.duration is not None and elapsed > self.config.duration:
                continue
            if self.config.stop_at_first_failure and t.stats.failures:
                continue
            pending = sum(max(0, x.n - x.counted) for x in t.in_flight if x.kind == "chunk")
            done = t.stats.examples + pending
            if done >= self.config.max_examples:
                continue
            n = min(chunk_size(self.config, t.stats.examples, elapsed, self.workers,
                               per_chunk=examples_per_chunk(t.target, self.config)),
                    self.config.max_examples - done)
            k = self.state.chunks.get(t.name, 0)
            self.state.chunks[t.name] = k + 1
            return self._task("chunk", t, n=max(1, n), chunk=k)
        return None

    def _task(self, kind: str, t: _Target, **kw) -> _Task:
        self._task_ids += 1
        task = _Task(self._task_ids, kind, t.name, **kw)
        t.start = t.start or time.monotonic()
        t.in_flight.append(task)
        return task

    def _assign(self, s: _Slot) -> None:
        task = self._next_task()
        if task is None:
            if not any(t.in_flight or t.retries or (not t.replayed and not t.stats.stopped) for t in self.targets):
                s.retired = True
                self._send(s, ("stop",))
            return
        t = self.by_name[task.target]
        known = {"signatures": [list(sig) for sig in t.stats.failures], "ended": t.ended}
        msg = {"replay": ("replay", task.id, task.target, known),
               "chunk": ("chunk", task.id, task.target, task.chunk, task.n, known),
               "retry": ("retry", task.id, task.target, task.example, known)}[task.kind]
        s.task = task
        self._send(s, msg)

    def _send(self, s: _Slot, msg) -> None:
        try:
            s.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # it died: its sentinel reports it

    # ---- messages ----------------------------------------------------------------------------------------------
    def _drain(self, s: _Slot) -> None:
        try:
            while s.conn.poll():
                self._message(s, s.conn.recv())
        except (EOFError, OSError):
            pass  # the worker is gone; what it sent before is handled
        except Exception as e:  # a message cut off by the worker's death
            self.on_event(f"worker {s.index}: unreadable message ({type(e).__name__})")

    def _message(self, s: _Slot, msg: tuple) -> None:
        from kvfuzz.fuzz.campaign.engine import FailureRecord, Outcome

        kind = msg[0]
        if kind == "ready":
            s.ready = True
            s.startup_failures = 0
        elif kind == "begin":
            s.in_flight = {"target": msg[1], "example": msg[2], "phase": "prepare", "since": time.monotonic()}
        elif kind == "phase":
            if s.in_flight is not None:
                s.in_flight["phase"] = msg[1]
                if msg[1] == "kernel":
                    s.in_flight["since"] = time.monotonic()
        elif kind == "end":
            t = self.by_name[msg[1]]
            o = msg[2]
            t.stats.add(Outcome(o["labels"], o["kernel_s"], o["harness_s"], o["ratio"],
                                None if o["signature"] is None else tuple(o["signature"]), o["rejection"]),
                        time.monotonic() - (t.start or time.monotonic()))
            if s.task is not None:
                s.task.counted += 1
            s.in_flight = None
        elif kind == "seen":
            record = FailureRecord(**msg[2])
            s.pending[record.signature] = record
        elif kind == "failure":
            record = FailureRecord(**msg[2])
            s.pending.pop(record.signature, None)
            self._failure(record)
        elif kind == "done":
            self._finish_task(s)
        elif kind == "fatal":
            self.fatal = msg[1]
            self.stopping = True
        elif kind == "disk_full":
            self._out_of_space(msg[1])
        elif kind == "bye":
            s.goodbye = True
        elif kind == "warning":
            if msg[1] not in self.warnings:
                self.warnings.append(msg[1])
                self.on_event(msg[1])

    def _finish_task(self, s: _Slot) -> None:
        task, s.task = s.task, None
        s.pending.clear()  # a task that ends normally has reported each of them shrunk
        if task is None:
            return
        t = self.by_name[task.target]
        if task in t.in_flight:
            t.in_flight.remove(task)
        if task.kind == "replay":
            t.replayed = True

    def _failure(self, record, how: str = "") -> None:
        t = self.by_name[record.target]
        if t.stats.add_failure(record):
            from kvfuzz.contracts.checks.oracles import check_label

            known = f"known ({record.known}): " if record.known else ""
            self.on_event(f"{known}{record.kind} ({check_label(record.check)}) in {record.target}{how} -> "
                          f"{record.reproducer}")
            return
        # another worker found it first (its hits are counted from the examples' outcomes): keep one reproducer
        first = t.stats.failures[record.signature]
        if record.reproducer and record.reproducer != first.reproducer:
            shutil.rmtree(record.reproducer, ignore_errors=True)

    # ---- endings ----------------------------------------------------------------------------------------------
    def _ended(self, s: _Slot) -> None:
        proc, flight, task = s.proc, s.in_flight, s.task
        ending = classify(proc.exitcode, said_goodbye=s.goodbye, killed_for_hang=s.killed_for_hang,
                          stopping=self.stopping)
        if self.disk_full is not None or (ending.kind is EndingKind.EXITED and not s.goodbye
                                          and self._out_nearly_full()):
            # stopped by the full disk, died of it (its log is there too) or with it: nobody's finding; what it
            # had in flight stays in state.json for a rerun
            self._out_of_space(self.disk_full or f"no space left on device: less than {FULL_BELOW_BYTES >> 20} MiB "
                               f"free in {self.out} when worker {s.index} {ending.kind.value} ({ending.detail})")
            self._keep_unfinished(s, flight)
            s.proc, s.in_flight = None, None
            self._keep_unshrunk(s, ending, note=" (not shrunk: the disk filled while shrinking it)")
            if task is not None:
                self._finish_task(s)
            return
        s.proc = None
        self._keep_unshrunk(s, ending)
        if task is not None:
            self._finish_task(s)
            if task.kind == "replay" and ending.kind is not EndingKind.FINISHED:
                self.by_name[task.target].replayed = True  # do not replay again: its example is handled below
        if not s.ready and ending.kind is not EndingKind.FINISHED and not self.stopping and self.fatal is None:
            s.startup_failures += 1
            tail = _tail(self.out / "workers" / f"w{s.index}.log")
            if s.startup_failures >= 2:
                self.fatal = (f"worker {s.index} could not start ({ending.detail}); the end of its log "
                              f"({self.out / 'workers' / f'w{s.index}.log'}):\n{tail}")
                self.stopping = True
                return
        if flight is not None:
            self._example_ended(s, flight, ending, retried=task is not None and task.kind == "retry")
        elif ending.kind in (EndingKind.CRASHED, EndingKind.EXITED) and s.ready and self.fatal is None:
            self.problems.append(f"worker {s.index} {ending.kind.value} ({ending.detail}) between examples; see "
                                 f"{self.out / 'workers' / f'w{s.index}.log'}")
        if ending.kind is EndingKind.FINISHED or self.stopping or self.fatal is not None:
            return
        if ending.kind is not EndingKind.KILLED or flight is None:
            self.on_event(f"worker {s.index}: {ending.kind.value} ({ending.detail}); starting a new one")
        self.restarts += 1
        self._start(s)

    def _keep_unshrunk(self, s: _Slot, ending, note: str | None = None) -> None:
        """The failures a dead worker was still shrinking keep their unshrunk reproducers: a shrink that steps
        into an input that crashes or hangs the kernel must not take the failure it was shrinking with it.
        ``note``: why it ended, instead of the ending's."""
        pending, s.pending = s.pending, {}
        if ending.kind is EndingKind.FINISHED:
            return
        for record in pending.values():
            if note is not None:
                why = note
            elif record.stage == "hypothesis":
                why = f" (shrunk by Hypothesis; the worker {ending.kind.value} during the structural shrink)"
            else:
                why = f" (not shrunk: the worker {ending.kind.value} while shrinking it)"
            if record.target in self.by_name:  # known meanwhile: _failure keeps one reproducer
                self._failure(attrs.evolve(record, message=record.message + why, stage="final"), how=why)

    def _example_ended(self, s: _Slot, flight: dict, ending, retried: bool) -> None:
        from kvfuzz.contracts.model.example import Example
        from kvfuzz.fuzz.campaign.engine import FailureRecord, Outcome
        from kvfuzz.fuzz.campaign.reproducers import write_reproducer

        t = self.by_name.get(flight["target"])
        if t is None:
            return
        if ending.kind is EndingKind.STOPPED:
            return  # interrupted by the user: not a finding, not a loss
        if ending.loses_the_example:
            if retried:
                t.stats.lost += 1
                self.on_event(f"worker {s.index} was killed ({ending.detail}) again while re-running an example of "
                              f"{t.name}; it is lost")
            else:
                t.retries.append(flight["example"])
                self.on_event(f"worker {s.index} was killed from outside ({ending.detail}) in {flight['phase']}; "
                              f"its example of {t.name} is retried by a new worker")
            return
        finding = finding_for(ending, flight["phase"], {"worker": s.index}, timeout=self.example_timeout)
        if finding is None:
            return
        example = Example.from_dict(flight["example"])
        t.stats.add(Outcome({"path": t.target.path(example.batch)}, signature=finding.signature),
                    time.monotonic() - (t.start or time.monotonic()))
        t.crashes += 1
        if len(t.ended) < MAX_ENDED_EXAMPLES:
            t.ended.append([list(finding.signature), flight["example"]])
        if finding.signature not in t.stats.failures:
            fault = self.config.fault.name if self.config.fault else None
            finding = self._blame_caller(t.target, example, finding)
            try:
                path = write_reproducer(self.out, t.target, example, finding, None, fault_name=fault)
            except OutOfSpace as e:  # not recorded: kept in state.json, so a rerun with space finds it again
                self._out_of_space(str(e))
                self._keep_unfinished(s, flight)
                return
            t.stats.add_failure(FailureRecord.of(t.name, finding, example, fault, path))
            self.on_event(f"{finding.kind.value} ({finding.check}) in {t.name}, worker {s.index} -> {path}")
        if t.crashes >= self.max_crashes and not t.stats.stopped:
            t.stats.stopped = f"stopped after {t.crashes} crashes and hangs (--max-crashes {self.max_crashes})"
            self.on_event(f"{t.name}: {t.stats.stopped}")

    def _blame_caller(self, target, example, finding):
        """A call that broke its contract and then killed the kernel is the caller's fault."""
        if self.config.fault is None:
            return finding
        from kvfuzz.fuzz.harness import properties
        from kvfuzz.fuzz.harness.attention import caller_finding, caller_violations

        try:
            violations = caller_violations(target, properties.prepare(target, example, self.config.fault))
        except Exception:
            return finding
        if not violations:
            return finding
        outcome = {"outcome": f"{finding.kind.value}: {finding.message}"}
        return caller_finding(violations, outcome, {"path": target.path(example.batch)})

    def _check_hangs(self) -> None:
        now = time.monotonic()
        for s in self.slots:
            f = s.in_flight
            if s.proc is not None and f is not None and not s.killed_for_hang \
                    and now - f["since"] > self.example_timeout:
                s.killed_for_hang = True
                s.proc.kill()

    def _reap_all(self) -> None:
        for s in self.slots:
            if s.proc is not None and s.proc.is_alive():
                s.proc.kill()
            if s.proc is not None:
                s.proc.join()

    # ---- files ---------------------------------------------------------------------------------------------
    def _snapshot(self, force: bool = False, final: bool = False) -> None:
        """Write state.json and status.json (atomically), at most every SNAPSHOT_SECONDS unless ``force``.
        ``final``: the campaign ended; nothing is in flight any more."""
        now = time.monotonic()
        if not (force or final) and now - self._snapshot_at < SNAPSHOT_SECONDS:
            return
        self._snapshot_at = now
        # stopped by a full disk: state.json stays "running" with what was in flight, so a rerun retries it
        self.state.running = not final or self.disk_full is not None
        self.state.in_flight = dict(self._unfinished) if final else {
            str(s.index): {"target": s.in_flight["target"], "example": s.in_flight["example"],
                           "phase": s.in_flight["phase"]}
            for s in self.slots if s.in_flight is not None}
        path = self.state.path
        try:
            self.state.save()
            if final:
                self._state_saved = True
            path = self.out / "status.json"
            write_json(path, {"updated": time.time(), "running": not final,
                              "targets": [t.stats.to_dict() for t in self.targets],
                              "workers": {str(s.index): (s.in_flight or {}).get("target") for s in self.slots}})
        except OSError as e:
            if not disk_full(e):
                raise
            if final and path == self.state.path:
                self._state_saved = False
            self._out_of_space(str(OutOfSpace(path, e)))

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._progress_at >= 1.0:
            self._progress_at = now
            self.on_progress([t.stats for t in self.targets])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


#: Crashing or hanging examples per target the workers are told not to re-run.
MAX_ENDED_EXAMPLES = 200

#: Workers per GPU at most by default: Triton compiles on the CPU, one worker at a time per process, while the
#: GPU runs the small fuzz batches of several workers with room to spare.
MAX_WORKERS_PER_GPU = 8


def default_workers(gpus: int, cpus: int | None = None) -> int:
    """Workers when --workers is not given: on CUDA, per GPU half the CPU cores it has (at most
    :data:`MAX_WORKERS_PER_GPU`, at least 1); on CPU, 1 (a second worker competes for the same cores)."""
    if not gpus:
        return 1
    cpus = cpus or os.cpu_count() or 1
    return gpus * max(1, min(MAX_WORKERS_PER_GPU, cpus // gpus // 2))


__all__ = ["MAX_WORKERS_PER_GPU", "Supervisor", "SupervisorResult", "WorkerSpec", "config_from_dict",
           "config_to_dict", "default_workers", "gpu_count",
           "worker_main", "read_json"]
