"""Each contract checker passes a correct call and fires, located, on a violating one."""

import pytest
import torch

from kvfuzz.contracts.caches.layouts import NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.invariants import (
    DECODE,
    PREFILL,
    UNIFIED,
    check_contract,
    check_decode_invariant,
    check_prefill_invariant,
    check_unified_invariant,
)
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison


def setup(make_batch, contract, lens=None, layout=VllmPagedLayout(), poison=Poison.NAN, **kw):
    b = make_batch([(5, 3), (1, 20), (17, 0)], dtype="float16", reverse=True, seed=5, **kw)
    d = make_batch_data(b)
    state = materialize(b, d, layout, lens or contract.cached_lens(b), poison)
    return b, d, state


@pytest.mark.parametrize("contract", list(Contract), ids=lambda c: c.value)
@pytest.mark.parametrize("layout", [VllmPagedLayout(), NHDLayout()], ids=lambda l: l.name)
def test_correct_calls_pass(make_batch, contract, layout):
    b, d, s = setup(make_batch, contract, layout=layout)
    key, value = d.new_kv(b) if contract.passes_new_kv else (None, None)
    assert check_contract(contract, b, d, layout, s.key_cache, s.value_cache, key, value) == []


@pytest.mark.parametrize("poison", [Poison.NAN, Poison.ZEROS, Poison.STALE])
def test_decode_invariant_fires_on_the_seeds_fill(make_batch, poison):
    """The seeds' bug: decode sequences filled only to ctx_len."""
    b, d, s = setup(make_batch, Contract.SPLIT, lens=(3, 20, 0), poison=poison)
    v = check_decode_invariant(b, d, s.layout, s.key_cache, s.value_cache)
    assert len(v) == 1
    v = v[0]
    assert (v.check, v.source, v.seq, v.position) == (DECODE, "cache", 1, 20)
    assert v.slot == b.slots(torch.tensor([1]), torch.tensor([20])).item()
    assert v.block == b.block_table[1][1]
    assert "sequence 1, position 20" in v.message and "before calling" in v.message


def test_prefill_invariant_fires_on_a_missing_context_position(make_batch):
    b, d, s = setup(make_batch, Contract.SPLIT, lens=(2, 21, 0))  # prefill 0 needs 3 cached positions
    v = check_prefill_invariant(b, d, s.layout, s.key_cache, s.value_cache, *d.new_kv(b))
    assert [(x.check, x.source, x.seq, x.position) for x in v] == [(PREFILL, "cache", 0, 2)]


def test_prefill_invariant_fires_on_new_kv_out_of_query_order(make_batch):
    b, d, s = setup(make_batch, Contract.SPLIT)
    key, value = d.new_kv(b)
    order = torch.arange(b.num_tokens)
    order[[0, 1]] = order[[1, 0]]  # swap two new tokens of sequence 0
    v = check_prefill_invariant(b, d, s.layout, s.key_cache, s.value_cache, key[order], value)
    assert [(x.source, x.seq, x.position, x.count) for x in v] == [("key", 0, 3, 2)]


def test_prefill_invariant_fires_on_missing_new_kv(make_batch):
    b, d, s = setup(make_batch, Contract.SPLIT)
    v = check_prefill_invariant(b, d, s.layout, s.key_cache, s.value_cache, None, None)
    assert {x.source for x in v} == {"key", "value"}
    assert "shape None" in v[0].message


def test_unified_invariant_fires_when_new_tokens_are_not_cached(make_batch):
    b, d, s = setup(make_batch, Contract.UNIFIED, lens=Contract.SPLIT.cached_lens(
        make_batch([(5, 3), (1, 20), (17, 0)], dtype="float16", reverse=True, seed=5)))
    v = check_unified_invariant(b, d, s.layout, s.key_cache, s.value_cache)
    assert [(x.check, x.seq, x.position, x.count) for x in v] == [(UNIFIED, 0, 3, 5), (UNIFIED, 2, 0, 17)]


def test_a_value_only_corruption_is_found(make_batch):
    b, d, s = setup(make_batch, Contract.SPLIT)
    slot = b.slots(torch.tensor([1]), torch.tensor([7]))
    s.layout.write(s.key_cache, s.value_cache, slot, d.keys[[b.seq_start_loc[1] + 7]],
                   d.values[[b.seq_start_loc[1] + 7]] + 1)
    v = check_decode_invariant(b, d, s.layout, s.key_cache, s.value_cache)
    assert [(x.seq, x.position) for x in v] == [(1, 7)]
