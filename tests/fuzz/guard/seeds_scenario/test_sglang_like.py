"""Kernel tests written the way SGLang's own test/registered/attention/test_triton_attention_kernels.py fills
caches and calls its Triton kernels (sglang 0.5.23), shrunk so Triton's interpreter runs them in seconds and
switched from bf16 to fp16 (the interpreter computes bf16 wrongly).

``test_decode_attention_as_in_the_seeds`` keeps the seeds' bug in SGLang's form (docs/contracts.md §2, §6):
like ``_test_decode_attention_once`` it fills the whole pool with random values, lists every sequence's
``seq_len`` slots in ``kv_indices = arange`` and treats ``q`` as "the new token being generated" (values
normal(0.1, 0.2), as the extend test fills its tensors); its reference
attends to the sequence's past tokens plus the new token's ``k_new``/``v_new``, which the test never writes
into the pool, so the kernel reads whatever the pool holds in the current token's slot (decode_attention_fwd
has the unified contract: SGLang's backend writes the current token before calling it). With seq_len 128 the
missing token moves the output by less than the test's atol of 1e-2 and plain pytest passes; under
``--kvfuzz-guard`` the test hands the new tokens to the guard (``kvfuzz_guard.new_kv``, a no-op without the
plugin) and fails with the unified invariant at each sequence's last position.
``test_decode_attention_with_the_seeds_fix`` writes the new token into its slot first and passes clean, and
``test_extend_attention_as_sglang_tests_it`` (``_test_extend_attention_once``'s fill: prefix and new tokens in
the pool, ``k_extend`` copied from it) shows the guard quiet on SGLang's own extend pattern.

Collected only with KVFUZZ_SEEDS_SCENARIO=1 (see conftest.py); tests/fuzz/guard/test_guard.py runs it.
"""


import pytest
import torch

from kvfuzz.fuzz.targets.sglang_triton import SglangDecodeAttentionFwd, prepare_sglang_runtime

_avail = SglangDecodeAttentionFwd().availability()
if not _avail.ok:
    pytest.skip(f"SGLang's Triton kernels are unavailable: {_avail.reason}", allow_module_level=True)
prepare_sglang_runtime()  # TRITON_INTERPRET=1 on CPU and the kernel tree, before sglang/triton are imported

from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16


def decode_attention_fwd_torch(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, k_new, v_new):
    """Per sequence: softmax over its past tokens (from the pool) and the new token (k_new/v_new), in fp32."""
    B, H_Q, _ = q.shape
    H_KV = k_buffer.shape[1]
    out = torch.empty(B, H_Q, v_buffer.shape[-1], dtype=torch.float32, device=q.device)
    for i in range(B):
        idx = kv_indices[kv_indptr[i] : kv_indptr[i + 1]][:-1]  # the past tokens
        k = torch.cat([k_buffer[idx], k_new[i : i + 1]]).float().repeat_interleave(H_Q // H_KV, dim=1)
        v = torch.cat([v_buffer[idx], v_new[i : i + 1]]).float().repeat_interleave(H_Q // H_KV, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i].float(), k) * sm_scale).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", p, v)
    return out


def _decode_attention_once(hand_over, fixed):
    torch.manual_seed(0)
    B, H_Q, H_KV, D = 2, 4, 2, 64
    seq_len = 128  # tokens already in the sequence, the one being generated included
    total_tokens = B * seq_len
    sm_scale = 1.0 / (D**0.5)
    max_kv_splits = 8
    num_kv_splits = torch.full((B,), 4, dtype=torch.int32, device=device)

    def randn(*shape):  # as the extend test fills its tensors
        return torch.empty(shape, dtype=dtype, device=device).normal_(mean=0.1, std=0.2)

    # q represents the new token being generated, one per batch
    q = randn(B, H_Q, D)
    k_new, v_new = randn(B, H_KV, D), randn(B, H_KV, D)
    # k_buffer and v_buffer represent all previous tokens
    k_buffer = randn(total_tokens, H_KV, D)
    v_buffer = randn(total_tokens, H_KV, D)
    o = torch.zeros(B, H_Q, D, dtype=dtype, device=device)
    b_seq_len = torch.full((B,), seq_len, device=device)
    kv_indptr = torch.zeros((B + 1,), dtype=torch.int32, device=device)
    kv_indptr[1 : B + 1] = torch.cumsum(b_seq_len[:B], dim=0)
    kv_indices = torch.arange(total_tokens, device=device)
    if fixed:  # the seeds' fix, SGLang's backend order: the current token goes into its slot first
        k_buffer[kv_indices[kv_indptr[1:] - 1]] = k_new
        v_buffer[kv_indices[kv_indptr[1:] - 1]] = v_new
    attn_logits = torch.empty((B, H_Q, max_kv_splits, D), dtype=torch.float32, device=device)
    attn_lse = torch.empty((B, H_Q, max_kv_splits), dtype=torch.float32, device=device)

    with hand_over(k_new, v_new):
        decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                             num_kv_splits, max_kv_splits, sm_scale, 1.0, 1.0)

    o_ref = decode_attention_fwd_torch(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, k_new, v_new)
    torch.testing.assert_close(o.float(), o_ref, atol=1e-2, rtol=1e-2)


@torch.inference_mode()
def test_decode_attention_as_in_the_seeds(hand_over):
    _decode_attention_once(hand_over, fixed=False)


@torch.inference_mode()
def test_decode_attention_with_the_seeds_fix(hand_over):
    _decode_attention_once(hand_over, fixed=True)


@torch.inference_mode()
def test_extend_attention_as_sglang_tests_it():
    torch.manual_seed(0)
    B, N_CTX, H_Q, H_KV, D = 3, 40, 4, 2, 32
    b_seq_len_prefix = torch.randint(1, N_CTX // 2, (B,), dtype=torch.int32, device=device)
    b_seq_len_extend = torch.randint(1, N_CTX // 2, (B,), dtype=torch.int32, device=device)
    b_seq_len = b_seq_len_prefix + b_seq_len_extend
    b_start_loc = torch.zeros((B,), dtype=torch.int32, device=device)
    b_start_loc[1:] = torch.cumsum(b_seq_len[:-1], 0)
    b_start_loc_extend = torch.zeros((B,), dtype=torch.int32, device=device)
    b_start_loc_extend[1:] = torch.cumsum(b_seq_len_extend[:-1], 0)

    kv_indptr = torch.zeros((B + 1,), dtype=torch.int32, device=device)
    kv_indptr[1 : B + 1] = torch.cumsum(b_seq_len_prefix[:B], dim=0)
    kv_indices = torch.zeros((b_seq_len_prefix.sum().item(),), dtype=torch.int32, device=device)
    for i in range(B):
        kv_indices[kv_indptr[i] : kv_indptr[i + 1]] = torch.arange(b_start_loc[i], b_start_loc[i] + b_seq_len_prefix[i])

    total_token_num = torch.sum(b_seq_len).item()
    extend_token_num = torch.sum(b_seq_len_extend).item()
    k_buffer = torch.empty((total_token_num, H_KV, D), dtype=dtype, device=device).normal_(mean=0.1, std=0.2)
    v_buffer = torch.empty((total_token_num, H_KV, D), dtype=dtype, device=device).normal_(mean=0.1, std=0.2)
    k_extend = torch.empty((extend_token_num, H_KV, D), dtype=dtype, device=device)
    v_extend = torch.empty((extend_token_num, H_KV, D), dtype=dtype, device=device)
    q_extend = torch.empty((extend_token_num, H_Q, D), dtype=dtype, device=device)
    for i in range(B):
        extend_start_in_buffer = b_start_loc[i] + b_seq_len_prefix[i]
        extend_end_in_buffer = b_start_loc[i] + b_seq_len[i]
        extend_start = b_start_loc_extend[i]
        extend_end = b_start_loc_extend[i] + b_seq_len_extend[i]
        k_extend[extend_start:extend_end] = k_buffer[extend_start_in_buffer:extend_end_in_buffer]
        v_extend[extend_start:extend_end] = v_buffer[extend_start_in_buffer:extend_end_in_buffer]
        q_extend[extend_start:extend_end] = torch.empty(
            (b_seq_len_extend[i], H_Q, D), dtype=dtype, device=device).normal_(mean=0.1, std=0.2)
    o_extend = torch.empty((extend_token_num, H_Q, D), dtype=dtype, device=device)
    max_len_extend = torch.max(b_seq_len_extend, 0)[0].item()
    qo_indptr = torch.zeros((B + 1,), dtype=torch.int32, device=device)
    qo_indptr[1 : B + 1] = torch.cumsum(b_seq_len_extend[:B], dim=0)

    extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                         kv_indices, None, True, None, max_len_extend, 1.0, 1.0)

    # reference: causal attention over the whole sequence as it lies in the pool
    for i in range(B):
        s, n, p = int(b_start_loc[i]), int(b_seq_len[i]), int(b_seq_len_prefix[i])
        k = k_buffer[s : s + n].float().repeat_interleave(H_Q // H_KV, dim=1)
        v = v_buffer[s : s + n].float().repeat_interleave(H_Q // H_KV, dim=1)
        q = q_extend[qo_indptr[i] : qo_indptr[i + 1]].float()
        logits = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
        logits = logits.masked_fill(torch.arange(n)[None, :] > torch.arange(p, n)[:, None], float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)
        torch.testing.assert_close(o_extend[qo_indptr[i] : qo_indptr[i + 1]].float(), ref, rtol=1e-2, atol=1e-3)
