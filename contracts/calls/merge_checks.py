"""The argument checks of a ``merge_attn_states`` call, from its arguments alone (vLLM 0.33.0,
vllm/v1/attention/ops/merge_attn_states.py: the docstring's shapes, the dispatcher's assertion on the head strides;
triton_merge_attn_states.py and the CUDA op address a token of ``prefix_output``/``suffix_output`` at
``token * num_heads * head_stride``, so the token stride must be that).

``merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
prefill_tokens_with_context=None, output_scale=None)``: outputs ``[T, H, D]`` float32/float16/bfloat16 (an fp8
``output`` only with ``output_scale``), log-sum-exps float32 ``[H, T]`` (any strides: the Triton kernel reads them
by their strides), ``prefill_tokens_with_context`` None or ``0 .. T``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..checks.violations import Check, Violation, violation

KERNEL = "merge_attn_states"
#: The dtypes of the parts and of an unquantized output.
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _bad(what: str, expected: Any, found: Any) -> Violation:
    return violation(Check.MERGE_INPUTS, what, kernel=KERNEL, expected=expected, found=found)


def _outputs(kw: Mapping[str, Any]) -> list[Violation]:
    out = []
    o, p, s = kw.get("output"), kw.get("prefix_output"), kw.get("suffix_output")
    for name, t in (("output", o), ("prefix_output", p), ("suffix_output", s)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            out.append(_bad(f"{name} is not a [num_tokens, num_heads, head_size] tensor", "a 3-D tensor",
                            getattr(t, "shape", type(t).__name__)))
    if out:
        return out
    if not (o.shape == p.shape == s.shape):
        out.append(_bad("output, prefix_output and suffix_output differ in shape", tuple(o.shape),
                        (tuple(p.shape), tuple(s.shape))))
    for name, t in (("prefix_output", p), ("suffix_output", s)):
        if t.dtype not in OUTPUT_DTYPES:
            out.append(_bad(f"{name} has an unsupported dtype", "float32, float16 or bfloat16", t.dtype))
    if o.dtype not in OUTPUT_DTYPES and kw.get("output_scale") is None:
        out.append(_bad("an fp8 output needs output_scale", "output_scale", None))
    if p.stride(1) != s.stride(1):
        out.append(_bad("prefix_output and suffix_output head strides differ (vLLM asserts they match)",
                        p.stride(1), s.stride(1)))
    for name, t in (("output", o), ("prefix_output", p), ("suffix_output", s)):
        if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
            out.append(_bad(f"{name}'s token stride is not num_heads * head stride (the kernels address a token "
                            "there)", t.shape[1] * t.stride(1), t.stride(0)))
        if t.shape[2] > 1 and t.stride(2) != 1:
            out.append(_bad(f"{name}'s last dim is strided", 1, t.stride(2)))
    return out


def _lses(kw: Mapping[str, Any], tokens: int, heads: int) -> list[Violation]:
    out = []
    for name in ("prefix_lse", "suffix_lse", "output_lse"):
        t = kw.get(name)
        if t is None and name == "output_lse":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (heads, tokens):
            out.append(_bad(f"{name} is not [num_heads, num_tokens]", (heads, tokens),
                            getattr(t, "shape", type(t).__name__)))
        elif t.dtype != torch.float32:
            out.append(_bad(f"{name} is not float32", torch.float32, t.dtype))
    return out


def check_merge_call(kw: Mapping[str, Any]) -> list[Violation]:
    """The violations of a ``merge_attn_states`` call's keyword arguments (module docstring): shapes, dtypes,
    strides, ``prefill_tokens_with_context``. Empty when the call keeps them."""
    out = _outputs(kw)
    o = kw.get("output")
    if out or not isinstance(o, torch.Tensor):
        return out
    tokens, heads = o.shape[0], o.shape[1]
    out += _lses(kw, tokens, heads)
    n = kw.get("prefill_tokens_with_context")
    if n is not None and not (isinstance(n, int) and 0 <= n <= tokens):
        out.append(_bad("prefill_tokens_with_context is outside 0..num_tokens", f"None or 0..{tokens}", n))
    return out


__all__ = ["KERNEL", "OUTPUT_DTYPES", "check_merge_call"]
