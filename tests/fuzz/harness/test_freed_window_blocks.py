"""The "sliding window with freed blocks" production state (``Batch.freed_window_blocks``, issue 32): vLLM's
SlidingWindowManager frees the blocks wholly before each sequence's window and points their columns at the null
block (vllm/v1/core/single_type_kv_cache_manager.py, remove_skipped_blocks). The model's own checks reject what
breaks it; the materializer leaves freed positions poisoned; the guard accepts freed columns and flags a visible
column on the null block; a default campaign finds and shrinks a kernel that reads the freed blocks, and passes
one that does not."""

import tempfile
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis.database import InMemoryExampleDatabase
from support.planted_window import ReadsFreedBlocks, SkipsFreedBlocks

from kvfuzz.contracts.caches.layouts import NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.invariants import check_cache_holds, check_unified_invariant
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.batch import NULL_BLOCK, Batch
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import PagedTorch
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness.attention import check_example, prepare
from kvfuzz.fuzz.harness.caller import call_violations, checked_signature
from kvfuzz.fuzz.targets.registry import get_target
from kvfuzz.strategies.batches import batches, freed_window_table


def _batch(**kw) -> Batch:
    """Decode at position 40 (W = 8: keys 33..40 visible, blocks 0 and 1 wholly before: freed) and a prefill of 3
    after 20 (keys from 13 on: nothing freed), block size 16."""
    base = dict(query_lens=[1, 3], ctx_lens=[40, 20], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                num_blocks=6, block_table=[[0, 0, 1, 0], [2, 3, 0, 0]], sliding_window=8, freed_window_blocks=True,
                dtype="float32")
    return Batch(**{**base, **kw})


def test_freed_columns_follow_vllms_rule():
    b = _batch()
    assert [b.freed_blocks(i) for i in range(2)] == [2, 0]  # (ctx_len - W + 1) // block_size = 33 // 16, 13 // 16
    assert attrs.evolve(b, freed_window_blocks=False, block_table=[[4, 5, 1, 0], [2, 3, 0, 0]]).freed_blocks(0) == 0
    seq, pos = b.held_positions(b.seq_lens)
    assert pos[seq == 0].tolist() == list(range(32, 41)) and pos[seq == 1].tolist() == list(range(23))
    assert "freed_window_blocks=[2, 0]" in b.summary()
    assert Batch.from_dict(b.to_dict()) == b and "freed_window_blocks" not in attrs.evolve(
        b, freed_window_blocks=False, block_table=[[4, 5, 1, 0], [2, 3, 0, 0]]).to_dict()


@pytest.mark.parametrize("table, match", [
    ([[0, 0, 0, 0], [2, 3, 0, 0]], r"block_table\[0\]\[2\] = 0 is the null block.*queries can see"),
    ([[5, 0, 1, 0], [2, 3, 0, 0]], r"block_table\[0\]\[0\] = 5, but with freed_window_blocks"),
    ([[0, 0, 1, 0], [0, 3, 0, 0]], r"block_table\[1\]\[0\] = 0 is the null block"),
    ([[0, 0, 1, 0], [1, 3, 0, 0]], r"block 1 is used by sequences 0 and 1"),
])
def test_validation_rejects_what_breaks_the_state(table, match):
    with pytest.raises(ValueError, match=match):
        _batch(block_table=table)


def test_needs_a_window():
    with pytest.raises(ValueError, match="needs sliding_window"):
        _batch(sliding_window=None)
    with pytest.raises(ValueError, match="needs the feature 'sliding_window'"):
        attrs.evolve(PagedTorch.capabilities, features=("alibi",), freed_window_blocks=True)


def test_shared_prefix_blocks_of_a_sequence_that_freed_more():
    """vLLM frees a shared prefix block from one request's table while another, with less context, still reads
    it: the later user's freed column does not stop the sharing (block 2 at column 1 of both)."""
    b = Batch(query_lens=[1, 1], ctx_lens=[32, 40], num_heads=1, num_kv_heads=1, head_size=32, block_size=16,
              num_blocks=5, block_table=[[1, 2, 4], [0, 2, 3]], sliding_window=20, freed_window_blocks=True)
    assert [b.freed_blocks(i) for i in range(2)] == [0, 1] and b.shared_prefix_blocks == (0, 2)
    dst, src = b.shared_prefix_rows()
    assert dst.tolist() == list(range(33 + 16, 33 + 32)) and src.tolist() == list(range(16, 32))
    with pytest.raises(ValueError, match="columns before 1 differ"):  # without the state: column 0 differs
        attrs.evolve(b, freed_window_blocks=False)


def test_a_shared_block_past_a_column_only_the_earlier_user_freed():
    """Found on an H100 (2026-11-25, a `--tier auto` campaign of vllm.unified_attention): the earlier user freed
    columns 0 and 1, the later one only column 0 and still holds its own column 1 (block 3), and both share
    block 1 at column 2. _check_shared accepts it (the columns both hold agree); the data generator used to stop
    at column 1, so the later user wrote other keys into the shared block: a unified-invariant failure blamed on
    the caller, kvfuzz itself."""
    b = Batch(query_lens=[1, 1], ctx_lens=[49, 48], num_heads=1, num_kv_heads=1, head_size=32, block_size=16,
              num_blocks=5, block_table=[[0, 0, 1, 2], [0, 3, 1, 4]], dtype="float16", sliding_window=18,
              freed_window_blocks=True)
    assert [b.freed_blocks(i) for i in range(2)] == [2, 1] and b.shared_prefix_blocks == (0, 3)
    dst, src = b.shared_prefix_rows()
    assert dst.tolist() == list(range(50 + 32, 50 + 48)) and src.tolist() == list(range(32, 48))
    data = make_batch_data(b)
    cache = materialize(b, data, NHDLayout(), b.seq_lens, Poison.NAN)
    assert check_unified_invariant(b, data, NHDLayout(), cache.key_cache, cache.value_cache) == []


def test_materializer_and_invariant_leave_freed_positions_poisoned():
    b = _batch()
    data = make_batch_data(b)
    cache = materialize(b, data, NHDLayout(), b.seq_lens, Poison.NAN)
    assert cache.key_cache[NULL_BLOCK].isnan().all() and cache.value_cache[NULL_BLOCK].isnan().all()
    assert not cache.key_cache[1, :9].isnan().any() and not cache.key_cache[2].isnan().any()  # positions 32..40, 0..15
    assert check_unified_invariant(b, data, NHDLayout(), cache.key_cache, cache.value_cache) == []
    # a position the window needs, missing: the invariant still fires
    cache.key_cache[1, 0] = float("nan")
    (v,) = check_unified_invariant(b, data, NHDLayout(), cache.key_cache, cache.value_cache)
    assert (v.check, v.seq, v.position) == (Check.UNIFIED, 0, 32)


@pytest.mark.kernel
def test_guard_accepts_freed_columns_and_flags_a_visible_null_column():
    """vllm.unified_attention's guard checks: the freed state passes; pointing a visible column at the null block
    (block 0) is an error naming the column, and only when the null block is known (the harness passes it for
    a batch in the state)."""
    target = get_target("vllm.unified_attention")
    run = prepare(target, Example(_batch(), Poison.NAN))
    assert call_violations(target, run) == []
    sig = checked_signature(target)
    kw = dict(run.call.kwargs)
    kw["block_table"] = kw["block_table"].clone()
    kw["block_table"][0, 2] = NULL_BLOCK
    (v,) = [v for v in sig.check(kw, vacuity=False, null_block=NULL_BLOCK) if v.check is Check.NULL_BLOCK]
    assert v.is_error and (v.seq, v.position, v.block) == (0, 32, NULL_BLOCK) and "first visible key 33" in v.message
    assert not [v for v in sig.check(kw, vacuity=False) if v.check is Check.NULL_BLOCK]
    kw["window_size"] = (-1, -1)  # no window: nothing is freed, nothing to check
    assert not [v for v in sig.check(kw, vacuity=False, null_block=NULL_BLOCK) if v.check is Check.NULL_BLOCK]
    # the harness's path: the state's hooks (fuzz/harness/states.py) hand the guard the null block
    run.call.kwargs["block_table"] = kw["block_table"]
    assert [v.check for v in call_violations(target, run) if v.check is Check.NULL_BLOCK] == [Check.NULL_BLOCK]


def test_freed_window_table_reserves_the_null_block():
    n, table = freed_window_table([[0, 1, 2], [3, 4, 0]], [1, 1], [40, 20], 16, 5, 8)
    assert (n, table) == (6, [[0, 0, 3], [4, 5, 0]])


@settings(max_examples=150, deadline=None, database=None)
@given(b=batches(ReadsFreedBlocks.capabilities))
def test_strategy_draws_valid_freed_batches(b):
    assert ReadsFreedBlocks.capabilities.accepts(b)
    if b.freed_window_blocks:
        assert b.sliding_window is not None
        for i in range(b.num_seqs):
            row = b.block_table[i][: b.blocks_needed(i)]
            assert all(x == NULL_BLOCK for x in row[: b.freed_blocks(i)])
            assert NULL_BLOCK not in row[b.freed_blocks(i):]


def test_strategy_reaches_freed_blocks():
    b = find(batches(ReadsFreedBlocks.capabilities), lambda b: any(b.freed_blocks(i) for i in range(b.num_seqs)),
             settings=settings(max_examples=2000, database=None))
    assert b.num_seqs == 1 and b.block_table[0][0] == NULL_BLOCK  # shrunk: one sequence, its first column freed


@settings(max_examples=100, deadline=None, database=None)
@given(b=batches(PagedTorch.capabilities))
def test_undeclaring_targets_never_get_the_state(b):
    assert not b.freed_window_blocks


def test_declarations():
    assert ReadsFreedBlocks.capabilities.states == ("freed window blocks",)
    assert PagedTorch.capabilities.states == ()
    assert "freed window blocks" in PagedTorch.capabilities.outside(_batch())
    assert not PagedTorch.capabilities.accepts(_batch(head_size=32, dtype="float32"))
    # vLLM frees the blocks whatever the backend: CUDA's TRITON_ATTN calls unified_attention, ROCm's ROCM_ATTN
    # chunked_prefill_paged_decode (its prefill part context_attention_fwd; vllm#53628, docs/targets.md)
    for name in ("vllm.unified_attention", "vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd"):
        assert get_target(name).capabilities.freed_window_blocks


def _campaign(target, max_examples: int):
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=max_examples, duration=240, seed=0,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True)
    return fuzz_target(target, config)


def test_default_campaign_finds_and_shrinks_a_kernel_reading_freed_blocks():
    stats = _campaign(ReadsFreedBlocks(), 400)
    assert stats.failures, f"not found in {stats.examples} examples"
    rec = min(stats.failures.values(), key=lambda r: len(Example.from_dict(r.example).batch.query_lens))
    b = Example.from_dict(rec.example).batch
    assert rec.kind == "non-finite output" and rec.blame == "kernel"
    assert b.num_seqs == 1 and b.freed_window_blocks and b.freed_blocks(0) >= 1
    # the same example with the blocks kept (the state off) passes: the state is the trigger
    n = b.num_blocks
    kept = attrs.evolve(b, freed_window_blocks=False, num_blocks=n + b.freed_blocks(0),
                        block_table=[[n + c if c < b.freed_blocks(0) else x for c, x in enumerate(b.block_table[0])]])
    check_example(ReadsFreedBlocks(), Example(kept, Example.from_dict(rec.example).poison))


def test_default_campaign_passes_a_kernel_that_skips_freed_blocks():
    stats = _campaign(SkipsFreedBlocks(), 300)
    assert not stats.failures, [(r.kind, r.example) for r in stats.failures.values()][:1]
    assert stats.examples >= 300


def test_a_sequence_with_every_cached_position_freed_is_checked_not_a_harness_error():
    """Block size 1, ctx 1, window 1: the one context block is freed, so the cache owes no position. The cache
    check gathered zero slots and reshaped them to ``[0, 1, -1]`` (a RuntimeError in kvfuzz's own check,
    issue 39); now it owes nothing and the kernel's output is checked."""
    b = Batch(query_lens=[1], ctx_lens=[1], num_heads=1, num_kv_heads=1, head_size=32, block_size=1,
              dtype="float32", num_blocks=2, block_table=[[0, 1]], sliding_window=1, freed_window_blocks=True)
    assert b.freed_blocks(0) == 1 and not len(b.held_positions([1])[0])
    layout = VllmPagedLayout()
    kc, vc = layout.allocate(b, "cpu")
    k, v = layout.gather(kc, vc, torch.zeros(0, dtype=torch.int64))
    assert k.shape == (0, 1, 32) and v.shape == (0, 1, 32)
    assert check_cache_holds(Check.PREFILL, b, make_batch_data(b), layout, kc, vc, {0: 1}) == []
    check_example(get_target("vllm.context_attention_fwd"), Example(b, Poison.ZEROS))  # the real kernel passes
