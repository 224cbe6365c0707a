"""Strategies stay inside a target's declaration and shrink to small batches."""

import pytest
from hypothesis import find, given, settings

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode
from kvfuzz.strategies.batches import batches, boundary_lengths, examples
from kvfuzz.strategies.limits import Limits

CAPS = Capabilities(contract=Contract.SPLIT, devices=("cpu",), dtypes=("float16", "float32"),
                    head_sizes=(32, 64), block_sizes=(16, 32))
LIMITS = Limits(max_num_seqs=5, max_ctx_len=70, max_query_len=20, max_num_heads=16)
FIND = settings(max_examples=1000)  # find() would otherwise inherit the profile's small property budget


@settings(max_examples=200)
@given(batches(CAPS, LIMITS))
def test_batches_respect_capabilities_and_limits(b: Batch):
    assert b.dtype in CAPS.dtypes and b.head_size in CAPS.head_sizes and b.block_size in CAPS.block_sizes
    assert 1 <= b.num_seqs <= LIMITS.max_num_seqs and b.num_heads <= LIMITS.max_num_heads
    assert max(b.ctx_lens) <= LIMITS.max_ctx_len and max(b.query_lens) <= LIMITS.max_query_len
    assert b.num_heads % b.num_kv_heads == 0


def test_triton_targets_never_get_bf16_on_cpu():
    import torch
    t = VllmChunkedPrefillPagedDecode()
    if torch.cuda.is_available():
        assert "float32" not in t.capabilities.dtypes  # TF32 dots: not modeled yet
    else:
        assert "bfloat16" not in t.capabilities.dtypes  # Triton's interpreter computes bf16 wrongly


def test_mixed_batches_are_generated():
    find(batches(CAPS, LIMITS), lambda b: b.decode_seqs and b.prefill_seqs and 0 in [
        c for i, c in enumerate(b.ctx_lens) if not b.is_decode(i)], settings=settings(max_examples=500))


def test_block_boundaries_are_reached():
    for k in (15, 16, 17, 32):
        find(boundary_lengths(16, 0, 40), lambda n, k=k: n == k, settings=settings(max_examples=300))
    find(batches(CAPS, LIMITS), lambda b: any(s % b.block_size == 0 for s in b.seq_lens), settings=FIND)


def test_gqa_and_mqa_are_generated():
    find(batches(CAPS, LIMITS), lambda b: b.num_kv_heads == 1 and b.num_heads > 1, settings=FIND)
    find(batches(CAPS, LIMITS), lambda b: b.gqa_ratio == 16, settings=settings(max_examples=1000))


def test_block_tables_are_not_always_identity():
    find(batches(CAPS, LIMITS), lambda b: any(r[0] > r[1] for r, n in zip(b.block_table, b.seq_lens)
                                              if n > b.block_size), settings=FIND)


def test_shrinks_to_a_single_short_decode_sequence():
    """What a decode-only failure shrinks to: the smallest batch that has a decode sequence."""
    b = find(batches(CAPS, LIMITS), lambda b: len(b.decode_seqs) > 0, settings=FIND)
    assert b.num_seqs == 1 and b.query_lens == (1,) and b.ctx_lens == (0,)
    # fewest heads, smallest head size; the largest block size: as few blocks as possible
    assert b.num_heads == 1 and b.head_size == 32 and b.block_size == max(CAPS.block_sizes)


def test_examples_draw_every_poison_and_respect_the_choice():
    from kvfuzz.contracts.model.poison import Poison
    for p in Poison:
        find(examples(CAPS, LIMITS), lambda e, p=p: e.poison is p, settings=FIND)
    e = find(examples(CAPS, LIMITS, poisons=(Poison.ZEROS,)), lambda e: True, settings=FIND)
    assert e.poison is Poison.ZEROS


def test_explicit_softmax_scales_are_drawn():
    for want in (None, 1.0, 0.5):
        find(batches(CAPS, LIMITS), lambda b, w=want: (b.sm_scale is None) if w is None
             else b.sm_scale is not None and abs(b.sm_scale * b.head_size**0.5 - w) < 1e-12, settings=FIND)


@settings(max_examples=100)
@given(batches(Capabilities(contract=Contract.UNIFIED, devices=("cpu",),
                                                            dtypes=("float16",), head_sizes=(64,),
                                                            block_sizes=(16,), decode_only=True), LIMITS))
def test_decode_only_targets_get_decode_sequences_only(b: Batch):
    assert b.query_lens == (1,) * b.num_seqs


# ---- shrinking reaches what matters (issue: heads stayed at 16/1, lengths stopped at block boundaries, fp8 caches
# and value ranges survived in failures that did not need them, an early sequence could not be removed) ----------
WIDE = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16", "float32"),
                    head_sizes=(32, 64, 128), block_sizes=(16, 48), kv_cache_dtypes=("auto", "fp8_e4m3"),
                    features=("sliding_window", "softcap"))


def test_heads_shrink_independently_of_the_gqa_ratio():
    """A bug that needs a GQA group of 2 shrinks to H=2, Hkv=1, whatever ratio and kv heads were drawn first."""
    b = find(batches(WIDE, LIMITS), lambda b: b.gqa_ratio == 2 and b.num_heads >= 8, settings=FIND)
    assert (b.num_heads, b.num_kv_heads) == (8, 4)  # the predicate's own minimum
    b = find(batches(WIDE, LIMITS), lambda b: b.gqa_ratio >= 2, settings=FIND)
    assert (b.num_heads, b.num_kv_heads) == (2, 1)


def test_the_default_limits_draw_groups_past_16_and_a_wide_group_shrinks_to_its_smallest():
    """Limits() draws groups of 24, 32 and 64 (up to 64 query heads); a defect needing a group past 16 shrinks
    to MQA at the first such group of GQA_RATIOS: 32 query heads over one kv head (24, which only a defect of
    groups that are not a multiple of 16 needs, comes last)."""
    b = find(batches(WIDE, Limits()), lambda b: b.gqa_ratio > 16, settings=FIND)
    assert (b.num_heads, b.num_kv_heads) == (32, 1)
    b = find(batches(WIDE, Limits()), lambda b: b.gqa_ratio > 16 and b.gqa_ratio % 16, settings=FIND)
    assert (b.num_heads, b.num_kv_heads) == (24, 1)
    b = find(batches(WIDE, Limits()), lambda b: b.gqa_ratio == 64, settings=FIND)
    assert (b.num_heads, b.num_kv_heads) == (64, 1) and Limits().max_num_heads == 64


def test_lengths_shrink_to_their_minimum_not_to_a_block_boundary():
    """A defect at any seq_len >= 17 with block size 48 stopped at 47 (a boundary) before."""
    b = find(batches(WIDE, LIMITS), lambda b: b.block_size == 48 and max(b.seq_lens) >= 17, settings=FIND)
    assert b.seq_lens == (17,) and b.num_seqs == 1


def test_irrelevant_settings_shrink_away():
    """A failure that needs only a softcap keeps no fp8 cache, no other feature and plain values."""
    b = find(batches(WIDE, LIMITS), lambda b: b.softcap is not None and b.kv_cache_dtype != "auto"
             and b.value_range != "normal", settings=FIND)
    b2 = find(batches(WIDE, LIMITS), lambda b: b.softcap is not None, settings=FIND)
    assert b2.kv_cache_dtype == "auto" and b2.value_range == "normal" and b2.sliding_window is None
    assert b2.features == ("softcap",) and b2.num_seqs == 1 and b2.seq_lens == (1,)
    assert b.kv_cache_dtype == "fp8_e4m3"  # (the first predicate keeps what it asks for)


def test_any_sequence_can_be_removed():
    """A bug in one long sequence shrinks to that sequence alone, wherever it sat in the batch."""
    b = find(batches(WIDE, LIMITS), lambda b: b.num_seqs >= 3 and b.seq_lens[-1] >= 20, settings=FIND)
    assert b.num_seqs == 3
    b = find(batches(WIDE, LIMITS), lambda b: any(s >= 20 for s in b.seq_lens), settings=FIND)
    assert b.num_seqs == 1 and b.seq_lens == (20,)



def test_value_ranges_are_bounded_by_the_limits():
    from hypothesis.errors import InvalidArgument

    from kvfuzz.contracts.model.batch import VALUE_RANGES
    from kvfuzz.strategies import limits

    assert limits.VALUE_RANGES == VALUE_RANGES  # spelled out in limits.py to keep torch out of the CLI
    assert Limits().value_ranges == VALUE_RANGES and "extreme" in VALUE_RANGES  # every range, by default
    extreme = find(examples(CAPS, Limits()), lambda e: e.batch.value_range == "extreme", settings=FIND)
    assert extreme.batch.value_range == "extreme"
    narrow = Limits(max_num_seqs=2, max_ctx_len=8, max_query_len=4, max_num_heads=2, value_ranges=("equal",))
    assert find(examples(CAPS, narrow), lambda e: True, settings=FIND).batch.value_range == "equal"
    with pytest.raises(InvalidArgument, match="value_ranges"):
        Limits(value_ranges=("huge",))
    with pytest.raises(InvalidArgument, match="value_ranges"):
        Limits(value_ranges=())


def test_declared_gqa_ratios_bound_the_draws_the_configurations_and_the_declaration():
    """A kernel compiled for some GQA group sizes only (FlashInfer's CUDA-core decode: 1, 2, 3, 4, 8) gets no
    other, free or pinned; a batch with another is outside its declaration."""
    from kvfuzz.strategies.configs import config_for

    caps = Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16",), head_sizes=(64,),
                        block_sizes=(16,), gqa_ratios=(1, 2, 3, 4, 8))
    limits = Limits(max_num_seqs=2, max_ctx_len=20, max_query_len=4, max_num_heads=16)
    seen = set()

    @settings(max_examples=150, deadline=None, database=None)
    @given(batches(caps, limits))
    def draws(b):
        assert b.gqa_ratio in (1, 2, 3, 4, 8) and caps.accepts(b)
        seen.add(b.gqa_ratio)

    draws()
    assert len(seen) >= 3  # the draws did cover several declared sizes
    assert {config_for(caps, limits, 0, i).num_heads // config_for(caps, limits, 0, i).num_kv_heads
            for i in range(40)} <= {1, 2, 3, 4, 8}
    b = Batch(query_lens=[1], ctx_lens=[5], num_heads=7, num_kv_heads=1, head_size=64, block_size=16,
              num_blocks=2, block_table=[[0]], dtype="float16", seed=0)
    assert not caps.accepts(b) and caps.outside(b) == ["GQA group size 7"]
