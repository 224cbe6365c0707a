"""Where one GPU example's time goes, per compiled target: Triton compile vs disk load vs launch, and the
harness stages (generation, materialization, caller checks, kernel, reference, output checks) of examples
inside one compiled kernel configuration, for small batches and for batches of 1M+ KV elements.

    python benchmarks/gpu_profile.py --out results.json [--target NAME]... [--examples 200]

Run it twice with the same TRITON_CACHE_DIR: the first run ("cold") compiles, the second ("load") finds every
kernel on disk. Each record says which. Hypothesis's own time per example (draw, engine) is measured with a
no-op property over the same pinned strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import attrs
import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.control import BuildContext
from hypothesis.internal.conjecture.data import ConjectureData

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.curve import compiled_kernels
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.run import Timings
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.configs import config_for
from kvfuzz.strategies.limits import Limits

STAGES = [f.name for f in attrs.fields(Timings)]
CACHE = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def draw(strategy, i: int):
    data = ConjectureData(random=random.Random(i))
    with BuildContext(data, wrapped_test=lambda: None):
        return data.draw(strategy)


def run_one(target, example: Example) -> tuple[Timings, float]:
    s = time.perf_counter()
    run = properties.prepare(target, example)
    try:
        properties.check(target, example, run=run)
    except Finding:
        pass
    return run.timings, time.perf_counter() - s


def first_calls(target, limits: Limits, configs: int) -> list[dict]:
    """The first two examples of each of the first ``configs`` configurations: the first pays the compile (or
    the disk load), the second shows what a reused specialization costs."""
    out = []
    for k in range(configs):
        cfg = config_for(target.capabilities, limits, 0, k)
        strategy = examples(target.capabilities, limits, (Poison.STALE,), pin=cfg)
        before = compiled_kernels(CACHE)
        rows = []
        for j in range(3):
            t, wall = run_one(target, draw(strategy, 1000 * k + j))
            rows.append({"wall_s": round(wall, 4), "kernel_s": round(t.kernel, 4)})
        out.append({"config": cfg.summary(), "calls": rows, "new_cache_entries": compiled_kernels(CACHE) - before})
    return out


def stages(target, limits: Limits, n: int, big: bool = False, tokens: bool = False) -> dict:
    """Per-stage milliseconds per example over ``n`` examples of configuration 0 (compiled by now); ``big``: each
    grown to 1M+ KV elements, or with ``tokens`` to 1M+ cached KV tokens over its sequences (issue 32's goal)."""
    cfg = config_for(target.capabilities, limits, 0, 0)
    strategy = examples(target.capabilities, limits, (Poison.STALE,), pin=cfg)
    tot = dict.fromkeys(STAGES, 0.0)
    wall, kv, kv_tokens = 0.0, [], []
    exs = [draw(strategy, i) for i in range(n)]
    if big:  # scale every example up to 1M+ KV elements: longer contexts, same configuration
        exs = [attrs.evolve(e, batch=_grow(e.batch, tokens=tokens)) for e in exs[: max(5, n // 10)]]
    run_one(target, exs[0])  # warm: compile whatever the first shape needs
    for e in exs:
        t, w = run_one(target, e)
        wall += w
        kv.append(e.batch.kv_elements)
        kv_tokens.append(sum(e.batch.ctx_lens) + sum(e.batch.query_lens))
        for k in STAGES:
            tot[k] += getattr(t, k)
    m = len(exs)
    return {"config": cfg.summary(), "examples": m, "ms_per_example": round(wall / m * 1e3, 3),
            "stages_ms": {k: round(v / m * 1e3, 3) for k, v in tot.items()},
            "harness_share": round(1 - tot["kernel"] / wall, 3), "median_kv_elements": int(statistics.median(kv)),
            "median_kv_tokens": int(statistics.median(kv_tokens))}


def _grow(b: Batch, target: int = 1 << 20, tokens: bool = False) -> Batch:
    per_token = 1 if tokens else b.num_kv_heads * b.head_size
    ctx = max(1, -(-target // per_token // b.num_seqs))
    ctx_lens = [ctx] * b.num_seqs
    needed = [-(-(q + c) // b.block_size) for q, c in zip(b.query_lens, ctx_lens)]
    table, k = [], 0
    for n in needed:
        table.append(list(range(k, k + n)) + [0] * (max(needed) - n))
        k += n
    # the states (freed window blocks, pads) are left out: the grown table is a fresh one
    return attrs.evolve(b, ctx_lens=ctx_lens, block_table=table, num_blocks=k, csr_tail=(), freed_window_blocks=False,
                        num_pad_seqs=0)


def hypothesis_ms(target, limits: Limits, n: int) -> float:
    """Milliseconds per example Hypothesis itself takes (draw + engine) on the pinned strategy."""
    cfg = config_for(target.capabilities, limits, 0, 0)
    strategy = examples(target.capabilities, limits, (Poison.STALE,), pin=cfg)

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate], verbosity=Verbosity.quiet)
    @seed(1)
    @given(strategy)
    def noop(e):
        pass

    noop()  # strategy validation
    s = time.perf_counter()
    noop()
    return round((time.perf_counter() - s) / n * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", action="append")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--configs", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", action="store_true", help="also batches of 1M+ cached KV tokens")
    a = ap.parse_args()
    names = a.target or ["vllm.unified_attention", "vllm.decode_attention_fwd", "vllm.chunked_prefill_paged_decode",
                         "vllm.context_attention_fwd", "sglang.extend_attention_fwd", "sglang.decode_attention_fwd"]
    limits = Limits()
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "cache_entries_at_start": compiled_kernels(CACHE), "targets": []}
    for name in names:
        t = get_target(name)
        if not t.availability().ok:
            doc["targets"].append({"target": name, "unavailable": t.availability().reason})
            continue
        rec = {"target": name}
        s = time.perf_counter()
        rec["first_calls"] = first_calls(t, limits, a.configs)
        rec["stages_small"] = stages(t, limits, a.examples)
        rec["stages_1M_kv"] = stages(t, limits, a.examples, big=True)
        if a.tokens:
            rec["stages_1M_kv_tokens"] = stages(t, limits, a.examples, big=True, tokens=True)
        rec["hypothesis_ms"] = hypothesis_ms(t, limits, a.examples)
        rec["seconds"] = round(time.perf_counter() - s, 1)
        doc["targets"].append(rec)
        print(json.dumps(rec)[:2000], flush=True)
    doc["cache_entries_at_end"] = compiled_kernels(CACHE)
    Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
