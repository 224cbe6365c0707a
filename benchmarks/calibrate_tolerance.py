"""Measure how far correct real kernels stray from the fp64 reference, relative to the same-precision
error, under three ways of applying FlashAttention's rule (per row, per sequence, whole batch).

    python benchmarks/calibrate_tolerance.py --target vllm.cpu_attention --examples 300 --json out.json

For each example it records, per dtype/kv_cache_dtype and per optional feature (window, ALiBi, sinks,
softcap, value range), with err = |out - ref| and pt = |out_lp - ref|:
  row:   max over (token, head) rows of (err_row - floor) / pt_row
  seq:   max over sequences of (max err in seq - floor) / (max pt in seq)
  batch: (max err - floor) / (max pt)        (FlashAttention's own form)
The rule in kvfuzz.contracts.oracles must sit above the worst value seen here, with margin.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from hypothesis import HealthCheck, given, settings

from kvfuzz.contracts.failures import Finding
from kvfuzz.contracts.oracles import atol_floor, row_floor
from kvfuzz.contracts.reference import same_precision_attention
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import Limits, examples


def ratios(batch, out, ref, lowp):
    err = (out.cpu().double() - ref).abs()
    pt = (lowp - ref).abs()
    floor_rows = row_floor(batch, ref)
    floor = float(floor_rows.max())
    tiny = 1e-300
    row = ((err.amax(-1) - floor_rows).clamp_min(0) / pt.amax(-1).clamp_min(tiny)).max().item()
    qsl = batch.query_start_loc
    seq = max(((err[qsl[i]:qsl[i + 1]].max() - floor).clamp_min(0) / pt[qsl[i]:qsl[i + 1]].max().clamp_min(tiny)).item()
              for i in range(batch.num_seqs))
    whole = ((err.max() - floor).clamp_min(0) / pt.max().clamp_min(tiny)).item()
    return {"row": row, "seq": seq, "batch": whole}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target = get_target(args.target)
    worst: dict = collections.defaultdict(lambda: {"row": 0.0, "seq": 0.0, "batch": 0.0, "n": 0})
    failures = []

    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(examples(target.capabilities, Limits()))
    def body(example):
        try:
            run = check_example(target, example)
        except Finding as f:
            if f.check != "agreement":
                failures.append(f"{f.kind.value}: {f.message[:200]}")
                return
            from kvfuzz.fuzz.harness.attention import prepare
            run = prepare(target, example)
            run.output = target.run(run.call)
            from kvfuzz.contracts.reference import reference_attention
            run.reference = reference_attention(example.batch, run.data)
        b = example.batch
        r = ratios(b, run.output, run.reference, same_precision_attention(b, run.data))
        groups = [f"{b.dtype}/{b.kv_cache_dtype}", *(f"{b.dtype}+{f}" for f in b.features)]
        if b.value_range != "normal":
            groups.append(f"{b.dtype}+values={b.value_range}")
        for g in groups:
            w = worst[g]
            w["n"] += 1
            for k in ("row", "seq", "batch"):
                w[k] = max(w[k], r[k])

    body()
    result = {"target": args.target, "worst_ratio_by_dtype": dict(worst), "other_failures": failures[:10],
              "floors": {d: atol_floor(getattr(torch, d)) for d in ("float16", "bfloat16", "float32")}}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
