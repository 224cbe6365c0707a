"""kvfuzz's structural shrink: after Hypothesis has shrunk a new distinct failure, try the moves of
:mod:`kvfuzz.strategies.reductions` (several fields at once: a smaller head size with block ids scaled to keep
their element offsets, a shorter sequence at a smaller block size, ...) and keep each candidate that fails
with the same signature, greedily, until none does or the time budget is spent.

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
from kvfuzz.strategies.reductions import reductions


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
                   before: Callable[[], None] = lambda: None) -> Reduced:
    """Greedy structural shrink of ``example``, which fails with ``signature`` (``(kind, check)``):
    ``attempt(candidate)`` runs one candidate and returns its Finding or None; the first candidate (smallest
    first) failing with ``signature`` becomes the new start, until no candidate does or ``seconds`` have
    passed (checked between candidates). ``skip``: candidates not to run (e.g. ones that ended a worker).
    ``before``: called once, right before the first candidate runs (not at all when none does)."""
    start = time.monotonic()
    deadline = start + seconds
    best, finding, tried, taken, tested = example, None, 0, 0, set()
    while True:
        for cand in reductions(best.batch, capabilities, limits):
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


__all__ = ["Reduced", "reduce_failure"]
