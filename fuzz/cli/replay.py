"""``kvfuzz replay``: re-run a reproducer directory."""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from kvfuzz.fuzz.cli.common import console


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def replay(directory: str) -> None:
    """Re-run a reproducer directory. Exit 1 while it still fails, 0 once it passes."""
    from kvfuzz.fuzz.campaign.reproducers import replay as replay_case

    try:
        r = replay_case(directory)
    except (FileNotFoundError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    if not r.inputs_match:
        console.print("[yellow]warning[/]: regenerated inputs differ from tensors.safetensors "
                      "(kvfuzz or torch version changed since this case was written)")
    if r.got is None:
        console.print(f"[green]passes now[/]: recorded {r.expected[0]} ({r.expected[1]}) no longer reproduces")
        sys.exit(0)
    same = "reproduced" if r.reproduced else f"fails differently (recorded {r.expected[0]} / {r.expected[1]})"
    console.print(f"[red]{same}[/]: {r.got[0]} ({r.got[1]})\n{escape(r.message)}")
    sys.exit(1)
