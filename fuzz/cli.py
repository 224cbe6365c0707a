"""The ``kvfuzz`` command: ``targets``, ``fuzz``, ``replay``.

Exit codes: 0 nothing failed, 1 something failed (a finding, or a replayed case that still fails), 2 bad
usage (unknown target or fault, an unavailable target named explicitly, a bad option).
"""

from __future__ import annotations

import json
import re
import signal
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

from .campaign import STOP, CampaignConfig, TargetStats, fuzz_target, recover_crashed
from .workers import merge_summaries, run_workers
from .faults import FAULTS, get_fault
from .bench_cli import bench
from .relations_cli import relations
from .report import write_report
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
        contract = "writer" if t.kind == "cache-writer" else c.contract.value
        contract += " (decode-only)" if c.decode_only else ""
        rows.append({"name": name, "contract": contract, "devices": list(c.devices),
                     "dtypes": list(c.dtypes), "head_sizes": list(c.head_sizes), "block_sizes": list(c.block_sizes),
                     "kv_cache_dtypes": list(c.kv_cache_dtypes), "features": sorted(c.features),
                     "exclusive": [sorted(p) for p in c.exclusive], "available": a.ok, "device": a.device,
                     "reason": a.reason, "description": t.description})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="kvfuzz targets")
    for col in ("target", "contract", "dtypes", "kv cache", "head sizes", "block sizes", "features", "here"):
        table.add_column(col)
    for r in rows:
        here = f"[green]yes[/]: {escape(r['reason'])}" if r["available"] else f"[red]no[/]: {escape(r['reason'])}"
        table.add_row(r["name"], r["contract"], ",".join(r["dtypes"]), ",".join(r["kv_cache_dtypes"]),
                      ",".join(map(str, r["head_sizes"])), ",".join(map(str, r["block_sizes"])),
                      ",".join(r["features"]) or "-", here)
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
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Worker processes (one per GPU on CUDA machines, pinned with CUDA_VISIBLE_DEVICES). A kernel "
                   "that crashes or hangs kills its worker, not the campaign; the example is saved.")
@click.option("--example-timeout", default=300.0, show_default=True, type=click.FloatRange(min=1),
              help="With --workers > 1: seconds one example may run before its worker is killed as hung.")
@click.option("--db", "db_spec", default=None,
              help="Shared example database: a directory or redis://host:port/N. Default: OUT/hypothesis-db.")
@click.option("--undeclared", is_flag=True,
              help="Draw configurations the targets do not declare (head/block sizes, dtypes): each must be "
                   "rejected with an error or computed right; silently wrong is a failure.")
@click.option("--big-cache", is_flag=True,
              help="Place every batch's blocks past 2**31 elements of the cache (int32 offset overflow): caches "
                   "of 4+ GiB each, allocated but poisoned only where referenced. For GPUs; attention targets.")
@click.option("--observability", is_flag=True,
              help="Write Hypothesis observability JSON lines (for Tyche) to OUT/observed/.")
@click.option("--worker-dir", default=None, hidden=True, type=click.Path(file_okay=False))
@click.option("--skip-target", "skip_targets", multiple=True, hidden=True)
def fuzz(target_names, duration, max_examples, seed, out_dir, caller_fault, max_num_seqs, max_ctx_len,
         max_query_len, poisons, threads, workers, example_timeout, db_spec, undeclared, big_cache, observability,
         worker_dir, skip_targets) -> None:
    """Fuzz real kernels; shrink each failure and write a reproducer directory under --out."""
    import torch

    torch.set_num_threads(threads)
    budget = _duration(duration)
    chosen = [t for t in _available_targets(target_names) if t.name not in skip_targets]
    out = Path(out_dir)
    config = CampaignConfig(out=out, max_examples=max_examples, duration=budget, seed=seed,
                            fault=get_fault(caller_fault) if caller_fault else None,
                            limits=Limits(max_num_seqs=max_num_seqs, max_ctx_len=max_ctx_len,
                                          max_query_len=max_query_len),
                            poisons=tuple(Poison(p) for p in poisons) or tuple(Poison),
                            work_dir=Path(worker_dir) if worker_dir else None, db_spec=db_spec,
                            run_unsafe=worker_dir is not None, undeclared=undeclared, big_cache=big_cache)
    if big_cache:
        writers = [t.name for t in chosen if t.kind != "attention"]
        if writers:
            raise click.UsageError(f"--big-cache fuzzes attention kernels; leave out {', '.join(writers)}")
    try:
        config.db()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    by_name = {t.name: t for t in chosen}
    recovered = recover_crashed(config, by_name)
    for r in recovered:
        console.print(f"[red]recovered a crash[/] from the last campaign: {r.target}: "
                      f"{escape(r.finding.message)} -> {escape(str(r.reproducer))}")

    if workers > 1 and not any(a.device == "cuda" for a in (t.availability() for t in chosen)):
        import os

        if workers > (os.cpu_count() or 1):
            console.print(f"[yellow]--workers {workers} on {os.cpu_count()} CPU cores[/]: workers will share cores "
                          "(one per core is the most that helps on CPU)")
    if workers > 1:
        worker_args = [a for name in target_names for a in ("--target", name)]
        worker_args += ["--max-examples", str(max_examples), "--out", str(out), "--max-num-seqs", str(max_num_seqs),
                        "--max-ctx-len", str(max_ctx_len), "--max-query-len", str(max_query_len),
                        "--threads", str(threads)]
        worker_args += [a for p in poisons for a in ("--poison", p)]
        worker_args += ["--caller-fault", caller_fault] if caller_fault else []
        worker_args += ["--db", db_spec] if db_spec else []
        worker_args += ["--observability"] if observability else []
        worker_args += ["--undeclared"] if undeclared else []
        worker_args += ["--big-cache"] if big_cache else []
        console.print(f"fuzzing {', '.join(by_name)} with {workers} workers (logs: {out / 'workers'})")
        started = time.monotonic()
        summaries, crashes, interrupted = run_workers(
            workers, worker_args, out, seed, budget, example_timeout, by_name, config,
            on_event=lambda msg: console.print(f"[yellow]{escape(msg)}[/]"))
        wall = time.monotonic() - started
        recovered += crashes
        for r in crashes:
            console.print(f"[red]{r.finding.kind.value}[/] ({escape(r.finding.check)}) in {r.target} (x{r.count}), "
                          f"recovered from a worker that died -> {escape(str(r.reproducer))}")
        results = merge_summaries(summaries, wall)
    elif observability:
        from .observability import observe_to

        with observe_to(out / "observed"):
            results, interrupted = _fuzz_here(chosen, config, caller_fault)
    else:
        results, interrupted = _fuzz_here(chosen, config, caller_fault)

    _print_summary(results, recovered)
    summary = {"targets": results, "caller_fault": caller_fault, "seed": seed, "workers": workers,
               "interrupted": interrupted,
               "recovered": [{"kind": r.finding.kind.value, "check": r.finding.check, "target": r.target,
                              "count": r.count, "reproducer": str(r.reproducer)}
                             for r in recovered]}
    summary_file = config.dir / "summary.json"
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"summary: {summary_file}" + (" (interrupted)" if interrupted else ""))
    if worker_dir is None:
        try:
            console.print(f"report: {write_report(out)}")
        except Exception as e:  # a plotting problem must not cost the campaign's exit status
            console.print(f"[yellow]could not write the report[/]: {escape(repr(e))}")
    failed = recovered or any(t["failures"] for t in results)
    sys.exit(1 if failed else 0)


def _available_targets(target_names) -> list:
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
    return chosen


def _fuzz_here(chosen, config: CampaignConfig, caller_fault) -> tuple[list[dict], bool]:
    """Fuzz targets one after another in this process, with live progress and a status file. SIGTERM is
    handled like Ctrl-C: the campaign stops after the current example and still writes its summary."""
    results: list[dict] = []
    interactive = console.is_terminal
    last = {"log": 0.0, "status": 0.0}
    status_file = config.dir / "status.json"
    config.dir.mkdir(parents=True, exist_ok=True)

    def term(signum, frame):
        STOP.set()  # checked at every example and chunk boundary, in case kernel code swallows the interrupt
        raise KeyboardInterrupt

    STOP.clear()
    old = {sig: signal.signal(sig, term) for sig in (signal.SIGTERM, signal.SIGINT)}
    interrupted = False
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]:.2f} ex/s  failures: {task.fields[fails]}"),
                      TimeElapsedColumn(), console=console, disable=not interactive) as progress:
            for t in chosen:
                task = progress.add_task(t.name, total=config.max_examples, rate=0.0, fails=0)

                def on_example(s: TargetStats, task=task) -> None:
                    progress.update(task, completed=min(s.examples, config.max_examples),
                                    rate=s.examples_per_second, fails=len(s.failures))
                    now = time.monotonic()
                    if not interactive and now - last["log"] > 10:
                        last["log"] = now
                        print(_progress_line(s), flush=True)
                    if now - last["status"] > 2:
                        last["status"] = now
                        status_file.write_text(json.dumps({"updated": time.time(), "done": results,
                                                           "current": s.to_dict()}))

                console.print(f"fuzzing {t.name} ({escape(t.availability().reason)}; "
                              f"{t.capabilities.contract.value} contract"
                              f"{'; caller fault ' + caller_fault if caller_fault else ''})")
                stats = TargetStats(t.name)
                try:
                    stats = fuzz_target(t, config, on_example, stats=stats)
                except KeyboardInterrupt:
                    interrupted = True
                results.append(stats.to_dict())
                progress.update(task, completed=config.max_examples)
                if not interactive:
                    print(_progress_line(stats), flush=True)
                if interrupted:
                    break
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    status_file.write_text(json.dumps({"updated": time.time(), "done": results, "current": None,
                                       "interrupted": interrupted}))
    return results, interrupted


def _print_summary(results: list[dict], recovered) -> None:
    table = Table(title="kvfuzz summary")
    for col in ("target", "examples", "ex/s", "kernel share", "paths", "failures"):
        table.add_column(col)
    for s in results:
        total = s["kernel_s"] + s["harness_s"]
        share = f"{100 * s['kernel_s'] / total:.0f}%" if total else "-"
        paths = ", ".join(f"{p}: {n}" for p, n in sorted(s["paths"].items(), key=lambda x: -x[1]))
        fails = "\n".join(f"[red]{f['kind']}[/] ({escape(f['check'])}) x{f['count']}"
                          for f in s["failures"]) or "[green]none[/]"
        table.add_row(s["target"], str(s["examples"]), f"{s['examples_per_s']:.2f}", share, escape(paths), fails)
    console.print(table)
    for s in results:
        for msg, n in s.get("rejections", {}).items():
            console.print(f"[bold]{s['target']}[/] rejected an undeclared configuration x{n}: {escape(msg)}")
    for s in results:
        if s.get("coverage"):
            console.print(f"[bold]{s['target']}[/] coverage: " + escape("; ".join(
                f"{dim}: " + ", ".join(f"{v} {n}" for v, n in counts.items())
                for dim, counts in s["coverage"].items())))
    for s in results:
        for f in s["failures"]:
            console.print(f"[bold]{s['target']}[/] [red]{f['kind']}[/] — blame: {f['blame']}\n"
                          f"  {escape(f['message'])}\n  minimal batch: {escape(f['batch'])}\n"
                          f"  reproducer: {escape(str(f['reproducer']))}")


@main.command()
@click.option("--target", "target_names", multiple=True, help="Targets to check (default: all available here).")
@click.option("--max-examples", default=30, show_default=True, type=click.IntRange(min=1),
              help="Deterministic example budget per target.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--corpus", default="regressions", show_default=True, type=click.Path(file_okay=False),
              help="Directory of committed reproducer directories to replay (skipped if absent).")
@click.option("--junit-xml", default=None, type=click.Path(dir_okay=False), help="Write JUnit XML here.")
@click.option("--out", "out_dir", default="kvfuzz-check-out", show_default=True, type=click.Path(file_okay=False),
              help="Reproducers of anything the gate finds.")
def check(target_names, max_examples, seed, corpus, junit_xml, out_dir) -> None:
    """Pre-merge gate: a deterministic fuzz budget on each target plus a replay of a regression corpus.
    Exit 0 when everything passes, 1 otherwise."""
    import torch

    from .check import check_corpus, check_targets, write_junit

    torch.set_num_threads(1)
    chosen = _available_targets(target_names)
    results = check_targets(chosen, Path(out_dir), max_examples, seed)
    corpus_dir = Path(corpus)
    if corpus_dir.is_dir():
        results += check_corpus(corpus_dir)
    elif corpus != "regressions":
        raise click.UsageError(f"--corpus {corpus}: no such directory")
    table = Table(title="kvfuzz check")
    for col in ("suite", "case", "time", "result"):
        table.add_column(col)
    for r in results:
        res = "[green]pass[/]" if r.failure is None else f"[red]FAIL[/] {escape(r.failure)}"
        table.add_row(r.suite, r.name, f"{r.seconds:.1f}s", res)
    console.print(table)
    if junit_xml:
        write_junit(results, Path(junit_xml))
        console.print(f"JUnit XML: {junit_xml}")
    failed = [r for r in results if r.failure is not None]
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
def report(out_dir: str) -> None:
    """Write OUT_DIR/report.md with coverage plots from OUT_DIR/summary.json."""
    try:
        console.print(f"report: {write_report(Path(out_dir))}")
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from None


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


main.add_command(relations)
main.add_command(bench)

if __name__ == "__main__":
    main()
