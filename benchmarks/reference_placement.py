"""Where the CPU time of a CUDA target's small-tier fp64 reference goes, and how much of it a placement by arithmetic
(kvfuzz.fuzz.harness.run.reference_work, ``KVFUZZ_GPU_REFERENCE_MIN_WORK``) would move to the GPU, measured on the CPU
(issue 51: on an H200 the small tier's reference was 3.5-12 host ms an example, on the CPU below
``GPU_REFERENCE_MIN_KV``).

    python benchmarks/reference_placement.py [--target vllm.flash_attn_varlen ...] [--examples 60]

Draws ``--examples`` small-tier examples of each target from its declaration as it reads on CUDA (no GPU needed:
``torch.cuda.is_available`` patched, as benchmarks/draw_identity.py does), eight per kernel configuration as a
campaign's chunks pin them, and times :func:`~kvfuzz.contracts.checks.reference.reference_and_envelope` on the CPU (one
torch thread, this thread's CPU time, after one warm-up call per example). Prints per target: the examples whose
reference ``reference_device`` leaves on the CPU today, the reference's mean and median ms, and for each threshold of
``reference_work`` the examples at or above it, their share of the reference time and the mean of the rest.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import time
from unittest import mock

import torch
from hypothesis.control import BuildContext
from hypothesis.internal.conjecture.data import ConjectureData

from kvfuzz.contracts.checks.reference import reference_and_envelope
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.fuzz.harness.run import GPU_REFERENCE_MIN_KV, reference_work
from kvfuzz.fuzz.targets.registry import BUILTIN
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.configs import config_for
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.tiers import tier_limits

THRESHOLDS = (1 << 20, 1 << 22, 1 << 23, 1 << 24)


def draw(name: str, n: int) -> list:
    """``n`` small-tier examples of target ``name`` as declared on CUDA, eight per pinned kernel configuration."""
    module, cls = BUILTIN[name].split(":")
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        caps = getattr(importlib.import_module(module), cls).capabilities
    limits = tier_limits("small", Limits())
    out, i, strategies = [], 0, {}
    while len(out) < n and i < 20 * n:
        k = len(out) // 8
        if k not in strategies:
            strategies[k] = examples(caps, limits, pin=config_for(caps, limits, 0, k))
        data = ConjectureData(random=random.Random(1000 * k + i))
        i += 1
        try:
            with BuildContext(data, wrapped_test=lambda: None):
                out.append(data.draw(strategies[k]))
        except BaseException as e:  # an assumption rejected, a draw that overran its buffer
            if not type(e).__module__.startswith("hypothesis"):
                raise
    return out


def measure(name: str, n: int) -> list[str]:
    rows = []
    for example in draw(name, n):
        batch = example.batch
        data = make_batch_data(batch, "cpu")
        reference_and_envelope(batch, data)
        began = time.thread_time()
        reference_and_envelope(batch, data)
        rows.append((reference_work(batch), 1e3 * (time.thread_time() - began), batch.kv_elements))
    total, times = sum(ms for _, ms, _ in rows), [ms for _, ms, _ in rows]
    on_cpu = [r for r in rows if r[2] < GPU_REFERENCE_MIN_KV]
    lines = [f"{name}: {len(rows)} small examples, {len(on_cpu)} with their reference on the CPU today (under "
             f"{GPU_REFERENCE_MIN_KV} KV elements); reference ms on one CPU thread: mean "
             f"{statistics.mean(times):.2f}, median {statistics.median(times):.2f}, max {max(times):.2f}"]
    for t in THRESHOLDS:
        big = [r for r in rows if r[0] >= t]
        rest = [ms for w, ms, _ in rows if w < t]
        lines.append(f"  reference_work >= 2**{t.bit_length() - 1}: {len(big)} examples "
                     f"({len([r for r in big if r[2] < GPU_REFERENCE_MIN_KV])} of them under the KV threshold), "
                     f"{100 * sum(ms for _, ms, _ in big) / total:.0f}% of the reference time, their mean "
                     f"{statistics.mean(ms for _, ms, _ in big) if big else 0.0:.2f} ms; the rest's mean "
                     f"{statistics.mean(rest) if rest else 0.0:.2f} ms")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="repeatable; default FA3 and unified_attention")
    ap.add_argument("--examples", type=int, default=60)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lines = []
    for name in args.target or ("vllm.flash_attn_varlen", "vllm.unified_attention"):
        lines += measure(name, args.examples)
        print("\n".join(lines[-1 - len(THRESHOLDS):]), flush=True)
    return lines


if __name__ == "__main__":
    main()
