"""What the supervisor (:mod:`kvfuzz.fuzz.campaign.workers.supervisor`) does when a worker ends (docs/campaigns.md,
"Every way a worker can end"): how it ended (:mod:`kvfuzz.fuzz.campaign.workers.endings`) decides whether the example
in flight is a finding (a kernel crash or hang, a harness error: a reproducer written here), retried by a
fresh worker or lost; a worker that cannot start ends the campaign; a full disk stops it, keeping what was in
flight for a rerun. Also hang detection (an example past its timeout gets its worker killed).

:class:`WorkerEndings` is the part of :class:`~kvfuzz.fuzz.campaign.workers.supervisor.Supervisor` that holds this; it
works on the supervisor's state (slots, targets, config, problems)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import attrs

from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.workers.bookkeeping import Slot
from kvfuzz.fuzz.campaign.workers.endings import EndingKind, classify, finding_for
from kvfuzz.fuzz.campaign.store.journal import OutOfSpace
from kvfuzz.fuzz.campaign.records import FailureRecord, Outcome
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.caller import caller_finding, caller_violations

#: A worker that dies without a word while ``--out`` has less free space than this died of the full disk (its
#: log is on it too): the supervisor ends the campaign as out of space instead of blaming the example.
FULL_BELOW_BYTES = 1 << 20
#: Crashing or hanging examples per target the workers are told not to re-run.
MAX_ENDED_EXAMPLES = 200


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker's log (what a worker that could not start said)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class WorkerEndings:
    """A worker's end, its example in flight, hangs and a full disk: the Supervisor's methods for them."""

    def _out_of_space(self, message: str) -> None:
        """The disk of ``--out`` is full: stop the campaign, keeping the examples in flight for a rerun."""
        if self.disk_full is None:
            self.disk_full = message  # said once, at the end (_disk_full_report), with what was kept
        self.stopping = True  # each worker's example in flight is kept as it ends (_ended)

    def _keep_unfinished(self, s: Slot, flight: dict | None) -> None:
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

    def _ended(self, s: Slot) -> None:
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

    def _example_ended(self, s: Slot, flight: dict, ending, retried: bool) -> None:
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
        finding = finding_for(ending, flight["phase"], {"worker": s.index}, timeout=self.policy.example_timeout)
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
        now = time.monotonic()
        for s in self.slots:
            f = s.in_flight
            if s.proc is not None and f is not None and not s.killed_for_hang \
                    and now - f["since"] > self.policy.example_timeout:
                s.killed_for_hang = True
                s.proc.kill()


__all__ = ["FULL_BELOW_BYTES", "MAX_ENDED_EXAMPLES", "WorkerEndings", "log_tail"]
