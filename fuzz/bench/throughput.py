"""Where an example's time goes: ``kvfuzz bench throughput``.

For each target, examples drawn by kvfuzz's strategies run through the property and their per-stage times
(:class:`~kvfuzz.fuzz.harness.run.Timings`: generation, cache materialization, caller checks, kernel,
reference, output checks, and the kernel call's compiles and queued device work) are summed; the harness
overhead ratio is (time outside the kernel) / total.
Materialization bandwidth is the bytes of both caches (poison fill plus token writes) over the
materialization time. Two sweeps show how time per example grows with total tokens and with num_blocks (a
single sequence, spare blocks added: the poison fill touches the whole cache).
"""

from __future__ import annotations

import time

import attrs
from hypothesis import HealthCheck, given, seed, settings

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.run import Run, Timings
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits

STAGES = tuple(a.name for a in attrs.fields(Timings))


def _timed(target: Target, example: Example) -> tuple[Run, float]:
    s = time.perf_counter()
    run = properties.prepare(target, example)
    try:
        properties.check(target, example, run=run)
    except Finding:
        pass  # a finding still costs what it costs; throughput counts it
    return run, time.perf_counter() - s


def _cache_bytes(run: Run) -> int:
    kc, vc = run.cache.key_cache, run.cache.value_cache
    # the CPU op's caches are two views of one allocation: count the storage once
    if kc.untyped_storage().data_ptr() == vc.untyped_storage().data_ptr():
        return kc.untyped_storage().nbytes()
    return kc.untyped_storage().nbytes() + vc.untyped_storage().nbytes()


def stage_profile(target: Target, n: int = 30, seed_: int = 0, limits: Limits = Limits()) -> dict:
    """Run ``n`` generated examples (finite poison) and return per-stage seconds, examples/s, the harness
    overhead ratio and the materialization bandwidth in GB/s."""
    totals = dict.fromkeys(STAGES, 0.0)
    wall = [0.0]
    cache_bytes = [0]
    count = [0]

    @seed(seed_)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(examples(target.capabilities, limits, (Poison.STALE, Poison.ZEROS)))
    def body(example: Example) -> None:
        run, seconds = _timed(target, example)
        wall[0] += seconds
        count[0] += 1
        cache_bytes[0] += _cache_bytes(run)
        for k in STAGES:
            totals[k] += getattr(run.timings, k)

    body()
    kernel = totals["kernel"]
    return {
        "target": target.name, "examples": count[0], "seconds": round(wall[0], 4),
        "examples_per_s": round(count[0] / wall[0], 3) if wall[0] else 0.0,
        "stages_s": {k: round(v, 4) for k, v in totals.items()},
        "harness_overhead": round((wall[0] - kernel) / wall[0], 3) if wall[0] else 0.0,
        "materialize_gb_per_s": (round(cache_bytes[0] / totals["materialize"] / 1e9, 3) if totals["materialize"]
                                 else None),
    }


def _single_sequence(target: Target, seq_len: int, num_blocks: int | None = None, num_seqs: int = 1) -> Batch:
    caps = target.capabilities
    bs = (max(b for b in caps.block_sizes if b <= 64) if any(b <= 64 for b in caps.block_sizes)
          else min(caps.block_sizes))
    per = [seq_len // num_seqs] * num_seqs
    needed = [-(-n // bs) for n in per]
    total = num_blocks or sum(needed)
    table, k = [], 0
    for n in needed:
        table.append(list(range(k, k + n)) + [0] * (max(needed) - n))
        k += n
    q = 1 if caps.decode_only else 4
    return Batch(query_lens=[min(q, n) for n in per], ctx_lens=[n - min(q, n) for n in per], num_heads=4,
                 num_kv_heads=2, head_size=64 if 64 in caps.head_sizes else min(caps.head_sizes), block_size=bs,
                 num_blocks=total, block_table=table, dtype=caps.dtypes[0], seed=1)


def scaling(target: Target, token_counts=(64, 256, 1024), block_counts=(64, 1024, 16384), repeat: int = 3) -> dict:
    """Seconds per example (median of ``repeat``) as total tokens grow (4 sequences) and as num_blocks grows
    (one short sequence, the rest spare blocks)."""
    import statistics

    def per_example(batch: Batch) -> dict:
        times, runs = [], []
        for _ in range(repeat):
            run, t = _timed(target, Example(batch, Poison.STALE))
            times.append(t)
            runs.append(run)
        mid = runs[len(runs) // 2].timings
        return {"seconds": round(statistics.median(times), 4), "kernel_s": round(mid.kernel, 4),
                "materialize_s": round(mid.materialize, 4)}

    by_tokens = {n: per_example(_single_sequence(target, n, num_seqs=4)) for n in token_counts}
    by_blocks = {n: per_example(_single_sequence(target, 32, num_blocks=n)) for n in block_counts}
    return {"target": target.name, "by_total_tokens": by_tokens, "by_num_blocks": by_blocks}


__all__ = ["STAGES", "scaling", "stage_profile"]
