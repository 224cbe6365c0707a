#!/usr/bin/env python3
"""vLLM 0.33.0's FlashAttention 4 (``flash_attn_varlen_func(..., fa_version=4)``) on Hopper fails to compile for head
sizes 288, 320, 384 and 448 (``MLIRError: failed to partition `input` '!cute.shape<"(64,320)">' with `tiled_mma```),
though FA4's ``_validate_head_dims`` accepts 8-512 on SM90 and vLLM's FLASH_ATTN backend ``supports_head_size``
accepts every multiple of 8 up to 512 when FA4 is available, and upgrades FA3 to FA4 on SM90 for head_size > 256
(``get_flash_attn_version``). 192, 256 and 512 compile and agree with fp64.

Needs torch, vLLM 0.33.0 with its FA4 Python, nvidia-cutlass-dsl 4.8.0 and quack-kernels 0.6.5, and an SM 9.x GPU;
no kvfuzz. Exit 1 while a head size vLLM routes to FA4 fails, 0 when all run, 2 when it cannot run here.
Usage: python standalone.py"""

import sys

try:
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    print("cannot run here: needs a GPU of compute capability 9.x (Hopper)")
    sys.exit(2)


def one(head_size: int, page: int = 16, seq_len: int = 1) -> float:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    q = torch.randn(1, 1, head_size, dtype=dt, device=dev)
    pages = (seq_len + page - 1) // page
    k = torch.randn(pages, page, 1, head_size, dtype=dt, device=dev)
    v = torch.randn(pages, page, 1, head_size, dtype=dt, device=dev)
    out = torch.empty_like(q)
    flash_attn_varlen_func(
        q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=dev), max_seqlen_q=1,
        seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=dev), max_seqlen_k=seq_len,
        softmax_scale=head_size ** -0.5, causal=True, window_size=[-1, -1],
        block_table=torch.arange(pages, dtype=torch.int32, device=dev)[None], softcap=0, fa_version=4)
    torch.cuda.synchronize()
    keys, values = k.view(-1, 1, head_size)[:seq_len].double(), v.view(-1, 1, head_size)[:seq_len].double()
    p = (torch.einsum("hd,khd->hk", q[0].double(), keys) * head_size ** -0.5).softmax(-1)
    return float((out[0].double() - torch.einsum("hk,khd->hd", p, values)).abs().max())


def main() -> int:
    failed = []
    for head_size in (192, 256, 288, 320, 384, 448, 512):
        try:
            print(f"head_size={head_size}: ran, max |out - ref|={one(head_size):.3g}")
        except Exception as e:  # noqa: BLE001 - the compile error is the finding
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            print(f"head_size={head_size}: {type(e).__name__}: {last[:200]}")
            failed.append(head_size)
    print(f"device: {torch.cuda.get_device_name()}")
    if failed:
        print(f"REPRODUCED: head sizes {failed} fail, which vLLM's FLASH_ATTN backend routes to FA4 on Hopper")
        return 1
    print("not reproduced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
