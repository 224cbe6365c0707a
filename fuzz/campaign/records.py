"""What a campaign counts and reports: an example's :class:`Outcome`, a distinct failure's
:class:`FailureRecord`, a target's :class:`TargetStats`, and the :class:`Listener` told about every example as it
happens (a worker's sends each event over its pipe; :class:`Quiet` ignores them all)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Protocol

import attrs

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.stages import StageTable
from kvfuzz.fuzz.harness.coverage import Coverage


@attrs.frozen
class Outcome:
    """What one example adds to its target's counts (small: a worker sends one per example).

    labels: coverage labels (:func:`kvfuzz.fuzz.harness.coverage.labels`). kernel_s, harness_s: seconds in the
    kernel and outside it. ratio: how close a passing kernel came to the tolerance bound. signature: the
    finding's (kind, check) when the example failed. rejection: ``--undeclared``: the error a kernel rejected
    an undeclared configuration with. skipped: why the example was not checked (``SKIPPED_FOR_MEMORY``): it is
    counted apart, not as an example. stages: its seconds per stage (:data:`kvfuzz.fuzz.campaign.stages.STAGES`),
    adding up to its time in the worker, its draw included. sanitize: its sanitized runs' seconds per phase, adding
    up to its ``sanitize`` stage (kvfuzz.fuzz.campaign.runner.SanitizerSchedule.take), or None."""

    labels: dict[str, str]
    kernel_s: float = 0.0
    harness_s: float = 0.0
    ratio: float = 0.0
    signature: tuple[str, str] | None = None
    rejection: str | None = None
    skipped: str | None = None
    #: KV tokens the example's kernel call attended over: its cached context plus its new tokens
    #: (``sum(ctx_lens) + sum(query_lens)``), for KV tokens checked per second.
    kv_tokens: int = 0
    stages: dict = attrs.field(factory=dict)
    sanitize: dict | None = None


#: :attr:`Outcome.skipped` of an example that ran out of device memory in kvfuzz's own phases (prepare, check)
#: even holding the campaign's device-memory lock, after the retries, or in the kernel call while the GPU stayed
#: full (kvfuzz.fuzz.harness.memory.device_full) (kvfuzz.fuzz.campaign.runner): it could not be fit, so it is
#: neither a finding nor a harness error; the campaign counts it and exits 3.
SKIPPED_FOR_MEMORY = "out of device memory in kvfuzz's own phases, or in the kernel call on a full GPU"


@attrs.define
class FailureRecord:
    """One distinct failure as summaries keep it: its signature, what it says, its minimal example, how often
    it was hit and its reproducer directory."""

    target: str
    kind: str
    blame: str
    check: str
    message: str
    example: dict
    fault: str | None = None
    reproducer: str | None = None
    count: int = 1
    #: How far a failure reported ``seen`` (not yet final) was shrunk: "unshrunk", "structural" (by the
    #: structural-first pass, before Hypothesis's shrink) or "hypothesis" (shrunk by Hypothesis, before the
    #: structural shrink after it).
    stage: str = "final"
    #: The findings-baseline entry this failure is (CampaignConfig.baseline), or None: a new failure.
    known: str | None = None
    #: Seconds each shrink of it took (kvfuzz.fuzz.campaign.reduce ``shrink_seconds``: structural_first,
    #: hypothesis, structural), None when it was not shrunk here.
    shrink: dict | None = None
    #: An earlier campaign in the same ``--out`` recorded it (a campaign killed and started again): its reproducer
    #: is the one already there, none is written again; still a failure (kvfuzz fuzz exits 1 unless it is known).
    found_before: bool = False

    @property
    def signature(self) -> tuple[str, ...]:
        return (self.kind, self.check) if self.known is None else (self.kind, self.check, self.known)

    @classmethod
    def of(cls, target: str, finding: Finding, example: Example, fault: str | None,
           reproducer: Path | None) -> "FailureRecord":
        return cls(target, finding.kind.value, finding.kind.blame, finding.check, finding.message,
                   example.to_dict(), fault, None if reproducer is None else str(reproducer),
                   known=finding.known, shrink=finding.details.get("shrink_seconds"))

    def batch_summary(self) -> str:
        try:
            e = Example.from_dict(self.example)
            return f"{e.batch.summary()}, poison={e.poison.value}"
        except (KeyError, TypeError, ValueError):
            return "(example unreadable)"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "blame": self.blame, "check": self.check, "count": self.count,
                "message": self.message, "batch": self.batch_summary(), "caller_fault": self.fault,
                "reproducer": self.reproducer, "example": self.example, "known": self.known, "shrink": self.shrink,
                "found_before": self.found_before}


@attrs.define
class TargetStats:
    """One target's counts over a campaign (every worker's examples, exactly)."""

    target: str
    examples: int = 0
    elapsed: float = 0.0
    kernel_seconds: float = 0.0
    harness_seconds: float = 0.0
    paths: collections.Counter = attrs.Factory(collections.Counter)
    failures: dict = attrs.Factory(dict)  # signature -> FailureRecord
    max_error_ratio: float = 0.0
    coverage: Coverage = attrs.Factory(Coverage)
    rejections: collections.Counter = attrs.Factory(collections.Counter)  # --undeclared: error -> count
    #: Seconds and examples (counted from the target's start) until the first failing example, before any
    #: shrinking; None while nothing failed.
    first_failure_s: float | None = None
    first_failure_examples: int | None = None
    #: The same for the first failure no baseline entry accepts (CampaignConfig.baseline; without one, the first
    #: failure): what a known failure's hits must not stand for (``kvfuzz bench bugs --baseline``).
    first_new_failure_s: float | None = None
    first_new_failure_examples: int | None = None
    #: Examples a worker was running when it was killed from outside and a retry could not complete.
    lost: int = 0
    #: Why the campaign stopped giving this target work early ("" if it did not).
    stopped: str = ""
    #: Per size tier (the "tier" label): [examples, kernel seconds, harness seconds].
    tier_seconds: dict = attrs.Factory(dict)
    #: Examples skipped because kvfuzz could not fit them in device memory (:data:`SKIPPED_FOR_MEMORY`).
    skipped_memory: int = 0
    #: KV tokens of the examples checked (:attr:`Outcome.kv_tokens`).
    kv_tokens: int = 0
    #: Seconds per stage and examples, per size tier (:class:`~kvfuzz.fuzz.campaign.stages.StageTable`): every
    #: example's :attr:`Outcome.stages` and the time its workers spent on it outside examples (:meth:`add_spent`).
    stages: StageTable = attrs.Factory(StageTable)
    #: Kernel runs that replayed the example database or shrank a failure: not examples (``--max-examples`` bounds
    #: the examples drawn), so counted apart; their time is in kernel_seconds, harness_seconds and the stages.
    shrink_runs: int = 0
    #: Per kind of chunk ("free" or "focused": a steered campaign's, kvfuzz.fuzz.campaign.steering; "free" for all
    #: without steering): [chunks, examples, seconds] of the chunks that ended (one a worker died in is not counted),
    #: each chunk's seconds from its hand-out to its end (its worker's wall time, the first example's compiles and
    #: any shrink included): where a campaign's time goes between aiming at empty bins and drawing freely.
    chunk_kinds: dict = attrs.Factory(dict)

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.elapsed if self.elapsed else 0.0

    def add(self, outcome: Outcome, elapsed: float, shrink: bool = False) -> None:
        """Count one example, ``elapsed`` seconds after the target's start; ``shrink``: a run that replayed the
        database or shrank a failure, counted in :attr:`shrink_runs` and its time only."""
        self.stages.add(outcome.labels.get("tier", "small"), outcome.stages,
                        examples=int(outcome.skipped is None and not shrink), sanitize=outcome.sanitize)
        if outcome.skipped is not None:  # not checked: counted apart
            self.skipped_memory += 1
            self.elapsed = max(self.elapsed, elapsed)
            return
        if shrink:
            self.shrink_runs += 1
            self.elapsed = max(self.elapsed, elapsed)
            self.kernel_seconds += outcome.kernel_s
            self.harness_seconds += outcome.harness_s
            self._first(outcome.signature, elapsed)  # a database replay's failure
            return
        self.examples += 1
        self.kv_tokens += outcome.kv_tokens
        self.elapsed = max(self.elapsed, elapsed)
        self.kernel_seconds += outcome.kernel_s
        self.harness_seconds += outcome.harness_s
        tier = self.tier_seconds.setdefault(outcome.labels.get("tier", "small"), [0, 0.0, 0.0])
        tier[0], tier[1], tier[2] = tier[0] + 1, tier[1] + outcome.kernel_s, tier[2] + outcome.harness_s
        self.paths[outcome.labels.get("path", "default")] += 1
        self.coverage.add(outcome.labels)
        self.max_error_ratio = max(self.max_error_ratio, outcome.ratio)
        if outcome.rejection is not None:
            self.rejections[outcome.rejection] += 1
        if outcome.signature is not None:
            self._first(outcome.signature, elapsed)
            known = self.failures.get(tuple(outcome.signature))
            if known is not None:
                known.count += 1

    def _first(self, signature, elapsed: float) -> None:
        """Note a failing example's time and count if it is the first failure, or the first new one: a signature of
        two parts (kind, check) is new, of three (kind, check, known id) a baseline entry's."""
        if signature is None:
            return
        if self.first_failure_s is None:
            self.first_failure_s, self.first_failure_examples = round(elapsed, 3), self.examples
        if len(signature) == 2 and self.first_new_failure_s is None:
            self.first_new_failure_s, self.first_new_failure_examples = round(elapsed, 3), self.examples

    @property
    def new_failures(self) -> list:
        """The failures no baseline entry accepts (all of them without a baseline)."""
        return [r for r in self.failures.values() if r.known is None]

    def add_spent(self, tier: str, seconds: dict[str, float]) -> None:
        """Add a worker's seconds on this target outside its examples (``{stage: seconds}``, of size tier ``tier``)."""
        self.stages.add(tier, seconds)

    def add_chunk(self, focused: bool, examples: int, seconds: float) -> None:
        """Count one chunk that ended (:attr:`chunk_kinds`): aimed at a bin (``focused``) or free, the ``examples``
        it counted and its ``seconds``."""
        row = self.chunk_kinds.setdefault("focused" if focused else "free", [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + examples, row[2] + seconds

    def add_failure(self, record: FailureRecord) -> bool:
        """Keep a new distinct failure; returns False when its signature is already known (then its count
        grows: a second worker found it, or a recovered crash repeated)."""
        if record.signature in self.failures:
            return False
        self.failures[record.signature] = record
        return True

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "examples": self.examples,
            "elapsed_s": round(self.elapsed, 3),
            "examples_per_s": round(self.examples_per_second, 3),
            "kv_tokens": self.kv_tokens,
            "kv_tokens_per_s": round(self.kv_tokens / self.elapsed, 1) if self.elapsed else 0.0,
            "kernel_s": round(self.kernel_seconds, 3),
            "harness_s": round(self.harness_seconds, 3),
            "tiers": {t: {"examples": n, "kernel_s": round(k, 3), "harness_s": round(h, 3)}
                      for t, (n, k, h) in self.tier_seconds.items()},
            "stages": self.stages.to_dict(),
            "chunks": {k: {"chunks": c, "examples": n, "seconds": round(sec, 3)}
                       for k, (c, n, sec) in sorted(self.chunk_kinds.items())},
            "paths": dict(self.paths),
            "coverage": self.coverage.to_dict(),
            "rejections": dict(self.rejections.most_common(20)),
            "max_error_ratio": self.max_error_ratio,
            "first_failure_s": self.first_failure_s,
            "first_failure_examples": self.first_failure_examples,
            "first_new_failure_s": self.first_new_failure_s,
            "first_new_failure_examples": self.first_new_failure_examples,
            "lost": self.lost,
            "skipped_for_memory": self.skipped_memory,
            "shrink_runs": self.shrink_runs,
            "stopped": self.stopped,
            "failures": [f.to_dict() for f in self.failures.values()],
        }


class Listener(Protocol):
    """Told about every example of a :class:`~kvfuzz.fuzz.campaign.engine.Campaign` as it happens: ``begin``
    (the example, before anything runs), ``phase`` ("kernel" right before the kernel call, "check" after it),
    ``end`` (an :class:`Outcome`, what it adds to the counts), ``failure`` (a new distinct failure, a
    :class:`FailureRecord`) and ``seen`` (the same, before it is shrunk); and ``spent``: seconds of the campaign's
    time outside its examples, per stage (``{stage: seconds}`` of one size tier: Hypothesis's engine, shrinking,
    recording; :mod:`kvfuzz.fuzz.campaign.stages`)."""

    def begin(self, target: str, example: Example) -> None: ...

    def phase(self, name: str) -> None: ...

    def end(self, target: str, outcome: Outcome) -> None: ...

    def failure(self, record: FailureRecord) -> None: ...

    def seen(self, record: FailureRecord) -> None:
        """A new distinct failure, unshrunk (its reproducer already written): the worker may die shrinking it."""

    def spent(self, target: str, tier: str, seconds: dict[str, float]) -> None: ...


class Quiet:
    """A listener that ignores everything (a base for listeners that care about some events)."""

    def begin(self, target, example) -> None:
        pass

    def phase(self, name) -> None:
        pass

    def end(self, target, outcome) -> None:
        pass

    def failure(self, record) -> None:
        pass

    def seen(self, record) -> None:
        pass

    def spent(self, target, tier, seconds) -> None:
        pass


def example_key(example: Example | dict) -> str:
    """A canonical text of an example (its dict, keys sorted): equal for equal examples."""
    return json.dumps(example if isinstance(example, dict) else example.to_dict(), sort_keys=True)


__all__ = ["FailureRecord", "Listener", "Outcome", "Quiet", "SKIPPED_FOR_MEMORY", "TargetStats", "example_key"]
