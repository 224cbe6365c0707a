"""``kvfuzz report``: report.md with coverage plots from a campaign's summary.json; with ``--issue``, ISSUE.md for
one reproducer directory (:mod:`kvfuzz.fuzz.campaign.store.issue`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from kvfuzz.fuzz.cli.common import console, load_baseline_option

#: The baseline ``--issue`` cites by default, when it exists (the one `make fuzz` and `kvfuzz baseline add` use).
DEFAULT_BASELINE = "kvfuzz-baseline.toml"


@click.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--issue", is_flag=True,
              help="OUT_DIR is one reproducer directory: write OUT_DIR/ISSUE.md, an upstream issue in the kernel's "
                   "terms (environment, minimal batch, expected and observed, the upstream file and function, why "
                   "the caller is not at fault, standalone.py inline when short).")
@click.option("--baseline", "baseline_file", default=DEFAULT_BASELINE, show_default=True,
              type=click.Path(dir_okay=False),
              help="With --issue: a findings baseline whose entries for the case's target, kind and check ISSUE.md "
                   "cites, with the upstream issues they name (the default one is read when it exists).")
def report(out_dir: str, issue: bool, baseline_file: str) -> None:
    """Write OUT_DIR/report.md with coverage plots and shape grids (longest context by longest query, head
    size by window, on log2 bins: the shapes a campaign never reached) from OUT_DIR/summary.json (a campaign's
    output directory), or with --issue OUT_DIR/ISSUE.md for one reproducer directory. Every file is written
    atomically. Exit 2 when the input is not what it should be (the message names the file, the field and the
    fix) or OUT_DIR cannot be written, 3 when the disk is full (the previous files are kept whole)."""
    from kvfuzz.fuzz.campaign.store.cases import BadReproducer
    from kvfuzz.fuzz.campaign.store.report import ReportError

    try:
        if issue:
            from kvfuzz.fuzz.campaign.store.issue import write_issue

            baseline = _baseline(baseline_file)
            console.print(f"issue: {escape(str(write_issue(Path(out_dir), baseline)))}")
        else:
            from kvfuzz.fuzz.campaign.store.report import write_report

            console.print(f"report: {escape(str(write_report(Path(out_dir))))}")
    except ReportError as e:
        console.print(f"[red]cannot write the {'issue' if issue else 'report'}[/]: {escape(str(e))}")
        sys.exit(3 if e.full else 2)
    except BadReproducer as e:
        console.print(f"[red]bad reproducer[/]: {escape(str(e))}")
        sys.exit(2)


def _baseline(path: str):
    """The baseline ISSUE.md cites: ``path`` loaded; None when it is the default and absent; exit 2 (naming the
    file, the field and the fix) when it cannot be read."""
    if path == DEFAULT_BASELINE and not Path(path).exists():
        return None
    return load_baseline_option(path)


__all__ = ["DEFAULT_BASELINE", "report"]
