"""Supervised campaigns: every ``kvfuzz fuzz`` runs its examples in worker processes (one or more) under a
supervisor, so a kernel that segfaults, aborts, exits or hangs costs one worker, never the campaign, and
every example is accounted for.

Process model (docs/campaigns.md has the full table):

- Workers (:mod:`kvfuzz.fuzz.campaign.workers.worker`) are standard ``multiprocessing`` processes (spawn). Each builds
  the campaign's targets and a :class:`~kvfuzz.fuzz.campaign.engine.Campaign` per target, then runs tasks the
  supervisor sends: replay the database for a target, explore a chunk of seeds, re-run one example. It
  reports every example over its pipe as it happens (begin, phase, end, new failures), so the supervisor
  knows at each moment which example each worker runs and in which phase, and counts every example exactly,
  including those of a worker that dies.
- The budget is global: ``--max-examples`` and ``--duration`` are per target for the whole campaign, shared by
  the workers; the supervisor hands out chunks (:mod:`kvfuzz.fuzz.campaign.workers.scheduling`) until they are
  spent.
- A worker dies with its supervisor (``PR_SET_PDEATHSIG`` plus a watchdog on its parent pid), ignores Ctrl-C
  (the supervisor stops it) and stops on SIGTERM after the example in flight.
- When a worker ends, :mod:`kvfuzz.fuzz.campaign.workers.endings` classifies how and the supervisor acts on it
  (``Supervisor._ended``): a crash or exit inside the kernel is a kernel crash, a timeout inside the kernel a
  kernel hang, either outside the kernel a harness error (each written as a reproducer by the supervisor); a
  worker killed from outside gets its example retried once by a fresh worker, and counts it lost if killed
  again. A target that crashes or hangs ``max_crashes`` times gets no
  more work (said in the summary). Workers that cannot start, or a database that fails, end the campaign.
- The supervisor writes ``OUT/status.json`` and ``OUT/state.json`` (chunks started per target, the examples in
  flight) atomically every couple of seconds (:mod:`kvfuzz.fuzz.campaign.workers.status`), so a campaign killed
  outright resumes with new seeds and retries what it had in flight; a failure it left a reproducer of in ``OUT`` is
  reported found before, with that reproducer (:class:`~kvfuzz.fuzz.campaign.workers.bookkeeping.FoundBefore`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import attrs

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.chunks import campaign_tiers, pins_configs
from kvfuzz.fuzz.campaign.config import CampaignConfig, CrashPolicy, WorkerPool, config_to_dict
from kvfuzz.fuzz.campaign.engine import duration_allowance
from kvfuzz.fuzz.campaign.records import SKIPPED_FOR_MEMORY, FailureRecord, Outcome, TargetStats, example_key
from kvfuzz.fuzz.campaign.stages import time_table
from kvfuzz.fuzz.campaign.steering import Steering
from kvfuzz.fuzz.campaign.store import ledger
from kvfuzz.fuzz.campaign.store.cases import BadReproducer, read_example
from kvfuzz.fuzz.campaign.store.journal import CampaignState, OutOfSpace
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.campaign.workers.bookkeeping import FoundBefore, Slot, SupervisorResult, TargetState
from kvfuzz.fuzz.campaign.workers.endings import (
    DEVICE_ERROR,
    MPS_BUSY,
    EndingKind,
    classify,
    compile_wait,
    finding_for,
)
from kvfuzz.fuzz.campaign.workers.scheduling import Scheduler
from kvfuzz.fuzz.campaign.workers.status import FULL_BELOW_BYTES, Snapshots, out_nearly_full
from kvfuzz.fuzz.campaign.workers.worker import WorkerSpec, worker_main
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.caller import caller_finding, caller_violations
from kvfuzz.fuzz.harness.isolation import MPS_NOT_READY

#: Seconds workers get to finish their example after a stop before they are killed.
STOP_GRACE_SECONDS = 20.0
#: Seconds the supervisor lets pass between two looks at its workers' pipes. A worker says four things per
#: example (begin, kernel, check, end): woken for each, the supervisor took the workers' cores from them some
#: thousand times a second. Messages wait in the pipes in order meanwhile (a dead worker's are read before its
#: death is handled), and the hang clock of an example starts at most this late. Longer costs more: a worker
#: that finished its chunk waits that long for the next (20 ms: 2 CPU workers ran 15% fewer examples).
POLL_SECONDS = 0.005
#: Crashing or hanging examples per target the workers are told not to re-run.
MAX_ENDED_EXAMPLES = 200
#: A worker that found the CUDA MPS server not accepting clients (after another client's fault) is started again
#: after this many seconds, up to this many times in a campaign, before the campaign ends (exit 3).
MPS_WAIT_SECONDS, MAX_MPS_WAITS = 0.5, 240
#: Times one example is re-run after a CUDA error ended its worker in kvfuzz's own phases (prepare, check) while
#: other workers share the GPU (another MPS client's fault, each time), before it is counted lost (exit 3).
MAX_BYSTANDER_RERUNS = 5


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker's log (what a worker that could not start said)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Supervisor:
    """Runs a campaign of ``pool.workers`` processes over ``targets`` (see the module docstring).

    ``target_names``: how the user named each target (names or file/module specs), so workers load the same
    code. ``pool``: the workers (how many, threads, GPUs, observability); ``policy``: example timeout and
    crashes per target. ``on_event``: a line for the console (crashes, restarts, retries). ``on_progress``:
    called with the list of TargetStats at most every second. ``resume=False``: start at chunk 0 and ignore
    what an earlier campaign in ``config.out`` left (the deterministic gate)."""

    def __init__(self, targets: list, target_names: list[str], config: CampaignConfig, *,
                 pool: WorkerPool = WorkerPool(), policy: CrashPolicy = CrashPolicy(), resume: bool = True,
                 on_event: Callable[[str], None] = lambda m: None,
                 on_progress: Callable[[list], None] = lambda s: None) -> None:
        self.config = config
        self.names = list(target_names)
        self.pool = pool
        self.policy = policy
        self.on_event = on_event
        self.on_progress = on_progress
        self.out = Path(config.out)
        if len({t.name for t in targets}) != len(targets) or len(set(self.names)) != len(self.names):
            raise ValueError(f"a target is named twice in {self.names}: name each once")
        self.targets = [TargetState(t, TargetStats(t.name), tiers=campaign_tiers(t, config)) for t in targets]
        for t in self.targets:  # each chunk's tier and focus (None: the fixed split, chunks.chunk_tier)
            t.steer = Steering.of(t.target, config, t.tiers)
        self.by_name = {t.name: t for t in self.targets}
        self.before = FoundBefore.read(config, self.by_name, on_event) if resume else FoundBefore()  # in --out
        self.slots = [Slot(i) for i in range(pool.workers)]
        self.ctx = mp.get_context("spawn")
        self.state = (CampaignState.load(self.out, config.seed, warn=on_event) if resume
                      else CampaignState(self.out / "state.json", config.seed))
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.stopping = False
        self.fatal: str | None = None
        #: what could not be written when the disk filled (None: it did not); the campaign then stops
        self.disk_full: str | None = None
        self.snapshots = Snapshots(self.out, self.state, config.duration)
        self.scheduler = Scheduler(config, self.state.chunks, pool.workers)
        self.restarts = 0
        self.mps_waits = 0
        self._bystander_reruns: dict[str, int] = {}  # example_key -> re-runs after a CUDA error in prepare/check
        self._progress_at = 0.0
        (self.out / "workers").mkdir(parents=True, exist_ok=True)

    def run(self) -> SupervisorResult:
        self._resume()
        old = {s: signal.signal(s, self._stop_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
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
        self._overruns()
        lost = sum(t.stats.lost for t in self.targets)
        if lost:
            self.problems.append(f"{lost} example(s) lost: their workers were killed from outside twice, or a CUDA "
                                 f"error ended them in kvfuzz's own phases {MAX_BYSTANDER_RERUNS + 1} times")
        skipped = sum(t.stats.skipped_memory for t in self.targets)
        if skipped:
            self.problems.append(f"{skipped} example(s) skipped: {SKIPPED_FOR_MEMORY} even alone on the device "
                                 "(holding the device-memory lock, after retries); neither findings nor harness "
                                 "errors, but not checked (fewer workers, a GPU with more memory, or one no other "
                                 "process fills, fits them)")
        self.problems += [] if self.stopping else self.scheduler.unserved(self.targets)  # a target never fuzzed
        if self.fatal:
            self.problems.insert(0, self.fatal)
        full = self.snapshots.disk_full_report(self.disk_full, self.targets) if self.disk_full else None
        if full:
            self.problems.insert(0, full)
        return SupervisorResult([t.stats for t in self.targets], self.problems,
                                self.stopping and not self.fatal and not self.disk_full,
                                self.pool.workers, self.restarts, self.warnings, full,
                                time_table([(t.name, t.stats.stages) for t in self.targets],
                                           sum(s.wall for s in self.slots), sum(s.startup for s in self.slots),
                                           self.pool.workers))

    def _overruns(self) -> None:
        """A target whose examples ran on past ``--duration`` by more than its allowance (max(10%, 15 s)) gets a
        warning saying so and why (the workers' reports of what the deadline cut short, or the examples that
        were in flight then)."""
        if self.config.duration is None:
            return
        allowance = duration_allowance(self.config.duration)
        for t in self.targets:
            over = t.stats.elapsed - self.config.duration
            if over > allowance:
                why = "; ".join(w for w in self.warnings if w.startswith(f"{t.name}: --duration ran out")) or \
                    "examples already running at the deadline took that long"
                self.warnings.append(f"{t.name} ran {over:.0f} s past --duration {self.config.duration:g} s (more "
                                     f"than the {allowance:.0f} s allowed): {why}")

    def _stop_signal(self, signum, frame) -> None:
        if not self.stopping:
            self.on_event(f"stopping ({signal.Signals(signum).name}): workers finish their example in flight")
        self.stopping = True

    def _resume(self) -> None:
        """Warm-up for a fresh target (CampaignConfig.warmup); a campaign killed outright left examples in
        flight: retry them first."""
        for t in self.targets:
            if self.config.warmup and not self.state.chunks.get(t.name) and pins_configs(t.target, self.config):
                t.warm = list(range(self.config.warmup))
        if not (self.state.running and self.state.in_flight):
            return
        n = 0
        for key, entry in self.state.in_flight.items():
            try:  # an edited state.json's example would end the worker that retries it, on every run
                read_example(entry["example"] if isinstance(entry, dict) else None, self.state.path,
                             f"in_flight.{key}.example", fix="it is not retried")
            except BadReproducer as e:
                self.on_event(str(e))
                continue
            t = self.by_name.get(entry.get("target"))
            if t is not None:
                t.retries.append(entry["example"])
                n += 1
        if n:
            self.on_event(f"the last campaign in {self.out} was killed; retrying the {n} example(s) it had in flight")

    def _start(self, slot: Slot) -> None:
        parent, child = self.ctx.Pipe()
        spec = WorkerSpec(tuple(self.names), config_to_dict(self.config), slot.index, os.getpid(),
                          str(self.out / "workers" / f"w{slot.index}.log"),
                          gpu=(slot.index % self.pool.gpus) if self.pool.gpus else None, threads=self.pool.threads,
                          gpu_workers=-(-self.pool.workers // self.pool.gpus) if self.pool.gpus else 1,
                          observe_dir=str(self.out / "observed") if self.pool.observe else None)
        proc = self.ctx.Process(target=worker_main, args=(spec, child), name=f"kvfuzz-worker-{slot.index}")
        proc.start()
        child.close()
        slot.proc, slot.conn = proc, parent
        slot.ready = slot.goodbye = slot.killed_for_hang = False
        slot.task = slot.in_flight = None
        slot.starts += 1
        slot.started, slot.gpu_memory = time.monotonic(), None

    def _loop(self) -> None:
        stop_sent_at = None
        looked_at = -POLL_SECONDS
        while True:
            pause = looked_at + POLL_SECONDS - time.monotonic()
            if pause > 0:
                time.sleep(pause)
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
            looked_at = time.monotonic()
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

    def _assign(self, s: Slot) -> None:
        task = self.scheduler.next_task(self.targets)
        if task is None:
            if not any(t.in_flight or t.retries or (not t.replayed and not t.stats.stopped) for t in self.targets):
                s.retired = True
                self._send(s, ("stop",))
            return
        t = self.by_name[task.target]
        known = {"signatures": self.before.signatures(t.name, t.stats.failures), "ended": t.ended,
                 # CLOCK_MONOTONIC, every process's; a replay or warm-up before the target's turn: from its hand-out
                 "deadline": None if self.config.duration is None else (t.start or task.sent) + self.config.duration,
                 "plan": None if task.plan is None else task.plan.to_dict()}
        msg = {"replay": ("replay", task.id, task.target, known),
               "chunk": ("chunk", task.id, task.target, task.chunk, task.n, known),
               "retry": ("retry", task.id, task.target, task.example, known)}[task.kind]
        s.task = task
        self._send(s, msg)

    def _send(self, s: Slot, msg) -> None:
        try:
            s.conn.send(msg)
        except (BrokenPipeError, OSError):
            pass  # it died: its sentinel reports it

    def _drain(self, s: Slot) -> None:
        try:
            while s.conn.poll():
                self._message(s, s.conn.recv())
        except (EOFError, OSError):
            pass  # the worker is gone; what it sent before is handled
        except Exception as e:  # a message cut off by the worker's death
            self.on_event(f"worker {s.index}: unreadable message ({type(e).__name__})")

    def _message(self, s: Slot, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            s.ready = True
            s.startup_failures = 0
            s.ready_at = time.monotonic()
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
            # a chunk draws its n examples first; what it runs past them, or while its worker says it is shrinking,
            # shrinks a failure, as a database replay does: counted apart (TargetStats.shrink_runs), so
            # --max-examples bounds the examples
            task, stages = s.task, o.get("stages", {})
            shrink = task is not None and (task.kind == "replay" or task.kind == "chunk" and (
                task.counted >= task.n or "shrink" in stages))
            t.stats.add(Outcome(o["labels"], o["kernel_s"], o["harness_s"], o["ratio"],
                                None if o["signature"] is None else tuple(o["signature"]), o["rejection"],
                                o.get("skipped"), o.get("kv_tokens", 0), stages, o.get("sanitize")),
                        time.monotonic() - (t.start or time.monotonic()), shrink=shrink)
            self.before.hit(t.stats, o["signature"])
            if t.steer is not None and not shrink and not o.get("skipped"):  # what the next chunks steer by
                t.steer.observe(o["labels"], o["ratio"], o["signature"])
            if task is not None and not shrink:
                task.counted += 1
            s.in_flight = None
        elif kind == "seen":
            record = FailureRecord(**msg[2])
            s.pending[record.signature] = record
        elif kind == "failure":
            record = FailureRecord(**msg[2])
            s.pending.pop(record.signature, None)
            self._failure(record)
        elif kind == "spent":
            self.by_name[msg[1]].stats.add_spent(msg[2], msg[3])
        elif kind == "memory":
            s.gpu_memory = (msg[1], msg[2])
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

    def _finish_task(self, s: Slot) -> None:
        task, s.task = s.task, None
        s.pending.clear()  # a task that ends normally has reported each of them shrunk
        if task is None:
            return
        t = self.by_name[task.target]
        if task in t.in_flight:
            t.in_flight.remove(task)
        if task.kind == "replay":
            t.replayed = True
        elif task.kind == "chunk" and task.chunk >= 0:
            t.chunk_ended(task, time.monotonic() - task.sent)

    def _add_failure(self, t: TargetState, record: FailureRecord) -> bool:
        """Keep a new distinct failure (False: already kept); with a shared ``--db``, one another campaign (another
        host) claimed first is listed as its known duplicate (kvfuzz.fuzz.campaign.store.ledger)."""
        if not t.stats.add_failure(record):
            return False
        if record.known is None and self.config.db_spec is not None and not self.config.gate:
            try:
                other = ledger.claim(self.config.db(), self.out, t.name, record.kind, record.check, record.reproducer)
            except Exception as e:  # the database: never the campaign's end (its findings are in --out)
                other = None
                if "the shared findings ledger" not in " ".join(self.warnings):
                    self.warnings.append(f"the shared findings ledger in --db could not be used: {e}")
            if other is not None:
                record.known = ledger.duplicate_note(other)
        return True

    def _failure(self, record, how: str = "") -> None:
        t = self.by_name[record.target]
        if self._add_failure(t, record):
            known = f"known ({record.known}): " if record.known else ""
            self.on_event(f"{known}{record.kind} ({check_label(record.check)}) in {record.target}{how} -> "
                          f"{record.reproducer}")
            return
        # another worker found it first (its hits are counted from the examples' outcomes): keep one reproducer
        first = t.stats.failures[record.signature]
        if record.reproducer and record.reproducer != first.reproducer:
            shutil.rmtree(record.reproducer, ignore_errors=True)

    # ---- a worker's end (docs/campaigns.md, "Every way a worker can end"): how it ended decides whether the
    # example in flight is a finding (a kernel crash or hang, a harness error: a reproducer written here), retried
    # by a fresh worker or lost; a worker that cannot start ends the campaign; a full disk stops it, keeping what
    # was in flight for a rerun; an example past its timeout gets its worker killed
    def _out_of_space(self, message: str) -> None:
        """The disk of ``--out`` is full: stop the campaign, keeping the examples in flight for a rerun."""
        if self.disk_full is None:
            self.disk_full = message  # said once, at the end (_disk_full_report), with what was kept
        self.stopping = True  # each worker's example in flight is kept as it ends (_ended)

    def _ended(self, s: Slot) -> None:
        s.clock_out(time.monotonic())
        proc, flight, task = s.proc, s.in_flight, s.task
        ending = classify(proc.exitcode, said_goodbye=s.goodbye, killed_for_hang=s.killed_for_hang,
                          stopping=self.stopping)
        if self.disk_full is not None or (ending.kind is EndingKind.EXITED and not s.goodbye
                                          and out_nearly_full(self.out)):
            # stopped by the full disk, died of it (its log is there too) or with it: nobody's finding; what it
            # had in flight stays in state.json for a rerun
            self._out_of_space(self.disk_full or f"no space left on device: less than {FULL_BELOW_BYTES >> 20} MiB "
                               f"free in {self.out} when worker {s.index} {ending.kind.value} ({ending.detail})")
            self.snapshots.keep_unfinished(s.index, flight)
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
        if ending.detail == MPS_BUSY and not self.stopping and self.fatal is None:
            # the MPS server refuses clients until every client another's fault ended has exited: wait a moment
            self.mps_waits += 1
            if self.mps_waits > MAX_MPS_WAITS:
                self.fatal = (f"the CUDA MPS server refused new workers {MAX_MPS_WAITS} times (error 807, "
                              f"'{MPS_NOT_READY}'); see {self.out / 'workers' / f'w{s.index}.log'}")
                self.stopping = True
                return
            time.sleep(MPS_WAIT_SECONDS)
        elif not s.ready and ending.kind is not EndingKind.FINISHED and not self.stopping and self.fatal is None:
            s.startup_failures += 1
            tail = log_tail(self.out / "workers" / f"w{s.index}.log")
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

    def _keep_unshrunk(self, s: Slot, ending, note: str | None = None) -> None:
        """The failures a dead worker was still shrinking keep their unshrunk reproducers: a shrink that steps
        into an input that crashes or hangs the kernel must not take the failure it was shrinking with it.
        ``note``: why it ended, instead of the ending's."""
        pending, s.pending = s.pending, {}
        if ending.kind is EndingKind.FINISHED and not self.stopping:
            return
        for record in pending.values():
            if note is not None:
                why = note
            elif self.stopping:  # a worker stopped mid-shrink says goodbye (FINISHED): the failure stays found
                how = "shrunk structurally first" if record.stage == "structural" else "not shrunk"
                why = f" ({how}: the campaign was stopped while shrinking it)"
            elif record.stage == "hypothesis":
                why = f" (shrunk by Hypothesis; the worker {ending.kind.value} during the structural shrink)"
            elif record.stage == "structural":
                why = f" (shrunk structurally first; the worker {ending.kind.value} while Hypothesis shrank it)"
            else:
                why = f" (not shrunk: the worker {ending.kind.value} while shrinking it)"
            if record.target in self.by_name:  # known meanwhile: _failure keeps one reproducer
                self._failure(attrs.evolve(record, message=record.message + why, stage="final"), how=why)

    def _example_ended(self, s: Slot, flight: dict, ending, retried: bool) -> None:
        t = self.by_name.get(flight["target"])
        if t is None:
            return
        if ending.kind is EndingKind.STOPPED:
            return  # interrupted by the user: not a finding, not a loss
        if ending.detail == MPS_BUSY:  # it never reached the GPU: nobody's fault, not a loss
            t.retries.append(flight["example"])
            self.on_event(f"worker {s.index}: {MPS_BUSY} (CUDA error 807, after another client's fault) in "
                          f"{flight['phase']}; its example of {t.name} runs again in a new worker")
            return
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
        if ending.detail == DEVICE_ERROR and flight["phase"] != "kernel" and self.pool.workers > max(1, self.pool.gpus):
            # in kvfuzz's own phases (prepare, check) while other workers share the GPU: under CUDA MPS another
            # client's fault ends this one, as often as that kernel faults (a shrink of it faults again and again),
            # so the example is re-run by a new worker each time, never reported; lost after MAX_BYSTANDER_RERUNS
            key = example_key(Example.from_dict(flight["example"]))
            self._bystander_reruns[key] = n = self._bystander_reruns.get(key, 0) + 1
            if n > MAX_BYSTANDER_RERUNS:
                t.stats.lost += 1
                self.on_event(f"worker {s.index}: a CUDA error ended it in {flight['phase']} for the "
                              f"{MAX_BYSTANDER_RERUNS + 1}th time on the same example of {t.name}; it is lost")
                return
            t.retries.append(flight["example"])
            self.on_event(f"worker {s.index}: a CUDA error ended it in {flight['phase']} (kvfuzz's own phase) while "
                          f"other workers share its GPU; its example of {t.name} is re-run by a new worker, not "
                          "reported")
            return
        if ending.detail == DEVICE_ERROR and not retried and self.pool.workers > max(1, self.pool.gpus):
            # under CUDA MPS one client's fault ends every client of its GPU: this example may be a bystander of
            # another worker's crash. Re-run it in a new worker; a crash there too is its finding.
            t.retries.append(flight["example"])
            self.on_event(f"worker {s.index}: a CUDA error ended it in {flight['phase']}; other workers share its "
                          f"GPU, so its example of {t.name} is re-run by a new worker before anyone is blamed")
            return
        details = {"worker": s.index, **({"compiling": flight["compiling"]} if flight.get("compiling") else {})}
        finding = finding_for(ending, flight["phase"], details, timeout=self.policy.example_timeout)
        if finding is None:
            return
        example = Example.from_dict(flight["example"])
        t.stats.add(Outcome({"path": t.target.path(example.batch)}, signature=finding.signature),
                    time.monotonic() - (t.start or time.monotonic()))
        self.before.hit(t.stats, finding.signature)
        t.crashes += 1
        if len(t.ended) < MAX_ENDED_EXAMPLES:
            t.ended.append([list(finding.signature), flight["example"]])
        if finding.signature not in t.stats.failures:
            fault = self.config.fault.name if self.config.fault else None
            finding = self._blame_caller(t.target, example, finding)
            try:
                path = write_reproducer(self.out, t.target, example, finding, None, fault_name=fault, stage="unshrunk")
            except OutOfSpace as e:  # not recorded: kept in state.json, so a rerun with space finds it again
                self._out_of_space(str(e))
                self.snapshots.keep_unfinished(s.index, flight)
                return
            self._add_failure(t, FailureRecord.of(t.name, finding, example, fault, path))
            self.on_event(f"{finding.kind.value} ({finding.check}) in {t.name}, worker {s.index} -> {path}")
        if t.crashes >= self.policy.max_crashes and not t.stats.stopped:
            t.stats.stopped = f"stopped after {t.crashes} crashes and hangs (--max-crashes {self.policy.max_crashes})"
            self.on_event(f"{t.name}: {t.stats.stopped}")

    def _blame_caller(self, target, example, finding):
        """A call that broke its contract and then killed the kernel is the caller's fault."""
        if self.config.fault is None:
            return finding
        try:
            violations = caller_violations(target, properties.prepare(target, example, self.config.fault))
        except Exception:
            return finding
        if not violations:
            return finding
        outcome = {"outcome": f"{finding.kind.value}: {finding.message}"}
        return caller_finding(violations, outcome, {"path": target.path(example.batch)})

    def _check_hangs(self) -> None:
        """Kill a worker whose example ran past --example-timeout (a hang), unless a compiler runs under it: then
        it is compiling the kernel, and gets the timeout again (endings.compile_wait)."""
        now, timeout = time.monotonic(), self.policy.example_timeout
        for s in self.slots:
            f = s.in_flight
            if s.proc is not None and f is not None and not s.killed_for_hang and now - f["since"] > timeout:
                again, tool = compile_wait(s.proc.pid, f.get("compile_waits", 0))
                if again:
                    f["compile_waits"], f["since"] = f.get("compile_waits", 0) + 1, now
                    note = (f"{f['target']}: an example ran past --example-timeout ({timeout:g} s) while its worker "
                            f"was compiling ({tool}): given the timeout again, not called a hang")
                    if tool is not None and note not in self.warnings:
                        self.warnings.append(note)
                    continue
                f["compiling"] = tool
                s.killed_for_hang = True
                s.proc.kill()

    def _reap_all(self) -> None:
        for s in self.slots:
            if s.proc is not None and s.proc.is_alive():
                s.proc.kill()
            if s.proc is not None:
                s.proc.join()
                s.clock_out(time.monotonic())

    def _snapshot(self, force: bool = False, final: bool = False) -> None:
        """state.json and status.json (:class:`~kvfuzz.fuzz.campaign.workers.status.Snapshots`); a full disk stops the
        campaign."""
        try:
            self.snapshots.write(self.targets, self.slots, force=force, final=final,
                                 disk_full_now=self.disk_full is not None)
        except OutOfSpace as e:
            self._out_of_space(str(e))

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._progress_at >= 1.0:
            self._progress_at = now
            self.on_progress([t.stats for t in self.targets])


__all__ = ["MAX_BYSTANDER_RERUNS", "MAX_ENDED_EXAMPLES", "POLL_SECONDS", "STOP_GRACE_SECONDS", "Supervisor",
           "log_tail"]
