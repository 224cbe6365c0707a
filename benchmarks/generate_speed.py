"""Milliseconds per call of the harness's generate step (kvfuzz.contracts.model.data.make_batch_data) on the
shapes of benchmarks/reference_speed.py (small mixed batches, as a fuzzing example draws, and batches of about
1M KV elements), and of drawing 1M float32 numbers: torch.randn from a seeded CPU generator (how kvfuzz drew
before issue 21) and kvfuzz.contracts.model.counter_rng.normal (how it draws since).

    python benchmarks/generate_speed.py [--device cpu|cuda] [--repeat 50] [--threads 1] [--wall]

Runs on a checkout from before the counter-based generator too (make_batch_data then has no device argument:
``--device cpu`` only; the counter_rng row is left out), so one machine can compare the two. Medians of
``--repeat`` calls after one warm-up call; the clock as in reference_speed.py (thread CPU time on the CPU,
``--wall`` for wall-clock; on CUDA wall-clock to ``torch.cuda.synchronize()``).
"""

from __future__ import annotations

import json

import torch
from reference_speed import SHAPES, arguments, make_batch, timed

from kvfuzz.contracts.model.data import make_batch_data

try:
    from kvfuzz.contracts.model import counter_rng
except ImportError:  # a checkout from before issue 21's generator
    counter_rng = None


def main() -> None:
    a = arguments(50)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    n = 1 << 20
    rows = [{"draw": "torch.randn 1M float32 (CPU generator)",
             "ms": timed(lambda: torch.randn(n, generator=torch.Generator().manual_seed(1)), a.repeat,
                         torch.device("cpu"), a.wall)}]
    if counter_rng is not None:
        rows.append({"draw": f"counter_rng.normal 1M float32 on {dev}",
                     "ms": timed(lambda: counter_rng.normal(1, [(counter_rng.KEYS, n)], dev), a.repeat, dev, a.wall)})
    for r in rows:
        print(json.dumps(r), flush=True)
    gen = (lambda b: make_batch_data(b)) if dev.type == "cpu" else (lambda b: make_batch_data(b, dev))
    for name, (lens, h, hkv, d, dtype, features) in SHAPES.items():
        b = make_batch(lens, num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, **features)
        repeat = a.repeat * 4 if b.kv_elements < 1 << 16 else a.repeat
        print(json.dumps({"shape": name, "kv_elements": b.kv_elements,
                          "make_batch_data_ms": timed(lambda: gen(b), repeat, dev, a.wall)}), flush=True)


if __name__ == "__main__":
    main()
