"""Size tiers (strategies/tiers.py): their limits, the batches they draw, how they shrink and how a campaign
rotates them by chunk."""

import collections

import attrs
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis.errors import NoSuchExample

from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.tiers import LONG_CTX_LEN, SMALL_EVERY, TIERS, WIDE_NUM_SEQS, tier_limits, tier_of_chunk

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16",), head_sizes=(32, 64),
                    block_sizes=(16, 32))
FIND = settings(max_examples=2000)


def test_tier_limits():
    base = Limits()
    assert tier_limits("small", base) is base and tier_limits("big-cache", base) is base
    long, wide = tier_limits("long", base), tier_limits("wide", base)
    assert long.max_ctx_len == LONG_CTX_LEN == 131072 and long.max_num_seqs <= 2
    assert wide.max_num_seqs == WIDE_NUM_SEQS == 256 and wide.max_ctx_len == base.max_ctx_len
    assert long.value_ranges == base.value_ranges and long.max_query_len == base.max_query_len
    with pytest.raises(ValueError, match="unknown size tier 'huge'"):
        tier_limits("huge", base)


def test_a_long_batch_passes_10k_tokens_and_shrinks_to_a_small_one():
    limits = tier_limits("long", Limits())
    long = find(batches(CAPS, limits), lambda b: max(b.ctx_lens) > 10_000, settings=FIND)
    # the shrinker walks the context down to the smallest that still satisfies the condition
    assert max(long.ctx_lens) <= 10_001 + max(CAPS.block_sizes) and long.num_seqs == 1
    small = find(batches(CAPS, limits), lambda b: b.num_seqs >= 1, settings=FIND)
    assert max(small.ctx_lens) <= 1 and max(small.query_lens) <= 2  # the minimum stays small


def test_a_wide_batch_passes_64_sequences_and_shrinks_back():
    limits = tier_limits("wide", Limits())
    seen = []

    @settings(max_examples=10, phases=[Phase.generate], database=None)
    @given(batches(CAPS, limits))
    def draw(b):
        assert b.num_seqs <= WIDE_NUM_SEQS and max(b.ctx_lens) <= limits.max_ctx_len
        seen.append(b.num_seqs)

    draw()
    assert max(seen) > 64  # each of the 256 slots is in the batch with probability 1/2
    assert find(batches(CAPS, limits), lambda b: True, settings=FIND).num_seqs == 1  # its minimum: one sequence


def test_tier_of_chunk_keeps_small_at_80_percent_and_at_60_with_serving():
    assert {tier_of_chunk(("small",), k) for k in range(20)} == {"small"}
    large = tuple(t for t in TIERS if t != "serving")
    counts = collections.Counter(tier_of_chunk(large, k) for k in range(SMALL_EVERY * 3 * 10))
    assert counts["small"] / sum(counts.values()) == 0.8
    assert counts["long"] == counts["wide"] == counts["big-cache"] == 10
    counts = collections.Counter(tier_of_chunk(TIERS, k) for k in range(600))  # 2 fives: every large tier 3 times
    assert counts["small"] / 600 == 0.6 and counts["serving"] / 600 == 0.3
    assert counts["long"] == counts["wide"] == counts["big-cache"] == 20
    assert [tier_of_chunk(("small", "serving"), k) for k in range(5)] == [
        "small", "serving", "small", "serving", "small"]  # 2 of every 5 without another large tier
    assert [tier_of_chunk(("long", "wide"), k) for k in range(4)] == ["long", "wide", "long", "wide"]
    assert [tier_of_chunk(("small", "long", "wide"), k) for k in range(7)] == [
        "small", "long", "small", "small", "small", "small", "wide"]  # the second chunk already a large tier
    assert tier_of_chunk(TIERS, -1) == tier_of_chunk(TIERS, 0)  # a warm-up chunk as its configuration's index
    with pytest.raises(ValueError, match="at least one tier"):
        tier_of_chunk((), 0)


def test_a_long_batch_of_many_wide_heads_stays_within_the_generators_stream():
    """The data generator draws at most MAX_STREAM_ELEMENTS keys (contracts/model/counter_rng.py): batches cut
    each context to its share, and the long tier still comes near it."""
    from kvfuzz.contracts.model.counter_rng import MAX_STREAM_ELEMENTS

    caps = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16",), head_sizes=(512,),
                        block_sizes=(16,))
    limits = attrs.evolve(tier_limits("long", Limits()), max_num_heads=32)
    keys = lambda b: sum(b.seq_lens) * b.num_kv_heads * b.head_size  # noqa: E731
    with pytest.raises(NoSuchExample):
        find(batches(caps, limits), lambda b: keys(b) > MAX_STREAM_ELEMENTS, settings=FIND)
    assert keys(find(batches(caps, limits), lambda b: keys(b) > MAX_STREAM_ELEMENTS // 2, settings=FIND)) > 0
