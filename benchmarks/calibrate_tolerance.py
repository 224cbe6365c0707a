"""Measure how close correct real kernels come to kvfuzz's oracle bounds (docs/tolerance.md).

    python benchmarks/calibrate_tolerance.py --target vllm.cpu_attention --examples 3000 --json out.json
    python benchmarks/calibrate_tolerance.py --target vllm.cpu_attention --dtype float32 --head-size 256 512 \\
        --value-range large --examples 800

Examples are drawn by kvfuzz's own strategies (finite poisons by default: NaN/inf poison makes some kernels'
outputs non-finite, docs/findings.md, Finding 1-2, which the finite oracle reports).
Per example, with err = |out - ref|:

  ratio        max over elements of err / bound           the agreement rule (fails above 1)
  envelope     max over elements of err / envelope        the envelope alone (a FlashAttention-family bound)
  naive        max over rows of max_d err / max_d |out_lp - ref|   err in multiples of the naive model's
  old_rule     max over rows of max_d err / (RTOL[dtype] * max_d |out_lp - ref| + row_floor)   the rule before
  flash        max over elements of |out_fa - ref| / envelope    the FlashAttention model (must stay <= 1)
  mean         mean err / max(model means)                FA3's mean-error statistic, 16-bit dtypes (measured,
                                                          not a rule: docs/tolerance.md, "Why no mean-error rule")
  mean_<model> mean err / that model's mean               naive (out_lp), flash (out_fa), rounded (ref rounded)

grouped per dtype/kv_cache_dtype, feature, value range and head size; the JSON keeps, per group, the worst value
of each statistic and the batch it came from, plus the distribution (median, p99) over examples.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import time

import attrs
import torch
from hypothesis import HealthCheck, given, seed, settings

from kvfuzz.contracts.checks.oracles import RTOL, agreement_bound, row_floor
from kvfuzz.contracts.checks.reference import (
    FLASH_ATTENTION,
    flash_attention_model,
    reference_and_envelope,
    same_precision_attention,
)
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.contracts.model.space import VALUE_RANGES
from kvfuzz.fuzz.harness.attention import prepare
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import Limits, examples

STATS = ("ratio", "envelope", "naive", "old_rule", "flash", "mean", "mean_naive", "mean_flash", "mean_rounded")


def statistics(batch, data, out: torch.Tensor, numerics=FLASH_ATTENTION) -> dict[str, float]:
    """The statistics of the module docstring for one example (``out`` the kernel's output; rows past the batch's
    tokens, a CUDA-graph padded call's pad rows, are the pad oracle's and left out here), the envelope that of the
    target's declared ``numerics`` (docs/tolerance.md, "Declared numerics")."""
    out = out[: batch.num_tokens]
    ref, env = reference_and_envelope(batch, data, numerics)
    lowp = same_precision_attention(batch, data)
    err = (out.cpu().double() - ref).abs()
    tiny = torch.finfo(torch.float64).tiny
    naive_row = (lowp - ref).abs().amax(-1)
    r = {"ratio": float((err / agreement_bound(ref, lowp, env)).max()),
         "envelope": float((err / env).max()),
         "naive": float((err.amax(-1) / naive_row.clamp_min(tiny)).max()),
         "old_rule": float((err.amax(-1) / (RTOL[batch.dtype] * naive_row + row_floor(batch, ref))).max()),
         "elements": err.numel()}
    flash = (flash_attention_model(batch, data) - ref).abs()
    r["flash"] = float((flash / env).max())
    if batch.dtype != "float32":
        models = {"naive": (lowp - ref).abs(), "flash": flash,
                  "rounded": (ref.to(batch.torch_dtype).double() - ref).abs()}
        means = {k: float(v.mean()) for k, v in models.items()}
        r["mean"] = float(err.mean()) / max(max(means.values()), tiny)
        r.update({f"mean_{k}": float(err.mean()) / max(v, tiny) for k, v in means.items()})
    return r


def groups(batch) -> list[str]:
    b = batch
    g = [f"{b.dtype}/{b.kv_cache_dtype}", *(f"{b.dtype}+{f}" for f in b.features),
         f"{b.dtype}+values={b.value_range}", f"{b.dtype}+D={b.head_size}"]
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--dtype", action="append", help="restrict the drawn dtypes (repeatable)")
    ap.add_argument("--head-size", type=int, nargs="*", help="restrict the drawn head sizes")
    ap.add_argument("--value-range", default=None, choices=VALUE_RANGES, help="force one value range")
    ap.add_argument("--poison", action="append", default=None, help="default: stale and zeros")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = get_target(args.target)
    caps = target.capabilities
    if args.dtype:
        caps = attrs.evolve(caps, dtypes=tuple(args.dtype))
    if args.head_size:
        caps = attrs.evolve(caps, head_sizes=tuple(args.head_size))
    poisons = tuple(Poison(p) for p in (args.poison or ("stale", "zeros")))
    strategy = examples(caps, Limits(), poisons)
    if args.value_range:
        strategy = strategy.map(lambda ex: attrs.evolve(ex, batch=attrs.evolve(ex.batch,
                                                                                value_range=args.value_range)))
    worst: dict = collections.defaultdict(dict)
    values: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    skipped = collections.Counter()
    start = time.time()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def body(example):
        b = example.batch
        run = prepare(target, example)
        out = target.run(run.call)[: b.num_tokens]
        if not torch.isfinite(out).all():
            skipped["non-finite output"] += 1
            return
        r = statistics(b, run.data, out, target.numerics)
        for g in groups(b):
            w = worst[g]
            w["n"] = w.get("n", 0) + 1
            for k in STATS:
                if k in r and not math.isnan(r[k]):  # NaN: the naive model overflowed (fp16 "extreme" values)
                    values[g][k].append(r[k])
                    if r[k] > w.get(k, {}).get("value", -1.0):
                        w[k] = {"value": r[k], "batch": b.summary(), "elements": r["elements"]}

    body()
    for g, per in values.items():
        for k, vs in per.items():
            vs.sort()
            worst[g][k]["median"] = vs[len(vs) // 2]
            worst[g][k]["p99"] = vs[min(len(vs) - 1, int(0.99 * len(vs)))]
    result = {"target": args.target, "examples": args.examples, "seconds": round(time.time() - start, 1),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
              "availability": target.availability().reason, "skipped": dict(skipped),
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "worst": dict(sorted(worst.items()))}
    for g, w in sorted(worst.items()):
        print(f"{g:28s} n={w['n']:5d} " + " ".join(f"{k}={w[k]['value']:.3g}" for k in STATS if k in w))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
