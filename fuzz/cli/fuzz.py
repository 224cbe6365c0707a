"""``kvfuzz fuzz``: fuzz real kernels in supervised worker processes, shrink each failure, write reproducers
and a summary.

Exit codes (also in the README):
  0  nothing failed and nothing was lost (with --baseline: every failure found is a known one of the baseline);
  1  a failure was found (a finding of any blame: caller, kernel, harness) that no --baseline entry accepts,
     new or found before (an earlier campaign in the same --out wrote its reproducer);
  2  bad usage: an unknown target or fault, a target that cannot run here, a bad option or --out, a bad
     --baseline file (the message names the file, the field and the fix);
  3  the campaign could not run as asked: examples were lost (workers killed from outside twice), workers could
     not start, the example database failed, --out is in use by another campaign, a target it ran drew no
     example (a target unavailable here is skipped, said, unless named: exit 2), or it was interrupted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click
from rich.markup import escape

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.cli.common import (
    console,
    db_option,
    duration_option,
    finite_range,
    interruption,
    load_baseline_option,
    named_targets,
    out_dir_option,
    parse_duration,
    say,
    unique,
    writable_dir_option,
)
from kvfuzz.fuzz.harness.faults import FAULT_NAMES
from kvfuzz.strategies.limits import BOUNDS, MAX_BATCH_TOKENS, Limits
from kvfuzz.strategies.tiers import TIERS

#: Exit statuses of kvfuzz fuzz (module docstring).
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 3
#: --max-examples when only --duration bounds the campaign.
UNLIMITED = 2**62
#: The largest --max-examples (and --chunk-examples): a trillion examples, decades of fuzzing.
MAX_EXAMPLES = 10**12


def _sanitize_share(ctx, param, value: str) -> float | str:
    """``--sanitize``: "auto" stays "auto" and "auto:SHARE" (a time share in (0, 1]) stays as given (a time share
    on CUDA: :func:`_sanitize_config`), "0"/"none"/"off" -> 0.0, "all" -> 1.0, a number in [0, 1]; else exit 2
    naming the option."""
    v = str(value).strip().lower()
    if v == "auto":
        return v
    if v.startswith("auto:"):
        try:
            share = float(v[5:])
        except ValueError:
            share = -1.0
        if not 0.0 < share <= 1.0:
            raise click.BadParameter(f"{value!r}: auto:SHARE takes a share of each worker's time in (0, 1], "
                                     "e.g. auto:0.05")
        return f"auto:{share}"
    if v in ("none", "off"):
        return 0.0
    if v == "all":
        return 1.0
    try:
        share = float(v)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise click.BadParameter(f"{value!r} is not a share: give auto, 0 (or none), a fraction such as 0.1, or all")
    return share


def _sanitize_config(sanitize: float | str) -> dict:
    """CampaignConfig's sanitize fields for ``--sanitize``: auto -> each worker spends up to
    :data:`~kvfuzz.fuzz.harness.sanitizer.AUTO_TIME_SHARE` of its time on sanitized runs (CUDA targets only);
    a share -> that share of the examples by hash."""
    from kvfuzz.fuzz.harness.sanitizer import AUTO_TIME_SHARE

    if sanitize == "auto":
        return {"sanitize": 0.0, "sanitize_time_share": AUTO_TIME_SHARE}
    if isinstance(sanitize, str) and sanitize.startswith("auto:"):
        return {"sanitize": 0.0, "sanitize_time_share": float(sanitize[5:])}
    return {"sanitize": float(sanitize), "sanitize_time_share": 0.0}


#: The options of ``kvfuzz fuzz``, in --help's order (:func:`_options` puts them on the command): what to fuzz, the
#: budgets, the batches' bounds, the workers and what each example may cost, the database, the strategy, the
#: caches, the oracles' extras and the baseline.
OPTIONS = [
    click.option("--target", "target_names", multiple=True,
                 help="Target to fuzz (repeatable): a registered name, path/to/file.py:CLASS or module:CLASS. "
                      "Default: every registered target available here."),
    click.option("--duration", default=None, callback=duration_option,
                 help="Time budget per target (90, 90s, 5m, 2h), from its first chunk of fresh examples (the "
                      "targets take the workers in turn; a target's database replay comes first, with a budget of its "
                      "own), shrinking included: each target ends within max(10%, 15 s) past it, or the summary says "
                      "what overran. Default: none."),
    click.option("--max-examples", default=None, type=click.IntRange(min=1, max=MAX_EXAMPLES),
                 help="Example budget per target, for the whole campaign (shared by the workers): at most this many "
                      "examples are drawn and counted; the runs that shrink a failure are counted apart (summary.json "
                      "shrink_runs). Default: 30, or no limit when --duration is given."),
    click.option("--seed", default=0, show_default=True, type=int, help="Campaign seed."),
    click.option("--out", "out_dir", default="kvfuzz-out", show_default=True, callback=out_dir_option,
                 help="Reproducers, the example database, state, status and summary.json go here."),
    click.option("--caller-fault", type=click.Choice(sorted(FAULT_NAMES)), default=None,
                 help="Break the cache contract in kvfuzz's own harness, as a buggy caller would."),
    click.option("--max-num-seqs", default=Limits().max_num_seqs, show_default=True,
                 type=click.IntRange(min=1, max=BOUNDS["max_num_seqs"])),
    click.option("--max-ctx-len", default=Limits().max_ctx_len, show_default=True,
                 type=click.IntRange(min=0, max=BOUNDS["max_ctx_len"])),
    click.option("--max-query-len", default=Limits().max_query_len, show_default=True,
                 type=click.IntRange(min=2, max=BOUNDS["max_query_len"])),
    click.option("--poison", "poisons", multiple=True, type=click.Choice([p.value for p in Poison]),
                 help="What fills unwritten cache slots (repeatable). Default: all of nan, inf, stale, zeros."),
    click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1, max=1024),
                 help="torch CPU threads per worker. Fuzz batches are small: more threads cost more in OpenMP "
                      "overhead than they gain (vllm.cpu_attention: 0.05 ms per call on 1 thread, 8 ms on 2)."),
    click.option("--workers", default=None, type=click.IntRange(min=1),
                 help="Worker processes (on CUDA machines spread over the GPUs with CUDA_VISIBLE_DEVICES). Every "
                      "campaign runs its examples in workers: a kernel that crashes or hangs costs a worker, not the "
                      "campaign, and the example is saved. Default: on CPU one per core this process may use "
                      "(its affinity), at most 8; on CUDA, per GPU half its share of the CPU cores, at most 8 "
                      "(Triton compiles on the CPU; the GPU has room), or under MPS its share of the cores less two "
                      "for the host, at most 28 "
                      "(14 on a 16-core host with one GPU). Capped, with a warning, at the campaign's example budget "
                      "(--max-examples times the targets), 4 per CPU core and 56 per GPU: more cannot help."),
    click.option("--mps", "mps_mode", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                 help="CUDA MPS for the workers sharing a GPU (their kernels then run concurrently instead of "
                      "time-slicing): auto starts a private daemon (nvidia-cuda-mps-control -d) when the targets "
                      "run on CUDA and the program is on PATH, and stops it at the end; on: exit 3 if it cannot "
                      "start; off: none. A campaign run under the user's own daemon (CUDA_MPS_PIPE_DIRECTORY set) "
                      "uses it."),
    click.option("--example-timeout", default=300.0, show_default=True, type=finite_range(min=1),
                 help="Seconds one example may run before its worker is killed and the example reported as hung."),
    click.option("--max-crashes", default=10, show_default=True, type=click.IntRange(min=1),
                 help="A target whose examples crash or hang this many times gets no more work."),
    click.option("--db", "db_spec", default=None, callback=db_option,
                 help="Shared example database: a directory or redis://host:port/N (Redis is mirrored into "
                      "OUT/hypothesis-db, so an outage loses nothing). Default: OUT/hypothesis-db."),
    click.option("--undeclared", is_flag=True,
                 help="Draw configurations the targets do not declare (head/block sizes, dtypes): each must be "
                      "rejected with an error or computed right; silently wrong is a failure."),
    click.option("--big-cache", is_flag=True,
                 help="Place every batch's blocks past 2**31 elements of the cache (int32 offset overflow): caches "
                      "of 4+ GiB each, allocated but poisoned only where referenced. For GPUs; attention targets."),
    click.option("--tier", "tiers", multiple=True, type=click.Choice(["auto", *TIERS]),
                 help="Size tier to draw batches from (repeatable; each chunk draws from one): small (--max-* limits), "
                      "serving (batches as vLLM's and SGLang's schedulers compose them: decodes first, chunked-prefill "
                      "chunks filling a token budget, real models' heads and windows), long (contexts up to 128k "
                      "tokens, 2 sequences), wide (up to 256 sequences), big-cache (as --big-cache). Several: steered "
                      "(--steer on), a chunk aimed at a bin takes the cheapest tier that reaches it and free chunks "
                      "alternate small and the others; --steer off: small gets 4 chunks of 5 (3 of 5 with serving, "
                      "which gets 3 of 10) and the others take turns; a large tier's chunk is sized to a small chunk's "
                      "time. Each target runs those it declares (`kvfuzz targets`); auto: every declared tier for a "
                      "target on CUDA, small on CPU. Default: auto."),
    click.option("--steer", type=click.Choice(["on", "off"]), default="on", show_default=True,
                 help="on: steer each chunk's size tier and the coverage bin its draws aim at (ctx_len x query_len, "
                      "head_size x window) by what the campaign has not covered, its near misses and its failures "
                      "(docs/fuzzing.md); off: the fixed split of chunks between tiers, every draw free."),
    click.option("--observability", is_flag=True,
                 help="Write Hypothesis observability JSON lines (for Tyche) to OUT/observed/."),
    click.option("--configs", "configs", type=click.Choice(["auto", "pinned", "free"]), default="auto",
                 show_default=True,
                 help="pinned: each chunk of examples stays in one kernel configuration (dtype, heads, head size, "
                      "kv_cache_dtype, block size, features: what Triton compiles a kernel for), rotating so every "
                      "declared value comes up; a failure is shrunk inside it, then across configurations. free: "
                      "every example draws its own. auto: pinned for targets on CUDA, free on CPU."),
    click.option("--chunk-examples", default=None, type=click.IntRange(min=1, max=MAX_EXAMPLES),
                 help="Examples per chunk (a worker's unit of work; with pinned configs, the examples each "
                      "configuration gets; fewer compile more often and visit more configurations a minute). "
                      "Default: 1000 pinned, 25 free."),
    click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0, max=10_000),
                 help="Pinned targets: first compile the first N configurations the campaign visits, in parallel "
                      "over the workers (2 examples each, counted), into the shared Triton cache."),
    click.option("--triton-cache", "triton_cache", default=None, type=click.Path(file_okay=False),
                 callback=writable_dir_option,
                 help="Triton's kernel cache for every worker (TRITON_CACHE_DIR): compiled kernels persist there "
                      "and are shared by the workers and later campaigns. Default: Triton's own (~/.triton/cache "
                      "unless TRITON_CACHE_DIR is set)."),
    click.option("--jit-cache", "jit_cache", default=None, type=click.Path(file_okay=False),
                 callback=writable_dir_option,
                 help="FlashInfer's JIT cache for every worker (FLASHINFER_WORKSPACE_BASE, set before flashinfer is "
                      "imported): compiled FlashInfer modules persist there. Default: $FLASHINFER_WORKSPACE_BASE, else "
                      "FlashInfer's own (the home directory)."),
    click.option("--structural-shrink", "structural_shrink", default=60.0, show_default=True,
                 type=finite_range(min=0),
                 help="Seconds each new distinct failure may spend in the structural shrink after Hypothesis's "
                      "(several fields at once, e.g. a smaller head size with block ids scaled to keep their "
                      "offsets; docs/campaigns.md); 0: off."),
    click.option("--sanitize", "sanitize", default="auto", show_default=True, callback=_sanitize_share,
                 help="Examples re-run under compute-sanitizer memcheck (CUDA's, on PATH or /usr/local/cuda/bin) in "
                      "a long-lived child with exact-size allocations: an invalid access is a 'memory safety' "
                      "failure, confirmed in a child that ran no other example (a standby started beforehand; "
                      "KVFUZZ_SANITIZE_STANDBY=0: a fresh child started for it) and shrunk like any "
                      "other. auto: up to 10% of each "
                      "worker's time (auto:0.05: 5%), on the targets that declare it (vLLM's and SGLang's Triton "
                      "kernels), one sanitized run at a time per GPU; 0 or "
                      "none: off; a fraction of the examples (0.1); all. CUDA targets only (off on CPU: the Triton "
                      "interpreter has no bounds checks)."),
    click.option("--baseline", "baseline_file", default=None, type=click.Path(dir_okay=False),
                 help="A findings baseline (TOML, e.g. kvfuzz-baseline.toml; `kvfuzz baseline add` writes entries): "
                      "failures it accepts are still found, counted and listed as known, but only a new failure (or a "
                      "known one that changed) exits 1."),
]


def _options(command):
    """``command`` with :data:`OPTIONS`, the first one first in --help."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command


@click.command()
@_options
def fuzz(target_names, duration, max_examples, seed, out_dir, caller_fault, max_num_seqs, max_ctx_len,
         max_query_len, poisons, threads, workers, mps_mode, example_timeout, max_crashes, db_spec, undeclared,
         big_cache, tiers, steer, observability, configs, chunk_examples, warmup, triton_cache, jit_cache,
         structural_shrink, sanitize, baseline_file) -> None:
    """Fuzz real kernels in supervised workers; shrink each failure and write a reproducer directory under
    --out. Exit 0 nothing failed (or only --baseline's known findings), 1 a failure found (new, or found before
    in --out), 2 bad usage, 3 the campaign could not run as asked (or was interrupted)."""
    if jit_cache:  # before any target is loaded: flashinfer reads it when first imported
        os.environ["FLASHINFER_WORKSPACE_BASE"] = str(Path(jit_cache).resolve())  # the workers inherit it
    limits = _limits(max_num_seqs, max_ctx_len, max_query_len)
    _check_environment()
    baseline = load_baseline_option(baseline_file)
    budget = parse_duration(duration)
    if max_examples is None:
        max_examples = UNLIMITED if budget is not None else 30
    chosen, specs = named_targets(target_names)
    tiers = unique(tiers, "--tier")
    _check_big_cache(chosen, big_cache, tiers)

    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.harness.faults import get_fault

    config = CampaignConfig(out=out_dir, max_examples=max_examples, duration=budget, seed=seed,
                            fault=get_fault(caller_fault) if caller_fault else None, limits=limits,
                            poisons=tuple(Poison(p) for p in unique(poisons, "--poison")) or tuple(Poison),
                            db_spec=db_spec, undeclared=undeclared, big_cache=big_cache, tiers=tiers or ("auto",),
                            steer=steer == "on", pin_configs={"auto": None, "pinned": True, "free": False}[configs],
                            chunk_examples=chunk_examples, warmup=warmup, structural_shrink=structural_shrink,
                            baseline=baseline, **_sanitize_config(sanitize))
    if not str(sanitize).startswith("auto") and sanitize != 0.0 and not any(t.device == "cuda" for t in chosen):
        say("--sanitize: no target runs on CUDA here, so no example is sanitized (compute-sanitizer checks GPU "
            "kernels; the Triton interpreter has no bounds checks)", highlight=False)
    sizes = _tier_sizes(chosen, config)
    if triton_cache:
        os.environ["TRITON_CACHE_DIR"] = str(Path(triton_cache).resolve())  # the workers inherit it
    from kvfuzz.fuzz.campaign.config import CrashPolicy

    policy = CrashPolicy(example_timeout=example_timeout, max_crashes=max_crashes)
    sys.exit(_campaign(chosen, specs, config, sizes, policy, workers=workers, threads=threads, mps_mode=mps_mode,
                       observe=observability))


def _limits(max_num_seqs: int, max_ctx_len: int, max_query_len: int) -> Limits:
    """The small tier's bounds; exit 2 when its largest batch would hold more than MAX_BATCH_TOKENS tokens."""
    limits = Limits(max_num_seqs=max_num_seqs, max_ctx_len=max_ctx_len, max_query_len=max_query_len)
    if limits.batch_tokens > MAX_BATCH_TOKENS:
        raise click.UsageError(f"--max-num-seqs {max_num_seqs} x (--max-ctx-len {max_ctx_len} + --max-query-len "
                               f"{max_query_len}) = {limits.batch_tokens:,} tokens in the largest batch; at most "
                               f"{MAX_BATCH_TOKENS:,} (lower one of them)")
    return limits


def _check_environment() -> None:
    """Exit 2 naming the variable when one of the campaign's environment settings (KVFUZZ_FOCUS_SECONDS,
    KVFUZZ_FREE_SECONDS, KVFUZZ_CHUNK_CLOCK, KVFUZZ_SANITIZE_STANDBY) holds a value it does not take, before any
    worker starts."""
    from kvfuzz.fuzz.campaign.chunks import chunk_clock, focus_chunk_seconds, free_chunk_seconds
    from kvfuzz.fuzz.harness.sanitizer_standby import standby_mode

    for check in (focus_chunk_seconds, free_chunk_seconds, chunk_clock, standby_mode):
        try:
            check()
        except ValueError as e:
            raise click.UsageError(str(e)) from None


def _check_big_cache(chosen, big_cache: bool, tiers) -> None:
    if not big_cache:
        return
    writers = [t.name for t in chosen if not t.capabilities.contract.is_attention]
    if writers:
        raise click.UsageError(f"--big-cache fuzzes attention kernels; leave out {', '.join(writers)}")
    if set(tiers) - {"big-cache"}:
        raise click.UsageError("--big-cache is --tier big-cache; leave out the other --tier values or --big-cache")


def _tier_sizes(chosen, config) -> dict[str, tuple[str, ...]]:
    """Each target's size tiers (kvfuzz.fuzz.campaign.chunks.campaign_tiers); exit 2 naming --tier otherwise."""
    from kvfuzz.fuzz.campaign.chunks import campaign_tiers

    sizes = {}
    for t in chosen:
        try:
            sizes[t.name] = campaign_tiers(t, config)
        except ValueError as e:
            raise click.BadParameter(f"{e}; choose among those (or leave the target out)", param_hint="--tier")
    return sizes


def _campaign(chosen, specs, config, sizes, policy, *, workers, threads, mps_mode, observe) -> int:
    """Lock --out, open the database, start MPS if asked, run the supervised campaign and finish it; returns the
    exit status."""
    from kvfuzz.fuzz.campaign.store.database import DatabaseError, open_database
    from kvfuzz.fuzz.campaign.store.journal import OutLock, OutLocked, OutOfSpace

    out = config.out
    try:
        lock = OutLock(out).acquire()
    except OutLocked as e:
        console.print(f"[red]cannot start[/]: {escape(str(e))}")
        return EXIT_CANNOT_RUN
    except OutOfSpace as e:
        console.print(f"[red]cannot start[/]: {escape(str(e))}; free some space on the device of {escape(str(out))}")
        return EXIT_CANNOT_RUN
    stack = contextlib.ExitStack()  # what the campaign started and must stop (an MPS daemon)
    try:
        try:
            open_database(config.db_spec, out)  # fail before any worker starts (each worker opens its own)
        except DatabaseError as e:
            console.print(f"[red]cannot start[/]: {escape(str(e))}")
            return EXIT_CANNOT_RUN if "does not answer" in str(e) else EXIT_USAGE
        pool = _pool(chosen, config, stack, workers=workers, threads=threads, mps_mode=mps_mode, observe=observe)
        if pool is None:
            return EXIT_CANNOT_RUN
        for t in chosen:
            fault = config.fault.name if config.fault else None
            say(f"fuzzing {t.name} ({escape(t.availability().reason)}; {t.capabilities.contract.value} contract"
                f"{'; caller fault ' + fault if fault else ''}"
                f"{'; size tiers ' + ', '.join(sizes[t.name]) if sizes[t.name] != ('small',) else ''})")
        say(f"{pool.workers} worker(s){f' on {pool.gpus} GPU(s)' if pool.gpus else ''}; logs in {out / 'workers'}")
        result = _supervise(chosen, specs, config, pool, policy)
        return _finish(result, chosen, config, out)
    finally:
        stack.close()
        lock.release()


def _pool(chosen, config, stack, *, workers, threads, mps_mode, observe):
    """The campaign's WorkerPool: workers capped where more cannot help (said), spread over the GPUs, under MPS
    when asked (its daemon stopped by ``stack``); None when MPS cannot start (said)."""
    from kvfuzz.fuzz.campaign.config import WorkerPool, cap_workers, default_workers, gpu_count, usable_cpus
    from kvfuzz.fuzz.campaign.workers.mps import MpsError, start_mps

    gpus = gpu_count() if any(t.availability().device == "cuda" for t in chosen) else 0
    try:
        mps = start_mps(mps_mode, gpus)
    except MpsError as e:
        console.print(f"[red]cannot start[/]: {escape(str(e))}")
        return None
    stack.callback(mps.stop)
    if mps.note:
        say(escape(mps.note))
    budget = None if config.max_examples >= UNLIMITED else config.max_examples * len(chosen)
    n, capped = cap_workers(workers or default_workers(gpus, mps=mps.active), budget, usable_cpus(), gpus)
    if capped and workers:
        console.print(f"[yellow]--workers {workers} capped at {n}[/]: " + escape("; ".join(capped)))
    if not gpus and n > usable_cpus():
        console.print(f"[yellow]--workers {n} on {usable_cpus()} CPU cores[/]: workers will share cores "
                      "(one per core is the most that helps on CPU)")
    return WorkerPool(workers=n, threads=threads, gpus=gpus, observe=observe)


def _supervise(chosen, specs, config, pool, policy):
    from kvfuzz.fuzz.campaign.workers.supervisor import Supervisor
    from kvfuzz.fuzz.cli.progress import CampaignProgress

    total = None if config.max_examples >= UNLIMITED else config.max_examples
    with CampaignProgress([t.name for t in chosen], total, config.duration) as progress:
        sup = Supervisor(chosen, specs, config, pool=pool, policy=policy,
                         on_event=lambda m: console.print(f"[yellow]{escape(m)}[/]"), on_progress=progress.update)
        return sup.run()


def _finish(result, targets, config, out: Path) -> int:
    """Print and write the summary and the report; returns the exit status."""
    from kvfuzz.fuzz.campaign.chunks import campaign_tiers
    from kvfuzz.fuzz.campaign.stages import time_line
    from kvfuzz.fuzz.campaign.steering import bin_counts, declared_bins
    from kvfuzz.fuzz.campaign.store.journal import disk_full, write_json
    from kvfuzz.fuzz.campaign.store.report import ReportError, write_report
    from kvfuzz.fuzz.cli.summary import print_next_steps, print_summary
    from kvfuzz.fuzz.harness.coverage import declared_space

    by_name = {t.name: t for t in targets}
    results = [s.to_dict() | {"declared": declared_space(by_name[s.target], s.coverage.to_dict()),
                              "bins": bin_counts(declared_bins(by_name[s.target], campaign_tiers(
                                  by_name[s.target], config), config.limits), s.coverage.to_dict())}
               for s in result.targets]
    print_summary(results, config.baseline)
    say(escape(time_line(result.time)))
    new = sum(1 for t in results for f in t["failures"] if not f.get("known") and not f.get("found_before"))
    before = sum(1 for t in results for f in t["failures"] if not f.get("known") and f.get("found_before"))
    known = sum(1 for t in results for f in t["failures"] if f.get("known"))
    # a failure found before in --out is not new, and still there: only a --baseline entry makes it known
    code = EXIT_FAILURE if new or before else (EXIT_CANNOT_RUN if result.problems or result.interrupted else EXIT_OK)
    if result.disk_full:  # the campaign could not run as asked, findings or not (the message lists what was kept)
        code = EXIT_CANNOT_RUN
    if config.baseline is not None:
        console.print(f"baseline {escape(config.baseline.path)}: {known} known finding(s), {new} new")
    if before:
        console.print(f"{before} failure(s) found before: an earlier campaign in {escape(str(out))} wrote their "
                      "reproducers (listed above); not new, and still failing")
    for p in result.problems:
        console.print(f"[red]problem[/]: {escape(p)}")
    for w in result.warnings:
        console.print(f"[yellow]warning[/]: {escape(w)}")
    summary = {"targets": results, "caller_fault": config.fault.name if config.fault else None, "seed": config.seed,
               "workers": result.workers, "worker_restarts": result.restarts, "interrupted": result.interrupted,
               "problems": result.problems, "warnings": result.warnings,
               "examples": sum(t["examples"] for t in results), "lost": sum(t["lost"] for t in results),
               "shrink_runs": sum(t.get("shrink_runs", 0) for t in results),
               "baseline": config.baseline.path if config.baseline is not None else None,
               "new_failures": new, "known_failures": known, "found_before_failures": before, "exit_status": code,
               "time": result.time}
    try:
        write_json(out / "summary.json", summary, fsync=True)
    except OSError as e:
        if not disk_full(e):
            raise
        console.print(f"[red]summary not written[/]: no space left for {escape(str(out / 'summary.json'))} "
                      "(the counts are above)")
        return EXIT_CANNOT_RUN
    console.print(f"summary: {out / 'summary.json'}" + (" (interrupted)" if result.interrupted else ""))
    if result.disk_full:
        console.print("report not written: the disk is full (`kvfuzz report` writes it once there is space)")
        return code
    try:
        console.print(f"report: {write_report(out)}")
    except KeyboardInterrupt as e:  # Ctrl-C or a signal once the campaign is over: summary.json holds its verdict
        console.print(f"[yellow]report not written[/]: interrupted ({escape(interruption(e))}) after the campaign "
                      f"ended; summary.json holds everything (`kvfuzz report {escape(str(out))}` draws it)",
                      highlight=False)
        return code
    except Exception as e:  # a report that cannot be drawn costs nothing found: it is all in summary.json
        why = str(e) if isinstance(e, ReportError) else repr(e)
        console.print(f"[yellow]could not write the report[/]: {escape(why)}")
        if isinstance(e, ReportError) and e.full:  # a full disk: 3, findings or not (docs/cli.md)
            code = summary["exit_status"] = EXIT_CANNOT_RUN
            with contextlib.suppress(OSError):  # summary.json says so too, if the disk takes it
                write_json(out / "summary.json", summary, fsync=True)
    print_next_steps(results)
    return code


__all__ = ["MAX_EXAMPLES", "OPTIONS", "UNLIMITED", "fuzz"]
