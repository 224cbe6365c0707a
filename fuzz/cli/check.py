"""``kvfuzz check``: the pre-merge gate (:mod:`kvfuzz.fuzz.campaign.gate`).

Exit codes (docs/cli.md, "kvfuzz check"): 0 every target spent its budget without a failure and every corpus case
passes; 1 something failed; 2 bad usage or a corpus case that cannot be read; 3 the gate did not finish: interrupted
(Ctrl-C, SIGTERM, SIGHUP), a database that does not answer, a campaign that could not run. A gate never passes by
accident: what did not finish is an error in the table and in the JUnit file, which is written before the gate
starts with every case an error, so a gate killed outright leaves a file that fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kvfuzz.fuzz.cli.common import (
    EXIT_INTERRUPTED,
    console,
    db_option,
    named_targets,
    next_steps,
    out_dir_option,
    writable_file_option,
)

#: The corpus ``--corpus`` names by default (replayed when it exists; said in one line when it does not).
DEFAULT_CORPUS = "regressions"


@click.command()
@click.option("--target", "target_names", multiple=True, help="Targets to check (default: all available here).")
@click.option("--max-examples", default=30, show_default=True, type=click.IntRange(min=1, max=10**9),
              help="Deterministic example budget per target.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--corpus", default=DEFAULT_CORPUS, show_default=True, type=click.Path(file_okay=False),
              help="Directory of committed reproducer directories to replay (the default one is skipped, with a "
                   "line saying so, when absent; a named one must exist).")
@click.option("--junit-xml", default=None, type=click.Path(dir_okay=False), callback=writable_file_option,
              help="Write JUnit XML here (first with every case an error, then the results).")
@click.option("--out", "out_dir", default="kvfuzz-check-out", show_default=True, type=click.Path(file_okay=False),
              callback=out_dir_option, help="Reproducers of anything the gate finds.")
@click.option("--db", "db_spec", default=None, callback=db_option,
              help="Also replay the failures of this example database (a directory or redis://host:port/N), "
                   "read-only: the gate never writes to it.")
@click.option("--trust-targets", is_flag=True,
              help="Replay corpus cases whose adapters were loaded from a file or module (imports that code).")
def check(target_names, max_examples, seed, corpus, junit_xml, out_dir, db_spec, trust_targets) -> None:
    """Pre-merge gate: a deterministic fuzz budget on each target plus an isolated replay of a regression corpus.
    Exit 0 when everything passes, 1 when something fails, 2 on bad usage or when a corpus case cannot be read
    (named), 3 when the gate did not finish (interrupted, a database that does not answer, a campaign that could
    not run). A corpus case whose target cannot run on this machine is skipped (said), not failed."""
    import torch

    from kvfuzz.fuzz.campaign.gate import GateInterrupted, check_corpus, check_targets, corpus_cases, unfinished

    torch.set_num_threads(1)
    chosen, specs = named_targets(target_names)
    corpus_dir = _corpus(corpus)
    cases = [c.name for c in corpus_cases(corpus_dir)] if corpus_dir is not None else []
    _open_database(db_spec)
    junit = Path(junit_xml) if junit_xml else None
    if junit is not None:  # a gate killed outright (SIGKILL) leaves errors, never the last run's passes
        _write_junit(unfinished([t.name for t in chosen], cases, "not finished: kvfuzz check is running, or was "
                                "killed before it wrote its results"), junit)
    interrupted = False
    try:
        results = check_targets(chosen, out_dir, max_examples, seed, db_spec=db_spec, names=specs)
    except GateInterrupted as e:
        results, interrupted = e.results + unfinished([], cases, "not replayed: the gate was interrupted"), True
    if corpus_dir is not None and not interrupted:
        try:
            results += check_corpus(corpus_dir, trust_targets=trust_targets)
        except GateInterrupted as e:
            results, interrupted = results + e.results, True
    _print_results(results)
    if junit is not None:
        _write_junit(results, junit)
        console.print(f"JUnit XML: {junit}")
    sys.exit(_verdict(results, interrupted, corpus))


def _corpus(corpus: str) -> Path | None:
    """The corpus directory to replay, or None: the default one, absent, is skipped with one line; a named one
    that is missing is a usage error (exit 2)."""
    path = Path(corpus)
    if path.is_dir():
        return path
    if corpus != DEFAULT_CORPUS:
        raise click.BadParameter(f"{corpus}: no such directory", param_hint="--corpus")
    console.print(f"no regression corpus: ./{DEFAULT_CORPUS}/ does not exist here, so no reproducer is replayed "
                  "(--corpus DIR names one)", highlight=False)
    return None


def _open_database(db_spec: str | None) -> None:
    """Open ``--db`` as the gate will, before anything runs: a server that does not answer ends the gate with exit
    3 (as ``kvfuzz fuzz``), a path that cannot be a corpus with exit 2."""
    if db_spec is None:
        return
    from kvfuzz.fuzz.campaign.store.database import DatabaseError, read_only_view

    try:
        read_only_view(db_spec)
    except DatabaseError as e:
        console.print(f"[red]cannot start[/]: {escape(str(e))}")
        sys.exit(EXIT_INTERRUPTED if "does not answer" in str(e) else 2)


def _write_junit(results, path: Path) -> None:
    from kvfuzz.fuzz.campaign.gate import write_junit
    from kvfuzz.fuzz.campaign.store.journal import disk_full

    try:
        write_junit(results, path)
    except OSError as e:
        console.print(f"[red]cannot write the JUnit XML[/] {escape(str(path))}: {escape(e.strerror or str(e))}")
        sys.exit(EXIT_INTERRUPTED if disk_full(e) else 2)


def _print_results(results) -> None:
    table = Table(title="kvfuzz check")
    for col in ("suite", "case", "time", "result"):
        table.add_column(col)
    for r in results:
        res = "[green]pass[/]" if r.failure is None else f"[red]FAIL[/] {escape(r.failure)}"
        if r.skipped is not None:
            res = f"[yellow]skipped[/] {escape(r.skipped)}"
        elif r.failure is None and r.error is not None:
            res = f"[red]ERROR[/] {escape(r.error)}"
        table.add_row(r.suite, r.name, f"{r.seconds:.1f}s", res)
    console.print(table)


def _verdict(results, interrupted: bool, corpus: str) -> int:
    """Print the counts and what to do next; the exit status: 2 bad input, 1 a failure, 3 not finished, else 0."""
    failed = [r for r in results if r.failure is not None]
    errors = [r for r in results if r.failure is None and r.error is not None]
    skipped = sum(r.skipped is not None for r in results)
    passed = len(results) - len(failed) - len(errors) - skipped
    console.print(f"{passed} passed, {len(failed)} failed"
                  + (f", {len(errors)} not finished (errors)" if errors else "")
                  + (f", {skipped} skipped (target not runnable here)" if skipped else "")
                  + (" — interrupted" if interrupted else ""), highlight=False)
    bad = [r for r in failed if r.bad_input]
    for r in bad:
        console.print(f"[red]bad input[/]: {escape(r.failure)}")
    next_steps([d for r in failed for d in r.reproducers],
               replays=[r.name for r in failed if r.suite == "regression" and not r.bad_input], corpus=corpus)
    if bad:
        return 2
    if failed:
        return 1
    return EXIT_INTERRUPTED if interrupted or errors else 0


__all__ = ["DEFAULT_CORPUS", "check"]
