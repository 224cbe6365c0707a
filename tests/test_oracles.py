"""Oracles pass exact answers and catch NaN, a one-position mask error and a wrong scale."""

import attrs
import pytest
import torch

from kvfuzz.contracts.data import make_batch_data
from kvfuzz.contracts.oracles import RTOL, atol_floor, check_agreement, check_finite, row_floor
from kvfuzz.contracts.reference import _attend, reference_attention, same_precision_attention


def case(make_batch, dtype="float16"):
    b = make_batch([(5, 3), (1, 40), (17, 0)], dtype=dtype, seed=11)
    d = make_batch_data(b)
    return b, d, reference_attention(b, d), same_precision_attention(b, d)


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_same_precision_output_passes(make_batch, dtype):
    b, d, ref, lowp = case(make_batch, dtype)
    assert check_agreement(b, lowp.to(b.torch_dtype), ref, lowp) is None
    assert check_finite(b, lowp) is None


def test_nan_is_always_a_failure_and_located(make_batch):
    b, d, ref, lowp = case(make_batch)
    out = lowp.clone()
    out[5, 2, 9] = float("nan")  # row 5 = sequence 1 (decode), position 40
    f = check_finite(b, out)
    assert (f.seq, f.position, f.token, f.head, f.dim, f.bad_elements) == (1, 40, 5, 2, 9, 1)
    assert check_agreement(b, out, ref, lowp) is not None


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_catches_a_one_position_mask_error(make_batch, dtype):
    """A decode that does not see its own token (attends to ctx_len positions, not seq_len)."""
    b, d, ref, lowp = case(make_batch, dtype)
    short = attrs.evolve(b, ctx_lens=(3, 39, 0), query_lens=(5, 2, 17))  # same data rows, one less visible
    out = lowp.clone()
    # recompute the decode row (sequence 1) without its last key
    keys = d.keys[b.seq_start_loc[1]:b.seq_start_loc[2] - 1].double().repeat_interleave(b.gqa_ratio, 1)
    vals = d.values[b.seq_start_loc[1]:b.seq_start_loc[2] - 1].double().repeat_interleave(b.gqa_ratio, 1)
    q = d.query[5].double()
    p = torch.softmax(torch.einsum("hd,khd->hk", q, keys) * b.scale, -1)
    out[5] = torch.einsum("hk,khd->hd", p, vals)
    f = check_agreement(b, out, ref, lowp)
    assert f is not None and (f.seq, f.position) == (1, 40)
    assert f.bad_tokens == (5,)
    assert short.num_seqs == 3


def test_catches_a_wrong_scale(make_batch):
    b, d, ref, lowp = case(make_batch)
    wrong = _attend(attrs.evolve(b, sm_scale=b.scale * 1.05), d, torch.float64)
    assert check_agreement(b, wrong, ref, lowp) is not None


def test_bound_is_rtol_times_same_precision_error_plus_floor(make_batch):
    b, d, ref, lowp = case(make_batch)
    pt = (lowp - ref).abs().amax(-1)
    out = ref.clone()
    floor = row_floor(b, ref)[0, 0]
    assert floor >= atol_floor(torch.float16)
    out[0, 0, 0] += RTOL['float16'] * pt[0, 0] + floor * 0.99
    assert check_agreement(b, out, ref, lowp) is None
    out[0, 0, 0] += floor * 0.02
    f = check_agreement(b, out, ref, lowp)
    assert f is not None and (f.token, f.head, f.dim) == (0, 0, 0)


def test_floor_grows_with_the_row_magnitude_in_fp32_only(make_batch):
    b, d, ref, lowp = case(make_batch)
    large = ref * 100
    assert torch.equal(row_floor(b, large), torch.full_like(row_floor(b, large), atol_floor(torch.float16)))
    b32 = attrs.evolve(b, dtype="float32")
    assert torch.allclose(row_floor(b32, ref * 0.1), torch.full_like(ref[..., 0], atol_floor(torch.float32)))
    expect = atol_floor(torch.float32) * (large.abs().amax(-1) / 0.3).clamp_min(1)
    assert torch.equal(row_floor(b32, large), expect)
    capped = attrs.evolve(b32, softcap=50.0)
    assert (row_floor(capped, large) > row_floor(b32, large)).all()
