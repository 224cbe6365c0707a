"""``kvfuzz fuzz``: fuzz real kernels, shrink each failure, write reproducers and a summary.

Exit codes: 0 nothing failed, 1 something failed, 2 bad usage (unknown target or fault, a named target that
cannot run here, a bad option).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvfuzz.contracts.poison import Poison
from kvfuzz.fuzz.cli.common import available_targets, console, parse_duration
from kvfuzz.fuzz.harness.faults import FAULT_NAMES
from kvfuzz.strategies.limits import Limits


def _progress_line(s) -> str:
    return (f"{s.target}: {s.examples} examples, {s.examples_per_second:.2f}/s, "
            f"{len(s.failures)} distinct failures, {sum(f.count for f in s.failures.values())} failing examples")


@click.command()
@click.option("--target", "target_names", multiple=True,
              help="Target to fuzz (repeatable): a built-in name, path/to/file.py:CLASS or module:CLASS. "
                   "Default: every built-in target available here.")
@click.option("--duration", default=None, help="Time budget per target (90, 90s, 5m, 2h). Default: none.")
@click.option("--max-examples", default=30, show_default=True, type=click.IntRange(min=1),
              help="Example budget per target.")
@click.option("--seed", default=0, show_default=True, type=int, help="Campaign seed.")
@click.option("--out", "out_dir", default="kvfuzz-out", show_default=True, type=click.Path(file_okay=False),
              help="Reproducers, the example database and summary.json go here.")
@click.option("--caller-fault", type=click.Choice(sorted(FAULT_NAMES)), default=None,
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

    from kvfuzz.contracts.poison import Poison
    from kvfuzz.fuzz.campaign.engine import CampaignConfig, recover_crashed
    from kvfuzz.fuzz.campaign.report import write_report
    from kvfuzz.fuzz.campaign.workers import merge_summaries, run_workers
    from kvfuzz.fuzz.harness.faults import get_fault

    torch.set_num_threads(threads)
    budget = parse_duration(duration)
    chosen = [t for t in available_targets(target_names) if t.name not in skip_targets]
    out = Path(out_dir)
    config = CampaignConfig(out=out, max_examples=max_examples, duration=budget, seed=seed,
                            fault=get_fault(caller_fault) if caller_fault else None,
                            limits=Limits(max_num_seqs=max_num_seqs, max_ctx_len=max_ctx_len,
                                          max_query_len=max_query_len),
                            poisons=tuple(Poison(p) for p in poisons) or tuple(Poison),
                            work_dir=Path(worker_dir) if worker_dir else None, db_spec=db_spec,
                            run_unsafe=worker_dir is not None, undeclared=undeclared, big_cache=big_cache)
    if big_cache:
        writers = [t.name for t in chosen if not t.capabilities.contract.is_attention]
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
        from kvfuzz.fuzz.campaign.observability import observe_to

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


def _fuzz_here(chosen, config, caller_fault) -> tuple[list[dict], bool]:
    """Fuzz targets one after another in this process, with live progress and a status file. SIGTERM is
    handled like Ctrl-C: the campaign stops after the current example and still writes its summary."""
    from kvfuzz.fuzz.campaign.engine import STOP, TargetStats, fuzz_target

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
