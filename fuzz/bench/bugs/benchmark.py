"""``kvfuzz bench bugs``: would a default kvfuzz campaign have caught the re-injected upstream bugs?

For each bug of :data:`~kvfuzz.fuzz.bench.bugs.BUGS` and each seed, one default campaign
(:func:`~kvfuzz.fuzz.campaign.engine.fuzz_target`, an in-memory example database, default strategy limits, all
poisons; ``--big-cache`` for a bug that needs it) on the ``bug.<slug>`` target, stopped after its first distinct
failure is shrunk or at the budget. Recorded per run: found or not, seconds and examples to the first failing
example (before shrinking) and to the shrunk report, the failure's kind, blame and check, the shrunk batch (its
sizes, :func:`~kvfuzz.fuzz.bench.paged_torch.batch_size`, and summary) next to the bug's hand-built smallest
trigger, whether the reproducer the campaign wrote replays (:func:`~kvfuzz.fuzz.campaign.workers.replay.replay_here`
in this process: the same finding again) and the kind of three reruns of the shrunk example.

A bug that needs ``--big-cache`` (its trigger crashes the process) runs as ``kvfuzz fuzz --big-cache`` in a child
process (the supervisor survives the crash; one worker, stopped at the first crash), read back from its
summary.json; its reproducer is replayed in a child (:func:`~kvfuzz.fuzz.campaign.workers.replay.replay`).

A bug whose trigger this machine cannot reach (``Bug.cpu`` False on a CPU: a multi-GiB cache under Triton's
interpreter) is listed with ``skipped`` and the reason, unless named explicitly. A bug this machine cannot run at
all (:meth:`~kvfuzz.fuzz.bench.bugs.Bug.unreachable`: FlashInfer's without CUDA or flashinfer) is listed with
``skipped`` and the reason, named or not.

A package bug (FlashInfer's: a patched copy of the package imported as ``flashinfer``, one per process) runs in
this process when it is the only one asked for and no other flashinfer is imported here; otherwise each runs as
``kvfuzz bench bugs --bug NAME`` in a child process, whose JSON entry is taken as is.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from hypothesis.database import InMemoryExampleDatabase

from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.bench.bugs import BUGS, Bug, get_bug, smallest_trigger
from kvfuzz.fuzz.bench.bugs.package_copy import MARK
from kvfuzz.fuzz.bench.detection import rerun_kinds
from kvfuzz.fuzz.bench.paged_torch import batch_size
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.campaign.store.cases import load_case
from kvfuzz.fuzz.campaign.workers.replay import replay, replay_here
from kvfuzz.fuzz.harness.sanitizer import AUTO_TIME_SHARE
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import SIZE_FIELDS, size_key


def machine() -> str:
    """The machine in words: the GPU's name, or the CPU's model and core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model}, {os.cpu_count()} cores"


def _result(name: str, seed: int) -> dict:
    """One run's result record, as it stands before the campaign finds anything (module docstring: the fields)."""
    return {"bug": name, "seed": seed, "found": False, "big_cache": BUGS[name].big_cache, "examples_total": 0,
            "seconds_total": None, "seconds_to_first": None, "examples_to_first": None, "seconds_to_shrunk": None,
            "kind": None, "blame": None, "check": None, "size": None, "case": None, "poison": None,
            "replays": None, "replay_message": None, "rerun_kinds": None}


def _found(out: dict, example: dict, kind: str, blame: str, check: str, seconds_to_first: float | None,
           examples_to_first: int | None, seconds_to_shrunk: float) -> Example:
    """Record in ``out`` the run's finding (the smallest failing example, as a dict, and its verdict) and its
    times; returns the example."""
    ex = Example.from_dict(example)
    out.update(found=True, seconds_to_first=seconds_to_first, examples_to_first=examples_to_first,
               seconds_to_shrunk=seconds_to_shrunk, kind=kind, blame=blame, check=check,
               size=batch_size(ex.batch), case=ex.batch.summary(), poison=ex.poison.value)
    return ex


#: ``kvfuzz fuzz``'s defaults a benchmark campaign (in one process) takes too: every size tier the target declares
#: on CUDA (the small tier on CPU) and the memory-safety oracle's time share on CUDA (``--tier auto``,
#: ``--sanitize auto``); ``CampaignConfig``'s own defaults are the small tier and no sanitizer.
DEFAULTS = {"tiers": ("auto",), "sanitize_time_share": AUTO_TIME_SHARE}


def _load(baseline: str | None, bug: Bug | None = None, target: str | None = None):
    """The baseline file loaded (None without one); raises BaselineError naming the file, field and fix. With
    ``bug`` and its target's name ``target``: the entries of the bug's base target apply to ``target`` too
    (``Baseline.retarget``: the re-injected kernel still holds its base kernel's live upstream bugs, e.g.
    vllm#56862 under ``bug.vllm-30887``)."""
    if baseline is None:
        return None
    from kvfuzz.fuzz.campaign.store.baseline import load_baseline

    loaded = load_baseline(baseline)
    return loaded if bug is None else loaded.retarget(bug.base.name, target or bug.name)


def ended_how(stats) -> dict:
    """What a run's counts say about how it ended besides its failures: examples skipped for device memory, lost
    ones, and why the campaign stopped early ("" when it did not)."""
    return {"skipped_memory": stats.skipped_memory, "lost": stats.lost, "stopped": stats.stopped}


def run_bug(name: str, seed: int, duration: float | None = 120.0, max_examples: int = 100_000,
            limits: Limits = Limits(), target=None, baseline: str | None = None) -> dict:
    """One default campaign of seed ``seed`` on bug ``name``; returns the run's result dict (module docstring).
    ``target``: the bug's target to use (default :func:`~kvfuzz.fuzz.bench.bugs.get_bug`'s; e.g. one whose
    declaration is narrowed to the configuration the bug lives in). ``baseline``: a findings baseline file; its
    known findings (a live upstream bug in the same kernel) neither end the campaign nor count as the bug found.
    Raises BaselineError for a bad baseline file."""
    bug = BUGS[name]
    target = target if target is not None else get_bug(name)
    start = time.monotonic()
    out = _result(name, seed)
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bugs-") as d:
        config = CampaignConfig(out=Path(d), max_examples=max_examples, duration=duration, seed=seed,
                                limits=limits, database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                big_cache=bug.big_cache, baseline=_load(baseline, bug, target.name), **DEFAULTS)
        stats = fuzz_target(target, config)
        elapsed = time.monotonic() - start
        out.update(examples_total=stats.examples, seconds_total=round(elapsed, 3), **ended_how(stats),
                   known_hits=sorted({r.known for r in stats.failures.values() if r.known}))
        if stats.new_failures:
            rec = min(stats.new_failures, key=lambda r: size_key(Example.from_dict(r.example).batch))
            example = _found(out, rec.example, rec.kind, rec.blame, rec.check,
                             round(stats.first_new_failure_s or elapsed, 3), stats.first_new_failure_examples,
                             round(elapsed, 3))
            out.update(rerun_kinds=rerun_kinds(target, example))
            if rec.reproducer:
                r = replay_here(load_case(rec.reproducer), target)
                out.update(replays=r.reproduced, replay_message=r.message)
    return out


def run_bug_supervised(name: str, seed: int, duration: float | None = 120.0, max_examples: int = 100_000,
                       limits: Limits = Limits(), baseline: str | None = None) -> dict:
    """As :func:`run_bug`, through ``kvfuzz fuzz --big-cache`` in a child process (a bug whose trigger crashes
    the process: the supervisor records the crash and its reproducer); ``baseline`` passed as ``--baseline``."""
    bug = BUGS[name]
    start = time.monotonic()
    out = _result(name, seed)
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bugs-") as d:
        cmd = [sys.executable, "-m", "kvfuzz.fuzz.cli", "fuzz", "--target", bug.spec, "--seed", str(seed),
               "--out", d, "--workers", "1", "--max-crashes", "1", "--max-examples", str(max_examples),
               "--max-num-seqs", str(limits.max_num_seqs), "--max-ctx-len", str(limits.max_ctx_len),
               "--max-query-len", str(limits.max_query_len)]
        if duration is not None:
            cmd += ["--duration", f"{duration}s"]
        if bug.big_cache:
            cmd.append("--big-cache")
        if baseline is not None:  # the child's target is the bug's: its base target's entries re-targeted
            retargeted = Path(d) / "baseline.toml"
            retargeted.write_text("\n".join(e.to_toml() for e in _load(baseline, bug).entries), encoding="utf-8")
            cmd += ["--baseline", str(retargeted)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        summary = Path(d) / "summary.json"
        if not summary.exists():
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode} without a summary: {p.stderr[-2000:]}")
        doc = json.loads(summary.read_text())
        (t,) = doc["targets"]
        new = [f for f in t["failures"] if not f.get("known")]
        out.update(examples_total=t["examples"], seconds_total=round(time.monotonic() - start, 3),
                   known_hits=sorted({f["known"] for f in t["failures"] if f.get("known")}))
        if new:
            rec = min(new, key=lambda f: size_key(Example.from_dict(f["example"]).batch))
            _found(out, rec["example"], rec["kind"], rec["blame"], rec["check"], t.get("first_new_failure_s"),
                   t.get("first_new_failure_examples"), t["elapsed_s"])
            if rec.get("reproducer"):
                r = replay(rec["reproducer"], target_spec=bug.spec)
                out.update(replays=r.reproduced, replay_message=r.message)
    return out


def _key(size: dict) -> tuple:
    return tuple(size[f] for f in SIZE_FIELDS)


def summarize(name: str, runs: list[dict]) -> dict:
    """Found count, median seconds/examples to the first failure over the seeds that found it, the shrunk
    sizes against the smallest trigger, and how many reproducers replayed."""
    import statistics

    found = [r for r in runs if r["found"]]
    out = {"runs": len(runs), "found": len(found)}
    if found:
        smallest = _key(batch_size(smallest_trigger(name)))
        out.update(median_seconds_to_first=round(statistics.median(r["seconds_to_first"] for r in found), 3),
                   median_examples_to_first=statistics.median(r["examples_to_first"] or 0 for r in found),
                   shrunk_to_smallest_trigger=sum(_key(r["size"]) <= smallest for r in found),
                   replayed=sum(bool(r["replays"]) for r in found),
                   kinds=sorted({f"{r['kind']} ({r['blame']}): {r['check']}" for r in found}),
                   shrunk=[r["size"] for r in found])
    return out


def in_own_process(names: list[str]) -> list[str]:
    """The package bugs of ``names`` that must run in a child process: all of them when there are several (one
    patched ``flashinfer`` per process), or when this process already imported flashinfer from elsewhere."""
    package = [n for n in names if BUGS[n].package is not None]
    if len(package) == 1:
        (name,) = package
        bug = BUGS[name]
        loaded = sys.modules.get(bug.package)
        if loaded is None or getattr(loaded, MARK, "").startswith(f"{bug.slug} "):
            return []
    return package


def run_bug_child(name: str, seeds: list[int], duration: float | None, max_examples: int,
                  baseline: str | None = None) -> dict:
    """Bug ``name``'s entry of ``kvfuzz bench bugs --bug NAME`` run in a child process for ``seeds`` (consecutive)
    (a package bug beside others, :func:`in_own_process`), with ``--baseline`` when given. Raises RuntimeError
    with the child's stderr when it writes no JSON."""
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bugs-") as d:
        out = Path(d) / "bug.json"
        cmd = [sys.executable, "-m", "kvfuzz.fuzz.cli", "bench", "bugs", "--bug", name, "--seeds", str(len(seeds)),
               "--first-seed", str(seeds[0]), "--max-examples", str(max_examples), "--json", str(out)]
        if duration is not None:
            cmd += ["--duration", f"{duration}s"]
        if baseline is not None:  # the child's bench bugs re-targets it (run_bug)
            cmd += ["--baseline", str(baseline)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode} without its JSON: {p.stderr[-2000:]}")
        (entry,) = json.loads(out.read_text())["bugs"]
        return entry


def bench_bugs(names: list[str] | None = None, seeds: int = 3, duration: float | None = 120.0,
               max_examples: int = 100_000, limits: Limits = Limits(),
               on_result: Callable[[dict], None] = lambda r: None, first_seed: int = 0,
               baseline: str | None = None) -> dict:
    """Run every bug (``names``, default: all, skipping those this machine cannot reach) for seeds
    ``first_seed .. first_seed + seeds - 1``; returns the JSON document. ``baseline``: a findings baseline file
    (e.g. the shipped kvfuzz-baseline.toml) whose known findings do not count as a bug found (:func:`run_bug`).
    Raises KeyError for an unknown bug name, ValueError for ``limits`` other than the default with package bugs
    that run in child processes, BaselineError for a bad baseline file."""
    explicit = names is not None
    names = list(names or BUGS)
    for n in names:
        if n not in BUGS:
            raise KeyError(f"unknown bug {n!r}; known: {', '.join(sorted(BUGS))}")
    _load(baseline)  # a bad file fails before any campaign
    started = time.time()
    on_gpu = torch.cuda.is_available()
    seed_list = list(range(first_seed, first_seed + seeds))
    children = [n for n in in_own_process(names) if BUGS[n].unreachable() is None]
    if children and limits != Limits():
        raise ValueError(f"limits other than the default cannot reach {', '.join(children)} (run in child "
                         "processes): run each package bug alone")
    results = []
    for name in names:
        bug = BUGS[name]
        entry = {"bug": name, "upstream": bug.upstream, "patch": f"fuzz/bench/bugs/patches/{bug.slug}.patch",
                 "patched_module": bug.patched_module, "base_target": bug.base.name, "trigger": bug.trigger,
                 "smallest_trigger": batch_size(bug.smallest()), "smallest_trigger_case": bug.smallest().summary(),
                 "smallest_trigger_query_scale": bug.scale_query, "big_cache": bug.big_cache,
                 "why_default_misses": bug.why_missed}
        if bug.package is not None:
            entry["patched_files"] = [p.path for p in bug.patches()]
        why = bug.unreachable()
        if why is None and not (bug.cpu or on_gpu or explicit):
            why = bug.why_missed
        if why is not None:
            entry.update(skipped=f"not reachable on this machine: {why}", runs=[], summary=None)
            results.append(entry)
            continue
        if name in children:
            child = run_bug_child(name, seed_list, duration, max_examples, baseline)
            for r in child["runs"]:
                on_result(r)
            entry.update({k: child[k] for k in ("summary", "runs") if k in child})
            if "skipped" in child:
                entry["skipped"] = child["skipped"]
            results.append(entry)
            continue
        runs = []
        for seed in seed_list:
            run = run_bug_supervised if bug.big_cache else run_bug
            r = run(name, seed, duration, max_examples, limits, baseline=baseline)
            on_result(r)
            runs.append(r)
        entry.update(summary=summarize(name, runs), runs=runs)
        results.append(entry)
    import importlib.metadata as md

    def version(p: str) -> str | None:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {"settings": {"seeds": seed_list, "duration_s": duration, "max_examples": max_examples,
                         "baseline": None if baseline is None else str(baseline),
                         "machine": machine(), "device": "cuda" if on_gpu else "cpu",
                         "torch": torch.__version__, "triton": version("triton"), "vllm": version("vllm"),
                         "flashinfer": version("flashinfer-python"),
                         "torch_threads": torch.get_num_threads()},
            "wall_seconds": round(time.time() - started, 1),
            "missed": [e["bug"] for e in results if e.get("summary") and e["summary"]["found"] == 0],
            "skipped": [e["bug"] for e in results if "skipped" in e],
            "bugs": results}


__all__ = ["DEFAULTS", "bench_bugs", "ended_how", "in_own_process", "machine", "run_bug", "run_bug_child",
           "run_bug_supervised", "summarize"]
