"""vLLM's ROCm routing model: when ``chunked_prefill_paged_decode`` sends decode sequences to the custom HIP
kernel (``ops.paged_attention_rocm``) instead of Triton's ``kernel_paged_attention_2d``, and what that kernel
accepts. Pure functions of a call's configuration: the guard uses them for kv_cache_dtype portability, the
fuzzer for coverage (which batches would take the ROCm path). Sources (vLLM 0.33.0): vllm/platforms/rocm.py
``use_rocm_custom_paged_attention``; csrc/rocm/attention.cu ``paged_attention`` (int32 index tensors,
kv_cache_dtype auto/fp8/fp8_e4m3); docs/contracts.md has the table.
"""

from __future__ import annotations

import torch


def current_rocm_arch() -> str | None:
    """The gfx architecture of GPU 0 when torch runs on ROCm (e.g. "gfx942"), else None."""
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        try:
            return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
        except Exception:
            return None
    return None


#: kv_cache_dtype values csrc/rocm/attention.cu's ``paged_attention`` accepts; others fail
#: ``TORCH_CHECK(false, "Unsupported KV cache dtype: ", kv_cache_dtype)``.
ROCM_CUSTOM_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
ROCM_CDNA_ARCHS = ("gfx90a", "gfx942", "gfx950")
#: Architectures checked for portability when the call does not run on ROCm (warnings only).
ROCM_PORTABILITY_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")


def rocm_custom_paged_attention_selected(arch: str, query_dtype: torch.dtype, head_size: int, block_size: int,
                                         gqa_ratio: int, max_seq_len: int, sliding_window: int = 0,
                                         kv_cache_dtype: str = "auto", has_alibi: bool = False,
                                         has_sinks: bool = False, packed_cache: bool = True) -> tuple[bool, str]:
    """Whether ``chunked_prefill_paged_decode`` on ROCm ``arch`` sends the decode sequences to the custom HIP
    kernel (``ops.paged_attention_rocm``) instead of Triton's ``kernel_paged_attention_2d``, and why.

    Models vllm/platforms/rocm.py ``use_rocm_custom_paged_attention`` (vLLM 0.33.0) and its caller, which
    also requires a power-of-2 block size and a packed cache (``has_native_kv_cache_layout``):
    CDNA (gfx90a/gfx942/gfx950): no window, fp16/bf16, head_size 64 or 128, block_size 16 or 32, gqa ratio
    1-16, max_seq_len <= 128K, no sinks. RDNA (gfx11*/gfx12*): no window, fp16/bf16, head_size 128,
    block_size 16, gqa ratio 3-16, max_seq_len <= 128K, no alibi, kv_cache_dtype "auto", no sinks.
    Returns ``(selected, reason)``: reason names the conditions that held or the first that failed.
    """
    conds: list[tuple[bool, str]] = [
        (sliding_window == 0, f"sliding window {sliding_window} (needs none)"),
        (query_dtype in (torch.float16, torch.bfloat16), f"query dtype {query_dtype} (needs fp16/bf16)"),
    ]
    if arch in ROCM_CDNA_ARCHS:
        conds += [
            (head_size in (64, 128), f"head_size {head_size} (needs 64 or 128)"),
            (block_size in (16, 32), f"block_size {block_size} (needs 16 or 32)"),
            (1 <= gqa_ratio <= 16, f"gqa ratio {gqa_ratio} (needs 1-16)"),
            (max_seq_len <= 128 * 1024, f"max_seq_len {max_seq_len} (needs <= 131072)"),
            (not has_sinks, "sinks (needs none)"),
        ]
    elif arch.startswith(("gfx11", "gfx12")):
        conds += [
            (head_size == 128, f"head_size {head_size} (needs 128)"),
            (block_size == 16, f"block_size {block_size} (needs 16)"),
            (3 <= gqa_ratio <= 16, f"gqa ratio {gqa_ratio} (needs 3-16)"),
            (max_seq_len <= 128 * 1024, f"max_seq_len {max_seq_len} (needs <= 131072)"),
            (not has_alibi, "alibi slopes (needs none)"),
            (kv_cache_dtype == "auto", f"kv_cache_dtype {kv_cache_dtype!r} (needs 'auto')"),
            (not has_sinks, "sinks (needs none)"),
        ]
    else:
        return False, f"{arch} is neither CDNA ({', '.join(ROCM_CDNA_ARCHS)}) nor gfx11/gfx12"
    conds += [
        (block_size > 0 and block_size & (block_size - 1) == 0, f"block_size {block_size} (needs a power of 2)"),
        (packed_cache, "a stride-padded cache (needs packed blocks)"),
    ]
    for ok, why in conds:
        if not ok:
            return False, f"not selected on {arch}: {why}"
    return True, (f"selected on {arch}: {str(query_dtype).removeprefix('torch.')}, head_size {head_size}, "
                  f"block_size {block_size}, gqa ratio {gqa_ratio}, no window")


def rocm_custom_path_taken(call, arch: str) -> tuple[bool, str]:
    """:func:`rocm_custom_paged_attention_selected` for one ``chunked_prefill_paged_decode`` call
    (a :class:`~kvfuzz.contracts.calls.paged_call.PagedCall` with valid shapes) on ROCm ``arch``: the query dtype,
    head size, block size, GQA ratio, the ``max_seq_len`` passed, window, kv_cache_dtype, alibi, sinks and
    whether both caches are packed, read off the call as vllm/v1/attention/ops/chunked_prefill_paged_decode.py
    reads them before ``use_rocm_custom_paged_attention``. Used as the ROCm path's ``taken_on``
    (:class:`~kvfuzz.contracts.calls.declaration.KernelPath`)."""
    q, kc, vc = call.query, call.key_cache, call.value_cache
    hkv = call.num_kv_heads
    msl = call.max_seq_len
    try:
        msl = int(msl.item()) if isinstance(msl, torch.Tensor) else int(msl or 0)
    except (TypeError, ValueError, RuntimeError):
        msl = 0
    packed = kc.stride(0) == kc.shape[1:].numel() and vc.stride(0) == vc.shape[1:].numel()
    kvd = call.kv_cache_dtype if isinstance(call.kv_cache_dtype, str) else "auto"
    return rocm_custom_paged_attention_selected(
        arch, q.dtype, int(q.shape[2]), call.block_size, int(q.shape[1]) // hkv if hkv else 0, msl,
        call.sliding_window, kvd, call.has_alibi, call.has_sinks, packed)


__all__ = ["ROCM_CDNA_ARCHS", "ROCM_CUSTOM_KV_CACHE_DTYPES", "ROCM_PORTABILITY_ARCHS", "current_rocm_arch",
           "rocm_custom_paged_attention_selected", "rocm_custom_path_taken"]
