"""What every command shares: the console, duration parsing, resolving the targets a command names, and what a
signal does (:func:`signals_interrupt`). Nothing here imports torch: ``kvfuzz --help`` stays fast."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click
from rich.console import Console
from rich.markup import escape

#: The width tables get outside a terminal: wide enough that no table of kvfuzz's is ever folded.
UNWRAPPED_WIDTH = 100_000


class _Console(Console):
    """rich's Console, but a stdout whose reader went away (``kvfuzz fuzz | head``) raises BrokenPipeError (its
    further output going to /dev/null), which the ``kvfuzz`` group ends with exit status 3, after every ``finally``
    ran (a campaign's workers stopped, its state saved): rich's own raised SystemExit(1), which says "a failure"."""

    def on_broken_pipe(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise BrokenPipeError("stdout's reader went away")


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
        return _Console(file=file)
    return _Console(file=file, width=UNWRAPPED_WIDTH, soft_wrap=True)


console = make_console()
#: Where messages that are not the command's output go (the project config line): stderr, so that ``--json``
#: output stays JSON.
errors = make_console(sys.stderr)

#: How much the commands say: 0 by default, -1 per ``-q`` and +1 per ``-v`` given to ``kvfuzz`` (``kvfuzz -q fuzz``).
_VERBOSITY = [0]


def set_verbosity(level: int) -> None:
    """Set how much the commands say (``kvfuzz -q``: -1, ``-qq``: -2, ``-v``: 1)."""
    _VERBOSITY[0] = level


def verbosity() -> int:
    """How much the commands say: below 0 quieter (``-q``: no progress, no start-up lines, no coverage; ``-qq``: no
    summary table either, only problems, failures and the verdict), above 0 more (``-v``: coverage in full)."""
    return _VERBOSITY[0]


def say(message, level: int = 0, **kwargs) -> None:
    """Print ``message`` (rich markup) when the verbosity is at least ``level`` (0: unless ``-q``)."""
    if verbosity() >= level:
        console.print(message, **kwargs)

#: Exit status of a command that was interrupted (Ctrl-C, SIGTERM, SIGHUP) or could not run as asked.
EXIT_INTERRUPTED = 3


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as a KeyboardInterrupt (``args[0]``: the signal's name) so every ``finally`` and
    every ``except KeyboardInterrupt`` runs as for Ctrl-C, and the command ends with :data:`EXIT_INTERRUPTED`."""


def interruption(e: KeyboardInterrupt) -> str:
    """What interrupted a command, for its one line: the signal's name of an :class:`Interrupted`, else "SIGINT"."""
    return e.args[0] if isinstance(e, Interrupted) and e.args else "SIGINT"


def _interrupt(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def signals_interrupt():
    """While inside: SIGTERM and SIGHUP raise :class:`Interrupted` (a CI job cancelled or timed out, a closed
    terminal), as SIGINT raises KeyboardInterrupt. A campaign's supervisor installs its own handlers while it runs
    (it stops its workers gracefully) and puts these back. Outside the main thread (a test's CliRunner in a thread)
    nothing is installed."""
    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[s] = signal.signal(s, _interrupt)
        except (ValueError, OSError):  # not the main thread
            pass
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def unique(values, option: str) -> tuple:
    """``values`` of a repeatable option without repeats, in order; a repeated value is dropped with a warning
    naming ``option`` (``--target X --target X`` runs X once)."""
    seen = tuple(dict.fromkeys(values))
    repeated = sorted({v for v in values if list(values).count(v) > 1}, key=list(values).index)
    if repeated:
        console.print(f"[yellow]warning[/]: {option} {escape(', '.join(map(str, repeated)))} given more than once; "
                      "each runs once", highlight=False)
    return seen


def parse_duration(value: str | None) -> float | None:
    """Seconds from ``90``, ``90s``, ``5m`` or ``2h``; None for None. Raises click.BadParameter otherwise."""
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", value)
    if not m:
        raise click.BadParameter(f"{value!r}: give seconds, or a number with s, m or h (e.g. 90, 90s, 5m, 2h)")
    return float(m.group(1)) * {"s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


#: The longest ``--duration`` (seconds): a year. Longer cannot be met, and a number of 400 digits reads as inf.
MAX_DURATION = 366 * 86400


class _FiniteRange(click.FloatRange):
    """A click.FloatRange that also refuses ``nan`` and ``inf`` (which pass a range check: every comparison with
    nan is false), naming the option (exit 2)."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def finite_range(min: float | None = None, max: float | None = None) -> click.FloatRange:
    """The type of a seconds or ratio option: a finite number in ``[min, max]`` (exit 2 otherwise)."""
    return _FiniteRange(min=min, max=max)


def duration_option(ctx, param, value: str | None) -> str | None:
    """Click callback for a duration option: ``value`` unchanged if :func:`parse_duration` reads it and it is
    more than 0 seconds; click.BadParameter naming the option otherwise (exit 2)."""
    seconds = parse_duration(value)
    if seconds is not None and seconds <= 0:
        raise click.BadParameter(f"{value!r}: must be more than 0 seconds (leave it out for no time limit)")
    if seconds is not None and not seconds <= MAX_DURATION:
        raise click.BadParameter(f"{value!r}: at most {MAX_DURATION // 3600:.0f}h (a year; leave it out for no time "
                                 "limit)")
    return value


#: The URL schemes ``--db`` takes as a Redis server (the rest names a directory).
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")  # as kvfuzz.fuzz.campaign.store.database reads them
#: What looks like a URL (a scheme and a colon: ``http://``, ``reddis://``, ``redis:host``), not a directory.
URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


def db_option(ctx, param, value: str | None) -> str | None:
    """Click callback for ``--db``: a directory, or a Redis URL (``redis://``, ``rediss://`` over TLS, ``unix://``
    a socket) whose host, port and database number parse (``redis://host:port/N``, N a non-negative integer;
    ``unix://`` needs a socket path); nothing else. ``value`` unchanged; click.BadParameter naming the fix
    otherwise (exit 2): a value that looks like a URL of another scheme (``http://...``, a misspelt
    ``reddis://...``) is refused, not taken for a relative directory. Whether the server answers is checked when
    the command opens the database (exit 3)."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty; name a directory or a redis://host:port/N URL, or leave --db out")
    if not value.startswith(REDIS_URL_SCHEMES):
        if URL_LIKE.match(value):
            scheme = value.split(":", 1)[0]
            raise click.BadParameter(f"{value!r}: {scheme}: is not a scheme --db takes; give a directory, or a Redis "
                                     "URL: redis://host:port/N (rediss:// over TLS, unix:///path/to/socket). A "
                                     f"directory whose name has a colon: write it ./{value}")
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


def out_dir_option(ctx, param, value: str | None) -> Path | None:
    """Click callback for an output directory kvfuzz writes into (``--out``): ``Path(value)`` once it exists or
    was created and a file can be written in it; click.BadParameter naming the problem otherwise (exit 2), before
    any work starts: a read-only folder, a file in the way, /proc."""
    if value is None:
        return None
    if not str(value).strip():
        raise click.BadParameter("is empty; name a directory (e.g. --out kvfuzz-out)")
    out = Path(value)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".kvfuzz-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise click.BadParameter(f"{str(value)!r} cannot be used as a directory ({e.strerror or e}); name a "
                                 "writable directory") from None
    return out


def next_steps(reproducers: list[str], replays: list[str] = (), corpus: str = "regressions") -> None:
    """The "next steps" block a command ends with when it found something (as pytest's short summary ends a run):
    how to replay the first reproducer, turn it into an upstream issue and accept it in a baseline; for a corpus
    case that fails again, how to replay it. Nothing when there is nothing to do."""
    if not reproducers and not replays:
        return
    lines = ["next steps:"]
    if reproducers:
        d = reproducers[0]
        more = f" (and {len(reproducers) - 1} more reproducer(s) beside it)" if len(reproducers) > 1 else ""
        lines += [f"  kvfuzz replay {d}{more}", "      re-run it, isolated (exit 1 while it still fails)",
                  f"  kvfuzz report {d} --issue", "      write ISSUE.md there: an upstream issue in the kernel's terms",
                  f"  kvfuzz baseline add {d} --id ID --reason TEXT --reference URL",
                  "      accept it as a known finding (kvfuzz fuzz --baseline kvfuzz-baseline.toml)"]
    for name in replays[:3]:
        lines += [f"  kvfuzz replay {corpus}/{name}", "      a corpus case that fails again: a regression"]
    console.print(escape("\n".join(lines)), highlight=False)


def write_output(path, content, option: str) -> None:
    """Write a command's output file (``content``: text, or a JSON-ready object) to ``path`` atomically
    (kvfuzz.fuzz.campaign.store.journal); when it cannot be written, one line naming ``option`` and the file, and
    exit 3 for a full disk, 2 otherwise (never a traceback after the work is done; the old file stays whole)."""
    from kvfuzz.fuzz.campaign.store.journal import disk_full, write_json, write_text

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            write_text(path, content)
        else:
            write_json(path, content)
    except OSError as e:
        console.print(f"[red]cannot write[/] {option} {escape(str(path))}: {escape(e.strerror or str(e))}"
                      + ("; free some space" if disk_full(e) else "; name a writable file"), highlight=False)
        sys.exit(EXIT_INTERRUPTED if disk_full(e) else 2)


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


def named_targets(target_names) -> tuple[list, list[str]]:
    """The targets a command names (default: every built-in available here), each available here, and how each
    was named (its spec: a registered name, path/to/file.py:CLASS or module:CLASS; a worker loads the same). A
    repeated ``--target`` runs once (:func:`unique`, with a warning). Raises click.BadParameter (``--target``) for
    an unknown or unavailable target named explicitly, or two specs that load targets of one name;
    click.UsageError when none is available."""
    from kvfuzz.fuzz.targets import BUILTIN, get_target

    names = list(unique(target_names, "--target")) or list(BUILTIN)
    chosen, specs, by_name = [], [], {}
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
        if t.name in by_name:  # two specs (a name and a file, say) that load targets of the same name
            raise click.BadParameter(f"{name} and {by_name[t.name]} are both target {t.name!r}; name it once",
                                     param_hint="--target")
        by_name[t.name] = name
        chosen.append(t)
        specs.append(name if target_names else t.name)
    if not chosen:
        raise click.UsageError("no target is available here; run `kvfuzz targets` to see why")
    return chosen, specs


def available_targets(target_names) -> list:
    """:func:`named_targets`' targets alone (for a command that runs them in this process)."""
    return named_targets(target_names)[0]


def load_baseline_option(path: str | None):
    """The --baseline file, loaded and validated (None without one); click.BadParameter (exit 2) naming the
    file, the field and the fix otherwise."""
    if path is None:
        return None
    from kvfuzz.fuzz.campaign.store.baseline import BaselineError, load_baseline

    try:
        return load_baseline(path)
    except BaselineError as e:
        raise click.BadParameter(str(e), param_hint="--baseline") from None


__all__ = ["EXIT_INTERRUPTED", "Interrupted", "MAX_DURATION", "REDIS_URL_SCHEMES", "UNWRAPPED_WIDTH", "URL_LIKE",
           "available_targets", "console", "db_option", "duration_option", "errors", "finite_range", "interruption",
           "load_baseline_option", "make_console", "named_targets", "next_steps", "nonempty_option", "out_dir_option",
           "parse_duration", "say", "set_verbosity", "signals_interrupt", "unique", "verbosity", "writable_dir_option",
           "writable_file_option", "write_output"]
