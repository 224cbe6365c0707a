"""What ``kvfuzz fuzz`` shows while its campaign runs (:class:`CampaignProgress`).

On a terminal: rich's live progress, one row per target, its bar filled by the examples spent of ``--max-examples``
or, under ``--duration``, by the time spent, with a time-left estimate either way. Anywhere else (a log, a pipe, CI):
one stats line per tick, as libFuzzer prints one line per pulse (:func:`progress_line`: elapsed, examples,
examples/s, failures, the time left, then each target compactly), instead of reprinting every target's line.
``kvfuzz -q`` shows neither."""

from __future__ import annotations

import time

from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvfuzz.fuzz.cli.common import console, verbosity

#: Seconds between two stats lines when the output is not a terminal.
TICK_SECONDS = 10.0


def clock(seconds: float) -> str:
    """``seconds`` as a short duration: "45s", "3m05s", "2h07m"."""
    s = int(max(0.0, seconds) + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def time_left(stats: list, elapsed: float, max_examples: int | None, duration: float | None) -> str:
    """What is left of the campaign: under ``duration`` (seconds per target) the time to its end, each target's
    ``duration`` less its own ``elapsed`` (its start to its last example), added up: the targets take the workers in
    turn (kvfuzz.fuzz.campaign.workers.scheduling), so one not yet started still has all of it; with
    ``max_examples`` (per target; None: no example budget) the examples still to run at the rate so far ("~" marks
    that estimate); the sooner of the two. "" when neither can tell (no budget, or no rate yet). ``elapsed``: the
    campaign's seconds, for a ``stats`` entry without its own."""
    left = []
    if duration is not None:
        ends = [max(0.0, duration - getattr(s, "elapsed", elapsed)) for s in stats if not getattr(s, "stopped", "")]
        left.append((sum(ends), ""))
    if max_examples is not None:
        todo = sum(max(0, max_examples - s.examples) for s in stats)
        rate = sum(s.examples_per_second for s in stats)
        if not todo:
            left.append((0.0, ""))
        elif rate > 0:
            left.append((todo / rate, "~"))
    if not left:
        return ""
    seconds, mark = min(left)
    return f"{mark}{clock(seconds)} left"


def _failures(n: int) -> str:
    return f"{n} failure{'s' if n != 1 else ''}"


def progress_line(stats: list, elapsed: float, max_examples: int | None = None, duration: float | None = None) -> str:
    """The one stats line of a tick (libFuzzer's pulse line, for logs): ``[elapsed] N examples (R/s), F failures,
    T left | target n[/max] (r/s[, f failures]) | ...``. ``stats``: each target's TargetStats (examples,
    examples_per_second, failures); ``max_examples``: the per-target budget (None: none); ``duration``: seconds
    per target (None: none). Every progress display of kvfuzz fuzz goes through here."""
    n = sum(s.examples for s in stats)
    rate = sum(s.examples_per_second for s in stats)
    fails = sum(len(s.failures) for s in stats)
    head = f"[{clock(elapsed)}] {n} examples ({rate:.1f}/s), {_failures(fails)}"
    left = time_left(stats, elapsed, max_examples, duration)
    if left:
        head += f", {left}"
    parts = [head]
    for s in stats:
        count = f"{s.examples}/{max_examples}" if max_examples is not None else str(s.examples)
        extra = f", {_failures(len(s.failures))}" if s.failures else ""
        parts.append(f"{s.target} {count} ({s.examples_per_second:.1f}/s{extra})")
    return " | ".join(parts)


class CampaignProgress:
    """The progress display of a campaign over ``targets`` (names), given each target's budget: ``max_examples``
    (None: none) and ``duration`` seconds (None: none). A context manager; :meth:`update` takes the targets'
    TargetStats (the supervisor calls it about every second)."""

    def __init__(self, targets: list[str], max_examples: int | None, duration: float | None) -> None:
        self.max_examples, self.duration = max_examples, duration
        self.start = time.monotonic()
        self.terminal = console.is_terminal and verbosity() >= 0
        self.logging = not console.is_terminal and verbosity() >= 0
        self.logged_at = self.start
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                                 TextColumn("{task.fields[rate]:.2f} ex/s  failures: {task.fields[fails]}"),
                                 TimeElapsedColumn(), TextColumn("{task.fields[left]}"), console=console,
                                 disable=not self.terminal)
        total = duration if duration is not None else max_examples
        self.tasks = {t: self.progress.add_task(escape(t), total=total, count="0", rate=0.0, fails=0, left="")
                      for t in targets}

    def __enter__(self) -> "CampaignProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, stats: list) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        for s in stats:
            done = min(elapsed, self.duration) if self.duration is not None else s.examples
            count = f"{s.examples}/{self.max_examples}" if self.max_examples is not None else f"{s.examples} examples"
            self.progress.update(self.tasks[s.target], completed=done, count=count, rate=s.examples_per_second,
                                 fails=len(s.failures), left=time_left([s], elapsed, self.max_examples, self.duration))
        if self.logging and now - self.logged_at >= TICK_SECONDS:
            self.logged_at = now
            console.print(escape(progress_line(stats, elapsed, self.max_examples, self.duration)), highlight=False,
                          soft_wrap=True)


__all__ = ["TICK_SECONDS", "CampaignProgress", "clock", "progress_line", "time_left"]
