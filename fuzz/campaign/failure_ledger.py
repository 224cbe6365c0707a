"""The failure signatures one target's campaign keeps in one process (:class:`FailureLedger`).

A signature is a finding's ``(kind, check)`` (with a baseline entry's id for a known finding:
:attr:`~kvfuzz.contracts.checks.failures.Finding.signature`). One signature is one distinct failure: the first
example to fail so is shrunk and written as a reproducer; later ones are counted. The ledger answers, for each
example the campaign runs, whether its failure is new, pending (being shrunk) or recorded, and keeps what a shrink
leaves behind until the failure is recorded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.records import FailureRecord, example_key
from kvfuzz.fuzz.harness.run import Run

#: ``(example, finding, run)``: a failing example, its finding and the Run it left (None once dropped).
Failing = tuple[Example, Finding, "Run | None"]


class FailureLedger:
    """Every failure signature a campaign process knows, and what it keeps for each:

    - *known*: recorded here, or reported by another worker (:meth:`learn`): counted, never shrunk or written again;
    - *ended*: examples (by :func:`~kvfuzz.fuzz.campaign.records.example_key`) that ended a worker, a crash or a hang:
      the supervisor counted them, and they are never run again (a chunk starts at its simplest example, so one that
      hangs would hang every chunk);
    - *latest*: for each signature seen, the latest failing ``(example, finding, run)``: as Hypothesis shrinks a
      failure, the smallest example so far;
    - *found*: the distinct new failures the Hypothesis run in progress has raised (:meth:`start_run` clears them);
    - *provisional*: the reproducer written for a failure seen and not yet recorded shrunk, so a worker that dies
      while shrinking leaves it behind;
    - *first*: for each failure seen and not yet recorded, its structural-first pass (kvfuzz.fuzz.campaign.reduce):
      the result, when the failure was first seen and the pass's seconds;
    - *recorded*: the records written since :meth:`start_run` (what a piece of the campaign returns)."""

    def __init__(self, known: Iterable[tuple[str, ...]] = ()) -> None:
        self._known: set[tuple[str, ...]] = set(known)
        self._ended: dict[str, tuple[str, ...]] = {}
        self._latest: dict[tuple[str, ...], Failing] = {}
        self._found: list[tuple[str, ...]] = []
        self._provisional: dict[tuple[str, ...], Path] = {}
        self._first: dict[tuple[str, ...], tuple[Failing | None, float, float]] = {}
        self._recorded: list[FailureRecord] = []

    # ---- what other workers know ---------------------------------------------------------------------------
    def learn(self, signatures: Iterable[Iterable[str]] = (), ended: Iterable[tuple[Iterable[str], dict]] = ()) -> None:
        """Take the supervisor's lists: signatures recorded anywhere in the campaign, and ``[signature, example]``
        pairs of examples that ended a worker."""
        self._known |= {tuple(s) for s in signatures}
        self._ended.update((example_key(e), tuple(sig)) for sig, e in ended)

    def is_known(self, signature: tuple[str, ...]) -> bool:
        return signature in self._known

    def mark_known(self, signature: tuple[str, ...]) -> None:
        """Count ``signature``'s later hits from now on (it is being recorded)."""
        self._known.add(signature)

    def ended_a_worker(self, example: Example) -> bool:
        """Whether ``example`` ended a worker before (it is counted, not run again)."""
        return bool(self._ended) and example_key(example) in self._ended

    # ---- the Hypothesis run in progress --------------------------------------------------------------------
    def start_run(self) -> None:
        """A new Hypothesis run: nothing found or recorded in it yet."""
        self._found, self._recorded = [], []

    def saw(self, signature: tuple[str, ...], failing: Failing) -> bool:
        """Keep ``failing`` as ``signature``'s latest example; returns whether the signature is seen for the first
        time in this process."""
        first = signature not in self._latest
        self._latest[signature] = failing
        return first

    def latest(self, signature: tuple[str, ...]) -> Failing:
        return self._latest[signature]

    def found(self, signature: tuple[str, ...]) -> None:
        """The run in progress ended with ``signature`` raised (Hypothesis shrank it)."""
        self._found.append(signature)

    def found_in_run(self) -> list[tuple[str, ...]]:
        return list(self._found)

    def pending(self) -> list[tuple[str, ...]]:
        """Signatures seen here, neither recorded nor raised by the run in progress: failures being shrunk."""
        return [sig for sig in self._latest if sig not in self._known and sig not in self._found]

    # ---- the structural-first pass (kvfuzz.fuzz.campaign.reduce) -------------------------------------------
    def keep_first(self, signature: tuple[str, ...], failing: Failing | None, found_at: float, seconds: float) -> None:
        """The structural-first pass of ``signature``, first seen at ``found_at`` (``time.monotonic()``), took
        ``seconds`` and left ``failing`` (None: it did not run)."""
        self._first[signature] = (failing, found_at, seconds)

    def take_first(self, signature: tuple[str, ...]) -> tuple[Failing | None, float | None, float]:
        """``(failing, found_at, seconds)`` of :meth:`keep_first`, let go of here (the failure is being recorded);
        ``(None, None, 0.0)`` for a failure not seen in this process (a pinned example recorded as it stands)."""
        return self._first.pop(signature, (None, None, 0.0))

    def first_passes(self) -> list[tuple[str, ...]]:
        """The signatures whose structural-first pass ended and that are not recorded yet."""
        return list(self._first)

    # ---- reproducers ---------------------------------------------------------------------------------------
    def keep_provisional(self, signature: tuple[str, ...], path: Path) -> None:
        """``path`` is ``signature``'s provisional reproducer now (an earlier one is removed)."""
        self.drop_provisional(signature, keep=path)
        self._provisional[signature] = path

    def drop_provisional(self, signature: tuple[str, ...], keep: Path) -> None:
        """Remove the provisional reproducer of ``signature`` unless it is ``keep`` (the same example)."""
        early = self._provisional.pop(signature, None)
        if early is not None and Path(early) != Path(keep):
            shutil.rmtree(early, ignore_errors=True)

    def recorded(self, record: FailureRecord) -> None:
        """A reproducer was written and reported for a distinct failure."""
        self._recorded.append(record)

    def records(self) -> list[FailureRecord]:
        """The records written since :meth:`start_run`."""
        return self._recorded

    def forget_run(self, signature: tuple[str, ...]) -> Run | None:
        """Drop the Run a recorded failure kept (its reproducer is written) and return it, or None: a big-cache
        example's Run holds caches of several GiB on the device for as long as anything keeps it."""
        latest = self._latest.get(signature)
        if latest is None or latest[2] is None:
            return None
        self._latest[signature] = (latest[0], latest[1], None)
        return latest[2]


__all__ = ["Failing", "FailureLedger"]
