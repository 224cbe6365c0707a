"""``kvfuzz report``: report.md with coverage plots from a campaign's summary.json."""

from __future__ import annotations

from pathlib import Path

import click

from kvfuzz.fuzz.cli.common import console


@click.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
def report(out_dir: str) -> None:
    """Write OUT_DIR/report.md with coverage plots and shape grids (longest context by longest query, head size by
    window, on log2 bins: the shapes a campaign never reached) from OUT_DIR/summary.json."""
    from kvfuzz.fuzz.campaign.store.report import write_report

    try:
        console.print(f"report: {write_report(Path(out_dir))}")
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from None


__all__ = ["report"]
