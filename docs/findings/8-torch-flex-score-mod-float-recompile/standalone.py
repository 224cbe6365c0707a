#!/usr/bin/env python3
"""Standalone reproducer of kvfuzz's finding 8 (docs/findings.md): torch.compile'd flex_attention whose score_mod
closes over a Python float that changes between calls fails on the second call with "InductorError:
LoweringException: RuntimeError: unbacked_bindings" (seen with torch 2.11 on an H200). Not paged-specific: no
PagedAttention, no block mask. Needs only torch and a CUDA GPU.

Run: python standalone.py
Exit status: 1 while the bug reproduces (a later call fails to compile), 0 once fixed (all three calls run),
2 when it cannot run here (no CUDA device: flex_attention compiles to Triton on CUDA only)."""

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("error: this reproducer needs a CUDA GPU (torch.compile'd flex_attention lowers to Triton on CUDA)",
              file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    f = torch.compile(flex_attention)
    q = torch.randn(1, 2, 16, 32, device="cuda", dtype=torch.float16)
    failed = 0
    for cap in (50.0, 4.0, 7.0):  # a softcap, as Gemma 2's logit softcapping writes it, closed over as a float

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        try:
            f(q, q, q, score_mod=score_mod)
            torch.cuda.synchronize()
            print(f"softcap {cap}: ok")
        except Exception as e:  # noqa: BLE001 - the compile error is the finding
            failed += 1
            print(f"softcap {cap}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    if failed:
        print("REPRODUCED: a score_mod closing over a float that changes between calls fails to compile")
        return 1
    print("not reproduced: every call compiled and ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
