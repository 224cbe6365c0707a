"""How ``kvfuzz fuzz`` ends on the console (:func:`print_summary`): the summary table, each target's coverage and
the declared values it never drew (capped, one line per dimension: ``kvfuzz -v`` prints them whole; report.md
has every count), each failure with its reproducer, and the "next steps" block when a new failure was found."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from kvfuzz.fuzz.cli.common import console, next_steps, say, verbosity

#: Unless ``kvfuzz -v``: values listed per coverage dimension (most frequent first), declared-but-never-drawn values
#: listed per target, and the characters of a target's one coverage line; the rest is counted ("+12 more"), so no
#: console line runs to thousands of characters (report.md has every count; ``-v`` prints one line per dimension).
SHOWN_VALUES, SHOWN_NEVER, LINE_CHARS = 3, 8, 200


def _capped(items: list[str], shown: int) -> str:
    if verbosity() > 0 or len(items) <= shown:
        return ", ".join(items)
    return ", ".join(items[:shown]) + f", +{len(items) - shown} more"


def coverage_lines(target: dict) -> list[str]:
    """The console lines of one target's coverage (``summary.json``'s target entry): by default one line of at most
    about :data:`LINE_CHARS` characters (each dimension's :data:`SHOWN_VALUES` most frequent values; the dimensions
    that do not fit counted), with ``-v`` one line per dimension with every value; then the declared values never
    drawn (at most :data:`SHOWN_NEVER` unless ``-v``)."""
    lines = []
    dims = [f"{dim}: " + _capped([f"{v} {n}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])],
                                 SHOWN_VALUES) for dim, counts in target.get("coverage", {}).items()]
    if dims and verbosity() > 0:
        lines += [f"{target['target']} coverage:"] + [f"  {d}" for d in dims]
    elif dims:
        line, shown = f"{target['target']} coverage: {dims[0]}", 1
        while shown < len(dims) and len(line) + len(dims[shown]) + 2 <= LINE_CHARS:
            line, shown = f"{line}; {dims[shown]}", shown + 1
        lines.append(line + (f"; +{len(dims) - shown} more dimensions (report.md; -v lists them)"
                             if shown < len(dims) else ""))
    never = [f"{dim} {v}" for dim, counts in target.get("declared", {}).items() for v, n in counts.items() if n == 0]
    if never and target["examples"]:
        lines.append(f"{target['target']} declared but never drawn: {_capped(never, SHOWN_NEVER)}")
    return lines


def _table(results: list[dict]) -> Table:
    from kvfuzz.contracts.checks.oracles import check_label

    def line(f: dict) -> str:
        what = f"{f['kind']}[/] ({escape(check_label(f['check']))}) x{f['count']}"
        if f.get("known"):
            return f"[yellow]known {escape(f['known'])}: {what}"
        return f"[red]found before: {what}" if f.get("found_before") else f"[red]{what}"

    table = Table(title="kvfuzz summary")
    for col in ("target", "examples", "ex/s", "kernel share", "paths", "failures"):
        table.add_column(col)
    for s in results:
        total = s["kernel_s"] + s["harness_s"]
        share = f"{100 * s['kernel_s'] / total:.0f}%" if total else "-"
        paths = ", ".join(f"{p}: {n}" for p, n in sorted(s["paths"].items(), key=lambda x: -x[1]))
        fails = "\n".join(line(f) for f in s["failures"]) or "[green]none[/]"
        examples = str(s["examples"]) + (f" (+{s['shrink_runs']} shrinking)" if s.get("shrink_runs") else "")
        table.add_row(s["target"], examples, f"{s['examples_per_s']:.2f}", share, escape(paths), fails)
    return table


def print_summary(results: list[dict], baseline=None) -> None:
    """Print a campaign's end: ``results`` are summary.json's target entries; ``baseline`` the loaded findings
    baseline (None: none). ``-q`` leaves out the coverage lines, ``-qq`` the table too."""
    say(_table(results), level=-1)
    for s in results:
        for msg, n in s.get("rejections", {}).items():
            say(f"[bold]{s['target']}[/] rejected an undeclared configuration x{n}: {escape(msg)}")
    for s in results:
        for text in coverage_lines(s):
            say(escape(text), highlight=False)
        if s.get("stopped"):
            console.print(f"[bold]{s['target']}[/] [yellow]{escape(s['stopped'])}[/]")
    for s in results:
        for f in s["failures"]:
            _print_failure(s["target"], f, baseline)


def _print_failure(target: str, f: dict, baseline) -> None:
    entry = baseline.get(f["known"]) if baseline is not None and f.get("known") else None
    if entry is not None:
        say(f"[bold]{target}[/] [yellow]known ({escape(entry.id)})[/]: {f['kind']} x{f['count']}"
            f" — {escape(entry.reason)} [{escape(entry.reference)}]\n"
            f"  reproducer (first hit, not shrunk): {escape(str(f['reproducer']))}", level=-1)
        return
    before = " (found before: written by an earlier campaign in this --out)" if f.get("found_before") else ""
    console.print(f"[bold]{target}[/] [red]{f['kind']}[/] — blame: {f['blame']}\n"
                  f"  {escape(f['message'])}\n  minimal batch: {escape(f['batch'])}\n"
                  f"  reproducer{before}: {escape(str(f['reproducer']))}")


def print_next_steps(results: list[dict]) -> None:
    """The "next steps" block (:func:`~kvfuzz.fuzz.cli.common.next_steps`) for the new failures' reproducers."""
    next_steps([str(f["reproducer"]) for s in results for f in s["failures"]
                if not f.get("known") and f.get("reproducer")])


__all__ = ["LINE_CHARS", "SHOWN_NEVER", "SHOWN_VALUES", "coverage_lines", "print_next_steps", "print_summary"]
