"""What FA3 raises when an allocation inside its forward fails (a GPU with FA3; run after benchmarks/gpu_env.sh).

Fills the device until about ``--leave`` GiB stay free, then calls ``flash_attn_varlen_func(..., fa_version=3,
num_splits=32)`` on a batch whose split accumulators (32 x num_heads x total_q x head_size fp32) need more than that.
Prints the exception's type and first line, and whether kvfuzz counts it as out of memory
(``kvfuzz.fuzz.harness.memory.is_out_of_memory``): exit 0 if it does, 1 if it does not, 2 if the call passed.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leave", type=float, default=1.0, help="GiB left free before the call")
    args = ap.parse_args()
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    from kvfuzz.fuzz.harness.memory import is_out_of_memory
    dev = torch.device("cuda")
    heads, kv_heads, d, block = 96, 4, 80, 32
    q_len = ctx = 8192
    blocks = (q_len + ctx) // block
    q = torch.randn(q_len, heads, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(blocks, block, kv_heads, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, q_len], device=dev, dtype=torch.int32)
    seqused_k = torch.tensor([q_len + ctx], device=dev, dtype=torch.int32)
    block_table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    hold = []
    while torch.cuda.mem_get_info()[0] > (args.leave + 1) * 2**30:
        hold.append(torch.empty(2**30, dtype=torch.uint8, device=dev))
    while torch.cuda.mem_get_info()[0] > args.leave * 2**30:
        hold.append(torch.empty(2**26, dtype=torch.uint8, device=dev))
    print(f"free before the call: {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB; accumulators need "
          f"{32 * heads * q_len * d * 4 / 2**30:.2f} GiB")
    try:
        flash_attn_varlen_func(q, k, v, max_seqlen_q=q_len, cu_seqlens_q=cu_q, max_seqlen_k=q_len + ctx,
                               seqused_k=seqused_k, causal=True, block_table=block_table, fa_version=3,
                               num_splits=32)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the point is what it is
        print(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        ok = is_out_of_memory(e)
        print(f"kvfuzz counts it as out of memory: {ok}")
        return 0 if ok else 1
    print("the call passed: nothing learned")
    return 2


if __name__ == "__main__":
    sys.exit(main())
