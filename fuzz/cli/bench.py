"""``kvfuzz bench``: benchmarks of kvfuzz itself. ``kvfuzz bench detect`` runs kvfuzz and vLLM's test grids
against the mutant zoo (:mod:`kvfuzz.fuzz.bench.detection`); ``kvfuzz bench throughput`` profiles examples/s
(:mod:`kvfuzz.fuzz.bench.throughput`); ``kvfuzz bench curve`` measures examples/s minute by minute over real
campaigns, cold and warm Triton cache (:mod:`kvfuzz.fuzz.bench.curve`); ``kvfuzz bench bugs`` runs default campaigns
on real upstream bugs re-injected into the pinned kernels (:mod:`kvfuzz.fuzz.bench.bugs.benchmark`); ``kvfuzz bench
upstream`` runs the upstream projects' own test files against them (:mod:`kvfuzz.fuzz.bench.bugs.upstream`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kvfuzz.fuzz.cli.common import (
    available_targets,
    console,
    duration_option,
    load_baseline_option,
    parse_duration,
    unique,
    writable_dir_option,
    writable_file_option,
    write_output,
)
from kvfuzz.strategies.limits import Limits


def output_file(flag: str = "--json", what: str = "Write the JSON here."):
    """The option of a file a benchmark writes (``--json``, ``--markdown``, ``--plot``): its folder created or
    refused before the benchmark runs (:func:`~kvfuzz.fuzz.cli.common.writable_file_option`, exit 2); the value
    goes to the parameter ``<name>_path`` (``json_path``, ``markdown_path``, ``plot_path``)."""
    return click.option(flag, f"{flag.lstrip('-')}_path", default=None, type=click.Path(dir_okay=False),
                        callback=writable_file_option, help=what)


def _worker_counts(ctx, param, values):
    """Click callback for ``bench curve --workers``: each a positive integer or 'default' (exit 2 otherwise)."""
    for w in values:
        if w != "default" and not (w.isdigit() and int(w) > 0):
            raise click.BadParameter(f"{w!r}: a positive integer or 'default'")
    return values


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks of kvfuzz itself."""


def _cell(s: dict | None, seeds: int) -> tuple[str, str, str, str]:
    if s is None:
        return ("-", "-", "-", "-")
    found = f"{s['found']}/{s['runs']}"
    if not s["found"]:
        return (f"[red]{found}[/red]", "-", "-", "-")
    from kvfuzz.fuzz.bench.detection import size_str

    return (f"[green]{found}[/green]" if s["found"] == s["runs"] else f"[yellow]{found}[/yellow]",
            f"{s['median_seconds_to_first']:.2f}", f"{s['median_examples_to_first']:g}", size_str(s["median_size"]))


def _of_found(s: dict, field: str) -> str:
    """``n/found`` of a kvfuzz summary's count ``field`` ("-" when nothing was found)."""
    return f"{s[field]}/{s['found']}" if s.get("found") and field in s else "-"


def print_table(doc: dict) -> None:
    from kvfuzz.fuzz.bench.detection import size_str

    seeds = len(doc["settings"]["seeds"])
    t = Table(title=f"kvfuzz bench detect: {len(doc['mutants'])} mutants x {seeds} seeds "
                    f"(kvfuzz: <= {doc['settings']['max_examples']} examples / {doc['settings']['duration_s']} s)")
    for col in ("mutant", "kvfuzz found", "s to 1st", "ex to 1st", "kvfuzz shrunk (median)", "smallest trigger",
                "shrunk = smallest", "kind stable", "grid found", "grid s", "grid cases", "grid failing case"):
        t.add_column(col, overflow="fold")
    for m in doc["mutants"]:
        k = _cell(m["kvfuzz"], seeds)
        g = _cell(m["grid"], seeds)
        t.add_row(m["mutant"].removeprefix("mutant."), *k, size_str(m["smallest_trigger"]),
                  _of_found(m["kvfuzz"], "shrunk_to_smallest_trigger"), _of_found(m["kvfuzz"], "kind_stable"), *g)
    console.print(t)
    if doc["settings"]["grid"]:
        console.print(f"grid misses: {', '.join(doc['grid_missed']) or 'none'}")
    console.print(f"kvfuzz misses: {', '.join(doc['kvfuzz_missed']) or 'none'}; wall {doc['wall_seconds']} s")


@bench.command()
@click.option("--mutant", "mutants", multiple=True,
              help="Mutants to run, by name (mutant.<slug> or <slug>; default: all of kvfuzz.fuzz.bench.mutants).")
@click.option("--seeds", default=5, show_default=True, type=click.IntRange(min=1), help="Seeds 0..N-1 per mutant.")
@click.option("--max-examples", default=200, show_default=True, type=click.IntRange(min=1),
              help="kvfuzz example budget per mutant and seed.")
@click.option("--duration", default="20s", show_default=True, callback=duration_option,
              help="kvfuzz time budget per mutant and seed.")
@click.option("--no-grid", is_flag=True, help="Skip the vLLM test-grid baseline.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Processes (each with one torch thread) running (mutant, seed) pairs.")
@output_file()
@output_file("--markdown", "Write the results table as Markdown here.")
@click.option("--configs", type=click.Choice(["auto", "pinned", "free"]), default="auto", show_default=True,
              help="As kvfuzz fuzz --configs: chunks pinned to one kernel configuration (auto: on CUDA).")
def detect(mutants, seeds, max_examples, duration, no_grid, jobs, json_path, markdown_path, configs) -> None:
    """How fast kvfuzz finds each mutant kernel, next to vLLM's parametrized test grids."""
    from kvfuzz.fuzz.bench.detection import detect as run_detect
    from kvfuzz.fuzz.bench.mutants import MUTANTS

    names = _bug_names(mutants, MUTANTS, "unknown mutant(s)", prefix="mutant.", option="--mutant")

    def show(r: dict) -> None:
        what = (f"found in {r['seconds_to_first']} s / {r['examples_to_first']} examples" if r["found"]
                else f"not found ({r['examples_total']} examples, {r['seconds_total']} s)")
        console.print(f"  {r['tool']:6} {r['mutant']} seed {r['seed']}: {what}", highlight=False)

    doc = run_detect(names or None, seeds, max_examples, parse_duration(duration), not no_grid, Limits(),
                     jobs, on_result=show, pin_configs={"auto": None, "pinned": True, "free": False}[configs])
    print_table(doc)
    if json_path:
        _save_json(json_path, doc)
    if markdown_path:
        write_output(markdown_path, markdown_table(doc), "--markdown")
        console.print(f"Markdown: {markdown_path}")


def markdown_table(doc: dict) -> str:
    """The detect results as a Markdown table (median time and examples to the first failure over the seeds
    that found the mutant; median shrunk size next to the smallest trigger; how many seeds shrank to it and
    kept one failure kind over reruns)."""
    from kvfuzz.fuzz.bench.detection import size_str

    rows = ["| mutant | kvfuzz found | s to 1st | examples to 1st | kvfuzz shrunk (median) | smallest trigger | "
            "shrunk = smallest | kind stable | grid found | grid s | grid cases |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in doc["mutants"]:
        k, g = m["kvfuzz"], m.get("grid") or {}

        def found(x):
            return f"{x['found']}/{x['runs']}" if x else "-"
        rows.append(f"| {m['mutant'].removeprefix('mutant.')} | {found(k)} | "
                    f"{k.get('median_seconds_to_first') or '-'} | "
                    f"{k.get('median_examples_to_first') or '-'} | {size_str(k.get('median_size'))} | "
                    f"{size_str(m['smallest_trigger'])} | {_of_found(k, 'shrunk_to_smallest_trigger')} | "
                    f"{_of_found(k, 'kind_stable')} | {found(g)} | {g.get('median_seconds_to_first') or '-'} | "
                    f"{g.get('median_examples_to_first') or '-'} |")
    grid = f"Grid misses: {', '.join(doc['grid_missed']) or 'none'}. " if doc["settings"]["grid"] else ""
    rows += ["", f"{grid}kvfuzz misses: {', '.join(doc['kvfuzz_missed']) or 'none'}. "
                 f"Wall time {doc['wall_seconds']} s.", ""]
    return "\n".join(rows)


@bench.command()
@click.option("--target", "target_names", multiple=True, help="Targets (default: every one available here).")
@click.option("--examples", "n", default=30, show_default=True, type=click.IntRange(min=1),
              help="Generated examples per target for the stage profile.")
@click.option("--no-scaling", is_flag=True, help="Skip the sweeps over total tokens and num_blocks.")
@output_file()
def throughput(target_names, n, no_scaling, json_path) -> None:
    """Examples/s per target, split into generation, materialization, caller checks, kernel, reference and
    output checks; harness overhead; materialization GB/s; time per example vs tokens and num_blocks."""
    import platform

    import torch

    from kvfuzz.fuzz.bench.throughput import STAGES, scaling, stage_profile

    torch.set_num_threads(1)
    targets = available_targets(target_names)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'})"
    doc = {"device": device, "torch": torch.__version__, "profiles": [], "scaling": []}
    table = Table(title=f"kvfuzz bench throughput on {device}")
    for col in ("target", "ex/s", *STAGES, "harness overhead", "materialize GB/s"):
        table.add_column(col)
    for t in targets:
        p = stage_profile(t, n)
        doc["profiles"].append(p)
        total = sum(p["stages_s"].values()) or 1.0
        table.add_row(t.name, f"{p['examples_per_s']:.2f}",
                      *(f"{100 * p['stages_s'][k] / total:.0f}%" for k in STAGES),
                      f"{100 * p['harness_overhead']:.0f}%", f"{p['materialize_gb_per_s']}")
        if not no_scaling:
            fast = t.device == "cuda" or "cpu" in t.name or "flex" in t.name  # not Triton's interpreter
            doc["scaling"].append(scaling(t, token_counts=(64, 256, 1024) if fast else (32, 128),
                                          block_counts=(64, 4096, 65536) if t.device == "cuda" else (64, 1024, 8192)))
    console.print(table)
    for s in doc["scaling"]:
        console.print(f"[bold]{s['target']}[/] seconds/example by total tokens: "
                      + ", ".join(f"{k}: {v['seconds']}" for k, v in s["by_total_tokens"].items())
                      + "; by num_blocks: " + ", ".join(f"{k}: {v['seconds']} (materialize {v['materialize_s']})"
                                                        for k, v in s["by_num_blocks"].items()))
    if json_path:
        _save_json(json_path, doc)


@bench.command()
@click.option("--target", "target_names", multiple=True,
              help="Targets (default: the compiled Triton targets available here).")
@click.option("--duration", default="10m", show_default=True, callback=duration_option, help="Length of each campaign.")
@click.option("--workers", "worker_counts", multiple=True, default=("1", "default"), show_default=True,
              callback=_worker_counts,
              help="Worker counts to run (repeatable; 'default' is kvfuzz fuzz's default).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(min=0.5),
              help="Seconds between samples of status.json and the Triton cache.")
@click.option("--dir", "root", default=None, type=click.Path(file_okay=False), callback=writable_dir_option,
              help="Keep each campaign's --out and Triton cache here (default: a temporary directory).")
@output_file()
@output_file("--plot", "Write a PNG plot here.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["warm", "warm-capped"]),
              help="Runs after the cold one (repeatable; default: warm). warm: the cache the cold run left; "
                   "warm-capped: the same, capped at the cold run's example count, so it stays within the "
                   "configurations the cold run compiled (the rate of a warm cache without compiles).")
@click.option("--cold-only", is_flag=True, help="Only the cold run (no --mode): e.g. a long cold campaign.")
@click.argument("fuzz_args", nargs=-1, type=click.UNPROCESSED)
def curve(target_names, duration, worker_counts, seed, interval, root, json_path, plot_path, modes, cold_only,
          fuzz_args) -> None:
    """Examples/s minute by minute over real campaigns: per target, a cold Triton cache then a warm one, for
    each worker count. Arguments after -- go to kvfuzz fuzz (e.g. -- --poison stale)."""
    from kvfuzz.fuzz.bench.curve import curve as run_curve
    from kvfuzz.fuzz.bench.curve import plot
    from kvfuzz.fuzz.targets import BUILTIN, get_target

    if cold_only and modes:
        raise click.UsageError("--cold-only runs no --mode: give one or the other")
    names = list(unique(target_names, "--target")) or [n for n in BUILTIN if get_target(n).device == "cuda"
                                   and get_target(n).capabilities.contract.is_attention]
    for name in target_names:
        try:
            get_target(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--target") from None
    if not names:
        raise click.UsageError("no compiled target is available here (the curve measures GPU campaigns); name "
                               "targets with --target to run it anyway")
    counts = [None if w == "default" else int(w) for w in unique(worker_counts, "--workers")]  # _worker_counts
    modes = unique(modes, "--mode")

    def show(r: dict) -> None:
        pm = " ".join(f"{p['examples_per_s']:g}" for p in r["per_minute"])
        console.print(f"{r['target']} {r['mode']} workers={r['workers']}: {r['examples']} examples, "
                      f"{r['examples_per_s']} ex/s, {r['compiled']} kernels compiled, exit {r['exit_status']}; "
                      f"per minute: {pm}", highlight=False)

    def save(doc: dict) -> None:  # after every run: a benchmark cut short keeps what it measured
        if json_path:
            _save_json(json_path, doc, quiet=True)

    doc = run_curve(names, parse_duration(duration), counts, seed, interval,
                    Path(root) if root else None, tuple(fuzz_args), on_run=show, on_doc=save,
                    modes=("cold",) if cold_only else ("cold", *(modes or ("warm",))))
    if json_path:
        console.print(f"JSON: {json_path}")
    if plot_path:
        from kvfuzz.fuzz.campaign.store.journal import disk_full

        try:
            console.print(f"plot: {plot(doc, Path(plot_path))}")
        except OSError as e:  # the JSON (written after every run) holds what the plot would show
            console.print(f"[red]cannot write[/] --plot {escape(plot_path)}: {escape(e.strerror or str(e))}")
            sys.exit(3 if disk_full(e) else 2)


def _save_json(json_path: str, doc: dict, quiet: bool = False) -> None:
    """Write a benchmark's JSON document to ``json_path`` atomically (kvfuzz.fuzz.campaign.store.journal.write_json;
    the folder created), and say where unless ``quiet``."""
    write_output(json_path, doc, "--json")
    if not quiet:
        console.print(f"JSON: {json_path}")


def _bug_names(given: tuple[str, ...], known, unknown_says: str, prefix: str = "bug.",
               option: str = "--bug") -> list[str]:
    """``option``'s values as registered names (``<prefix><slug>``; a bare slug gets the prefix: ``bug.``,
    ``live.``, ``mutant.``). Raises BadParameter naming ``option`` for a name not in ``known``: "``unknown_says``
    NAMES; known: ..."."""
    names = list(unique([b if b.startswith(prefix) else f"{prefix}{b}" for b in given], option))
    unknown = [b for b in names if b not in known]
    if unknown:
        raise click.BadParameter(f"{unknown_says} {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                                 param_hint=option)
    return names


def _check_patches(names) -> None:
    """Refuse (UsageError, exit 2) when a bug's re-injection no longer applies to the installed source."""
    from kvfuzz.fuzz.bench.bugs import BUGS, PatchDoesNotApply

    for name in names:
        try:
            BUGS[name].check_applies()
        except (PatchDoesNotApply, FileNotFoundError) as e:
            raise click.UsageError(str(e)) from None


@bench.command()
@click.option("--bug", "bugs", multiple=True,
              help="Bugs to run, by name (bug.<slug> or <slug>; default: every one this machine can reach, see "
                   "kvfuzz.fuzz.bench.bugs).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(min=1), help="Seeds 0..N-1 per bug.")
@click.option("--first-seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Start the seeds here: seeds S..S+N-1 (one seed per process, for concurrent runs).")
@click.option("--duration", default="120s", show_default=True, callback=duration_option,
              help="Campaign time budget per bug and seed.")
@click.option("--max-examples", default=100_000, show_default=True, type=click.IntRange(min=1),
              help="Campaign example budget per bug and seed.")
@output_file()
@click.option("--live", is_flag=True,
              help="The live upstream bugs instead (open in the pinned versions; kvfuzz.fuzz.bench.bugs.live): a "
                   "plain campaign of each one's unpatched target; --bug takes live.<slug> or <slug>.")
@click.option("--baseline", "baseline_file", default=None, type=click.Path(dir_okay=False),
              help="A findings baseline (e.g. kvfuzz-baseline.toml): a known finding, such as a live upstream bug in "
                   "the same kernel, neither ends a campaign nor counts as the re-injected bug found. Not with --live "
                   "(the baseline lists the live bugs).")
def bugs(bugs, seeds, first_seed, duration, max_examples, json_path, live, baseline_file) -> None:
    """Real upstream bugs re-injected into the pinned kernels (fuzz/bench/bugs/patches/): time and examples to
    the first failure of a default campaign, its kind and blame, the shrunk batch against the smallest trigger,
    and whether the reproducer replays. With --live, the bugs still open upstream (docs/bugs.md)."""
    from kvfuzz.fuzz.bench.bugs import BUGS
    from kvfuzz.fuzz.bench.bugs.benchmark import bench_bugs

    if live:
        if first_seed:
            raise click.BadParameter("--live runs seeds 0..N-1; leave --first-seed out", param_hint="--first-seed")
        if baseline_file is not None:
            raise click.BadParameter("--live fuzzes the bugs a baseline lists as known; leave --baseline out",
                                     param_hint="--baseline")
        return _live_bugs(bugs, seeds, duration, max_examples, json_path)
    names = _bug_names(bugs, BUGS, "unknown bug(s)")
    seconds = parse_duration(duration)
    load_baseline_option(baseline_file)  # a bad file: exit 2 naming the file, the field and the fix
    _check_patches(names or list(BUGS))
    doc = bench_bugs(names or None, seeds, seconds, max_examples, on_result=_bug_progress(live=False),
                     first_seed=first_seed, baseline=baseline_file)
    _bug_report(doc, f"kvfuzz bench bugs on {doc['settings']['machine']} ({seeds} seeds, <= {duration} each)",
                live=False, json_path=json_path)


def _live_bugs(bugs, seeds, duration, max_examples, json_path) -> None:
    """``kvfuzz bench bugs --live``: :func:`kvfuzz.fuzz.bench.bugs.live.bench_live` and its table."""
    from kvfuzz.fuzz.bench.bugs.live import LIVE, bench_live

    given = _bug_names(bugs, LIVE, "unknown live bug(s)", prefix="live.")
    doc = bench_live(given or None, seeds, parse_duration(duration), max_examples, on_result=_bug_progress(live=True))
    _bug_report(doc, f"kvfuzz bench bugs --live on {doc['settings']['machine']} ({seeds} seeds, <= {duration} each)",
                live=True, json_path=json_path)


def _bug_progress(live: bool):
    """The line ``kvfuzz bench bugs`` prints as each campaign ends (``on_result`` of
    :func:`~kvfuzz.fuzz.bench.bugs.benchmark.bench_bugs` and :func:`~kvfuzz.fuzz.bench.bugs.live.bench_live`): a
    live bug's names the failed check, a re-injected bug's whether the reproducer replays, and (``--baseline``) the
    known findings the campaign met and let pass."""
    from kvfuzz.fuzz.bench.detection import size_str

    def show(r: dict) -> None:
        if r["found"]:
            check, replays = (f": {r['check']}", "") if live else ("", f", replays: {r['replays']}")
            what = (f"found in {r['seconds_to_first']} s / {r['examples_to_first']} examples, {r['kind']} "
                    f"({r['blame']}){check}, shrunk to {size_str(r['size'])}{replays}")
        else:
            what = f"not found ({r['examples_total']} examples, {r['seconds_total']} s)"
        known = f"; known, passed: {', '.join(r['known_hits'])}" if r.get("known_hits") else ""
        console.print(f"  {r['bug']} seed {r['seed']}: {what}{known}", highlight=False)

    return show


def _bug_report(doc: dict, title: str, live: bool, json_path: str | None) -> None:
    """The table of ``kvfuzz bench bugs`` (``live``: ``--live``, with each bug's target and without the replayed
    column), the bugs skipped and why, and the JSON written to ``json_path`` (None: not written)."""
    from kvfuzz.fuzz.bench.detection import size_str

    t = Table(title=title)
    middle = ("found", "s to 1st", "ex to 1st", "kind", "shrunk", "smallest trigger")
    for col in ("bug", "target", *middle) if live else ("bug", *middle, "replayed"):
        t.add_column(col, overflow="fold")
    for e in doc["bugs"]:
        s, smallest = e.get("summary"), size_str(e["smallest_trigger"])
        if s is None:
            cells = ["skipped", "-", "-", "-", "-", smallest]
            replayed = "-"
        else:
            cells = [f"{s['found']}/{s['runs']}", str(s.get("median_seconds_to_first", "-")),
                     str(s.get("median_examples_to_first", "-")), "; ".join(s.get("kinds", [])) or "-",
                     size_str(s["shrunk"][0]) if s.get("shrunk") else "-", smallest]
            replayed = f"{s['replayed']}/{s['found']}" if s["found"] else "-"
        t.add_row(*((e["bug"], e["target"], *cells) if live else (e["bug"], *cells, replayed)))
    console.print(t)
    for e in doc["bugs"]:
        if "skipped" in e:
            console.print(f"{e['bug']} skipped: {e['skipped']}", highlight=False)
    if json_path:
        _save_json(json_path, doc)


@bench.command()
@click.option("--tree", required=True, type=click.Path(exists=True, file_okay=False),
              help="The upstream source tree holding the test files (`make upstream-tests` unpacks vLLM 0.33.0's "
                   "into .upstream/vllm-0.33.0).")
@click.option("--bug", "bugs", multiple=True,
              help="Bugs to run, by name (bug.<slug> or <slug>; default: every one with an upstream test file).")
@click.option("--workers", default=8, show_default=True, type=click.IntRange(min=0),
              help="pytest-xdist workers per run (0: none).")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds each pytest run may take.")
@output_file()
def upstream(tree, bugs, workers, timeout, json_path) -> None:
    """The anchor column of `kvfuzz bench bugs`: each bug's upstream test file (its kernel's own tests, from the
    pinned release) run plainly and with the bug re-injected (the pytest plugin kvfuzz.fuzz.bench.bugs.upstream
    swaps the kernel before the file imports it). Does the project's own suite fail on the bug? Needs CUDA: the
    upstream files make their tensors on the GPU. Exit 0 once every run finished (whatever the suites found), 1
    when a run timed out or a plain run failed (the table would not be about the bug)."""
    from kvfuzz.fuzz.bench.bugs.benchmark import machine
    from kvfuzz.fuzz.bench.bugs.upstream import UPSTREAM_TESTS, run_upstream

    names = _bug_names(bugs, UPSTREAM_TESTS, "no upstream test for") or list(UPSTREAM_TESTS)
    for name in names:
        t = UPSTREAM_TESTS[name]
        if t.file is not None and not (Path(tree) / t.file).exists():
            raise click.BadParameter(f"{Path(tree) / t.file} is missing (run `make upstream-tests`, or name the "
                                     "vLLM 0.33.0 source tree)", param_hint="--tree")
    _check_patches(names)
    results, trouble = [], False
    for name in names:
        r = run_upstream(name, Path(tree), workers, timeout)
        results.append(r)
        if r["plain"] is None:
            console.print(f"{name}: not run: {r['reading']}", highlight=False)
            continue
        bad = [k for k in ("plain", "reinjected") if r[k].get("timed_out") or "failed_ids" not in r[k]]
        trouble |= bool(bad) or r["plain"].get("failed", 0) > 0
        console.print(f"{name}: {r['file']} -k {r['select']!r}: plain {r['plain'].get('passed')}/"
                      f"{r['plain'].get('tests')} passed; re-injected {r['reinjected'].get('failed')} failed "
                      f"(injected: {r['reinjected'].get('injected')}); fails: {r['fails']}, outside the fix's own "
                      f"tests: {r['fails_without_regression']}", highlight=False)
    doc = {"settings": {"machine": machine(), "tree": str(tree), "workers": workers, "timeout_s": timeout},
           "bugs": results}
    if json_path:
        _save_json(json_path, doc)
    sys.exit(1 if trouble else 0)


__all__ = ["bench"]
