"""The materializer: each required token at its slot, poison everywhere else, for each layout."""

import pytest
import torch

from kvfuzz.contracts.caches.layouts import LayoutError, NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.model.batch import positions
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison

LAYOUTS = [VllmPagedLayout(), NHDLayout()]


def all_slots(b):
    return torch.arange(b.num_blocks * b.block_size)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("contract", list(Contract), ids=lambda c: c.value)
def test_required_tokens_at_their_slots_and_poison_elsewhere(make_batch, layout, dtype, contract):
    b = make_batch([(5, 3), (1, 20), (17, 0), (1, 0)], dtype=dtype, spare=2, reverse=True, seed=3)
    d = make_batch_data(b)
    lens = contract.cached_lens(b)
    state = materialize(b, d, layout, lens, Poison.NAN)
    seq, pos = positions(lens)
    slots = b.slots(seq, pos)
    k, v = layout.gather(state.key_cache, state.value_cache, slots)
    rows = d.token_rows(b, seq, pos)
    assert torch.equal(k, d.keys[rows]) and torch.equal(v, d.values[rows])
    others = torch.ones(b.num_blocks * b.block_size, dtype=torch.bool)
    others[slots] = False
    ok, ov = layout.gather(state.key_cache, state.value_cache, all_slots(b)[others])
    assert ok.isnan().all() and ov.isnan().all()
    # exactly the required count was written: the split contract skips prefill new tokens
    assert len(slots) == sum(lens)


@pytest.mark.parametrize("poison", list(Poison), ids=lambda p: p.value)
def test_each_poison_fills_unwritten_slots(make_batch, poison):
    b = make_batch([(1, 5)], dtype="float16", spare=1)
    d = make_batch_data(b)
    layout = NHDLayout()
    state = materialize(b, d, layout, (3,), poison)
    k, v = layout.gather(state.key_cache, state.value_cache, torch.arange(3, b.num_blocks * b.block_size))
    if poison is Poison.NAN:
        assert k.isnan().all()
    elif poison is Poison.INF:
        assert (k == float("inf")).all()
    elif poison is Poison.ZEROS:
        assert (k == 0).all()
    else:
        assert k.abs().max() > 10 and torch.isfinite(k).all()


def test_rejects_cached_len_past_seq_len(make_batch):
    b = make_batch([(1, 5)])
    with pytest.raises(ValueError, match="outside 0..seq_len"):
        materialize(b, make_batch_data(b), NHDLayout(), (7,), Poison.ZEROS)


def test_vllm_layout_rejects_head_size_not_multiple_of_x(make_batch):
    b = make_batch([(1, 5)], head_size=20, dtype="float16")  # x = 8 for fp16
    with pytest.raises(LayoutError, match="multiple of x=8"):
        VllmPagedLayout().allocate(b)


@pytest.mark.parametrize("kv, nan, inf", [("fp8_e4m3", 0x7F, 0x7F), ("fp8_e5m2", 0x7F, 0x7C)])
def test_fp8_cache_holds_the_codes_and_fp8_poison(make_batch, kv, nan, inf):
    import attrs
    b = attrs.evolve(make_batch([(1, 5)], dtype="float16"), kv_cache_dtype=kv, k_scale=0.375, v_scale=2.0)
    d = make_batch_data(b)
    for poison, code in ((Poison.NAN, nan), (Poison.INF, inf)):
        state = materialize(b, d, NHDLayout(), (6,), poison)
        assert state.key_cache.dtype == b.fp8_dtype
        k, v = NHDLayout().gather(state.key_cache, state.value_cache, torch.arange(6))
        assert torch.equal(k.view(torch.uint8), d.cache_keys.view(torch.uint8))
        assert torch.equal(v.float() * 2.0, d.values.float())  # the logical values are codes * v_scale
        assert (state.key_cache.view(torch.uint8)[0, 6:] == code).all()  # unwritten tail of block 0
    stale = materialize(b, d, VllmPagedLayout(), (6,), Poison.STALE)
    assert torch.isfinite(stale.key_cache.float()).all()  # saturated to the fp8 range, never NaN


def test_scales_need_an_fp8_cache(make_batch):
    import attrs
    with pytest.raises(ValueError, match="apply to fp8 caches only"):
        attrs.evolve(make_batch([(1, 5)]), k_scale=0.5)
    with pytest.raises(ValueError, match="q_scale=0.375 applies with an fp8 cache only"):
        attrs.evolve(make_batch([(1, 5)]), q_scale=0.375)
    assert attrs.evolve(make_batch([(1, 5)]), kv_cache_dtype="fp8_e4m3", q_scale=0.375).q_scale == 0.375
    from kvfuzz.contracts.model.capabilities import Capabilities
    from kvfuzz.contracts.model.contract import Contract

    with pytest.raises(ValueError, match="quant_query .* needs an fp8 kv_cache_dtype"):
        Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("bfloat16",), head_sizes=(64,),
                     block_sizes=(16,), quant_query=True)


def test_big_caches_are_poisoned_only_where_referenced(make_batch, monkeypatch):
    import importlib
    m = importlib.import_module("kvfuzz.contracts.caches.materialize")
    from kvfuzz.strategies.batches import relocate_high

    b = relocate_high(make_batch([(1, 5), (3, 4)], dtype="float16", block_size=16), min_element_offset=2**16)
    assert min(r[0] for r in b.block_table) * 16 * b.num_kv_heads * b.head_size >= 2**16
    monkeypatch.setattr(m, "FULL_POISON_MAX_BYTES", 1024)
    d = make_batch_data(b)
    state = m.materialize(b, d, NHDLayout(), b.seq_lens, Poison.NAN)
    used = m.referenced_blocks(b)
    assert torch.isnan(state.key_cache[used]).any()  # tails of referenced blocks are poisoned
    k, _ = NHDLayout().gather(state.key_cache, state.value_cache, b.slots(*positions(b.seq_lens)))
    assert torch.equal(k, d.keys)


def test_vllm_5d_layout_matches_vllm_documented_indexing(make_batch):
    """Token t at (blk, off): key_cache[blk, h, d // x, off, d % x] and value_cache[blk, h, d, off]."""
    b = make_batch([(1, 20)], dtype="float16", num_kv_heads=2, num_heads=2)
    d = make_batch_data(b)
    state = materialize(b, d, VllmPagedLayout(), (21,), Poison.ZEROS)
    x = 8
    p = 19  # position 19 -> block_table[0][1], offset 3
    blk, off = b.block_table[0][1], 3
    for h in range(2):
        for dim in (0, 7, 8, 31):
            assert state.key_cache[blk, h, dim // x, off, dim % x] == d.keys[p, h, dim]
            assert state.value_cache[blk, h, dim, off] == d.values[p, h, dim]


def test_stale_poison_is_large_finite_values_drawn_from_the_seed_repeating_every_period(make_batch):
    """STALE: the same seed gives the same cache, another seed other values; the blocks of a period differ and
    the pattern repeats every STALE_PERIOD blocks; values are N(0, 1) * STALE_MAGNITUDE."""
    from kvfuzz.contracts.caches.materialize import STALE_MAGNITUDE, STALE_PERIOD, fill_poison

    t = torch.empty((2 * STALE_PERIOD + 3, 2, 4, 8), dtype=torch.float16)
    fill_poison(t, Poison.STALE, 7)
    again, other = torch.empty_like(t), torch.empty_like(t)
    fill_poison(again, Poison.STALE, 7)
    fill_poison(other, Poison.STALE, 8)
    assert torch.equal(t, again) and not torch.equal(t, other)
    assert torch.isfinite(t).all() and t.abs().max() > 2 * STALE_MAGNITUDE
    assert 0.8 * STALE_MAGNITUDE < t.float().std() < 1.2 * STALE_MAGNITUDE
    assert all(not torch.equal(t[0], t[i]) for i in range(1, STALE_PERIOD))
    assert torch.equal(t[:STALE_PERIOD], t[STALE_PERIOD:2 * STALE_PERIOD])
    assert torch.equal(t[2 * STALE_PERIOD:], t[:3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("blocks", [1, 5, 16, 2 * 16, 3 * 16 + 7])
def test_stale_poison_fills_a_strided_view_like_one_copy_per_period(blocks, dtype):
    """The fill of every block (whole periods through one broadcast copy, then the remainder) equals copying
    the pattern period by period, also into a non-contiguous view (one half of a FlashInfer-style
    ``[num_blocks, 2, ...]`` cache), and leaves the other half alone."""
    from kvfuzz.contracts.caches.materialize import STALE_PERIOD, fill_poison, stale_pattern

    kv = torch.zeros((blocks, 2, 3, 8), dtype=dtype)
    fill_poison(kv[:, 0], Poison.STALE, 11)
    period = min(blocks, STALE_PERIOD)
    pattern = stale_pattern((period, 3, 8), dtype, 11).view(torch.uint8)
    want = torch.cat([pattern] * (blocks // period) + [pattern[: blocks % period]])
    assert torch.equal(kv[:, 0].view(torch.uint8), want)
    assert not kv[:, 1].view(torch.uint8).any()


def test_a_stale_pattern_larger_than_the_pool_wraps_around_it(monkeypatch):
    import importlib

    m = importlib.import_module("kvfuzz.contracts.caches.materialize")
    monkeypatch.setattr(m, "STALE_POOL_SIZE", 1000)
    monkeypatch.setattr(m, "_STALE_POOLS", {})
    small = m.stale_pattern((1000,), torch.float32, 3)  # one whole pool, from the seed's offset on
    big = m.stale_pattern((5, 700), torch.float32, 3)
    assert big.shape == (5, 700)
    flat = big.flatten()
    assert torch.equal(flat[:1000], small) and torch.equal(flat[1000:2000], small)
    assert torch.equal(flat[2000:3000], small) and torch.equal(flat[3000:], small[:500])
    fp8 = m.stale_pattern((10, 10), torch.float8_e4m3fn, 3)
    assert torch.isfinite(fp8.float()).all()  # saturated to the fp8 range, never NaN
