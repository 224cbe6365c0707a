"""What a `kvfuzz bench bugs` campaign of a CUDA-only bug draws, reproduced on the CPU without the kernel.

    .venv/bin/python benchmarks/bug_draws.py                      # bug.flashinfer-4401, seeds 0-2, 450 examples
    .venv/bin/python benchmarks/bug_draws.py --seeds 0 1 2 --examples 450 --duration 240 --json out.json

A bench campaign (fuzz/bench/bugs/benchmark.py ``run_bug``) runs :func:`~kvfuzz.fuzz.campaign.engine.fuzz_target`
on the bug's target with ``--tier auto`` on CUDA, where chunks are pinned (one kernel configuration, a JIT module,
per chunk: kvfuzz.fuzz.campaign.chunks) and steered (kvfuzz.fuzz.campaign.steering). This script runs that same
``fuzz_target`` with the same ``CampaignConfig`` (seed, in-memory database, stop at the first failure), the target's
CUDA tiers and pinning set explicitly (``tiers=target.size_tiers()``, ``pin_configs=True``: what ``auto`` gives on
CUDA), on a stand-in target: :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch` (correct torch paged attention)
declaring the bug target's capabilities and runtime fields, so the strategies, pinning and steering draw what they
draw on the GPU. What differs from the GPU: no sanitizer re-runs (CUDA only; they re-run examples, they do not draw
them), and time. With ``--duration`` the engine's clock is a simulated GPU clock: each example costs
``--example-s`` seconds and the first example of each FlashInfer JIT module (dtypes, head size, window on/off,
soft cap on/off) ``--compile-s`` more (defaults from benchmarks/results/flashinfer-4401-h200.txt: 381-461 examples
and one 22 s decode module per seed in 240 s), so chunk sizes and time caps act as they would there.

Each example the campaign begins is counted (Listener ``begin``, as the campaign reports it): its value range, soft
cap, dtype, head size, kv_cache_dtype, JIT module, decode path, and whether it *triggers* bug.flashinfer-4401: some
decode row none of whose valid keys (the window's, or all ``seq_len``) has a natural logit ``scale * q.k`` at or
above -5e4 / log2(e) ~ -34,657 (the CUDA-core decode's finite sentinel, in log2 units 5e4), computed in fp64 from
the example's generated data (fp8 caches dequantized: ``BatchData.keys``) and ``batch.scale``, no soft cap (a soft
cap bounds a logit at -c). ``flashinfer.batch_decode`` runs the CUDA-core decode for every example
(``use_tensor_cores=False``; the group sizes it dispatches are all it declares). ~1-3 minutes per seed on a
2-core CPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from hypothesis.database import InMemoryExampleDatabase

#: FlashInfer's finite mask sentinel (math::inf = 5e4, log2 units) as a natural logit.
SENTINEL = -5e4 / math.log2(math.e)


def module_key(batch) -> tuple:
    """The FlashInfer JIT module a batch runs in (flashinfer/jit/attention/modules.py: dtypes, head size, window
    on/off, soft cap on/off)."""
    return (batch.dtype, batch.kv_cache_dtype, batch.head_size, batch.sliding_window is not None,
            batch.softcap is not None)


def min_row_max_logit(batch, data) -> float:
    """The lowest, over decode rows (sequence x query head), of the row's largest natural logit over its valid
    keys: a row below :data:`SENTINEL` is one the finite sentinel zeroes."""
    q = data.query.double()
    keys = data.keys.double()
    group = batch.num_heads // batch.num_kv_heads
    lo = math.inf
    for i, (start, n) in enumerate(zip(batch.seq_start_loc, batch.seq_lens)):
        first = 0 if batch.sliding_window is None else max(0, n - batch.sliding_window)
        k = keys[start + first:start + n]  # [S, Hkv, D]
        row = batch.query_start_loc[i + 1] - 1  # the sequence's last (decode) query row
        qi = q[row].view(batch.num_kv_heads, group, -1)  # [Hkv, G, D]
        s = torch.einsum("kgd,skd->kgs", qi, k) * batch.scale
        lo = min(lo, float(s.amax(dim=-1).min()))
    return lo


def sim_target(bug_name: str):
    """A stand-in for bug ``bug_name``'s target: correct torch paged attention on the CPU declaring the bug
    target's capabilities (devices: cpu), runtime fields and size tiers."""
    import attrs

    from kvfuzz.fuzz.bench.bugs import get_bug
    from kvfuzz.fuzz.bench.paged_torch import PagedTorch

    real = get_bug(bug_name)
    caps = attrs.evolve(real.capabilities, devices=("cpu",))

    class Sim(PagedTorch):
        name = f"sim.{real.name}"
        capabilities = caps
        runtime_fields = real.runtime_fields
        tiers = real.size_tiers()

    return Sim(), real


class SimClock:
    """A GPU's clock for the engine: ``example_s`` per example begun, ``compile_s`` more for the first example of
    each module; ``monotonic()`` reads it."""

    def __init__(self, example_s: float, compile_s: float) -> None:
        self.now, self.example_s, self.compile_s, self.modules = 1000.0, example_s, compile_s, set()

    def monotonic(self) -> float:
        return self.now

    def begin(self, batch) -> None:
        key = module_key(batch)
        if key not in self.modules:
            self.modules.add(key)
            self.now += self.compile_s
        self.now += self.example_s


class Triggered(BaseException):
    """The campaign drew its first triggering example (``until_trigger``): ends it there."""


def campaign(bug_name: str, seed: int, examples: int, duration: float | None, example_s: float,
             compile_s: float, until_trigger: bool = False) -> dict:
    """Run seed ``seed``'s bench campaign of ``bug_name`` on the stand-in for at most ``examples`` examples (or, with
    ``until_trigger``, until its first triggering one); returns the counts (module docstring)."""
    from kvfuzz.contracts.model.data import make_batch_data
    from kvfuzz.fuzz.bench.bugs.benchmark import DEFAULTS
    from kvfuzz.fuzz.campaign import engine, runner
    from kvfuzz.fuzz.campaign.config import CampaignConfig

    target, real = sim_target(bug_name)
    rows: list[dict] = []
    clock = SimClock(example_s, compile_s) if duration is not None else None
    fake_time = mock.Mock(wraps=time)
    if clock is not None:
        fake_time.monotonic = clock.monotonic
    original, run_chunk = engine._Counting.begin, engine.Campaign.run_chunk
    chunks: list[dict] = []

    def chunk(camp, k, n, plan=None):
        chunks.append({"chunk": k, "n": n, "tier": plan.tier if plan else None,
                       "focus": None if plan is None or plan.focus is None else [b for _, b in plan.bins],
                       "first_example": len(rows) + 1, "t": None if clock is None else round(clock.now - 1000.0, 1)})
        print(f"  seed {seed} chunk {chunks[-1]}", file=sys.stderr, flush=True)
        return run_chunk(camp, k, n, plan)

    def begin(listener, name, example):
        if len(rows) < examples:
            b = example.batch
            if clock is not None:
                clock.begin(b)
            low = min_row_max_logit(b, make_batch_data(b))
            rows.append({"value_range": b.value_range, "softcap": b.softcap, "dtype": b.dtype,
                         "head_size": b.head_size, "kv_cache_dtype": b.kv_cache_dtype, "k_scale": b.k_scale,
                         "scale": b.scale, "window": b.sliding_window, "gqa": b.gqa_ratio,
                         "module": "/".join(map(str, module_key(b))), "path": "cuda-core decode",
                         "decode_rows": b.num_seqs, "min_row_max_logit": low,
                         "below_sentinel": low < SENTINEL, "triggers": low < SENTINEL and b.softcap is None,
                         "t": None if clock is None else round(clock.now - 1000.0, 1)})
            if until_trigger and rows[-1]["triggers"]:
                raise Triggered()
        return original(listener, name, example)

    cfg = dict(DEFAULTS, tiers=target.size_tiers(), pin_configs=True)
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bug-draws-") as d, \
            mock.patch.object(engine._Counting, "begin", begin), \
            mock.patch.object(engine.Campaign, "run_chunk", chunk), \
            (mock.patch.object(engine, "time", fake_time) if clock else contextlib.nullcontext()), \
            (mock.patch.object(runner, "time", fake_time) if clock else contextlib.nullcontext()):
        config = CampaignConfig(out=Path(d), max_examples=examples, duration=duration, seed=seed,
                                database=InMemoryExampleDatabase(), stop_at_first_failure=True, **cfg)
        try:
            engine.fuzz_target(target, config)
        except Triggered:
            pass
    return {"seed": seed, "examples": len(rows), "chunks": chunks, "rows": rows}


def summary(run: dict) -> dict:
    rows = run["rows"]
    c = collections.Counter
    trig = [i for i, r in enumerate(rows) if r["triggers"]]
    shifted = [r for r in rows if r["value_range"] == "shifted"]
    return {
        "seed": run["seed"], "examples": len(rows),
        "chunks": [f"{c['chunk']}: {c['tier']} n={c['n']} from example {c['first_example']} at {c['t']} s"
                   + (f" focus {c['focus']}" if c["focus"] else "") for c in run["chunks"]],
        "modules": list(dict.fromkeys(r["module"] for r in rows)),
        "value_range": dict(c(r["value_range"] for r in rows)),
        "softcap": dict(c(str(r["softcap"]) for r in rows)),
        "dtype/head_size/kv": dict(c(f"{r['dtype']}/D{r['head_size']}/{r['kv_cache_dtype']}" for r in rows)),
        "path": dict(c(r["path"] for r in rows)),
        "shifted": len(shifted),
        "shifted, no softcap": sum(r["softcap"] is None for r in shifted),
        "shifted, no softcap, below sentinel": sum(r["softcap"] is None and r["below_sentinel"] for r in shifted),
        "shifted, below sentinel (any softcap)": sum(r["below_sentinel"] for r in shifted),
        "shifted not below sentinel": [f"{r['dtype']}/D{r['head_size']}/{r['kv_cache_dtype']} k_scale="
                                       f"{r['k_scale']:g} scale={r['scale']:.4g} max={r['min_row_max_logit']:.0f}"
                                       for r in shifted if not r["below_sentinel"]],
        "triggering examples": len(trig),
        "first triggering example": trig[0] + 1 if trig else None,
        "first trigger at (simulated s)": rows[trig[0]]["t"] if trig else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bug", default="bug.flashinfer-4401")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--examples", type=int, default=450, help="examples per seed (default 450)")
    p.add_argument("--duration", type=float, default=None,
                   help="the campaign's --duration in simulated GPU seconds (default: none, examples only)")
    p.add_argument("--example-s", type=float, default=0.52, help="simulated seconds per example (0.52)")
    p.add_argument("--compile-s", type=float, default=22.0, help="simulated seconds per new JIT module (22)")
    p.add_argument("--until-trigger", action="store_true", help="end each campaign at its first triggering example")
    p.add_argument("--json", type=Path, help="write every example's row and the summaries here")
    args = p.parse_args(argv)
    runs = []
    for s in args.seeds:
        t0 = time.monotonic()
        run = campaign(args.bug, s, args.examples, args.duration, args.example_s, args.compile_s, args.until_trigger)
        runs.append(run)
        print(json.dumps(summary(run), indent=1), f"({time.monotonic() - t0:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bug": args.bug, "args": {k: str(v) for k, v in vars(args).items()},
                                         "summaries": [summary(r) for r in runs], "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
