"""The baseline ``kvfuzz bench detect`` compares kvfuzz with: the parametrized grids of vLLM's own kernel
tests, re-implemented against the mutant targets.

Grid side (docs/contracts.md §3), one pass per seed over these cases in order, stopping at the first failing case
(a test run that fails is "found"; the time and number of cases run until then are reported):

1. ``test_prefix_prefill`` (tests/kernels/attention/test_prefix_prefill.py, ``test_contexted_kv_attention``):
   KV_CACHE_DTYPES [float16, fp8, fp8_e5m2] with ``k_scale = v_scale = 1.0``, SLIDING_WINDOW [0, 16, 2048],
   NUM_HEADS [64], NUM_QUERIES_PER_KV [1, 64], HEAD_SIZES [24, 128], fp16; 10 sequences with
   ``query_len ~ randint(16, 1024)`` (the last one 1, a decode) and ``ctx_len ~ randint(16, 1024)``, block size
   32, a cache of 640 blocks with a random permutation as block table (64 columns), the cache zero-filled,
   inputs ``uniform(-1e-3, 1e-3)`` (an fp8 cache holds them converted with scale 1.0; the test's reference
   uses the unconverted fp16 keys), no sm_scale passed (the kernel's default), ``assert_close(atol=1e-4, or
   1e-3 for fp8, rtol=0)``. Scaled for the CPU by 1/8 in lengths, heads and windows: heads 8 with 1 or 8
   (MQA) queries per kv head, ``query_len ~ randint(2, 128)``, ``ctx_len ~ randint(2, 128)``, windows
   0, 2, 256, block size 8 (1/4), 32 columns and 320 blocks (1/2: blocks per sequence shrink by 8/4), head
   sizes unchanged. (With scale 1.0 a kernel that ignores the fp8 scales passes; and e4m3's smallest
   subnormal, 2**-9, is above the inputs' 1e-3, so the fp8 legs check outputs of ~1e-4 against atol 1e-3.)
2. ``test_triton_unified_attention``: (q_len, kv_len) sets [(1, 1328), (5, 18), (129, 463)] and
   [(1, 523), (1, 37), (1, 2011)]; heads (4, 4), (8, 2); head sizes 128, 256; block size 16; fp16, bf16;
   NUM_BLOCKS 32768 and 2048; window None; softcap None; q dtype None; the cache ``randn``, scale
   ``head_size**-0.5`` passed explicitly; ``atol 1.5e-2, rtol 1e-2``. Lengths, heads and head sizes unchanged;
   NUM_BLOCKS scaled by 1/8 (4096, 256); the random cache is a tiling of 64 random blocks (the slots the
   sequences use hold their own random keys/values).

Not modeled: the prefix test's ALiBi variant and the unified test's fp8 query, sliding-window and softcap
cases. The grids' block tables are drawn without repeats (``Batch`` forbids a block
shared by two sequences; vLLM's unified test draws ``randint`` with repeats). Both grids are checked against
kvfuzz's fp64 reference instead of their own fp16 references: at their tolerances (1e-4 on outputs of
magnitude 1e-3; 1.5e-2) the difference does not change a verdict.
"""


from __future__ import annotations

import time
from typing import Callable, Iterator

import attrs
import torch

from kvfuzz.contracts.caches.layouts import NHDLayout
from kvfuzz.contracts.caches.materialize import CacheState, materialize
from kvfuzz.contracts.checks.reference import reference_attention
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData, make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.mutants import get_mutant
from kvfuzz.fuzz.bench.paged_torch import batch_size


@attrs.frozen
class GridCase:
    """One parametrized case of a vLLM test, scaled for the CPU: how to build its batch, data and cache, and
    the test's tolerance."""

    test: str
    params: str
    build: Callable[[], tuple[Batch, BatchData, CacheState]]
    atol: float
    rtol: float
    #: The test's reference uses these keys/values instead of the cache's (fp8 legs: unquantized fp16).
    reference_data: Callable[[Batch, BatchData], BatchData] | None = None


def _distinct_table(gen: torch.Generator, seq_lens: list[int], block_size: int, num_blocks: int,
                    width: int) -> list[list[int]]:
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table, k = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        table.append(perm[k:k + n] + [0] * (width - n))
        k += n
    return table


def _prefix_case(seed: int, idx: int, num_heads: int, qpk: int, head_size: int, kv_cache_dtype: str = "auto",
                 window: int = 0) -> GridCase:
    unquantized: dict = {}

    def build():
        gen = torch.Generator().manual_seed(seed * 1000 + idx)
        n, bs, nb, width = 10, 8, 320, 32
        query_lens = torch.randint(2, 129, (n,), generator=gen).tolist()
        query_lens[-1] = 1
        ctx_lens = torch.randint(2, 129, (n,), generator=gen).tolist()
        perm = torch.randperm(nb, generator=gen)[: n * width].view(n, width).tolist()
        batch = Batch(query_lens=query_lens, ctx_lens=ctx_lens, num_heads=num_heads,
                      num_kv_heads=num_heads // qpk, head_size=head_size, block_size=bs, num_blocks=nb,
                      block_table=perm, dtype="float16", seed=seed, kv_cache_dtype=kv_cache_dtype,
                      sliding_window=window or None)
        total = sum(batch.seq_lens)

        def uni(*shape):
            return (torch.rand(shape, generator=gen) * 2e-3 - 1e-3).to(torch.float16)

        data = BatchData(query=uni(batch.num_tokens, num_heads, head_size),
                         keys=uni(total, batch.num_kv_heads, head_size),
                         values=uni(total, batch.num_kv_heads, head_size))
        unquantized["data"] = data
        if batch.fp8_dtype is not None:  # the cache holds the fp16 inputs converted to fp8 (scale 1.0)
            kc, vc = (x.to(batch.fp8_dtype) for x in (data.keys, data.values))
            data = BatchData(query=data.query, keys=kc.to(torch.float16), values=vc.to(torch.float16),
                             cache_keys=kc, cache_values=vc)
        cache = materialize(batch, data, NHDLayout(), batch.seq_lens, Poison.ZEROS)
        return batch, data, cache

    return GridCase("test_prefix_prefill",
                    f"heads={num_heads} qpk={qpk} D={head_size} fp16 {kv_cache_dtype} window={window}",
                    build, atol=1e-3 if kv_cache_dtype != "auto" else 1e-4, rtol=0.0,
                    reference_data=lambda batch, data: unquantized["data"])


UNIFIED_SEQ_SETS = ([(1, 1328), (5, 18), (129, 463)], [(1, 523), (1, 37), (1, 2011)])


def _unified_case(seed: int, idx: int, seqs, heads, head_size: int, dtype: str, num_blocks: int) -> GridCase:
    def build():
        gen = torch.Generator().manual_seed(seed * 1000 + idx)
        bs = 16
        query_lens = [q for q, _ in seqs]
        seq_lens = [k for _, k in seqs]
        width = -(-max(seq_lens) // bs)
        table = _distinct_table(gen, seq_lens, bs, num_blocks, width)
        batch = Batch(query_lens=query_lens, ctx_lens=[k - q for q, k in seqs], num_heads=heads[0],
                      num_kv_heads=heads[1], head_size=head_size, block_size=bs, num_blocks=num_blocks,
                      block_table=table, dtype=dtype, seed=seed * 1000 + idx, sm_scale=head_size ** -0.5)
        data = make_batch_data(batch)  # randn queries, keys, values, as the test's randn cache
        layout = NHDLayout()
        tile = torch.randn((64, bs, heads[1], head_size), generator=gen).to(batch.torch_dtype)
        reps = -(-num_blocks // 64)
        kc = tile.repeat(reps, 1, 1, 1)[:num_blocks].contiguous()
        vc = tile.flip(0).repeat(reps, 1, 1, 1)[:num_blocks].contiguous()
        from kvfuzz.contracts.model.batch import positions
        seq, pos = positions(batch.seq_lens)
        slots = batch.slots(seq, pos)
        rows = data.token_rows(batch, seq, pos)
        layout.write(kc, vc, slots, data.cache_keys[rows], data.cache_values[rows])
        return batch, data, CacheState(layout, kc, vc, batch.seq_lens, slots, Poison.STALE)

    kind = "decode-only" if all(q == 1 for q, _ in seqs) else "mixed"
    return GridCase("test_triton_unified_attention",
                    f"seqs={kind} heads={heads} D={head_size} BS=16 {dtype} NUM_BLOCKS={num_blocks * 8}(/8)",
                    build, atol=1.5e-2, rtol=1e-2)


def grid_cases(seed: int) -> Iterator[GridCase]:
    """The scaled cases of both vLLM tests, in order (module docstring)."""
    idx = 0
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        for window in (0, 2, 256):
            for qpk in (1, 8):
                for head_size in (24, 128):
                    yield _prefix_case(seed, idx, 8, qpk, head_size, kv_cache_dtype, window)
                    idx += 1
    for seqs in UNIFIED_SEQ_SETS:
        for heads in ((4, 4), (8, 2)):
            for head_size in (128, 256):
                for dtype in ("float16", "bfloat16"):
                    for nb in (4096, 256):
                        yield _unified_case(seed, idx, seqs, heads, head_size, dtype, nb)
                        idx += 1


def grid_fails(target, case: GridCase) -> tuple[bool, str, Batch]:
    """Run one grid case; ``(failed, why, batch)`` with the test's own verdict rule
    (``torch.testing.assert_close(out, ref, atol, rtol)``: NaN fails; a raised kernel error fails)."""
    batch, data, cache = case.build()
    call = target.build_call(batch, data, cache)
    try:
        out = target.run(call)
    except Exception as e:  # the test would error
        return True, f"kernel raised {type(e).__name__}: {e}", batch
    ref = reference_attention(batch, case.reference_data(batch, data) if case.reference_data else data)
    o = out.to(torch.float64)
    bad = ~((o - ref).abs() <= case.atol + case.rtol * ref.abs())
    if bad.any():
        err = (o - ref).abs().nan_to_num(float("inf")).max().item()
        return True, f"{int(bad.sum())} elements outside atol={case.atol} rtol={case.rtol} (max err {err:.3g})", batch
    return False, "", batch


def grid_detect(name: str, seed: int) -> dict:
    """One pass of the grid over mutant ``name``, stopping at the first failing case."""
    target = get_mutant(name)
    start = time.monotonic()
    out = {"tool": "grid", "mutant": name, "seed": seed, "found": False, "examples_to_first": None,
           "seconds_to_first": None, "check": None, "size": None, "case": None}
    n = 0
    for case in grid_cases(seed):
        n += 1
        failed, why, batch = grid_fails(target, case)
        if failed:
            out.update(found=True, examples_to_first=n, seconds_to_first=round(time.monotonic() - start, 3),
                       check=why, size=batch_size(batch), case=f"{case.test}[{case.params}]")
            break
    out.update(examples_total=n, seconds_total=round(time.monotonic() - start, 3))
    return out


__all__ = ["GridCase", "grid_cases", "grid_detect", "grid_fails"]
