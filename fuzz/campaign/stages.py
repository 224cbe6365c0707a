"""Where a campaign's time goes: the stage table (docs/campaigns.md, "Where the time goes").

Every second of every worker is charged to one row, so the rows add up to the workers' wall time:

- an example's stages (its :attr:`~kvfuzz.fuzz.campaign.records.Outcome.stages`): ``draw`` (Hypothesis drawing it
  from its choices), ``generate`` (its ground-truth tensors), ``materialize`` (the paged cache, the call, the
  output's poison and the production states' snapshots), ``check_caller`` (the caller checks), ``kernel`` (the kernel
  call's own time), ``reference`` (the fp64 reference), ``check_output`` (the oracles), ``sanitize`` (its sanitized
  re-run), and its waits: ``compile`` (JIT compiles and kernel loads during the kernel call), ``queued`` (the kernel
  call waiting on the device for work queued before it: the harness's own asynchronous device work, other
  processes' under CUDA MPS), ``memory_wait`` (the device-memory lock and the out-of-memory pauses); ``other``: the
  rest of the example (the runner's own work, its reports, a failed attempt);
- ``shrink``: every second of a shrink (the structural-first pass on a new failure as found, Hypothesis's shrink
  phase, the widening across kernel configurations, the structural shrink), its examples included;
- ``hypothesis``: Hypothesis's engine between examples outside their draws (its choice tree, the example
  database, a run's start and end);
- per worker, outside any target (:data:`WORKER_STAGES`): ``startup`` (spawn to ready: imports, the target's set-up)
  and ``idle`` (the rest: waiting for a task, the pipe, what a worker that died had not reported).

Time outside Hypothesis's runs inside a task (recording a failure's reproducer, the engine's flow) is ``other``
too. Kept per target and size tier (:class:`StageTable`); :func:`time_table` turns the tables and the workers' wall
time into summary.json's ``time``; :func:`time_line` says it in one line.

The ``sanitize`` stage is split further by phase (:class:`SanitizeTable`, summary.json's ``time.sanitize``): where
a sanitized example's seconds went, worker and child (kvfuzz.fuzz.harness.sanitizer.PHASES), per group of examples
(:data:`SANITIZE_GROUPS`: the child's first example, the first call of a kernel configuration in the child, a
configuration it had run before, ...).
"""

from __future__ import annotations

import sys
import time

import attrs

from kvfuzz.fuzz.harness.sanitizer import PHASES

#: The stages of a target's time, in the table's order.
STAGES = ("draw", "generate", "materialize", "check_caller", "kernel", "reference", "check_output", "sanitize",
          "compile", "queued", "memory_wait", "shrink", "hypothesis", "other")
#: A worker's time outside any target's tasks.
WORKER_STAGES = ("startup", "idle")
#: The fields of :class:`kvfuzz.fuzz.harness.run.Timings` that are stages of the same name.
TIMED = ("generate", "materialize", "check_caller", "kernel", "reference", "check_output", "compile", "queued")
#: The groups of sanitized examples (kvfuzz.fuzz.campaign.runner.SanitizerSchedule.take): the child's first example,
#: one whose kernel call compiled or loaded a kernel in the child (a new configuration), one it had run before, one
#: the child gave no report of (it raised, died or hung), one not sanitized after all (its GPU's slot held, its child
#: starting); and the sanitized runs of a shrink, whose seconds are the ``shrink`` stage's, not ``sanitize``'s.
SANITIZE_GROUPS = ("first example", "new config", "seen config", "no report", "skipped", "shrink")


@attrs.define
class SanitizeTable:
    """One target's sanitized runs by phase: ``groups`` is ``{group: {"examples": n, "seconds": {phase: s},
    "count": {phase: examples it occurred in}}}``; ``starts`` the children's starts seen complete (``count``, and
    seconds: ``seconds`` spawn to ready, ``target``, ``cuda`` and ``warm`` as the child measured them, and
    ``warm_errors``: kvfuzz.fuzz.harness.sanitizer_warmup); ``confirms`` the confirmations (of hits, or after a
    child that raised, died or hung) by where they ran (``{where: n}``,
    kvfuzz.fuzz.harness.sanitizer_standby.CONFIRMS: the standby, or a fresh child and why)."""

    groups: dict = attrs.Factory(dict)
    starts: dict = attrs.Factory(dict)
    confirms: dict = attrs.Factory(dict)

    def add(self, record: dict) -> None:
        """Add one example's record (kvfuzz.fuzz.campaign.runner.SanitizerSchedule.take)."""
        row = self.groups.setdefault(record.get("group", "no report"), {"examples": 0, "seconds": {}, "count": {}})
        row["examples"] += 1
        for phase, s in record.get("seconds", {}).items():
            if s > 0:
                row["seconds"][phase] = row["seconds"].get(phase, 0.0) + s
                row["count"][phase] = row["count"].get(phase, 0) + 1
        for key, s in ({"count": 1, **record["start"]} if record.get("start") else {}).items():
            self.starts[key] = self.starts.get(key, 0) + s
        if record.get("confirm"):
            self.confirms[record["confirm"]] = self.confirms.get(record["confirm"], 0) + 1

    def to_dict(self) -> dict:
        """summary.json's form: ``{"examples", "seconds", "phases": {phase: {"seconds", "count"}}, "groups": {group:
        {"examples", "seconds", "phases"}}, "starts", "confirms"}``, the first three over every group but ``shrink`` (so
        ``seconds`` is the target's ``sanitize`` stage), phases in :data:`~kvfuzz.fuzz.harness.sanitizer.PHASES`'
        order."""
        def phases(rows: list[dict]) -> dict:
            return {p: {"seconds": round(sum(r["seconds"].get(p, 0.0) for r in rows), 4),
                        "count": sum(r["count"].get(p, 0) for r in rows)}
                    for p in PHASES if any(p in r["seconds"] for r in rows)}

        stage = [row for group, row in self.groups.items() if group != "shrink"]
        return {"examples": sum(r["examples"] for r in stage),
                "seconds": round(sum(sum(r["seconds"].values()) for r in stage), 4), "phases": phases(stage),
                "groups": {g: {"examples": self.groups[g]["examples"],
                               "seconds": round(sum(self.groups[g]["seconds"].values()), 4),
                               "phases": phases([self.groups[g]])} for g in SANITIZE_GROUPS if g in self.groups},
                "starts": {k: round(v, 4) for k, v in self.starts.items()}, "confirms": dict(self.confirms)}


@attrs.define
class StageTable:
    """One target's seconds per stage and examples, per size tier:
    ``{tier: {"examples": n, "seconds": {stage: s}}}``."""

    tiers: dict = attrs.Factory(dict)
    #: the ``sanitize`` stage by phase, all tiers together (:class:`SanitizeTable`)
    sanitize: SanitizeTable = attrs.Factory(SanitizeTable)

    def add(self, tier: str, seconds: dict[str, float], examples: int = 0, sanitize: dict | None = None) -> None:
        """Add ``seconds`` per stage and ``examples`` to ``tier``'s row; ``sanitize``: an example's sanitized runs by
        phase (:meth:`SanitizeTable.add`)."""
        if sanitize:
            self.sanitize.add(sanitize)
        row = self.tiers.setdefault(tier, {"examples": 0, "seconds": {}})
        row["examples"] += examples
        for stage, s in seconds.items():
            if s:
                row["seconds"][stage] = row["seconds"].get(stage, 0.0) + s

    def total(self) -> float:
        return sum(sum(row["seconds"].values()) for row in self.tiers.values())

    def to_dict(self) -> dict:
        return {tier: {"examples": row["examples"],
                       "seconds": {s: round(row["seconds"][s], 4) for s in STAGES if s in row["seconds"]}}
                for tier, row in self.tiers.items()}


class Clock:
    """Charges a process's time to stages interval by interval: each charge takes the seconds since the last one
    (:attr:`mark`), so nothing is counted twice and nothing between two charges is lost. Seconds charged here wait
    in :attr:`pending` (per tier, per stage) until :meth:`take`; an example's own seconds travel in its Outcome
    instead, and :meth:`skip_to` moves the mark past them."""

    def __init__(self) -> None:
        self.mark = time.perf_counter()
        self.pending: dict[str, dict[str, float]] = {}
        self.pending_seconds = 0.0

    def charge(self, tier: str, stage: str, until: float | None = None) -> None:
        """Charge the seconds from the mark to ``until`` (default: now) to ``stage`` of ``tier``."""
        now = time.perf_counter() if until is None else until
        seconds = now - self.mark
        self.mark = now
        if seconds > 0:
            row = self.pending.setdefault(tier, {})
            row[stage] = row.get(stage, 0.0) + seconds
            self.pending_seconds += seconds

    def skip_to(self, until: float) -> float:
        """Move the mark to ``until`` without charging; returns the seconds skipped (charged elsewhere)."""
        seconds, self.mark = until - self.mark, until
        return seconds

    def take(self) -> dict[str, dict[str, float]]:
        """The pending seconds, emptied."""
        pending, self.pending, self.pending_seconds = self.pending, {}, 0.0
        return pending


def time_table(targets: list[tuple[str, StageTable]], wall: float, startup: float, workers: int) -> dict:
    """summary.json's ``time``: ``targets`` (each target's name and table), ``wall`` (the workers' wall time: each
    worker process from its spawn to its end, summed), ``startup`` (of that, spawn to ready) and ``workers``.

    Returns ``{"workers", "wall_s", "stages": [row names], "seconds": {stage: s}, "rows": [{"target", "tier",
    "examples", "seconds", "share", "ms": {stage: mean ms per example}}], "sanitize": [{"target", ...}]}``:
    ``seconds`` adds up to ``wall_s`` (``idle`` is the wall time no report covers), ``share`` is a row's seconds over
    ``wall_s``; ``sanitize`` has each target with sanitized runs, its :meth:`SanitizeTable.to_dict`."""
    totals: dict[str, float] = {}
    rows = []
    for name, table in targets:
        for tier, row in table.tiers.items():
            seconds = row["seconds"]
            for stage, s in seconds.items():
                totals[stage] = totals.get(stage, 0.0) + s
            n, spent = row["examples"], sum(seconds.values())
            rows.append({"target": name, "tier": tier, "examples": n, "seconds": round(spent, 3),
                         "share": round(spent / wall, 4) if wall else 0.0,
                         "ms": {s: round(1000 * seconds[s] / n, 3) for s in STAGES if s in seconds and n}})
    accounted = sum(totals.values())
    totals["startup"] = startup
    totals["idle"] = max(0.0, wall - startup - accounted)
    return {"workers": workers, "wall_s": round(wall, 3), "stages": list(STAGES + WORKER_STAGES),
            "seconds": {s: round(totals[s], 3) for s in STAGES + WORKER_STAGES if s in totals},
            "rows": rows, "sanitize": [{"target": name, **table.sanitize.to_dict()} for name, table in targets
                                       if table.sanitize.groups]}


def time_line(table: dict, top: int = 6) -> str:
    """One line of summary.json's ``time`` (:func:`time_table`): the workers' wall time and the ``top`` stages'
    shares of it, largest first (a stage under 1% left out)."""
    wall = table.get("wall_s") or 0.0
    if not wall:
        return "time: no worker time measured"
    shares = sorted(((s / wall, stage) for stage, s in table.get("seconds", {}).items() if s / wall >= 0.01),
                    reverse=True)[:top]
    parts = ", ".join(f"{stage} {100 * share:.0f}%" for share, stage in shares)
    return f"time: {table.get('workers', 1)} worker(s), {wall:.0f} s of worker time: {parts}"


def conjecture_runner():
    """The ``ConjectureRunner`` of the Hypothesis run that called the property (this is called from the property
    body, kvfuzz.fuzz.campaign.runner ``ExampleRunner.body``), found up the stack (its ``_current_phase`` says
    whether Hypothesis is generating or shrinking), or None (an explicit example, an example run outside Hypothesis).
    Both are Hypothesis's internals (6.170): where they change, the phase reads as None and Hypothesis's shrink phase
    counts as exploring (and a pinned chunk is never cut at its share of --duration); tests/fuzz/campaign/
    test_stages.py would see it."""
    frame = sys._getframe(2)
    while frame is not None:
        runner = frame.f_locals.get("self")
        if type(runner).__name__ == "ConjectureRunner":
            return runner
        frame = frame.f_back
    return None


__all__ = ["SANITIZE_GROUPS", "STAGES", "TIMED", "WORKER_STAGES", "Clock", "SanitizeTable", "StageTable",
           "conjecture_runner", "time_line", "time_table"]
