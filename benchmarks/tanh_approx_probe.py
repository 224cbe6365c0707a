"""PTX ``tanh.approx.f32``'s relative error on this GPU, over every positive finite fp32 input (the instruction is odd:
``-x`` is checked on a sample): what ``TANH_APPROX_ULPS`` (contracts/checks/reference.py, 2**-16, from an exhaustive
sm_75 measurement) assumes for the softcap of the FlashAttention kernels and FlashInfer on Hopper.

Prints the largest relative error ``|approx - tanh(x)| / |tanh(x)|`` (tanh in fp64) over the normal inputs and where it
is, the same per range of ``|x|``, and the largest absolute error over the subnormal ones. Needs a CUDA GPU with torch
and triton (inline PTX through ``tl.inline_asm_elementwise``). Usage: python3 benchmarks/tanh_approx_probe.py
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh_approx(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, y, mask=mask)


def approx(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _tanh_approx[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def main() -> int:
    if not torch.cuda.is_available():
        print("tanh_approx_probe.py: needs a CUDA GPU", file=sys.stderr)
        return 3
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    step = 1 << 23  # one binade of inputs a pass
    last = 0x7F800000  # +inf's bits: every positive finite input below it
    worst, worst_x, sub_abs = 0.0, 0.0, 0.0
    per_range: dict[int, float] = {}
    for start in range(0, last, step):
        bits = torch.arange(start, min(start + step, last), dtype=torch.int64, device=dev).to(torch.int32)
        x = bits.view(torch.float32)
        y = approx(x).double()
        ref = torch.tanh(x.double())
        normal = x >= 2.0**-126
        if bool((~normal).any()):
            sub_abs = max(sub_abs, float((y - ref)[~normal].abs().max()))
        if not bool(normal.any()):
            continue
        rel = ((y - ref).abs() / ref.abs())[normal]
        xs = x[normal]
        i = int(rel.argmax())
        if float(rel[i]) > worst:
            worst, worst_x = float(rel[i]), float(xs[i])
        e = int(math.floor(math.log2(float(xs[0]))))
        key = max(-20, min(4, e))
        per_range[key] = max(per_range.get(key, 0.0), float(rel.max()))
    neg = -torch.rand(1 << 24, device=dev) * 20
    neg_sym = float((approx(neg) + approx(-neg)).abs().max())
    print(f"max relative error over normal inputs: {worst:.4e} = 2**{math.log2(worst):.2f} at x = {worst_x!r}")
    print(f"max absolute error over subnormal inputs: {sub_abs:.3e}")
    print(f"odd on a sample of 2**24 negative inputs: max |approx(x) + approx(-x)| = {neg_sym:.3e}")
    for e in sorted(per_range):
        label = f"|x| < 2**{e + 1}" if e == -20 else f"|x| >= 2**{e}" if e == 4 else f"2**{e} <= |x| < 2**{e + 1}"
        print(f"  {label}: {per_range[e]:.4e} = 2**{math.log2(per_range[e]) if per_range[e] else float('-inf'):.2f}")
    print(f"TANH_APPROX_ULPS assumes 2**-16 = {2.0**-16:.4e}: {'holds' if worst <= 2.0**-16 else 'EXCEEDED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
