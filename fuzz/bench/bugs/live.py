"""Live upstream bugs: open upstream in the versions kvfuzz pins (vLLM 0.33.0), so the unpatched kernel is the
subject; no patch, no ``bug.<slug>`` target (docs/bugs.md, "Live upstream bugs").

``LIVE`` maps ``"live.<slug>"`` to its :class:`LiveBug`; :func:`bench_live` runs a plain default campaign of each
bug's registered target per seed (``kvfuzz bench bugs --live``) and reports, as ``kvfuzz bench bugs`` does for the
re-injected bugs, time and examples to the first failure, its kind and the shrunk batch. When upstream fixes one,
pin it, do not drop it: set ``fixed_in`` and turn it into a re-injection (a patch undoing the fix), so the row
stays measured.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, ClassVar

import attrs
import torch
from hypothesis.database import InMemoryExampleDatabase

from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.bench.bugs import UpstreamBug
from kvfuzz.fuzz.bench.bugs.benchmark import DEFAULTS, ended_how
from kvfuzz.fuzz.bench.paged_torch import batch_size, small_batch
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.targets.registry import get_target
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import SIZE_FIELDS, size_key


@attrs.frozen
class LiveBug(UpstreamBug):
    """One bug open upstream in the pinned version: an :class:`~kvfuzz.fuzz.bench.bugs.UpstreamBug` (``upstream``
    the issue's URL; ``vllm-53628``) with ``target`` (the registered target whose unpatched kernel shows it),
    ``engine_path`` (which engine path reaches the kernel so), ``fix`` (a proposed fix's URL, or None), ``needs``
    (the kvfuzz option or state that shows it; None: a plain campaign), ``fixed_in`` (the upstream version that
    fixed it: then re-inject it, do not drop it)."""

    prefix: ClassVar[str] = "live"

    target: str
    engine_path: str
    fix: str | None = None
    needs: str | None = None
    fixed_in: str | None = None


_VLLM = "https://github.com/vllm-project/vllm/"

LIVE: dict[str, LiveBug] = {b.name: b for b in (
    LiveBug("vllm-53628", _VLLM + "issues/53628", "vllm.chunked_prefill_paged_decode",
            "ROCm's ROCM_ATTN (vllm/v1/attention/backends/rocm_attn.py) behind SlidingWindowManager's freed blocks",
            trigger="a sliding window with the blocks wholly before it freed to the null block (NaN/inf there): "
                    "kernel_paged_attention_2d multiplies their V by probability 0",
            # a decode at position 16, W = 1: block 0 (positions 0..15) freed to the null block
            smallest=lambda: attrs.evolve(small_batch([1], [16], head_size=32, block_size=16, dtype="float16",
                                                      sliding_window=1),
                                          freed_window_blocks=True, num_blocks=2, block_table=[[0, 1]]),
            needs="the freed-window state (declared since issue 39)"),
    LiveBug("vllm-57017", _VLLM + "issues/57017", "vllm.triton_mla_decode",
            "TRITON_MLA under FULL CUDA graphs (vllm/v1/attention/backends/mla/triton_mla.py forward_mqa)",
            trigger="a CUDA-graph pad row (seq_len 0, the null block): stage 2 divides an empty softmax sum, 0/0",
            smallest=lambda: attrs.evolve(small_batch([1], [0], heads=(1, 1), head_size=576, block_size=16,
                                                      dtype="float16", value_head_size=512), num_pad_seqs=1),
            fix=_VLLM + "pull/57094", needs="the CUDA-graph padding state (declared since issue 39)"),
    LiveBug("vllm-56862", _VLLM + "issues/56862", "vllm.unified_attention",
            "TRITON_ATTN (vllm/v1/attention/backends/triton_attn.py)",
            trigger="a prefill tile of 32 over blocks of 16, seq_len a multiple of 16 but not of 32: the block "
                    "table is loaded without a mask on the final tile, one entry past the row (the output is right)",
            # a prefill of 9 tokens (MAX_3D_QUERY_LEN = 8: the 2-D kernel, TILE_SIZE_PREFILL 32; a prefill of <= 8
            # takes the 3-D path, whose 16-token decode tile never passes the row) after 7 cached: seq_len 16, one
            # block of 16, the tile's second half reads block_table[0][1], past the exact one-column table
            smallest=lambda: small_batch([9], [7], head_size=32, block_size=16, dtype="float16"),
            cpu=False, needs="the memory-safety oracle on CUDA (kvfuzz fuzz --sanitize, auto by default: "
                             "compute-sanitizer memcheck, exact-size block tables)",
            why_missed="an out-of-bounds read whose value is masked off: no output oracle sees it; Triton's CPU "
                       "interpreter reads the spare entry silently (docs/bugs.md)"),
)}


def run_live(name: str, seed: int, duration: float | None = 300.0, max_examples: int = 100_000,
             limits: Limits = Limits()) -> dict:
    """One plain default campaign (in this process, stopping at the first failure) of live bug ``name``'s
    target; the result dict of :func:`kvfuzz.fuzz.bench.bugs.benchmark.run_bug` (found, seconds and examples to
    the first failure, kind, blame, check, shrunk size and case, poison). Raises KeyError for an unknown name."""
    bug = LIVE[name]
    target = get_target(bug.target)
    start = time.monotonic()
    out = {"bug": name, "seed": seed, "target": bug.target, "found": False, "examples_total": 0,
           "seconds_total": None, "seconds_to_first": None, "examples_to_first": None, "kind": None,
           "blame": None, "check": None, "size": None, "case": None, "poison": None}
    with tempfile.TemporaryDirectory(prefix="kvfuzz-live-") as d:
        config = CampaignConfig(out=Path(d), max_examples=max_examples, duration=duration, seed=seed,
                                limits=limits, database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                **DEFAULTS)
        stats = fuzz_target(target, config)
        elapsed = time.monotonic() - start
        out.update(examples_total=stats.examples, seconds_total=round(elapsed, 3), **ended_how(stats))
        if stats.failures:
            rec = min(stats.failures.values(), key=lambda r: size_key(Example.from_dict(r.example).batch))
            example = Example.from_dict(rec.example)
            out.update(found=True, seconds_to_first=round(stats.first_failure_s or elapsed, 3),
                       examples_to_first=stats.first_failure_examples, kind=rec.kind, blame=rec.blame,
                       check=rec.check, size=batch_size(example.batch), case=example.batch.summary(),
                       poison=example.poison.value)
    return out


def summarize_live(name: str, runs: list[dict]) -> dict:
    """Found count, median seconds/examples to the first failure over the seeds that found it, the kinds, and
    how many shrank to the hand-built smallest trigger or smaller."""
    found = [r for r in runs if r["found"]]
    out = {"runs": len(runs), "found": len(found)}
    if found:
        smallest = tuple(batch_size(LIVE[name].smallest())[f] for f in SIZE_FIELDS)
        out.update(median_seconds_to_first=round(statistics.median(r["seconds_to_first"] for r in found), 3),
                   median_examples_to_first=statistics.median(r["examples_to_first"] or 0 for r in found),
                   shrunk_to_smallest_trigger=sum(tuple(r["size"][f] for f in SIZE_FIELDS) <= smallest
                                                  for r in found),
                   kinds=sorted({f"{r['kind']} ({r['blame']}): {r['check']}" for r in found}),
                   shrunk=[r["size"] for r in found])
    return out


def bench_live(names: list[str] | None = None, seeds: int = 3, duration: float | None = 300.0,
               max_examples: int = 100_000, limits: Limits = Limits(),
               on_result: Callable[[dict], None] = lambda r: None) -> dict:
    """Every live bug (``names``, default: all) for seeds ``0..seeds-1``, skipping one this machine cannot show
    (``cpu`` False without CUDA, or its target unavailable) with the reason; returns the JSON document."""
    from kvfuzz.fuzz.bench.bugs.benchmark import machine

    for n in names or ():
        if n not in LIVE:
            raise KeyError(f"unknown live bug {n!r}; known: {', '.join(sorted(LIVE))}")
    on_gpu = torch.cuda.is_available()
    started = time.time()
    results = []
    for name in names or list(LIVE):
        bug = LIVE[name]
        entry = {"bug": name, "upstream": bug.upstream, "fix": bug.fix, "fixed_in": bug.fixed_in,
                 "target": bug.target, "engine_path": bug.engine_path, "trigger": bug.trigger, "needs": bug.needs,
                 "smallest_trigger": batch_size(bug.smallest()), "smallest_trigger_case": bug.smallest().summary(),
                 "why_default_misses": bug.why_missed}
        avail = get_target(bug.target).availability()
        why = (None if avail.ok else f"{bug.target} does not run here: {avail.reason}") or (
            None if (bug.cpu or on_gpu) else f"not shown on a CPU: {bug.why_missed}")
        if why:
            entry.update(skipped=why, runs=[], summary=None)
            results.append(entry)
            continue
        runs = []
        for seed in range(seeds):
            r = run_live(name, seed, duration, max_examples, limits)
            on_result(r)
            runs.append(r)
        entry.update(summary=summarize_live(name, runs), runs=runs)
        results.append(entry)
    return {"settings": {"seeds": list(range(seeds)), "duration_s": duration, "max_examples": max_examples,
                         "machine": machine(), "device": "cuda" if on_gpu else "cpu", "torch": torch.__version__},
            "wall_seconds": round(time.time() - started, 1),
            "missed": [e["bug"] for e in results if e.get("summary") and e["summary"]["found"] == 0],
            "skipped": [e["bug"] for e in results if "skipped" in e],
            "bugs": results}


__all__ = ["LIVE", "LiveBug", "bench_live", "run_live", "summarize_live"]
