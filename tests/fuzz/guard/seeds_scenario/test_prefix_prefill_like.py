"""A kernel test written the way vLLM's tests/kernels/attention/test_prefix_prefill.py
(``test_contexted_kv_attention``) was when the seeds' bug lived in it (docs/contracts.md §2), shrunk so
Triton's interpreter runs it in about a second: ten sequences, the last one a decode (query_len 1), the cache
zero-initialised and filled only up to ctx_len, inputs uniform(-1e-3, 1e-3), an fp16 SDPA-style reference,
atol 1e-4, and the maximum *context* length passed as ``max_seq_len``.

``test_contexted_kv_attention_as_in_the_seeds`` keeps both caller bugs: the decode sequence's current token is
missing from the cache (the decode kernel reads it from there), and ``max_seq_len = MAX_CTX_LEN`` although
sequences reach ctx_len + query_len. With inputs of magnitude 1e-3 the missing token moves the output by less
than atol, so the test passes on a kernel that reads the zeroed slot; with ``--kvfuzz-guard`` it fails,
naming the decode invariant. (The understated ``max_seq_len`` is not reported here: vLLM 0.33.0's Triton path
never reads it, and at head size 32 the ROCm custom kernel, which does, would not be selected.)
``test_contexted_kv_attention_with_the_seeds_fix`` applies the seeds' fix (decode sequences cached up to seq_len,
``max_seq_len = max(seq_lens)``) and passes clean under the guard.

Collected only with KVFUZZ_SEEDS_SCENARIO=1 (see conftest.py); tests/fuzz/guard/test_guard.py runs it.
"""

import random

import pytest
import torch

from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode, prepare_triton_runtime

_avail = VllmChunkedPrefillPagedDecode().availability()
if not _avail.ok:
    pytest.skip(f"vLLM's Triton kernels are unavailable: {_avail.reason}", allow_module_level=True)
prepare_triton_runtime()  # TRITON_INTERPRET=1 on CPU, before vllm/triton are imported

from vllm.v1.attention.ops.chunked_prefill_paged_decode import chunked_prefill_paged_decode  # noqa: E402

if torch.cuda.is_available():  # as vLLM's test does (device "cuda:0"); on CPU the interpreter runs it
    torch.set_default_device("cuda")

NUM_HEADS = 4
NUM_QUERIES_PER_KV = 2
HEAD_SIZE = 32
DTYPE = torch.float16
BLOCK_SIZE = 16


def _contexted_kv_attention(fixed: bool) -> None:
    random.seed(0)
    torch.manual_seed(0)
    MAX_SEQ_LEN = 24
    MAX_CTX_LEN = 24
    BS = 10
    cache_size = 64
    max_block_per_request = 4
    block_size = BLOCK_SIZE
    num_heads, head_size, dtype = NUM_HEADS, HEAD_SIZE, DTYPE
    query_lens = [random.randint(4, MAX_SEQ_LEN) for _ in range(BS)]
    query_lens[-1] = 1  # ensure one sequence in batch is a decode
    ctx_lens = [random.randint(4, MAX_CTX_LEN) for _ in range(BS)]
    seq_lens = [a + b for a, b in zip(query_lens, ctx_lens)]
    num_kv_heads = num_heads // NUM_QUERIES_PER_KV

    num_tokens = sum(query_lens)
    query = torch.empty(num_tokens, num_heads, head_size, dtype=dtype).uniform_(-1e-3, 1e-3)
    output = torch.empty(num_tokens, num_heads, head_size, dtype=dtype)
    kv = torch.empty(sum(seq_lens), 2, num_kv_heads, head_size, dtype=dtype).uniform_(-1e-3, 1e-3)
    key, value = kv.unbind(dim=1)

    k_cache = torch.zeros(cache_size, block_size, num_kv_heads, head_size, dtype=dtype)
    v_cache = torch.zeros(cache_size, block_size, num_kv_heads, head_size, dtype=dtype)
    k = torch.zeros(sum(query_lens), num_kv_heads, head_size, dtype=dtype)
    v = torch.zeros(sum(query_lens), num_kv_heads, head_size, dtype=dtype)
    values = torch.arange(0, cache_size, dtype=torch.int32)
    values = values[torch.randperm(cache_size)]
    block_table = values[: BS * max_block_per_request].view(BS, max_block_per_request)
    b_seq_len = torch.tensor(seq_lens, dtype=torch.int32)
    b_ctx_len = torch.tensor(ctx_lens, dtype=torch.int32)
    b_start_loc = torch.cumsum(torch.tensor([0] + query_lens), dim=0).to(torch.int32)
    max_input_len = MAX_SEQ_LEN
    b_seq_start_loc = torch.cumsum(torch.tensor([0] + seq_lens[:-1]), dim=0).to(torch.int32)
    for i in range(BS):
        for j in range(query_lens[i]):
            k[b_start_loc[i] + j].copy_(key[b_seq_start_loc[i] + b_ctx_len[i] + j])
            v[b_start_loc[i] + j].copy_(value[b_seq_start_loc[i] + b_ctx_len[i] + j])
        # the seeds' bug: only ctx_len tokens are cached; their fix caches seq_len tokens of a decode sequence
        cache_len = seq_lens[i] if (fixed and query_lens[i] == 1) else b_ctx_len[i]
        cur_ctx = 0
        block_id = 0
        while cur_ctx < cache_len:
            start_loc = b_seq_start_loc[i] + cur_ctx
            if cur_ctx + block_size > cache_len:
                end_loc = b_seq_start_loc[i] + cache_len
            else:
                end_loc = start_loc + block_size
            start_slot = block_table[i, block_id] * block_size
            end_slot = start_slot + end_loc - start_loc
            k_cache.view(-1, num_kv_heads, head_size)[start_slot:end_slot].copy_(key[start_loc:end_loc])
            v_cache.view(-1, num_kv_heads, head_size)[start_slot:end_slot].copy_(value[start_loc:end_loc])
            cur_ctx += block_size
            block_id += 1
    # [num_blocks, block_size, num_kv_heads, head_size] -> [num_blocks, num_kv_heads, head_size/8, block_size, 8]
    k_cache = k_cache.view(-1, block_size, num_kv_heads, head_size // 8, 8).permute(0, 2, 3, 1, 4).contiguous()
    # -> [num_blocks, num_kv_heads, head_size, block_size]
    v_cache = v_cache.view(-1, block_size, num_kv_heads, head_size).permute(0, 2, 3, 1).contiguous()
    k_scale = v_scale = torch.tensor(1.0, dtype=torch.float32)

    max_seq_len = max(seq_lens) if fixed else MAX_CTX_LEN  # the seeds' bug: the longest context
    chunked_prefill_paged_decode(query, k, v, output, "auto", k_cache, v_cache, block_table, b_start_loc,
                                 b_seq_len, max_seq_len, max_input_len, k_scale, v_scale, sliding_window=0)

    # reference: causal attention of every query token over its sequence's keys
    scale = float(1.0 / (head_size**0.5))
    ref = torch.empty_like(output)
    for i in range(BS):
        q = query[int(b_start_loc[i]):int(b_start_loc[i + 1])].float()
        kk = key[int(b_seq_start_loc[i]):int(b_seq_start_loc[i]) + seq_lens[i]].float()
        vv = value[int(b_seq_start_loc[i]):int(b_seq_start_loc[i]) + seq_lens[i]].float()
        kk = kk.repeat_interleave(NUM_QUERIES_PER_KV, dim=1)
        vv = vv.repeat_interleave(NUM_QUERIES_PER_KV, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        qpos = torch.arange(ctx_lens[i], seq_lens[i])[:, None]
        s = s.masked_fill(torch.arange(seq_lens[i])[None, :] > qpos, float("-inf"))
        ref[int(b_start_loc[i]):int(b_start_loc[i + 1])] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(dtype)
    torch.testing.assert_close(output, ref, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_contexted_kv_attention_as_in_the_seeds():
    _contexted_kv_attention(fixed=False)


@torch.inference_mode()
def test_contexted_kv_attention_with_the_seeds_fix():
    _contexted_kv_attention(fixed=True)
