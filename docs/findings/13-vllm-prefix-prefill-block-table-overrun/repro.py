"""vLLM 0.33.0 context_attention_fwd (vllm/v1/attention/ops/prefix_prefill.py, _fwd_kernel's context loop) loads
the block table without a mask: ``_paged_kv_cache_offsets(..., MASK_BLOCK_TABLE=False)`` at prefix_prefill.py:91.
The loop's comment says the context tile "never steps past this batch's block-table row" because the current
chunk follows the context, but the tile is BLOCK_SIZE tokens (32 or more) and the row holds only
ceil(seq_len / block_size) entries: one decode token after one cached token at block size 1 reads a whole tile's
entries from a 2-entry row (memcheck counted 64 invalid 4-byte reads). The K/V loads are masked, so the output is
right and only a memory checker sees it. Found by kvfuzz's memory-safety oracle (`kvfuzz fuzz --target
vllm.context_attention_fwd`, H200, 2026-11-27).

Run without kvfuzz, on a CUDA GPU with vLLM 0.33.0's Python files importable (measured on an H200:
benchmarks/results/finding13-prefix-prefill-h200.txt):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 repro.py exact   # invalid reads
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 repro.py padded  # none
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 repro.py filled  # none

exact: the block table has exactly the row the sequence needs (2 entries); padded: the same row with 62 spare
columns, as vLLM's persistent block table has (the read lands inside the allocation, unseen); filled: 64 cached
tokens, so the last context tile ends inside the row. Prints the output's finiteness; the verdict is
compute-sanitizer's "ERROR SUMMARY" (exact: 64 invalid reads at prefix_prefill.py:91; memcheck then stops the
kernel, so the script ends with "unspecified launch failure"; padded and filled: 0 errors).
"""

import sys

import torch
from vllm.v1.attention.ops.prefix_prefill import context_attention_fwd

case = sys.argv[1] if len(sys.argv) > 1 else "exact"
torch.manual_seed(0)
dev, dtype = "cuda", torch.float16
head_size, block_size, heads, kv_heads, x = 32, 1, 1, 1, 8  # x: 16 bytes / 2-byte elements
ctx_len = 64 if case == "filled" else 1
query_len = 1
seq_len = ctx_len + query_len
num_blocks = seq_len  # block size 1: one block per token
k_cache = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, dtype=dtype, device=dev)
v_cache = torch.randn(num_blocks, kv_heads, head_size, block_size, dtype=dtype, device=dev)
q = torch.randn(query_len, heads, head_size, dtype=dtype, device=dev)
k = torch.randn(query_len, kv_heads, head_size, dtype=dtype, device=dev)
v = torch.randn(query_len, kv_heads, head_size, dtype=dtype, device=dev)
o = torch.empty_like(q)
columns = seq_len + (62 if case == "padded" else 0)
b_loc = torch.zeros(1, columns, dtype=torch.int32, device=dev)
b_loc[0, :seq_len] = torch.arange(seq_len, dtype=torch.int32, device=dev)
b_start_loc = torch.tensor([0, query_len], dtype=torch.int32, device=dev)
b_seq_len = torch.tensor([seq_len], dtype=torch.int32, device=dev)
one = torch.tensor(1.0, dtype=torch.float32, device=dev)
context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, b_loc, b_start_loc, b_seq_len, seq_len, query_len,
                      one, one)
torch.cuda.synchronize()
print(f"{case}: block table {tuple(b_loc.shape)}, output finite: {bool(o.isfinite().all())}")
