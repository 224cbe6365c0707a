"""``kvfuzz report``: report.md with coverage plots from a campaign's summary.json; with ``--issue``, ISSUE.md for
one reproducer directory (:mod:`kvfuzz.fuzz.campaign.store.issue`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from kvfuzz.fuzz.cli.common import console


@click.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--issue", is_flag=True,
              help="OUT_DIR is one reproducer directory: write OUT_DIR/ISSUE.md, an upstream issue in the kernel's "
                   "terms (environment, minimal batch, expected and observed, the upstream file and function, why "
                   "the caller is not at fault, standalone.py inline when short).")
def report(out_dir: str, issue: bool) -> None:
    """Write OUT_DIR/report.md with coverage plots and shape grids (longest context by longest query, head
    size by window, on log2 bins: the shapes a campaign never reached) from OUT_DIR/summary.json (a campaign's
    output directory), or with --issue OUT_DIR/ISSUE.md for one reproducer directory. Exit 2 when the input is not
    what it should be (the message names the file, the field and the fix)."""
    if issue:
        from kvfuzz.fuzz.campaign.store.cases import BadReproducer
        from kvfuzz.fuzz.campaign.store.issue import write_issue

        try:
            console.print(f"issue: {escape(str(write_issue(Path(out_dir))))}")
        except BadReproducer as e:
            console.print(f"[red]bad reproducer[/]: {escape(str(e))}")
            sys.exit(2)
        return
    from kvfuzz.fuzz.campaign.store.report import write_report

    try:
        console.print(f"report: {write_report(Path(out_dir))}")
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from None


__all__ = ["report"]
