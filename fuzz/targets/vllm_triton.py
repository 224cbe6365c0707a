"""vLLM's Triton paged-attention kernels: compiled on CUDA, under Triton's interpreter on CPU.

On a machine without CUDA the adapter sets ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` before
triton or vllm is first imported (without the second, vllm.triton_utils swaps real Triton for a placeholder
when no GPU driver is active), and registers a stub ``vllm.platforms.rocm`` whose
``use_rocm_custom_paged_attention`` returns False (the real module needs a GPU to import). Triton's
interpreter computes bf16 wrongly (triton-lang/triton#11584), so on CPU these targets declare fp16/fp32 only.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import types

import attrs
import numpy as np
import torch

from kvfuzz.contracts.batch import Batch
from kvfuzz.contracts.capabilities import Capabilities
from kvfuzz.contracts.contract import Contract
from kvfuzz.contracts.data import BatchData
from kvfuzz.contracts.layouts import CacheLayout, VllmPagedLayout
from kvfuzz.contracts.materialize import CacheState

from .base import Availability, KernelCall, Target


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _quiet_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        import vllm.logger  # noqa: F401  (configures vLLM's loggers; then quiet its platform-probe warnings)

        logging.getLogger("vllm").setLevel(logging.ERROR)


@functools.cache
def prepare_triton_runtime() -> str:
    """Make vLLM's Triton kernels importable here; returns "cuda" or "cpu" (interpreted).

    Raises RuntimeError if triton was already imported without the interpreter on a machine without CUDA
    (the interpreter flag is read at import time): set TRITON_INTERPRET=1 before importing triton.
    """
    if _on_cuda():
        _quiet_vllm()
        return "cuda"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before kvfuzz could enable its interpreter; on a machine without CUDA set "
            "TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' in the environment before importing triton"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if "vllm.platforms.rocm" not in sys.modules:
        stub = types.ModuleType("vllm.platforms.rocm")
        stub.use_rocm_custom_paged_attention = lambda *a, **k: False  # no ROCm here: the Triton decode path
        sys.modules["vllm.platforms.rocm"] = stub
    _quiet_vllm()
    return "cpu"


def _missing(*modules: str) -> str | None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            return m
    return None


class VllmTritonTarget(Target):
    """Shared availability logic for vLLM's Triton kernels.

    dtypes depend on where the kernel runs: interpreted on CPU, fp16 and fp32 (the interpreter computes
    bf16 wrongly); compiled on CUDA, fp16 and bf16 (Triton's ``tl.dot`` takes fp32 inputs as TF32 by
    default, measured 1.7e-3 error on a single-key decode on an H200, which kvfuzz's fp32 tolerance does
    not model yet).
    """

    cpu_dtypes: tuple[str, ...] = ("float16", "float32")
    cuda_dtypes: tuple[str, ...] = ("float16", "bfloat16")

    def __init__(self) -> None:
        dtypes = self.cuda_dtypes if _on_cuda() else self.cpu_dtypes
        self.capabilities = attrs.evolve(type(self).capabilities, dtypes=dtypes)

    def availability(self) -> Availability:
        missing = _missing("triton", "vllm")
        if missing:
            return Availability(False, f"python package {missing!r} is not installed (run `make setup`, or "
                                       "`pip install triton vllm` on a GPU machine)")
        try:
            device = prepare_triton_runtime()
        except RuntimeError as e:
            return Availability(False, str(e))
        if device == "cpu" and not set(self.capabilities.dtypes) - {"bfloat16"}:
            return Availability(False, "only bf16 declared, and Triton's interpreter computes bf16 wrongly")
        return Availability(True, "compiled (CUDA)" if device == "cuda" else "Triton interpreter (CPU)", device)

    @property
    def interpreted(self) -> bool:
        return not _on_cuda()


class VllmChunkedPrefillPagedDecode(VllmTritonTarget):
    """``chunked_prefill_paged_decode`` (vllm/v1/attention/ops/chunked_prefill_paged_decode.py, vllm 0.33.0).

    Split contract: prefill sequences are computed by ``context_attention_fwd(..., skip_decode=True)`` from
    the cache (positions ``0 .. ctx_len-1``) plus ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
    (the new tokens, in query order); decode sequences by ``kernel_paged_attention_2d`` from the cache alone
    (positions ``0 .. seq_len-1``). Cache: :class:`~kvfuzz.contracts.layouts.VllmPagedLayout`. Index
    tensors int32; ``k_scale``/``v_scale`` float32 scalar tensors.
    """

    name = "vllm.chunked_prefill_paged_decode"
    description = "vLLM Triton prefix-prefill + paged decode (split contract)"
    capabilities = Capabilities(
        contract=Contract.SPLIT,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
        head_sizes=(32, 64, 128),  # context_attention_fwd pads other sizes; the 5-D cache needs D % x == 0
        block_sizes=(16, 32),
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return VllmPagedLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        key, value = data.new_kv(batch)
        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
        one = torch.tensor(1.0, dtype=torch.float32, device=dev)
        kwargs = dict(
            query=data.query.to(dev), key=key.to(dev), value=value.to(dev), output=out,
            kv_cache_dtype=batch.kv_cache_dtype, key_cache=cache.key_cache, value_cache=cache.value_cache,
            block_table=batch.block_table_tensor(dev), query_start_loc=batch.query_start_loc_tensor(dev),
            seq_lens=batch.seq_lens_tensor(dev), max_seq_len=batch.max_seq_len,
            max_query_len=batch.max_query_len, k_scale=one, v_scale=one.clone(), sm_scale=batch.sm_scale,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out,
                          key=kwargs["key"], value=kwargs["value"])

    def run(self, call: KernelCall) -> torch.Tensor:
        prepare_triton_runtime()
        from vllm.v1.attention.ops.chunked_prefill_paged_decode import chunked_prefill_paged_decode

        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison arithmetic
            chunked_prefill_paged_decode(**call.kwargs)
        return call.output

    def path(self, batch: Batch) -> str:
        parts = []
        if batch.prefill_seqs:
            parts.append("context_attention_fwd")
        if batch.decode_seqs:
            parts.append("kernel_paged_attention_2d")
        return "+".join(parts)
