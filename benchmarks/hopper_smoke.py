"""A few fixed examples of the Hopper-only targets (vllm.flash_attn_varlen: FlashAttention 3; vllm.flashmla_decode:
FlashMLA) through kvfuzz's property, one line each: the target's availability, then per example its batch, path and
verdict (passed with its error ratio to the tolerance, or the finding). Run by benchmarks/gpu_hopper.sh and
benchmarks/gpu_padding.sh on a lent H100/H200 after ``source benchmarks/gpu_env.sh`` (vLLM's Python files and the
Hopper bundle on PYTHONPATH). The padded cases (``num_pad_seqs``: vLLM's FULL CUDA-graph padding, seq_len-0 pads on
the null block, :mod:`kvfuzz.contracts.model.padding`) also print what the kernel left in the pad rows.

Usage: python3 benchmarks/hopper_smoke.py [OUT.json]   (exit 0 always: the lines are the result)
"""

from __future__ import annotations

import json
import sys
import time

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets.registry import get_target


def batch(lens, *, block_size, **kw) -> Batch:
    """:func:`~kvfuzz.contracts.model.batch.contiguous_batch` of ``(query_len, ctx_len)`` pairs, blocks handed out
    in reverse; with CUDA-graph pads, from block 1: block 0 is vLLM's null block, the pads' block-table rows."""
    return contiguous_batch(*zip(*lens), block_size=block_size, reverse=True,
                            first_block=1 if kw.get("num_pad_seqs") else 0, **kw)


MIXED = [(1, 33), (1, 100), (7, 57), (20, 0)]
DECODES = [(1, 33), (1, 100), (1, 0), (1, 64), (1, 300)]
LATENT = dict(num_kv_heads=1, head_size=576, value_head_size=512, sm_scale=1 / 192 ** 0.5, block_size=64)
CASES = {
    "vllm.flash_attn_varlen": [
        *(batch(MIXED, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype="bfloat16", seed=s)
          for s in (0, 1, 2, 3, 12)),  # every split choice; seed 12: no ahead-of-time schedule
        batch(MIXED, num_heads=8, num_kv_heads=1, head_size=64, block_size=32, dtype="float16", seed=5,
              sliding_window=32, softcap=30.0),
        batch([(1, 600), (3, 40)], num_heads=4, num_kv_heads=4, head_size=256, block_size=544, dtype="bfloat16",
              seed=6),
        batch([(1, 70), (9, 9)], num_heads=16, num_kv_heads=4, head_size=40, block_size=48, dtype="float16", seed=7),
        # vLLM's FULL-graph padding: 3 decodes padded to a capture size of 4, 5 to 8 (num_splits 32, aot or not)
        batch(DECODES[:3], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype="bfloat16", seed=1,
              num_pad_seqs=1),
        batch(DECODES, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="float16", seed=12,
              num_pad_seqs=3),
        # an fp8 cache (bf16 only; the layer's e4m3 query): every declared fp8 head size, each block size,
        # the window and softcap, the scales, a padded decode batch
        *(batch(MIXED, num_heads=8, num_kv_heads=2, head_size=d, block_size=bs, dtype="bfloat16", seed=20 + i,
                kv_cache_dtype=kv, k_scale=ks, v_scale=vs, **extra)
          for i, (d, bs, kv, ks, vs, extra) in enumerate((
              (32, 16, "fp8", 1.0, 1.0, {}), (64, 32, "fp8_e4m3", 0.5, 0.75, {}),
              (80, 48, "fp8", 0.25, 0.5, dict(sliding_window=20)), (96, 64, "fp8", 1.0, 0.5, dict(softcap=30.0)),
              (128, 16, "fp8_e4m3", 0.5, 0.5, dict(value_range="dominant")),
              (192, 544, "fp8", 0.75, 1.0, dict(sliding_window=33, softcap=20.0)),
              (256, 16, "fp8", 0.5, 0.25, dict(value_range="extreme"))))),
        batch(DECODES, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16", seed=13,
              kv_cache_dtype="fp8", k_scale=0.5, v_scale=0.5, num_pad_seqs=3),
    ],
    "vllm.flashmla_decode": [
        batch([(1, 0), (1, 64), (1, 300)], num_heads=16, dtype="bfloat16", seed=1, **LATENT),
        batch([(1, 700), (1, 65)], num_heads=128, dtype="float16", seed=2, **LATENT),
        batch([(1, 129)], num_heads=1, dtype="bfloat16", seed=3, **LATENT),
        # vLLM's FULL-graph padding: 3 decodes padded to 4 (vllm#57017's shape, TRITON_MLA's NaN), 5 to 8
        batch(DECODES[:3], num_heads=16, dtype="bfloat16", seed=4, num_pad_seqs=1, **LATENT),
        batch(DECODES, num_heads=128, dtype="float16", seed=5, num_pad_seqs=3, **LATENT),
    ],
}


def main() -> None:
    results = []
    for name, batches in CASES.items():
        t = get_target(name)
        a = t.availability()
        print(f"{name}: {'available' if a.ok else 'UNAVAILABLE'}: {a.reason}", flush=True)
        if not a.ok:
            results.append(dict(target=name, available=False, reason=a.reason))
            continue
        for b in batches:
            t0 = time.perf_counter()
            row = dict(target=name, batch=b.summary(), path=t.path(b))
            try:
                run = check_example(t, Example(b, Poison.NAN))
                row.update(verdict="pass", ratio=round(float(run.ratio), 4))
                if b.num_pad_seqs:  # what the kernel left in the pad rows (the harness zeroes them first)
                    pads = run.output[b.num_tokens:].float()
                    row["pad_rows"] = (f"{b.num_pad_seqs} pads: finite {bool(pads.isfinite().all())}, "
                                       f"max |x| {float(pads.abs().max()):.3g}")
            except Finding as f:
                row.update(verdict=f"FINDING {f.kind.value}", message=str(f)[:400])
            except Exception as e:  # a harness or kernel error: printed, the next case runs
                row.update(verdict=f"ERROR {type(e).__name__}", message=str(e)[:400])
            row["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(row)
            print(f"  {row['verdict']:<28} {row['path']:<40} {row.get('ratio', '')!s:<8} {row['seconds']}s "
                  f"{row['batch'][:110]}" + (f"\n    {row['message']}" if "message" in row else "")
                  + (f"\n    {row['pad_rows']}" if "pad_rows" in row else ""), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
