"""``kvfuzz check``: the pre-merge gate (:mod:`kvfuzz.fuzz.campaign.gate`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kvfuzz.fuzz.cli.common import available_targets, console, db_option, writable_file_option


@click.command()
@click.option("--target", "target_names", multiple=True, help="Targets to check (default: all available here).")
@click.option("--max-examples", default=30, show_default=True, type=click.IntRange(min=1),
              help="Deterministic example budget per target.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--corpus", default="regressions", show_default=True, type=click.Path(file_okay=False),
              help="Directory of committed reproducer directories to replay (skipped if absent).")
@click.option("--junit-xml", default=None, type=click.Path(dir_okay=False), callback=writable_file_option,
              help="Write JUnit XML here.")
@click.option("--out", "out_dir", default="kvfuzz-check-out", show_default=True, type=click.Path(file_okay=False),
              help="Reproducers of anything the gate finds.")
@click.option("--db", "db_spec", default=None, callback=db_option,
              help="Also replay the failures of this example database (a directory or redis://host:port/N), "
                   "read-only: the gate never writes to it.")
@click.option("--trust-targets", is_flag=True,
              help="Replay corpus cases whose adapters were loaded from a file or module (imports that code).")
def check(target_names, max_examples, seed, corpus, junit_xml, out_dir, db_spec, trust_targets) -> None:
    """Pre-merge gate: a deterministic fuzz budget on each target plus an isolated replay of a regression corpus.
    Exit 0 when everything passes, 1 when something fails, 2 when a corpus case cannot be read (named). A corpus
    case whose target cannot run on this machine is skipped (said), not failed."""
    import torch

    from kvfuzz.fuzz.campaign.gate import check_corpus, check_targets, write_junit

    torch.set_num_threads(1)
    chosen = available_targets(target_names)
    from kvfuzz.fuzz.campaign.store.database import DatabaseError

    try:
        results = check_targets(chosen, Path(out_dir), max_examples, seed, db_spec=db_spec,
                                names=list(target_names) or None)
    except DatabaseError as e:
        raise click.UsageError(str(e)) from None
    corpus_dir = Path(corpus)
    if corpus_dir.is_dir():
        results += check_corpus(corpus_dir, trust_targets=trust_targets)
    elif corpus != "regressions":
        raise click.UsageError(f"--corpus {corpus}: no such directory")
    table = Table(title="kvfuzz check")
    for col in ("suite", "case", "time", "result"):
        table.add_column(col)
    for r in results:
        res = "[green]pass[/]" if r.failure is None else f"[red]FAIL[/] {escape(r.failure)}"
        if r.skipped is not None:
            res = f"[yellow]skipped[/] {escape(r.skipped)}"
        table.add_row(r.suite, r.name, f"{r.seconds:.1f}s", res)
    console.print(table)
    if junit_xml:
        write_junit(results, Path(junit_xml))
        console.print(f"JUnit XML: {junit_xml}")
    failed = [r for r in results if r.failure is not None]
    skipped = sum(r.skipped is not None for r in results)
    console.print(f"{len(results) - len(failed) - skipped} passed, {len(failed)} failed"
                  + (f", {skipped} skipped (target not runnable here)" if skipped else ""))
    bad = [r for r in failed if r.bad_input]
    for r in bad:
        console.print(f"[red]bad input[/]: {escape(r.failure)}")
    sys.exit(2 if bad else 1 if failed else 0)


__all__ = ["check"]
