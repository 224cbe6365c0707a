"""The ``kvfuzz`` command: ``targets``, ``fuzz``, ``replay``.

Exit codes: 0 nothing failed, 1 something failed (a finding, or a replayed case that still fails), 2 bad
usage (unknown target or fault, an unavailable target named explicitly, a bad option).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvfuzz.contracts.materialize import Poison
from kvfuzz.strategies.batches import Limits

from .campaign import CampaignConfig, TargetStats, fuzz_target, recover_crashed
from .faults import FAULTS, get_fault
from .reproducer import replay as replay_case
from .targets import BUILTIN, get_target

# Outside a terminal (a log file, CI) rich would wrap tables at 80 columns: give it room instead.
console = Console(width=None if sys.stdout.isatty() else 160)


def _duration(value: str | None) -> float | None:
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", value)
    if not m:
        raise click.BadParameter(f"{value!r}: give seconds, or a number with s, m or h (e.g. 90, 90s, 5m, 2h)")
    return float(m.group(1)) * {"s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvfuzz")
def main() -> None:
    """Property-based fuzzing of paged KV-cache attention kernels and their callers' contracts."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def targets(as_json: bool) -> None:
    """List the built-in targets, their contracts and whether they run here."""
    rows = []
    for name in BUILTIN:
        t = get_target(name)
        a = t.availability()
        c = t.capabilities
        rows.append({"name": name, "contract": c.contract.value, "devices": list(c.devices),
                     "dtypes": list(c.dtypes), "head_sizes": list(c.head_sizes), "block_sizes": list(c.block_sizes),
                     "kv_cache_dtypes": list(c.kv_cache_dtypes), "available": a.ok, "device": a.device,
                     "reason": a.reason, "description": t.description})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="kvfuzz targets")
    for col in ("target", "contract", "dtypes", "head sizes", "block sizes", "here"):
        table.add_column(col)
    for r in rows:
        here = f"[green]yes[/]: {r['reason']}" if r["available"] else f"[red]no[/]: {r['reason']}"
        table.add_row(r["name"], r["contract"], ",".join(r["dtypes"]), ",".join(map(str, r["head_sizes"])),
                      ",".join(map(str, r["block_sizes"])), here)
    console.print(table)


def _progress_line(s: TargetStats) -> str:
    return (f"{s.target}: {s.examples} examples, {s.examples_per_second:.2f}/s, "
            f"{len(s.failures)} distinct failures, {sum(f.count for f in s.failures.values())} failing examples")


@main.command()
@click.option("--target", "target_names", multiple=True,
              help="Target to fuzz (repeatable): a built-in name, path/to/file.py:CLASS or module:CLASS. "
                   "Default: every built-in target available here.")
@click.option("--duration", default=None, help="Time budget per target (90, 90s, 5m, 2h). Default: none.")
@click.option("--max-examples", default=30, show_default=True, type=click.IntRange(min=1),
              help="Example budget per target.")
@click.option("--seed", default=0, show_default=True, type=int, help="Campaign seed.")
@click.option("--out", "out_dir", default="kvfuzz-out", show_default=True, type=click.Path(file_okay=False),
              help="Reproducers, the example database and summary.json go here.")
@click.option("--caller-fault", type=click.Choice(sorted(FAULTS)), default=None,
              help="Break the cache contract in kvfuzz's own harness, as a buggy caller would.")
@click.option("--max-num-seqs", default=Limits().max_num_seqs, show_default=True, type=click.IntRange(min=1))
@click.option("--max-ctx-len", default=Limits().max_ctx_len, show_default=True, type=click.IntRange(min=0))
@click.option("--max-query-len", default=Limits().max_query_len, show_default=True, type=click.IntRange(min=2))
@click.option("--poison", "poisons", multiple=True, type=click.Choice([p.value for p in Poison]),
              help="What fills unwritten cache slots (repeatable). Default: all of nan, inf, stale, zeros.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch CPU threads. Fuzz batches are small: more threads cost more in OpenMP overhead "
                   "than they gain (vllm.cpu_attention: 0.05 ms per call on 1 thread, 8 ms on 2).")
def fuzz(target_names, duration, max_examples, seed, out_dir, caller_fault, max_num_seqs, max_ctx_len,
         max_query_len, poisons, threads) -> None:
    """Fuzz real kernels; shrink each failure and write a reproducer directory under --out."""
    import torch

    torch.set_num_threads(threads)
    budget = _duration(duration)
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
    out = Path(out_dir)
    config = CampaignConfig(out=out, max_examples=max_examples, duration=budget, seed=seed,
                            fault=get_fault(caller_fault) if caller_fault else None,
                            limits=Limits(max_num_seqs=max_num_seqs, max_ctx_len=max_ctx_len,
                                          max_query_len=max_query_len),
                            poisons=tuple(Poison(p) for p in poisons) or tuple(Poison))
    out.mkdir(parents=True, exist_ok=True)
    recovered = recover_crashed(config, {t.name: t for t in chosen})
    for r in recovered:
        console.print(f"[red]recovered a crash[/] from the last campaign: {r.target}: "
                      f"{escape(r.finding.message)} -> {escape(str(r.reproducer))}")

    results: list[TargetStats] = []
    interactive = console.is_terminal
    last_log = [0.0]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]:.2f} ex/s  failures: {task.fields[fails]}"),
                  TimeElapsedColumn(), console=console, disable=not interactive) as progress:
        for t in chosen:
            task = progress.add_task(t.name, total=max_examples, rate=0.0, fails=0)

            def on_example(s: TargetStats, task=task) -> None:
                progress.update(task, completed=min(s.examples, max_examples), rate=s.examples_per_second,
                                fails=len(s.failures))
                if not interactive and time.monotonic() - last_log[0] > 10:
                    last_log[0] = time.monotonic()
                    print(_progress_line(s), flush=True)

            console.print(f"fuzzing {t.name} ({t.availability().reason}; {t.capabilities.contract.value} contract"
                          f"{'; caller fault ' + caller_fault if caller_fault else ''})")
            stats = fuzz_target(t, config, on_example)
            progress.update(task, completed=max_examples)
            results.append(stats)
            if not interactive:
                print(_progress_line(stats), flush=True)

    _print_summary(results, recovered)
    summary = {"targets": [s.to_dict() for s in results], "caller_fault": caller_fault, "seed": seed,
               "recovered_crashes": [str(r.reproducer) for r in recovered]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"summary: {out / 'summary.json'}")
    failed = recovered or any(s.failures for s in results)
    sys.exit(1 if failed else 0)


def _print_summary(results: list[TargetStats], recovered) -> None:
    table = Table(title="kvfuzz summary")
    for col in ("target", "examples", "ex/s", "kernel share", "paths", "failures"):
        table.add_column(col)
    for s in results:
        total = s.kernel_seconds + s.harness_seconds
        share = f"{100 * s.kernel_seconds / total:.0f}%" if total else "-"
        paths = ", ".join(f"{p}: {n}" for p, n in s.paths.most_common())
        fails = "\n".join(f"[red]{f.finding.kind.value}[/] ({f.finding.check}) x{f.count}"
                          for f in s.failures.values()) or "[green]none[/]"
        table.add_row(s.target, str(s.examples), f"{s.examples_per_second:.2f}", share, paths, fails)
    console.print(table)
    for s in results:
        cov = s.coverage.to_dict()
        if cov:
            console.print(f"[bold]{s.target}[/] coverage: " + escape("; ".join(
                f"{dim}: " + ", ".join(f"{v} {n}" for v, n in counts.items()) for dim, counts in cov.items())))
    for s in results:
        for f in s.failures.values():
            console.print(f"[bold]{s.target}[/] [red]{f.finding.kind.value}[/] — blame: {f.finding.kind.blame}\n"
                          f"  {escape(f.finding.message)}\n  minimal batch: {escape(f.example.batch.summary())}, "
                          f"poison={f.example.poison.value}\n  reproducer: {escape(str(f.reproducer))}")


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def replay(directory: str) -> None:
    """Re-run a reproducer directory. Exit 1 while it still fails, 0 once it passes."""
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


if __name__ == "__main__":
    main()
