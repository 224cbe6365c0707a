"""What every command shares: the console, duration parsing, and resolving the targets a command names.
Nothing here imports torch: ``kvfuzz --help`` stays fast."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

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


def duration_option(ctx, param, value: str | None) -> str | None:
    """Click callback for a duration option: ``value`` unchanged if :func:`parse_duration` reads it and it is
    more than 0 seconds; click.BadParameter naming the option otherwise (exit 2)."""
    seconds = parse_duration(value)
    if seconds is not None and seconds <= 0:
        raise click.BadParameter(f"{value!r}: must be more than 0 seconds (leave it out for no time limit)")
    return value


#: The URL schemes ``--db`` takes as a Redis server (the rest names a directory).
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")  # as kvfuzz.fuzz.campaign.store.database reads them


def db_option(ctx, param, value: str | None) -> str | None:
    """Click callback for ``--db``: a directory, or a Redis URL whose host, port and database number parse
    (``redis://host:port/N``, N a non-negative integer; ``unix://`` needs a socket path). ``value`` unchanged;
    click.BadParameter naming the fix otherwise (exit 2). Whether the server answers is checked when the command
    opens the database (exit 3)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty; name a directory or a redis://host:port/N URL, or leave --db out")
    if not value.startswith(REDIS_URL_SCHEMES):
        return value
    example = "e.g. redis://localhost:6379/0"
    try:
        url = urlsplit(value)
        port = url.port  # ValueError when it is not an integer in 0..65535
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: {e}; give redis://host:port/N ({example})") from None
    if url.scheme == "unix":
        if not url.path:
            raise click.BadParameter(f"{value!r}: a unix:// URL names the server's socket (unix:///path/to/socket)")
        return value
    if not url.hostname:
        raise click.BadParameter(f"{value!r}: no host; give redis://host:port/N ({example})")
    if port == 0:
        raise click.BadParameter(f"{value!r}: port 0; give the server's port ({example})")
    db = url.path.strip("/")
    if db and not db.isdigit():
        raise click.BadParameter(f"{value!r}: the database {db!r} is not a number; give redis://host:port/N with N "
                                 f"a database number ({example})")
    return value


def writable_dir_option(ctx, param, value: str | None) -> str | None:
    """Click callback for a directory option kvfuzz creates (a cache directory): ``value`` unchanged once it is
    a directory this process can create and write; click.BadParameter naming the problem otherwise (exit 2)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty; name a directory, or leave the option out")
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"{value!r} cannot be created as a directory ({e.strerror or e}); name a writable "
                                 "directory") from None
    if not os.access(path, os.W_OK):
        raise click.BadParameter(f"{value!r} is not writable; name a writable directory")
    return value


def nonempty_option(ctx, param, value):
    """Click callback for a text option that must say something (a baseline entry's id, reason, reference):
    ``value`` unchanged; click.BadParameter (exit 2) when it is empty or only spaces."""
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; give some text")
    return value


def writable_file_option(ctx, param, value):
    """Click callback for an output file option (JSON, Markdown, JUnit XML, a plot): ``value`` unchanged once its
    folder exists or can be created and the path is not a folder nor a read-only file, so a run does not end in an
    error after its work is done; click.BadParameter naming the problem otherwise (exit 2)."""
    if value is None:
        return None
    if not str(value).strip():
        raise click.BadParameter("is empty; name a file, or leave the option out")
    path = Path(value)
    if path.is_dir():
        raise click.BadParameter(f"{str(value)!r} is a directory; name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        file_in_the_way = next((str(p) for p in path.parents if p.exists() and not p.is_dir()), None)
        why = f"{file_in_the_way} is a file, not a folder" if file_in_the_way else (e.strerror or str(e))
        raise click.BadParameter(f"{str(value)!r}: its folder cannot be created ({why}); name a file in a writable "
                                 "folder") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{str(value)!r} is not writable; name a file in a writable folder")
    return value


def available_targets(target_names) -> list:
    """The targets a command names (default: every built-in available here), each available here. Raises
    click.BadParameter (``--target``) for an unknown or unavailable target named explicitly, click.UsageError when
    none is available."""
    from kvfuzz.fuzz.targets import BUILTIN, get_target

    names = list(target_names) or list(BUILTIN)
    chosen = []
    for name in names:
        try:
            t = get_target(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--target") from None
        a = t.availability()
        if not a.ok:
            if target_names:
                raise click.BadParameter(f"target {name} is not available here: {a.reason}", param_hint="--target")
            console.print(f"[yellow]skipping {name}[/]: {escape(a.reason)}")
            continue
        chosen.append(t)
    if not chosen:
        raise click.UsageError("no target is available here; run `kvfuzz targets` to see why")
    return chosen


__all__ = ["REDIS_URL_SCHEMES", "UNWRAPPED_WIDTH", "available_targets", "console", "db_option", "duration_option",
           "make_console", "nonempty_option", "parse_duration", "writable_dir_option", "writable_file_option"]
