import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfuzz.contracts.model.batch import Batch, contiguous_batch, positions


def test_derived_quantities(make_batch):
    b = make_batch([(5, 3), (1, 20), (17, 0)], block_size=16)
    assert b.seq_lens == (8, 21, 17)
    assert b.query_start_loc == (0, 5, 6, 23)
    assert b.seq_start_loc == (0, 8, 29, 46)
    assert b.num_tokens == 23 and b.max_query_len == 17 and b.max_seq_len == 21
    assert b.decode_seqs == (1,) and b.prefill_seqs == (0, 2)
    assert b.block_table_tensor().dtype == torch.int32
    assert b.scale == pytest.approx(32 ** -0.5)


def test_slot_arithmetic_follows_the_block_table():
    b = Batch(query_lens=[1, 3], ctx_lens=[17, 0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
              num_blocks=5, block_table=[[4, 2], [0, 0]])
    seq = torch.tensor([0, 0, 0, 1, 1])
    pos = torch.tensor([0, 15, 17, 0, 2])
    assert b.slots(seq, pos).tolist() == [64, 79, 33, 0, 2]
    # slot_mapping: the query tokens, in query order
    assert b.slot_mapping().tolist() == [33, 0, 1, 2]


def test_positions_enumerates_in_order():
    seq, pos = positions([2, 0, 3], offsets=[5, 9, 1])
    assert seq.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [5, 6, 1, 2, 3]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), max_size=6), st.booleans())
def test_positions_is_every_position_of_every_sequence_in_order(seqs, with_offsets):
    lens = [n for n, _ in seqs]
    offsets = [o for _, o in seqs] if with_offsets else None
    seq, pos = positions(lens, offsets)
    want = [(i, (offsets[i] if offsets else 0) + j) for i, n in enumerate(lens) for j in range(n)]
    assert list(zip(seq.tolist(), pos.tolist())) == want
    assert seq.dtype == pos.dtype == torch.int64


@pytest.mark.parametrize("change, match", [
    (dict(query_lens=[0, 1]), "query_len must be >= 1"),
    (dict(ctx_lens=[-1, 0]), "ctx_len must be >= 0"),
    (dict(num_heads=3), "multiple of num_kv_heads"),
    (dict(block_table=[[0], [0]]), "used by sequences 0 and 1"),
    (dict(block_table=[[7], [1]]), "outside"),
    (dict(ctx_lens=[40, 0]), "needs 3 blocks"),
    (dict(dtype="float64"), "dtype"),
    (dict(query_lens=[1]), "one entry per sequence"),
])
def test_inconsistent_batches_are_rejected_with_the_field_named(change, match):
    base = dict(query_lens=[1, 2], ctx_lens=[3, 0], num_heads=2, num_kv_heads=2, head_size=32, block_size=16,
                num_blocks=2, block_table=[[0], [1]])
    with pytest.raises(ValueError, match=match):
        Batch(**{**base, **change})


def test_round_trips_through_a_dict(make_batch):
    b = make_batch([(3, 2), (1, 7)], seed=9)
    assert Batch.from_dict(b.to_dict()) == b
    with pytest.raises(ValueError, match="unknown Batch fields"):
        Batch.from_dict({**b.to_dict(), "bogus": 1})


def test_its_dict_is_attrs_asdict_of_its_fields_less_the_defaults_left_out():
    """to_dict builds its dict by hand (a serving batch's table made attrs.asdict cost ~10 ms an example): the
    same keys in the same order, tuples as lists, each optional field present exactly when set."""
    import attr
    import attrs

    plain = Batch(query_lens=[1, 3], ctx_lens=[17, 0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                  num_blocks=5, block_table=[[4, 2], [0, 0]], csr_tail=[7], sliding_window=4)
    latent = attrs.evolve(plain, num_kv_heads=1, head_size=576, value_head_size=512, num_pad_seqs=2,
                          freed_window_blocks=True, ctx_lens=[40, 0], block_table=[[0, 0, 2], [3, 4, 1]])
    calibrated = attrs.evolve(plain, kv_cache_dtype="fp8_e4m3", k_scale=0.5, q_scale=3 / 64)
    for b in (plain, latent, calibrated):
        expected = attr.asdict(b)  # the classic API: tuples as lists
        for name, unset in (("value_head_size", None), ("num_pad_seqs", 0), ("freed_window_blocks", False),
                            ("q_scale", 1.0)):
            if getattr(b, name) == unset:
                del expected[name]
        got = b.to_dict()
        assert got == expected and list(got) == list(expected)
        assert got["block_table"] == [list(r) for r in b.block_table] and type(got["csr_tail"]) is list
        assert Batch.from_dict(got) == b


def test_a_contiguous_batch_hands_out_blocks_sequence_after_sequence():
    heads = dict(num_heads=2, num_kv_heads=1, head_size=32)
    b = contiguous_batch([5, 1], [20, 0], block_size=16, **heads)
    assert b.block_table == ((0, 1), (2, 0)) and b.num_blocks == 3
    # spare blocks, ids from the highest down above a reserved block 0, a padding column
    b = contiguous_batch([5, 1], [20, 0], block_size=16, spare_blocks=2, first_block=1, reverse=True,
                         pad_columns=1, **heads)
    assert b.block_table == ((5, 4, 0), (3, 0, 0)) and b.num_blocks == 6
    # ids and padding given: handed out in order, row by row
    b = contiguous_batch([5, 1], [20, 0], block_size=16, block_ids=[2, 0, 1], pad_ids=[2, 1, 0], pad_columns=1,
                         **heads)
    assert b.block_table == ((2, 0, 2), (1, 1, 0))


@pytest.mark.parametrize("change, match", [
    (dict(block_ids=[0, 1]), "block_ids has 2 ids; the sequences use 3 blocks"),
    (dict(pad_ids=[0, 0], pad_columns=1), "pad_ids ran short"),
    (dict(spare_blocks=-1, block_ids=[0, 1, 2]), "outside"),  # a pool too small for the ids: the Batch says so
])
def test_a_contiguous_batch_rejects_ids_that_run_short(change, match):
    with pytest.raises(ValueError, match=match):
        contiguous_batch([5, 1], [20, 0], block_size=16, num_heads=2, num_kv_heads=1, head_size=32, **change)


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 40)), min_size=1, max_size=4),
       st.lists(st.integers(-1, 12), min_size=12, max_size=12), st.integers(1, 12), st.sampled_from([None, 3]))
def test_the_quick_block_check_agrees_with_the_loop_that_names_faults(lens, ids, num_blocks, window):
    """Batch's check of its block ids over all ids at once (_blocks_plainly_valid) only ever lets a batch through that
    the loop over them passes; anything else the loop decides, with its message."""
    import attrs

    width = 3
    table = [ids[i * width:(i + 1) * width] for i in range(len(lens))]
    fields = dict(query_lens=[q for q, _ in lens], ctx_lens=[c for _, c in lens], num_heads=2, num_kv_heads=1,
                  head_size=32, block_size=16, num_blocks=num_blocks, block_table=table, sliding_window=window)

    def outcome():
        try:
            return attrs.asdict(Batch(**fields))
        except ValueError as e:
            return str(e)

    quick = outcome()
    original = Batch._blocks_plainly_valid
    try:
        Batch._blocks_plainly_valid = lambda self: False  # the loop alone
        assert outcome() == quick
    finally:
        Batch._blocks_plainly_valid = original


def test_the_quick_block_check_passes_plain_tables_and_leaves_shared_ones_to_the_loop():
    plain = Batch(query_lens=[1, 3], ctx_lens=[17, 0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                  num_blocks=5, block_table=[[4, 2], [0, 0]])
    assert plain._blocks_plainly_valid()
    shared = Batch(query_lens=[1, 1], ctx_lens=[16, 16], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                   num_blocks=5, block_table=[[3, 1], [3, 2]])  # block 3: a full shared prefix block
    assert not shared._blocks_plainly_valid()
    with pytest.raises(ValueError, match="outside"):
        Batch(query_lens=[1], ctx_lens=[0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16, num_blocks=2,
              block_table=[[2]])


def test_int_lists_convert_as_int_would_whatever_the_path():
    import numpy as np

    from kvfuzz.contracts.model.batch import _tuple_of_ints

    cases = [[1, 2, 3], (True, False), [2.0, 3.7], ["3"], [np.int64(5), np.int32(-2)], [2**70, 1], [-1], (),
             [torch.tensor(4)], [np.float32(2.5)], torch.tensor([7, 8])]
    for value in cases:
        got = _tuple_of_ints(value)
        assert got == tuple(int(v) for v in value) and all(type(v) is int for v in got), value
    assert _tuple_of_ints(v for v in (1, 2.5, 3)) == (1, 2, 3)  # a generator: read once, by the loop
    with pytest.raises(ValueError):
        _tuple_of_ints(["x"])
