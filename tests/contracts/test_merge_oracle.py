"""The merge's model and oracle (kvfuzz.contracts.model.merge, kvfuzz.contracts.checks.merge): the two parts of a
batch's attention merge back into the fp64 reference of the whole; the exact merge's conventions at the edges
(empty parts either infinity, both empty, copied tokens); the bound admits a correct fp32 merge and refuses a
precision defect (weights rounded to bf16); the ground-truth check names swapped parts."""

import attrs
import pytest
import torch
from support import batch_of

from kvfuzz.contracts.checks.merge import (
    check_merge,
    check_merge_parts,
    check_merged_lse,
    exact_merge,
    merge_bound,
    merge_weights,
)
from kvfuzz.contracts.checks.oracles import Oracle
from kvfuzz.contracts.checks.reference import reference_attention
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.merge import MergeInputs, attention_parts, merge_inputs


def batch(dtype="float32", **kw):
    return batch_of([(1, 20), (5, 9), (3, 0)], num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, seed=3, **kw)


def fp32_merge(inp: MergeInputs, n=None):
    """A correct merge in fp32 (vLLM's kernels' arithmetic), its output rounded to the parts' dtype."""
    p = torch.where(torch.isinf(inp.prefix_lse), torch.full_like(inp.prefix_lse, float("-inf")), inp.prefix_lse)
    s = torch.where(torch.isinf(inp.suffix_lse), torch.full_like(inp.suffix_lse, float("-inf")), inp.suffix_lse)
    m = torch.maximum(p, s)
    ep, es = torch.exp(p - m), torch.exp(s - m)
    out = inp.prefix_output.float() * (ep / (ep + es)).T[..., None] + inp.suffix_output.float() * (
        es / (ep + es)).T[..., None]
    n = out.shape[0] if n is None else n
    out[n:] = inp.suffix_output[n:].float()
    return out.to(inp.prefix_output.dtype), (m + torch.log(ep + es))


@pytest.mark.parametrize("value_range", ["normal", "dominant", "extreme", "shifted"])
def test_the_parts_merge_back_into_the_whole_reference(value_range):
    """Merging the fp64 parts exactly gives the fp64 reference of the whole context (the model is right)."""
    b = batch(value_range=value_range)
    d = make_batch_data(b)
    out, lse = exact_merge(attention_parts(b, d))
    assert torch.allclose(out, reference_attention(b, d), rtol=1e-9, atol=1e-12)
    assert torch.isfinite(lse).all()


def test_an_empty_part_is_either_infinity_and_both_empty_merge_to_zero():
    b = batch()
    d = make_batch_data(b)
    minus, plus = merge_inputs(b, d, float("-inf")), merge_inputs(b, d, float("inf"))
    assert bool((minus.prefix_lse[:, 6:] == float("-inf")).all())
    assert bool((plus.prefix_lse[:, 6:] == float("inf")).all())
    assert torch.equal(exact_merge(minus)[0], exact_merge(plus)[0])
    out, lse = exact_merge(minus)
    assert torch.equal(out[6:], minus.suffix_output[6:].double())  # no context: the suffix, exactly
    empty = attrs.evolve(minus, suffix_lse=torch.full_like(minus.suffix_lse, float("inf")))
    out, lse = exact_merge(empty)
    assert bool((out[6:] == 0).all()) and bool((lse[:, 6:] == float("-inf")).all())
    with pytest.raises(ValueError, match="empty_lse"):
        merge_inputs(b, d, 0.0)


def test_tokens_past_prefill_tokens_with_context_are_the_suffix_copied():
    b = batch()
    inp = merge_inputs(b, make_batch_data(b))
    out, lse = exact_merge(inp, 1)
    assert torch.equal(out[1:], inp.suffix_output[1:].double())
    assert torch.equal(lse[:, 1:], inp.suffix_lse[:, 1:].double())
    bound, lse_bound = merge_bound(inp, out, lse, torch.float32, 1)
    assert bool((bound[1:] == 0).all()) and bool((lse_bound[:, 1:] == 0).all()) and bool((bound[:1] > 0).all())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value_range", ["normal", "extreme", "shifted", "dominant"])
def test_a_correct_fp32_merge_passes_and_bf16_weights_fail(dtype, value_range):
    """The bound admits the merge's own arithmetic; weights rounded to bf16 fail it (in fp32, where the output's
    rounding does not hide them)."""
    b = batch(dtype=dtype, value_range=value_range)
    d = make_batch_data(b)
    inp = merge_inputs(b, d)
    exact, exact_lse = exact_merge(inp)
    bound, lse_bound = merge_bound(inp, exact, exact_lse, b.torch_dtype)
    out, lse = fp32_merge(inp)
    fail, ratio = check_merge(b, out, exact, bound)
    assert fail is None and ratio <= 1.0
    assert check_merged_lse(b, lse, exact_lse, lse_bound) is None
    if dtype == "float32" and value_range == "normal":
        wp, ws, _ = merge_weights(inp)
        bad = (inp.prefix_output * wp.T[..., None].bfloat16().float() + inp.suffix_output * ws.T[..., None].bfloat16()
               .float())
        fail, _ = check_merge(b, bad, exact, bound)
        assert fail is not None and fail.oracle is Oracle.MERGE


def test_a_wrong_lse_and_nan_are_failures():
    b = batch()
    inp = merge_inputs(b, make_batch_data(b))
    exact, exact_lse = exact_merge(inp)
    bound, lse_bound = merge_bound(inp, exact, exact_lse, torch.float32)
    f = check_merged_lse(b, exact_lse + 1e-3, exact_lse, lse_bound)
    assert f is not None and f.oracle is Oracle.MERGE_LSE and f.bad_rows == exact_lse.numel()
    nan = exact.float().clone()
    nan[2, 1, 3] = float("nan")
    f, _ = check_merge(b, nan, exact, bound)
    assert f is not None and f.oracle is Oracle.FINITE and (f.token, f.head, f.dim) == (2, 1, 3)


def test_parts_handed_swapped_are_a_caller_violation():
    b = batch()
    inp = merge_inputs(b, make_batch_data(b))
    assert check_merge_parts(inp, inp) == []
    swapped = attrs.evolve(inp, prefix_lse=inp.suffix_lse, suffix_lse=inp.prefix_lse)
    vs = check_merge_parts(inp, swapped)
    assert {v.check for v in vs} == {Check.MERGE_PARTS} and len(vs) == 2
    assert check_merge_parts(inp, attrs.evolve(inp, prefix_output=inp.prefix_output.double()))[0].check is \
        Check.MERGE_PARTS
