#!/usr/bin/env python3
"""vLLM 0.33.0's FlashAttention 4 (``flash_attn_varlen_func(..., fa_version=4)``, the CuTe-DSL kernels in
vllm/vllm_flash_attn/cute) on Hopper, paged KV with a page (block_size) of 128: the slots of a sequence's last page
past its seq_len are read, and a NaN or an Inf there reaches the output (0 x NaN). Pages of 16, 32 and 64 are right
at head sizes 64 to 256; at head size 512 pages of 64 are read past seq_len too, with a 16-bit cache and with an fp8
e4m3 cache (SM90's fp8-KV path, ``fp8_kv_dequant``: k/v descales of shape (num_seqs, num_kv_heads), no q_descale, as
vLLM's FlashAttentionImpl.forward passes them to FA4).

Needs torch, vLLM 0.33.0 with its FA4 Python, nvidia-cutlass-dsl 4.8.0 and quack-kernels 0.6.5 (as vLLM pins them),
and an SM 9.x GPU; no kvfuzz. One decode query over seq_len keys, every key and value slot past seq_len set to
TAIL (NaN, Inf, or 0 as the control), against the fp64 softmax over the seq_len valid keys.
Exit 1 while a non-finite tail reaches the output of a finite-input call, 0 when none does, 2 when it cannot run.
Usage: python standalone.py"""

import sys

try:
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    print("cannot run here: needs a GPU of compute capability 9.x or newer")
    sys.exit(2)


def one(head_size: int, page: int, tail: float | None, seq_len: int, num_heads: int = 1, fp8: bool = False):
    """One decode query over seq_len keys in pages of ``page``; the slots past seq_len hold ``tail`` (for an fp8
    cache: e4m3's NaN byte 0x7F, or 0). Returns the kernel's output and the fp64 softmax over the valid keys."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    q = torch.randn(1, num_heads, head_size, dtype=dt, device=dev)
    pages = (seq_len + page - 1) // page
    k = torch.randn(pages, page, num_heads, head_size, dtype=dt, device=dev)
    v = torch.randn(pages, page, num_heads, head_size, dtype=dt, device=dev)
    descales = {}
    if fp8:  # vLLM stores an fp8 cache as uint8 and views it as e4m3; descales 1.0, one per (sequence, kv head)
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        one_ = torch.ones((1, num_heads), dtype=torch.float32, device=dev)
        descales = dict(k_descale=one_, v_descale=one_)
    if tail is not None:  # the slots past seq_len: stale data of a freed or reused block
        for c in (k, v):
            if fp8:
                c.view(torch.uint8).view(-1, num_heads, head_size)[seq_len:] = 0x7F if tail != 0 else 0
            else:
                c.view(-1, num_heads, head_size)[seq_len:] = tail
    out = torch.empty_like(q)
    flash_attn_varlen_func(
        q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=dev), max_seqlen_q=1,
        seqused_k=torch.tensor([seq_len], dtype=torch.int32, device=dev), max_seqlen_k=seq_len,
        softmax_scale=head_size ** -0.5, causal=True, window_size=[-1, -1],
        block_table=torch.arange(pages, dtype=torch.int32, device=dev)[None], softcap=0, fa_version=4, **descales)
    torch.cuda.synchronize()
    keys = k.view(-1, num_heads, head_size)[:seq_len].double()
    values = v.view(-1, num_heads, head_size)[:seq_len].double()
    scores = torch.einsum("hd,khd->hk", q[0].double(), keys) * head_size ** -0.5
    ref = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out[0].double(), ref


def main() -> int:
    bad = 0
    cases = [(64, 16, 1, False), (64, 64, 1, False), (64, 128, 1, False), (64, 128, 100, False),
             (64, 128, 129, False), (128, 128, 1, False), (256, 128, 1, False),
             (512, 64, 1, False), (512, 64, 66, False), (512, 64, 1, True), (512, 64, 66, True)]
    for head_size, page, seq_len, fp8 in cases:
        for tail in (float("nan"), 0.0) if fp8 else (float("nan"), float("inf"), 0.0):  # e4m3fn has no Inf
            o, r = one(head_size, page, tail, seq_len, fp8=fp8)
            nan = bool(o.isnan().any())
            err = float((o - r).abs().max())
            bad += nan and tail != 0.0
            print(f"head_size={head_size} page={page} seq_len={seq_len} cache={'fp8_e4m3' if fp8 else 'float16'} "
                  f"tail={tail}: non-finite output={nan} max |out - ref|={err:.3g}")
    print(f"device: {torch.cuda.get_device_name()}")
    if bad:
        print(f"REPRODUCED: {bad} call(s) with finite valid keys gave a non-finite output")
        return 1
    print("not reproduced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
