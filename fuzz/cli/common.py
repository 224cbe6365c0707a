"""What every command shares: the console, duration parsing, and resolving the targets a command names.
Nothing here imports torch: ``kvfuzz --help`` stays fast."""

from __future__ import annotations

import re
import sys

import click
from rich.console import Console
from rich.markup import escape

#: The width tables get outside a terminal: wide enough that no table of kvfuzz's is ever folded.
UNWRAPPED_WIDTH = 100_000


def make_console(file=None) -> Console:
    """A console for ``file`` (default: stdout, looked up at each print). On a terminal, rich's layout (the
    terminal's width). Anywhere else (a log file, a pipe, CI) nothing is ever hard-wrapped, whatever ``COLUMNS``
    says: each message is whole on its line and tables are at their full width, so logs can be grepped."""
    stream = sys.stdout if file is None else file
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # a closed or foreign stream
        terminal = False
    if terminal:
        return Console(file=file)
    return Console(file=file, width=UNWRAPPED_WIDTH, soft_wrap=True)


console = make_console()


def parse_duration(value: str | None) -> float | None:
    """Seconds from ``90``, ``90s``, ``5m`` or ``2h``; None for None. Raises click.BadParameter otherwise."""
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", value)
    if not m:
        raise click.BadParameter(f"{value!r}: give seconds, or a number with s, m or h (e.g. 90, 90s, 5m, 2h)")
    return float(m.group(1)) * {"s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


def available_targets(target_names) -> list:
    """The targets a command names (default: every built-in available here), each available here. Raises
    click.UsageError for an unknown or unavailable target named explicitly, or when none is available."""
    from kvfuzz.fuzz.targets import BUILTIN, get_target

    names = list(target_names) or list(BUILTIN)
    chosen = []
    for name in names:
        try:
            t = get_target(name)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        a = t.availability()
        if not a.ok:
            if target_names:
                raise click.UsageError(f"target {name} is not available here: {a.reason}")
            console.print(f"[yellow]skipping {name}[/]: {escape(a.reason)}")
            continue
        chosen.append(t)
    if not chosen:
        raise click.UsageError("no target is available here; run `kvfuzz targets` to see why")
    return chosen


__all__ = ["UNWRAPPED_WIDTH", "available_targets", "console", "make_console", "parse_duration"]
