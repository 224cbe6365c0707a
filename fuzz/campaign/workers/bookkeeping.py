"""The supervisor's bookkeeping (:mod:`kvfuzz.fuzz.campaign.workers.supervisor`): the :class:`Task` a worker runs, the
:class:`Slot` a worker fills (replaced when it dies), the :class:`TargetState` of each target, and what a
campaign comes to (:class:`SupervisorResult`); the failures an earlier campaign in the same ``--out`` recorded
(:class:`FoundBefore`)."""

from __future__ import annotations

from typing import Any, Callable

import attrs

from kvfuzz.contracts.checks.failures import FailureKind
from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.campaign.chunks import record_tier_time
from kvfuzz.fuzz.campaign.records import FailureRecord, TargetStats
from kvfuzz.fuzz.campaign.store.cases import Case, earlier_cases


@attrs.define
class Task:
    """One unit of work handed to a worker: replay the database, a chunk of ``n`` examples, or a retry."""

    id: int
    kind: str  # "replay", "chunk", "retry"
    target: str
    n: int = 0
    chunk: int = -1
    example: dict | None = None
    counted: int = 0  # examples of this task counted so far
    tier: str = "small"  # a chunk's size tier (its plan's, else kvfuzz.fuzz.campaign.chunks.chunk_tier)
    sent: float = 0.0  # time.monotonic() when it was handed to a worker
    plan: Any = None  # a chunk's kvfuzz.fuzz.campaign.steering.Plan (its tier and focus), None: the fixed split


@attrs.define
class Slot:
    """One worker position; its process is replaced when it dies."""

    index: int
    proc: Any = None
    conn: Any = None
    ready: bool = False
    goodbye: bool = False
    task: Task | None = None
    in_flight: dict | None = None  # {"target", "example", "phase", "since"}
    killed_for_hang: bool = False
    starts: int = 0
    startup_failures: int = 0
    retired: bool = False
    #: distinct failures the worker saw and is shrinking (unshrunk reproducers written), by signature
    pending: dict = attrs.field(factory=dict)
    #: ``time.monotonic()`` when its process was started, and when it said it was ready (None: not yet)
    started: float = 0.0
    ready_at: float | None = None
    #: seconds its processes lived (spawn to end), and of those, spent starting (spawn to ready), summed
    wall: float = 0.0
    startup: float = 0.0
    #: (reserved, allocated) bytes of CUDA memory, as its process last reported them (None: not on CUDA, or not yet)
    gpu_memory: tuple | None = None

    def clock_out(self, now: float) -> None:
        """Its process ended (or the campaign did) at ``now``: add its lifetime and its start-up."""
        if self.started:
            self.wall += now - self.started
            self.startup += (self.ready_at or now) - self.started
            self.started, self.ready_at = 0.0, None


@attrs.define
class TargetState:
    """The supervisor's view of one target."""

    target: Any
    stats: Any
    #: ``time.monotonic()`` when its turn began (its first chunk of fresh seeds), its ``--duration`` clock's start;
    #: None before (kvfuzz.fuzz.campaign.workers.scheduling)
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
    tiers: tuple = ("small",)  # the size tiers its chunks rotate through (chunks.campaign_tiers)
    #: {tier: [chunks, examples, worker seconds]} of its finished chunks (chunks.tier_chunk_size)
    tier_times: dict = attrs.Factory(dict)
    #: the policy choosing each chunk's tier and focus (kvfuzz.fuzz.campaign.steering.Steering), None: not steered
    steer: Any = None

    @property
    def name(self) -> str:
        return self.target.name

    def chunk_ended(self, task: Task, seconds: float) -> None:
        """Chunk ``task`` ended after ``seconds`` (hand-out to end): its tier's time (chunks.tier_chunk_size), its kind
        in the stats (``TargetStats.add_chunk``: free or aimed at a bin), and its bins' examples no longer coming."""
        record_tier_time(self.tier_times, task.tier, task.counted, seconds)
        self.stats.add_chunk(task.plan is not None and task.plan.focus is not None, task.counted, seconds)
        if self.steer is not None:
            self.steer.finished(task.plan, task.n)


@attrs.define
class SupervisorResult:
    """targets: TargetStats per target. problems: what went wrong besides findings (workers that could not
    start, examples lost; any of them makes the campaign's exit status 3). interrupted: the user stopped the
    campaign. warnings: worth knowing, lost nothing (a shared database's outage). disk_full: why the campaign
    stopped for want of space and what it kept (also the first problem; exit status 3, findings or not). time:
    where the workers' time went (:func:`kvfuzz.fuzz.campaign.stages.time_table`; summary.json's ``time``)."""

    targets: list
    problems: list[str]
    interrupted: bool
    workers: int
    restarts: int
    warnings: list[str] = attrs.Factory(list)
    disk_full: str | None = None
    time: dict = attrs.Factory(dict)


#: Which of two reproducers of one failure in ``--out`` stands for it: the one shrunk furthest (case.json ``stage``).
_STAGE_RANK = {"final": 0, "hypothesis": 1, "structural": 2}


@attrs.define
class FoundBefore:
    """The failures an earlier campaign in the same ``--out`` recorded (one killed, or stopped, and started again):
    ``cases[(target, signature)]`` is the reproducer already there. Workers are told their signatures as known, so
    their hits are counted, never shrunk or written again; the first hit lists the failure, ``found_before``, with
    that reproducer (:meth:`hit`). ``say``: a line for the console."""

    cases: dict[tuple[str, tuple[str, ...]], Case] = attrs.Factory(dict)
    say: Callable[[str], None] = lambda m: None

    @classmethod
    def read(cls, config, targets, say: Callable[[str], None]) -> "FoundBefore":
        """The reproducers in ``config.out`` of ``targets`` (names) written under the campaign's caller fault (or
        none); one that cannot be read is named in a warning and left out (its failure, found again, is new)."""
        out, fault = config.out, config.fault.name if config.fault else None
        found: dict = {}
        for case in sorted(earlier_cases(out, say),
                           key=lambda c: (_STAGE_RANK.get(c.raw.get("stage", "final"), 3), c.directory.name)):
            if case.target in targets and case.fault == fault:
                found.setdefault((case.target, case.signature), case)
        if found:
            say(f"{len(found)} failure(s) already have a reproducer in {out} (an earlier campaign there): found "
                "again, they are reported as found before, with that reproducer")
        return cls(found, say)

    def signatures(self, target: str, known) -> list[list[str]]:
        """``known`` (signatures) and those found before of ``target``: what its workers count without recording."""
        return [list(sig) for sig in known] + [list(sig) for t, sig in self.cases if t == target and sig not in known]

    def hit(self, stats: TargetStats, signature) -> None:
        """A hit of ``signature`` (None: the example passed), just counted in ``stats``: the first of a failure found
        before adds its record (count 1; later hits are counted on it), with the reproducer already in ``--out``."""
        case = None if signature is None else self.cases.get((stats.target, tuple(signature)))
        if case is None or tuple(signature) in stats.failures:
            return
        stats.add_failure(FailureRecord(
            case.target, case.kind, FailureKind(case.kind).blame, case.check, str(case.raw.get("message", "")),
            case.example.to_dict(), case.fault, str(case.directory),
            known=signature[2] if len(signature) > 2 else None, found_before=True))
        self.say(f"found before: {case.kind} ({check_label(case.check)}) in {case.target} -> {case.directory} "
                 "(its reproducer from an earlier campaign in this --out; none written again)")


__all__ = ["FoundBefore", "Slot", "SupervisorResult", "TargetState", "Task"]
