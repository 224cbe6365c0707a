"""kvfuzz's structural shrink, in the order a new distinct failure is shrunk (issue 52):

1. **structural first**, on the failure as found: the coarse moves of
   :func:`kvfuzz.strategies.reductions.coarse_reductions` (drop half of the sequences, then a quarter, ..., then
   one at a time; halve contexts and queries; snap them to block and tile edges), all inside the failure's kernel
   configuration. A serving-sized failure of tens of sequences at 60-140 ms an example gets to one or two
   sequences in seconds, where Hypothesis's shrink of its hundreds of choices had not finished within the
   120 s grace (KVFUZZ_SHRINK_GRACE);
2. **Hypothesis's own shrink** (and a pinned or focused chunk's widening across configurations), from the
   choices it found the failure with;
3. **structural after**: from the smaller of the two (:func:`smaller`), every move of
   :func:`kvfuzz.strategies.reductions.reductions` (several fields at once: a smaller head size with block ids
   scaled to keep their element offsets, a shorter sequence at a smaller block size, ...).

Each structural pass keeps the first candidate that fails with the same signature, greedily, until none does or
its time budget is spent (:func:`reduce_failure`). The reproducer's case.json says how long each pass took
(``details.shrink_seconds``, :func:`shrink_seconds`; also in summary.json).

Hypothesis's example database still holds the Hypothesis-shrunk choices (a candidate has no choice sequence);
replaying them shrinks again and reaches the same case. A candidate that fails differently (another kind or
check) is not taken: the reproducer keeps the failure it was found as.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.example import Example
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import coarse_reductions, reductions, size_key


@attrs.frozen
class Reduced:
    """The result of :func:`reduce_failure`: the smallest failing example found, its finding (None when no
    candidate beat the start), how many candidates ran and how many were taken, the seconds it took and
    whether the time budget ran out."""

    example: Example
    finding: Finding | None
    tried: int
    taken: int
    seconds: float
    out_of_time: bool

    def to_dict(self, start: Example) -> dict:
        """What a reproducer's case.json says of it (``details.structural_shrink``)."""
        return {"from": start.batch.summary(), "tried": self.tried, "taken": self.taken,
                "seconds": round(self.seconds, 3), "out_of_time": self.out_of_time}


def reduce_failure(example: Example, signature: tuple[str, str], attempt: Callable[[Example], Finding | None],
                   capabilities: Capabilities, limits: Limits = Limits(), seconds: float = 60.0,
                   skip: Callable[[Example], bool] = lambda e: False,
                   before: Callable[[], None] = lambda: None, moves=reductions) -> Reduced:
    """Greedy structural shrink of ``example``, which fails with ``signature`` (``(kind, check)``):
    ``attempt(candidate)`` runs one candidate and returns its Finding or None; the first candidate (in the order
    ``moves(batch, capabilities, limits)`` gives them: :func:`~kvfuzz.strategies.reductions.reductions`, smallest
    first) failing with ``signature`` becomes the new start, until no candidate does or ``seconds`` have
    passed (checked between candidates). ``skip``: candidates not to run (e.g. ones that ended a worker).
    ``before``: called once, right before the first candidate runs (not at all when none does)."""
    start = time.monotonic()
    deadline = start + seconds
    best, finding, tried, taken, tested = example, None, 0, 0, set()
    while True:
        for cand in moves(best.batch, capabilities, limits):
            if time.monotonic() > deadline:
                return Reduced(best, finding, tried, taken, time.monotonic() - start, True)
            candidate = attrs.evolve(best, batch=cand)
            if candidate in tested or skip(candidate):
                continue
            tested.add(candidate)
            if not tried:
                before()
            tried += 1
            found = attempt(candidate)
            if found is not None and found.signature == tuple(signature):
                best, finding, taken = candidate, found, taken + 1
                break
        else:
            return Reduced(best, finding, tried, taken, time.monotonic() - start, False)


def structural(runner, signature: tuple[str, ...], start: tuple, first: bool = False) -> tuple:
    """One structural pass over ``start`` (``(example, finding, run)``, failing with ``signature``), its candidates run
    by ``runner`` (the campaign's :class:`~kvfuzz.fuzz.campaign.runner.ExampleRunner`: its ``attempt`` runs one, its
    ``run`` is the candidate's Run, its ``ledger`` knows the examples that ended a worker, its ``seen`` reports a
    provisional reproducer): the coarse moves on a failure as found (``first``), every move after Hypothesis's shrink
    (then, before its first candidate, the Hypothesis-shrunk reproducer is written and reported ``seen``, so a
    candidate that kills the worker leaves it behind; after a first pass that took a candidate, its result is, stage
    "structural", so a worker killed or stopped while Hypothesis shrinks leaves that). Within
    ``runner.shrink_seconds_left`` of ``--structural-shrink`` (never past ``--duration``'s shrink grace). Returns the
    smallest ``(example, finding, run)`` failing the same way, the finding's details saying what the pass did
    (``structural_first`` or ``structural_shrink``: the case it started from, the candidates tried and taken,
    seconds)."""
    example, finding, run = start
    kept: list = []

    def attempt(candidate: Example) -> Finding | None:
        found = runner.attempt(candidate)
        if found is not None and found.signature == signature:
            kept[:] = [runner.run]  # every candidate failing so is taken: the last one is the result
        return found

    config = runner.config
    reduced = reduce_failure(example, signature, attempt, runner.target.capabilities, config.limits,
                             runner.shrink_seconds_left(config.structural_shrink), skip=runner.ledger.ended_a_worker,
                             before=(lambda: None) if first else lambda: runner.seen(signature, start,
                                                                                     stage="hypothesis"),
                             moves=coarse_reductions if first else reductions)
    if reduced.finding is not None:
        example, finding, run = reduced.example, reduced.finding, kept[0]
        _carry(start[1], finding)
    finding.details["structural_first" if first else "structural_shrink"] = reduced.to_dict(start[0])
    if first and reduced.finding is not None:  # a worker killed while Hypothesis shrinks keeps this one
        runner.seen(signature, (example, finding, run), stage="structural")
    return example, finding, run


#: What a finding's details say of its shrink, kept when a smaller example's finding replaces it.
SHRINK_NOTES = ("structural_first", "shrink_stopped")


def _carry(source: Finding, to: Finding) -> None:
    for note in SHRINK_NOTES:
        if note in source.details and note not in to.details:
            to.details[note] = source.details[note]


def smaller(first: tuple | None, latest: tuple) -> tuple:
    """Of the structural-first result ``first`` and Hypothesis's ``latest`` (each ``(example, finding, run)``),
    the smaller by :func:`~kvfuzz.strategies.reductions.size_key` (Hypothesis's on a tie, or without ``first``).
    The chosen finding's details keep what the other's say of the shrink (``structural_first``, and
    ``shrink_stopped``: Hypothesis's shrink cut short)."""
    if first is None:
        return latest
    chosen, other = (first, latest) if size_key(first[0].batch) < size_key(latest[0].batch) else (latest, first)
    _carry(other[1], chosen[1])
    return chosen


def shrink_seconds(found_at: float | None, first: float, recorded_at: float, structural_after: dict | None) -> dict:
    """How long each shrink of one failure took, in seconds: ``structural_first`` (``first``), ``hypothesis``
    (from the failure's first sight, ``found_at``, to ``recorded_at``, less ``first``: Hypothesis's shrink and the
    widening), ``structural`` (``structural_after``'s seconds, a :meth:`Reduced.to_dict`; 0 when it did not
    run)."""
    hypothesis = 0.0 if found_at is None else max(0.0, recorded_at - found_at - first)
    after = (structural_after or {}).get("seconds", 0.0)
    return {"structural_first": round(first, 3), "hypothesis": round(hypothesis, 3), "structural": round(after, 3)}


__all__ = ["SHRINK_NOTES", "Reduced", "reduce_failure", "shrink_seconds", "smaller", "structural"]
