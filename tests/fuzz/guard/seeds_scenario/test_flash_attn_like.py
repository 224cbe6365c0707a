"""The seeds' bug in FlashAttention 3 form: a kernel test written the way vLLM's tests/kernels/attention/
test_flash_attn.py calls ``flash_attn_varlen_func`` (paged: block_table, cu_seqlens_q, seqused_k; the unified
contract: every one of a sequence's seq_len tokens is read from the cache), with the caller bug of the seeds
(../shared/seeds/): the decode sequence's current token is never written to the cache, which the test
zero-initialises. Its inputs are uniform(-1e-3, 1e-3) and its tolerance atol 1e-4, so the missing token moves the
output by less than the tolerance and the test passes plainly; under ``--kvfuzz-guard`` it fails, naming the
unified invariant. ``test_varlen_with_the_fix`` writes every token and passes clean under the guard.

FA3 runs on Hopper GPUs only: elsewhere the file skips. Collected only with KVFUZZ_SEEDS_SCENARIO=1 (conftest.py);
benchmarks/gpu_hopper_seeds.sh runs it on an H100, plainly and under the guard.
"""

import pytest
import torch

from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttnVarlen

_avail = VllmFlashAttnVarlen().availability()
if not _avail.ok:
    pytest.skip(f"FlashAttention 3 is unavailable: {_avail.reason}", allow_module_level=True)

from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 128, 16
DTYPE = torch.bfloat16


def _varlen(fixed: bool, hand_over) -> None:
    torch.manual_seed(0)
    dev = "cuda"
    query_lens, ctx_lens = [5, 9, 1], [20, 7, 30]  # the last sequence is a decode
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    num_blocks = 32
    q = torch.empty(sum(query_lens), NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=dev).uniform_(-1e-3, 1e-3)
    k = torch.empty(sum(seq_lens), NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=dev).uniform_(-1e-3, 1e-3)
    v = torch.empty_like(k).uniform_(-1e-3, 1e-3)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=dev)
    v_cache = torch.zeros_like(k_cache)
    width = -(-max(seq_lens) // BLOCK_SIZE)
    block_table = torch.randperm(num_blocks, device=dev)[: len(seq_lens) * width].view(len(seq_lens), width)
    block_table = block_table.to(torch.int32)
    start = 0
    for i, (s, qn) in enumerate(zip(seq_lens, query_lens)):
        # the bug: a decode sequence's current token (its last one) is left out of the cache
        written = s if fixed or qn > 1 else s - 1
        for p in range(written):
            b, o = int(block_table[i, p // BLOCK_SIZE]), p % BLOCK_SIZE
            k_cache[b, o], v_cache[b, o] = k[start + p], v[start + p]
        start += s
    cu_q = torch.tensor([0] + query_lens, device=dev).cumsum(0).to(torch.int32)
    seqused_k = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    new = torch.cat([k[sum(seq_lens[:i]) + ctx_lens[i]:sum(seq_lens[: i + 1])] for i in range(len(seq_lens))])
    new_v = torch.cat([v[sum(seq_lens[:i]) + ctx_lens[i]:sum(seq_lens[: i + 1])] for i in range(len(seq_lens))])
    with hand_over(new, new_v):
        out = flash_attn_varlen_func(q, k_cache, v_cache, max(query_lens), cu_q, max(seq_lens), seqused_k=seqused_k,
                                     causal=True, block_table=block_table, softmax_scale=HEAD_SIZE**-0.5,
                                     fa_version=3)
    # the reference: each sequence's own keys, causal, in fp32
    refs, start = [], 0
    for i, (s, qn) in enumerate(zip(seq_lens, query_lens)):
        qi = q[int(cu_q[i]):int(cu_q[i + 1])].float()
        ki = k[start:start + s].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
        vi = v[start:start + s].float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * HEAD_SIZE**-0.5
        mask = torch.arange(s, device=dev)[None, :] > (s - qn + torch.arange(qn, device=dev))[:, None]
        scores.masked_fill_(mask, float("-inf"))
        refs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))
        start += s
    torch.testing.assert_close(out.float(), torch.cat(refs), atol=1e-4, rtol=0)


def test_varlen_as_in_the_seeds(hand_over):
    _varlen(fixed=False, hand_over=hand_over)


def test_varlen_with_the_fix(hand_over):
    _varlen(fixed=True, hand_over=hand_over)
