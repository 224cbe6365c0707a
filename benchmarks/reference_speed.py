"""Milliseconds per call of the fp64 reference and envelope (kvfuzz.contracts.checks.reference) on fixed batch
shapes: small mixed batches (what a fuzzing example draws) and batches of about 1M KV elements (what
check_example computes on a CUDA target's GPU).

    python benchmarks/reference_speed.py [--device cpu|cuda] [--repeat 20] [--threads 1] [--wall]

Medians of ``--repeat`` calls after one warm-up call. On CPU: the calling thread's CPU time
(``time.thread_time``) with torch on ``--threads`` threads (1 by default: on a shared machine wall-clock
medians are dominated by other processes; CPU time is not), or wall-clock time with ``--wall``. On CUDA:
wall-clock time from before the call to after ``torch.cuda.synchronize()`` (the data is on the GPU already).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvfuzz.contracts.checks.reference import reference_and_envelope, reference_attention
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.data import make_batch_data


def make_batch(lens, *, num_heads, num_kv_heads, head_size, dtype, block_size=16, **features) -> Batch:
    """:func:`~kvfuzz.contracts.model.batch.contiguous_batch` of ``(query_len, ctx_len)`` pairs."""
    return contiguous_batch([q for q, _ in lens], [c for _, c in lens], block_size=block_size, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, **features)


FEATURES = dict(sliding_window=11, alibi=True)
#: name -> (lens, heads, kv heads, head size, dtype, features)
SHAPES = {
    "small 4 seqs H3/1 D64 fp32 window+alibi": ([(5, 3), (1, 40), (17, 0), (1, 30)], 3, 1, 64, "float32", FEATURES),
    "small 4 seqs H8/2 D128 fp16 sinks+softcap": ([(12, 20), (1, 90), (1, 7), (40, 56)], 8, 2, 128, "float16",
                                                  dict(sinks=True, softcap=30.0)),
    "small 1 decode H4/4 D32 bf16": ([(1, 33)], 4, 4, 32, "bfloat16", {}),
    "1M KV 4 seqs H3/1 D64 fp32 window+alibi": ([(40, 4056), (1, 4095), (17, 4079), (1, 4095)], 3, 1, 64,
                                                "float32", FEATURES),
    "1M KV 32 decodes+prefills H8/2 D128 fp16": ([(1 if i % 4 else 24, 120 + 3 * i) for i in range(32)], 8, 2, 128,
                                                 "float16", {}),
    "1M KV uneven 1 long + 7 short H4/1 D64 fp16": ([(8, 16000)] + [(1, 20 + i) for i in range(7)], 4, 1, 64,
                                                     "float16", dict(sinks=True)),
}


def timed(fn, repeat: int, device: torch.device, wall: bool) -> float:
    fn()  # warm-up
    times = []
    clock = time.perf_counter if wall or device.type == "cuda" else time.thread_time
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        s = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - s)
    return round(statistics.median(times) * 1e3, 3)


def arguments(repeat: int) -> argparse.Namespace:
    """``--device``, ``--repeat`` (default ``repeat``), ``--threads``, ``--wall`` (benchmarks/generate_speed.py
    takes the same)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall-clock time on CPU (default: thread CPU time)")
    return ap.parse_args()


def main() -> None:
    a = arguments(20)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    rows = []
    for name, (lens, h, hkv, d, dtype, features) in SHAPES.items():
        b = make_batch(lens, num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, **features)
        data = make_batch_data(b).to(dev)
        rows.append({"shape": name, "kv_elements": b.kv_elements,
                     "reference_and_envelope_ms": timed(lambda: reference_and_envelope(b, data), a.repeat, dev, a.wall),
                     "reference_ms": timed(lambda: reference_attention(b, data), a.repeat, dev, a.wall)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
