"""The index helpers of kvfuzz.contracts.model.space that move host lists to a device in one copy: the same integers
as the plain CPU enumeration, whatever path computes them."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.space import host_tensor, host_to, positions, table_tensor


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), min_size=1, max_size=6), st.booleans())
def test_positions_on_a_device_are_the_cpu_enumeration(seqs, with_offsets):
    lens = [n for n, _ in seqs]
    offsets = [o for _, o in seqs] if with_offsets else None
    want = positions(lens, offsets)
    got = positions(lens, offsets, device="cpu")  # the one-copy path a GPU takes, run here
    assert all(g.dtype == torch.int64 for g in got)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_positions_on_a_device_reject_a_negative_length():
    with pytest.raises(RuntimeError, match="negative"):
        positions([2, -1], device="cpu")


@given(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), min_size=3, max_size=3), min_size=1, max_size=5),
       st.sampled_from([torch.int32, torch.int64]))
def test_table_tensor_is_torch_tensor(rows, dtype):
    got = table_tensor(tuple(tuple(r) for r in rows), dtype)
    assert got.dtype == dtype and torch.equal(got, torch.tensor(rows, dtype=dtype))


def test_host_tensor_and_host_to_keep_values_and_dtype():
    t = host_tensor([0.5, 3.0], torch.float32, "cpu")
    assert t.dtype == torch.float32 and t.tolist() == [0.5, 3.0]
    assert host_to(t, "cpu") is t


def test_held_positions_and_slots_on_a_device_match_the_cpu():
    b = Batch(query_lens=[1, 3, 2], ctx_lens=[17, 0, 40], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
              num_blocks=9, block_table=[[4, 2, 0], [1, 0, 0], [5, 6, 7]])
    lens = (10, 3, 42)
    cpu = b.held_positions(lens)
    dev = b.held_positions(lens, device="cpu")
    assert [t.tolist() for t in dev] == [t.tolist() for t in cpu]
    assert b.slots(*dev).tolist() == b.slots(*cpu).tolist()
