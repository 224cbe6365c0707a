"""The fp64 reference against torch's scaled_dot_product_attention on gathered K/V."""

import pytest
import torch
import torch.nn.functional as F

from kvfuzz.contracts.checks.reference import reference_attention, same_precision_attention
from kvfuzz.contracts.model.data import make_batch_data


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_reference_matches_sdpa_on_gathered_kv(make_batch, num_heads, num_kv_heads):
    b = make_batch([(5, 3), (1, 20), (17, 0), (2, 31)], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=4)
    d = make_batch_data(b)
    ref = reference_attention(b, d)
    assert ref.dtype == torch.float64 and ref.shape == (b.num_tokens, num_heads, b.head_size)
    for i in range(b.num_seqs):
        qs, qe = b.query_start_loc[i], b.query_start_loc[i + 1]
        ks, ke = b.seq_start_loc[i], b.seq_start_loc[i + 1]
        q = d.query[qs:qe].double().transpose(0, 1)  # [H, q, D]
        k = d.keys[ks:ke].double().repeat_interleave(b.gqa_ratio, 1).transpose(0, 1)
        v = d.values[ks:ke].double().repeat_interleave(b.gqa_ratio, 1).transpose(0, 1)
        # query j sits at position ctx_len + j: a bottom-right aligned causal mask
        mask = torch.arange(ke - ks)[None, :] <= (b.ctx_lens[i] + torch.arange(qe - qs))[:, None]
        expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(ref[qs:qe], expect, rtol=1e-12, atol=1e-12)


def test_explicit_sm_scale_is_used(make_batch):
    import attrs
    b = make_batch([(3, 4)], seed=1)
    d = make_batch_data(b)
    assert not torch.allclose(reference_attention(b, d), reference_attention(attrs.evolve(b, sm_scale=1.0), d))


def test_same_precision_error_is_small_but_nonzero(make_batch):
    b = make_batch([(9, 30)], dtype="float16", seed=2)
    d = make_batch_data(b)
    err = (same_precision_attention(b, d) - reference_attention(b, d)).abs().max().item()
    assert 0 < err < 1e-2


def test_data_is_deterministic_per_seed(make_batch):
    b = make_batch([(3, 4), (1, 2)], seed=7)
    a, c = make_batch_data(b), make_batch_data(b)
    assert torch.equal(a.query, c.query) and torch.equal(a.keys, c.keys) and torch.equal(a.values, c.values)
