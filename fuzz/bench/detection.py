"""``kvfuzz bench detect``: how fast kvfuzz finds each mutant of :mod:`kvfuzz.fuzz.bench.mutants`, next to a
baseline that runs the parametrized grids of vLLM's own kernel tests against the same mutant targets.

kvfuzz side: :func:`~kvfuzz.fuzz.campaign.fuzz_target` with a :class:`~kvfuzz.fuzz.campaign.CampaignConfig`
(in-memory example database, default strategy limits, all poisons), per mutant and seed, stopping after the
first distinct failure is shrunk (or at the example/time budget). Reported: whether it found the mutant, the
wall time and the number of examples to the first failing example (before shrinking), the time to the shrunk
report, the size of the shrunk case (:func:`kvfuzz.strategies.reductions.size_key`) next to
:func:`~kvfuzz.fuzz.bench.mutants.smallest_trigger`, and the failure kind of :data:`RERUNS` reruns of it.

Grid side: :mod:`kvfuzz.fuzz.bench.grid`.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import attrs
import torch
from hypothesis.database import InMemoryExampleDatabase

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.bench.grid import grid_detect
from kvfuzz.fuzz.bench.mutants import MUTANTS, get_mutant, smallest_trigger
from kvfuzz.fuzz.bench.paged_torch import batch_size
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import properties
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import SIZE_FIELDS, size_key

#: Reruns of each shrunk failure (its kind must not change from run to run).
RERUNS = 3

# ---- kvfuzz ---------------------------------------------------------------------------------------------------

def kvfuzz_detect(name: str, seed: int, max_examples: int = 200, duration: float | None = 20.0,
                  limits: Limits = Limits(), pin_configs: bool | None = None) -> dict:
    """Fuzz mutant ``name`` with seed ``seed`` until its first distinct failure is shrunk or the budget is
    spent; ``pin_configs`` as in :class:`~kvfuzz.fuzz.campaign.config.CampaignConfig` (None: pinned on CUDA).
    Returns a result dict (see the module docstring)."""
    target = get_mutant(name)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bench-") as d:
        config = CampaignConfig(out=Path(d), max_examples=max_examples, duration=duration, seed=seed,
                                limits=limits, database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                pin_configs=pin_configs)
        stats = fuzz_target(target, config)
    first = {} if stats.first_failure_s is None else {"seconds": stats.first_failure_s,
                                                      "examples": stats.first_failure_examples}
    elapsed = time.monotonic() - start
    out = {"tool": "kvfuzz", "mutant": name, "seed": seed, "found": bool(stats.failures),
           "examples_total": stats.examples, "seconds_total": round(elapsed, 3),
           "seconds_to_first": None, "examples_to_first": None, "seconds_to_shrunk": None,
           "check": None, "kind": None, "size": None, "case": None, "poison": None, "rerun_kinds": None}
    if stats.failures:
        examples = {sig: Example.from_dict(f.example) for sig, f in stats.failures.items()}
        sig = min(examples, key=lambda s: size_key(examples[s].batch))
        found, example = stats.failures[sig], examples[sig]
        out.update(seconds_to_first=round(first.get("seconds", elapsed), 3),
                   examples_to_first=first.get("examples"), seconds_to_shrunk=round(elapsed, 3),
                   check=found.check, kind=found.kind, size=batch_size(example.batch),
                   case=example.batch.summary(), poison=example.poison.value,
                   rerun_kinds=rerun_kinds(target, example))
    return out



def _size_key(size: dict) -> tuple:
    return tuple(size[f] for f in SIZE_FIELDS)


def size_str(size: dict | None) -> str:
    """``1s 1t 9kv H1/1 D24 BS8 NB3``: sequences, query tokens, KV tokens, heads, head size, block size, blocks."""
    if not size:
        return "-"
    return (f"{size['seqs']}s {size['tokens']}t {size['kv_tokens']}kv H{size['heads']}/{size['kv_heads']} "
            f"D{size['head_size']} BS{size['block_size']} NB{size['blocks']}")


def rerun_kinds(target, example: Example, n: int = RERUNS) -> list[str]:
    """The failure kind (or "passed") of ``n`` reruns of ``example``: a kind that changes from run to run makes
    one bug two entries."""
    kinds = []
    for _ in range(n):
        try:
            properties.check(target, example)
            kinds.append("passed")
        except Finding as f:
            kinds.append(f.kind.value)
    return kinds


def summarize(name: str, runs: list[dict]) -> dict:
    """Per-tool summary of one mutant's runs: found count, median time/examples to the first failure over the
    seeds that found it, and the smallest and typical (median by size) failing case."""
    found = [r for r in runs if r["found"]]
    out = {"runs": len(runs), "found": len(found)}
    if found:
        out["median_seconds_to_first"] = round(statistics.median(r["seconds_to_first"] for r in found), 3)
        out["median_examples_to_first"] = statistics.median(r["examples_to_first"] for r in found)
        sizes = sorted((r["size"] for r in found), key=_size_key)
        out["smallest_size"] = sizes[0]
        out["median_size"] = sizes[len(sizes) // 2]
        # shrunk as far as the smallest trigger in every size, in the order a developer reads a case: sequences,
        # tokens, kv tokens, heads, head size, blocks
        out["shrunk_to_smallest_trigger"] = sum(
            _size_key(r["size"]) <= _size_key(batch_size(smallest_trigger(name))) for r in found)
        if all("rerun_kinds" in r for r in found):  # kvfuzz's: the shrunk case fails so on every rerun
            out["kind_stable"] = sum(r["rerun_kinds"] == [r["kind"]] * len(r["rerun_kinds"]) for r in found)
    return out


def _run_one(job: tuple) -> list[dict]:
    name, seed, max_examples, duration, grid, limits, threads, pin_configs = job
    if threads:
        torch.set_num_threads(threads)
    runs = [kvfuzz_detect(name, seed, max_examples, duration, limits, pin_configs)]
    if grid:
        runs.append(grid_detect(name, seed))
    return runs


def detect(mutants: list[str] | None = None, seeds: int = 5, max_examples: int = 200,
           duration: float | None = 20.0, grid: bool = True, limits: Limits = Limits(), jobs: int = 1,
           on_result: Callable[[dict], None] = lambda r: None, pin_configs: bool | None = None) -> dict:
    """Run kvfuzz (and the grid) on every mutant for seeds ``0..seeds-1``; returns the JSON document.
    ``jobs > 1`` runs (mutant, seed) pairs in that many processes, each with one torch thread.
    ``pin_configs``: kvfuzz's chunks stay in one kernel configuration (None: on CUDA only)."""
    names = list(mutants or MUTANTS)
    for n in names:
        if n not in MUTANTS:
            raise KeyError(f"unknown mutant {n!r}; known: {', '.join(sorted(MUTANTS))}")
    started = time.time()
    threads = 1 if jobs > 1 else 0
    work = [(name, seed, max_examples, duration, grid, limits, threads, pin_configs)
            for name in names for seed in range(seeds)]
    by_name: dict[str, list[dict]] = {n: [] for n in names}
    if jobs > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            for runs in pool.map(_run_one, work):
                for r in runs:
                    by_name[r["mutant"]].append(r)
                    on_result(r)
    else:
        for job in work:
            for r in _run_one(job):
                by_name[r["mutant"]].append(r)
                on_result(r)
    results = []
    for name in names:
        runs = by_name[name]
        cls = MUTANTS[name]
        results.append({
            "mutant": name, "bug": cls.bug, "trigger": cls.trigger, "description": cls.description,
            "smallest_trigger": batch_size(smallest_trigger(name)),
            "smallest_trigger_case": smallest_trigger(name).summary(),
            "kvfuzz": summarize(name, [r for r in runs if r["tool"] == "kvfuzz"]),
            "grid": summarize(name, [r for r in runs if r["tool"] == "grid"]) if grid else None,
            "runs": runs,
        })
    return {
        "settings": {"seeds": list(range(seeds)), "max_examples": max_examples, "duration_s": duration,
                     "limits": attrs.asdict(limits), "grid": grid, "jobs": jobs, "torch": torch.__version__,
                     "configs": {None: "auto", True: "pinned", False: "free"}[pin_configs],
                     "device": "cuda" if torch.cuda.is_available() else "cpu",
                     "torch_threads": threads or torch.get_num_threads()},
        "wall_seconds": round(time.time() - started, 1),
        "grid_missed": [r["mutant"] for r in results if grid and r["grid"]["found"] == 0],
        "kvfuzz_missed": [r["mutant"] for r in results if r["kvfuzz"]["found"] == 0],
        "mutants": results,
    }


__all__ = ["detect", "kvfuzz_detect", "rerun_kinds", "size_str", "summarize"]
