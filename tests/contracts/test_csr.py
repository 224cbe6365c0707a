"""The CSR model (contracts/model/csr.py), shared prefix blocks and csr_tail in Batch, and the strategies that draw
them: no kernels."""

import attrs
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample

from kvfuzz.contracts.caches.layouts import NHDLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.invariants import check_contract
from kvfuzz.contracts.checks.reference import reference_attention
from kvfuzz.contracts.model.batch import Batch, positions
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.csr import indptr, page_lists, token_slot_lists, token_table
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.limits import Limits

LIMITS = Limits(max_num_seqs=4, max_ctx_len=70, max_query_len=20, max_num_heads=8)
FIND = settings(max_examples=1000)
CSR_CAPS = Capabilities(contract=Contract.PREFIX, devices=("cpu",), dtypes=("float32",), head_sizes=(32,),
                        block_sizes=(1, 4, 16), metadata="csr", shared_prefix_blocks=True,
                        features=("sliding_window",), min_sliding_window=2)
TABLE_CAPS = attrs.evolve(CSR_CAPS, metadata="block_table", shared_prefix_blocks=False)


def shared_batch(**kw) -> Batch:
    """Sequence 1 shares sequence 0's first two blocks (32 full context tokens); sequence 2 shares one."""
    return Batch(**{**dict(query_lens=[3, 1, 2], ctx_lens=[40, 33, 20], num_heads=2, num_kv_heads=1, head_size=32,
                           block_size=16, num_blocks=12, block_table=[[0, 1, 2, 0], [0, 1, 3, 0], [0, 4, 0, 0]],
                           seed=5), **kw})


def test_token_slot_lists_are_the_block_table_slots(make_batch):
    b = make_batch([(3, 5), (1, 0), (2, 17)], block_size=4, reverse=True)
    lists = token_slot_lists(b, b.ctx_lens)
    assert lists.kv_indptr.tolist() == [0, 5, 5, 22]
    seq, pos = positions(b.ctx_lens)
    assert lists.kv_indices.tolist() == b.slots(seq, pos).tolist()
    full = token_slot_lists(b, b.seq_lens)
    assert full.kv_indptr.tolist() == indptr(b.seq_lens).tolist() == [0, 8, 9, 28]
    ptr, idx = full.tensors()
    assert ptr.dtype == torch.int32 and idx.dtype == torch.int64  # as SGLang's backend allocates them
    with pytest.raises(ValueError, match="outside 0..seq_len"):
        token_slot_lists(b, (9, 0, 0))


def test_the_tail_follows_the_listed_entries(make_batch):
    b = attrs.evolve(make_batch([(1, 3), (1, 1)], block_size=4), csr_tail=(-1, 999, 2))
    lists = token_slot_lists(b, b.seq_lens)
    assert lists.kv_indptr.tolist() == [0, 4, 6] and lists.kv_indices.tolist()[6:] == [-1, 999, 2]
    assert len(token_slot_lists(b, b.seq_lens, tail=False).kv_indices) == 6
    assert Batch.from_dict(b.to_dict()) == b and "csr_tail=[-1, 999, 2]" in b.summary()


def test_page_lists_address_the_same_slots(make_batch):
    b = make_batch([(3, 5), (1, 0), (2, 13)], block_size=4, reverse=True)
    pl = page_lists(b, b.seq_lens)
    assert pl.page_indptr.tolist() == [0, 2, 3, 7]
    assert pl.last_page_len.tolist() == [4, 1, 3]
    slots = token_slot_lists(b, b.seq_lens).kv_indices
    for i, n in enumerate(b.seq_lens):
        for p in range(n):
            page = pl.page_indices[pl.page_indptr[i] + p // 4]
            assert int(page) * 4 + p % 4 == int(slots[indptr(b.seq_lens)[i] + p])
    assert page_lists(b, (0, 1, 0)).last_page_len.tolist() == [0, 1, 0]


def test_token_table_survives_a_malformed_indptr():
    idx = torch.arange(10, 20)
    tt = token_table(torch.tensor([0, 3, 2, 12]), idx)
    assert tt.within.tolist() == [True, False, False]  # decreasing; past the end
    assert tt.table[0].tolist() == [10, 11, 12] and tt.lens.tolist() == [3, 0, 10]
    assert token_table(torch.tensor([0]), idx).table.shape == (0, 0)
    assert token_table(torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int64)).table.shape == (1, 0)


# ---- shared prefix blocks ---------------------------------------------------------------------------------
def test_shared_prefix_blocks_are_legal_and_share_their_data():
    b = shared_batch()
    assert b.shared_prefix_blocks == (0, 2, 1)
    dst, src = b.shared_prefix_rows()
    starts = b.seq_start_loc
    assert dst.tolist()[:32] == list(range(starts[1], starts[1] + 32)) and src.tolist()[:32] == list(range(32))
    for vr in ("normal", "equal", "dominant", "large"):
        d = make_batch_data(attrs.evolve(b, value_range=vr))
        assert torch.equal(d.keys[dst], d.keys[src]) and torch.equal(d.values[dst], d.values[src])
    unshared = make_batch_data(attrs.evolve(b, block_table=[[0, 1, 2, 0], [5, 6, 3, 0], [7, 4, 0, 0]]))
    d = make_batch_data(b)  # the same draw; only the shared positions are copied
    keep = torch.ones(len(d.keys), dtype=torch.bool)
    keep[dst] = False
    assert torch.equal(d.keys[keep], unshared.keys[keep]) and torch.equal(d.query, unshared.query)


def test_a_cache_with_shared_blocks_keeps_every_invariant():
    b = shared_batch()
    data = make_batch_data(b)
    for contract in (Contract.PREFIX, Contract.UNIFIED):
        cache = materialize(b, data, NHDLayout(), contract.cached_lens(b), Poison.NAN)
        assert check_contract(contract, b, data, cache.layout, cache.key_cache, cache.value_cache,
                              *data.new_kv(b)) == []
    assert torch.isfinite(reference_attention(b, data)).all()


@pytest.mark.parametrize("table, match", [
    ([[0, 1, 2, 0], [5, 0, 3, 0], [7, 4, 0, 0]], "at columns 0 and 1"),
    ([[0, 1, 2, 0], [0, 1, 2, 0], [7, 4, 0, 0]], "not full context"),  # block 2 holds seq 1's new token
    ([[0, 1, 2, 0], [5, 1, 3, 0], [7, 4, 0, 0]], "columns before 1 differ"),
])
def test_sharing_that_is_not_a_read_only_prefix_is_rejected(table, match):
    with pytest.raises(ValueError, match=f"used by sequences 0 and 1 .*{match}"):
        shared_batch(block_table=table)


# ---- strategies ---------------------------------------------------------------------------------------------
@settings(max_examples=150)
@given(batches(CSR_CAPS, LIMITS))
def test_csr_batches_stay_legal_and_inside_the_declaration(b: Batch):
    assert CSR_CAPS.accepts(b)
    assert b.sliding_window is None or b.sliding_window >= 2
    slots = b.num_blocks * b.block_size
    assert all(-1 <= x <= slots for x in b.csr_tail) and len(b.csr_tail) <= 3


def test_csr_targets_get_shared_prefixes_and_tails_others_never():
    find(batches(CSR_CAPS, LIMITS), lambda b: sum(b.shared_prefix_blocks) >= 2, settings=FIND)
    find(batches(CSR_CAPS, LIMITS), lambda b: -1 in b.csr_tail, settings=FIND)
    b = find(batches(CSR_CAPS, LIMITS), lambda b: any(b.shared_prefix_blocks), settings=FIND)
    assert b.num_seqs == 2 and b.shared_prefix_blocks == (0, 1)  # shrinks to the smallest sharing
    with pytest.raises(NoSuchExample):
        find(batches(TABLE_CAPS, LIMITS), lambda b: any(b.shared_prefix_blocks) or b.csr_tail,
             settings=settings(max_examples=300))
    assert not TABLE_CAPS.accepts(shared_batch(head_size=32, dtype="float32"))
    assert "shared prefix blocks" in TABLE_CAPS.outside(shared_batch())


def test_fp8_gqa_ratios_restrict_fp8_batches_only():
    caps = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float32",), head_sizes=(32,),
                        block_sizes=(16,), decode_only=True, kv_cache_dtypes=("auto", "fp8_e4m3"),
                        fp8_gqa_ratios=(1,))
    find(batches(caps, LIMITS), lambda b: b.kv_cache_dtype == "auto" and b.gqa_ratio > 1, settings=FIND)
    with pytest.raises(NoSuchExample):
        find(batches(caps, LIMITS), lambda b: b.kv_cache_dtype != "auto" and b.gqa_ratio > 1,
             settings=settings(max_examples=300))
