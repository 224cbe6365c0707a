"""FlashAttention 3's paged forward as vLLM 0.33.0 ships it (``vllm.vllm_flash_attn``, the compiled
``_vllm_fa3_C`` extension; Hopper, SM 9.x, only): the kernel of vLLM's FLASH_ATTN backend on an H100/H200.

How vLLM 0.33.0 calls it (vllm/v1/attention/backends/flash_attn.py, ``FlashAttentionImpl.forward``, decoder
self-attention, no DCP, no mm-prefix/R-SWA mask mods, which are FA4 only):

- the cache is one buffer ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]``, viewed as
  ``key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)``: two strided
  ``[num_blocks, block_size, num_kv_heads, head_size]`` views (token stride ``2 * head_size``, head stride
  ``block_size * 2 * head_size``), through ``canonicalize_singleton_dim_strides`` (TMA needs 16-byte strides on
  size-1 dims); an fp8 cache is viewed as ``current_platform.fp8_dtype()``;
- new tokens are written first (``do_kv_cache_update``: ``reshape_and_cache_flash`` at ``slot_mapping``;
  ``forward_includes_kv_cache_update = False``), then the kernel reads every ``seq_len`` position from the
  cache: the **unified contract**;
- ``flash_attn_varlen_func(q=query[:T], k=key_cache, v=value_cache, out=output[:T], cu_seqlens_q=
  query_start_loc, max_seqlen_q=max_query_len, seqused_k=seq_lens, max_seqlen_k=max_seq_len,
  softmax_scale=scale, causal=True, alibi_slopes=None, window_size=[W - 1, 0] (else [-1, -1]),
  block_table=block_table, softcap=logits_soft_cap (0: off), scheduler_metadata=..., fa_version=3,
  q_descale/k_descale/v_descale=layer scales .expand((num_seqs, num_kv_heads)), num_splits=max_num_splits,
  s_aux=sinks)`` (through ``FA4DenseAttentionKernel.__call__``, which passes the kwargs on unchanged);
- the metadata builder (``FlashAttentionMetadataBuilder.build``) computes ``scheduler_metadata =
  get_scheduler_metadata(batch_size=num_reqs, max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
  num_heads_q, num_heads_kv, headdim, cache_seqlens=seq_lens, qkv_dtype, cu_seqlens_q=query_start_loc,
  page_size=block_size, causal=True, window_size=the model's one window, num_splits=max_num_splits)`` when it
  schedules ahead of time (FA3: ``aot_schedule``; not for the spec-decode proposer's ``fast_build``, where it is
  None), without ``has_softcap``; ``max_num_splits`` is 0 (FA3's heuristic) in eager mode and
  ``attention_config.flash_attn_max_num_splits_for_cuda_graph`` (32) for batches captured in full CUDA graphs.

CUDA-graph padding (the ``"vllm"`` convention, :mod:`kvfuzz.contracts.model.padding`): FLASH_ATTN's metadata
builder declares ``AttentionCGSupport.ALWAYS`` for FA3 (``FlashAttentionMetadataBuilder._cudagraph_support``), so
under vLLM's default ``FULL_AND_PIECEWISE`` mode a uniform decode batch replays a FULL graph captured for a larger
size; vllm/v1/worker/gpu_model_runner.py (``pad_attn = cudagraph_mode == CUDAGraphMode.FULL``) then builds the
metadata for ``num_reqs_padded`` requests and ``num_tokens_padded`` tokens: ``query_start_loc`` repeats its last real
value (``_prepare_inputs``: ``query_start_loc.np[num_reqs + 1:].fill(cu_num_tokens[-1])``, "kernels like
FlashAttention requires" it non-decreasing), pad ``seq_lens`` 0 (``optimistic_seq_lens_cpu[num_reqs:].fill_(0)``),
pad block-table rows ``NULL_BLOCK_ID`` (``_get_block_table``), ``max_seq_len`` over the real requests, pad slots -1.
``build()`` passes all of it through unchanged and hands ``get_scheduler_metadata`` ``batch_size=num_reqs`` (the
padded count), ``seq_lens`` and ``query_start_loc`` with the pads, ``num_splits=32`` (``max_num_splits``: a FULL
graph's batch is at most ``max_cudagraph_capture_size``); ``forward`` calls FA3 with ``q=query[:num_actual_tokens]``
and ``out=output[:num_actual_tokens]`` (one row per pad token past ``cu_seqlens_q[-1]``, which no sequence owns) and
descales ``[num_reqs_padded, Hkv]``. Mixed batches run PIECEWISE (attention eager, unpadded) unless the user asks
for ``cudagraph_mode=FULL``, which kvfuzz does not model.

What FA3 accepts (read off the backend): dtypes fp16/bf16 (``supported_dtypes``); ``head_size % 8 == 0`` and
``<= 256`` (``supports_head_size``); block sizes multiples of 16 (``get_supported_kernel_block_sizes``); sliding
window and softcap; sinks (``flash_attn_supports_sinks``: FA3 and 4) in bf16 only (the extension checks "We only
support bf16 dtype for S aux."; gpt-oss's sinks are a parameter in the model dtype); no ALiBi
(``get_flash_attn_version`` drops to FA2 with ALiBi; ``flash_attn_varlen_func`` asserts ``alibi_slopes is None`` for
FA3); int32 index tensors (FA3's flash_api.cpp checks them). kv_cache_dtype fp8/fp8_e4m3 (not e5m2;
``supported_kv_cache_dtypes``), where FA3's fp8 forward takes the *query* in fp8 too: vLLM's attention layer quantizes
it first (vllm/model_executor/layers/attention/attention.py ``Attention.forward``: ``query_quant``, a static
per-tensor ``QuantFP8`` with ``_q_scale``: a checkpoint's calibrated ``q_scale``, 1.0 without one; ``Batch.q_scale``,
drawn from ``Capabilities.quant_query``), the backend views the cache as e4m3, passes
``q_descale``/``k_descale``/``v_descale`` ``[N, Hkv]`` and computes ``scheduler_metadata`` with ``qkv_dtype`` e4m3.
The target quantizes the query the same way in :meth:`VllmFlashAttnVarlen.call_data`, so the reference gets the
e4m3 values the kernel gets, and declares P rounded to e4m3 for those calls (``Numerics(p_fp8_e4m3=True)``,
docs/tolerance.md). An fp8 forward writes bf16 only (hopper/flash_api.cpp: "For FP8 input, output must have dtype
BF16"; vLLM hands it the model-dtype ``output``, so an fp16 model with an fp8 cache fails there) and takes head sizes
that are multiples of 16 ("head_size should be a multiple of 16"): fp8 is declared with bf16 and those head sizes
(``fp8_dtypes``, ``fp8_head_sizes``). Not sinks:
kvfuzz draws fp32 sink logits, which a bf16 ``s_aux`` rounds by up to 2^-9 relative, more than the reference's tolerance
allows for a dominant sink; an undeclared sink batch is called with ``s_aux`` in bf16.

The family's home: the signature of ``flash_attn_varlen_func`` for the guard (:data:`FLASH_ATTN_VARLEN_FUNC`,
listed in :data:`SIGNATURES`), and the target :class:`VllmFlashAttnVarlen`. Importing this module imports
neither vllm nor the extension.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, ClassVar, Mapping

import attrs
import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, NHDLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.declaration import INT32_ONLY, KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.paged_call import CacheReads, NewTokensCached, PagedCall, index_values, is_tensor
from kvfuzz.contracts.checks.reference import Numerics
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData, exactly_dequantized, quantize_fp8
from kvfuzz.contracts.model.padding import padding

from .base import NOT_LOADED, Availability, DeviceCapabilities, KernelCall
from .signature import KernelSignature
from .triton_runtime import HopperKernel, HopperTarget, quiet_vllm, vllm_files_missing

#: The extension's file inside the vllm package (vLLM 0.33.0's wheel; 172 MB).
FA3_EXTENSION = "vllm_flash_attn/_vllm_fa3_C.abi3.so"
#: FlashAttention 2's extension (308 MB) and FlashAttention 4's entry module (CuTe-DSL Python), in the same wheel.
FA2_EXTENSION = "vllm_flash_attn/_vllm_fa2_C.abi3.so"
FA4_INTERFACE = "vllm_flash_attn/cute/interface.py"
#: vllm/config/attention.py ``flash_attn_max_num_splits_for_cuda_graph``: the split count of a full-CUDA-graph batch.
CUDA_GRAPH_MAX_SPLITS = 32
#: The split counts the target draws from a batch's seed (``batch.seed % 4``): FA3's heuristic (0, eager mode), the
#: CUDA-graph value, and two forced counts (1: no split; 3: splits that do not divide the blocks evenly).
SPLIT_CHOICES = (0, CUDA_GRAPH_MAX_SPLITS, 1, 3)
#: Why the target cannot run without a Hopper GPU (``kvfuzz targets`` prints it).
HOPPER_ONLY = ("FlashAttention 3 runs on a Hopper GPU (SM 9.x) only; this machine has no CUDA device (on an H100: "
               "vLLM 0.33.0 with vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so, e.g. `make device-bundle FA3=1`)")


def _window(args: Mapping[str, Any]) -> int:
    """``window_size = (left, right)`` as kvfuzz's window: ``left + 1`` keys for a causal ``(left, 0)``, 0: none."""
    w = args.get("window_size")
    try:
        left = int(w[0]) if w is not None else -1
    except (TypeError, IndexError, ValueError):
        return 0
    return left + 1 if left >= 0 else 0


def _per_tensor(x: Any) -> Any:
    """A descale as one scale when every element is the same (vLLM's ``layer._k_scale.expand((N, Hkv))``), else
    as passed (several values: the fp8 content checks are skipped)."""
    if is_tensor(x) and x.numel() > 1:
        flat = x.detach().reshape(-1)
        if bool((flat == flat[0]).all()):
            return flat[:1].clone()
    return 1.0 if x is None else x


def _unpaged_view(args: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """A non-paged varlen call (``k``/``v`` ``[total_k, Hkv, D]`` with ``cu_seqlens_k``, no block_table: the
    encoder, DCP and cascade paths) as a paged one of one-token blocks: ``k.unsqueeze(1)``, a block table of
    token indices ``cu_seqlens_k[i] ..`` per sequence, and ``seq_lens`` = the differences of ``cu_seqlens_k``."""
    k, v, cu = args["k"], args["v"], index_values(args.get("cu_seqlens_k"))
    if cu is None or cu.dim() != 1 or len(cu) < 1:
        raise ValueError("flash_attn_varlen_func without block_table needs cu_seqlens_k [N + 1]")
    lens = cu[1:] - cu[:-1]
    width = max(int(lens.max()) if len(lens) else 0, 1)
    table = cu[:-1, None] + torch.arange(width)[None, :]
    table = torch.where(torch.arange(width)[None, :] < lens[:, None], table, torch.zeros_like(table))
    return k.unsqueeze(1), v.unsqueeze(1), table.to(torch.int32), lens.to(torch.int32)


def flash_attn_varlen_func_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``flash_attn_varlen_func(q [T, H, D], k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
    seqused_k=None, ..., window_size=None, softcap=0.0, alibi_slopes=None, ..., block_table=None, ...,
    q_descale=None, k_descale=None, v_descale=None, num_splits=0, fa_version=2, s_aux=None, ...)``
    (vllm/vllm_flash_attn/flash_attn_interface.py, bound by name) as a unified-contract call: ``k``/``v`` the
    paged caches ``[num_blocks, block_size, Hkv, D]`` read through ``block_table`` for ``seqused_k`` positions
    per sequence. The kernel takes no new-token key/value, so the new tokens can be compared with the cache only
    when the caller hands them over (``key``/``value``). Without ``block_table`` (``k``/``v`` ``[total_k, Hkv,
    D]`` and ``cu_seqlens_k``), the call is read as one-token blocks (:func:`_unpaged_view`). An fp8 cache is
    recognized by its dtype; ``k_descale``/``v_descale`` ``[N, Hkv]`` that hold one value are its scales."""
    paged = args.get("block_table") is not None
    if paged:
        kc, vc, table, seq_lens = args["k"], args["v"], args["block_table"], args["seqused_k"]
        names = dict(query="q", key_cache="k", value_cache="v", query_start_loc="cu_seqlens_q",
                     seq_lens="seqused_k", max_seq_len="max_seqlen_k", max_query_len="max_seqlen_q")
    else:
        kc, vc, table, seq_lens = _unpaged_view(args)
        names = dict(query="q", key_cache="k (unpaged: one-token blocks)", value_cache="v (unpaged)",
                     block_table="(derived from cu_seqlens_k)", query_start_loc="cu_seqlens_q",
                     seq_lens="(derived from cu_seqlens_k)", max_seq_len="max_seqlen_k",
                     max_query_len="max_seqlen_q")
    return PagedCall(
        kernel="flash_attn_varlen_func", contract=Contract.UNIFIED, layout=NHDLayout(), query=args["q"],
        key_cache=kc, value_cache=vc, block_table=table, query_start_loc=args["cu_seqlens_q"], seq_lens=seq_lens,
        key=key if paged else None, value=value if paged else None,
        max_seq_len=args.get("max_seqlen_k"), max_query_len=args.get("max_seqlen_q"), names=names,
        kv_cache_dtype=None, k_scale=_per_tensor(args.get("k_descale")), v_scale=_per_tensor(args.get("v_descale")),
        new_tokens_cached=NewTokensCached.ALL if (paged and key is not None) else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, sliding_window=_window(args),
        has_alibi=args.get("alibi_slopes") is not None, has_sinks=args.get("s_aux") is not None,
    )


#: flash_attn_varlen_func: FA3's fwd (hopper/flash_api.cpp in vllm-flash-attention) checks cu_seqlens_q,
#: seqused_k and the page table are int32; max_seqlen_q sizes its grid and max_seqlen_k its split heuristic and
#: scheduler (the backend passes both exact).
FLASH_ATTN_VARLEN_FUNC = KernelSignature(
    "flash_attn_varlen_func", flash_attn_varlen_func_call, "flash_attn_varlen_func",
    ("vllm.vllm_flash_attn.flash_attn_interface", "vllm.vllm_flash_attn"),
    takes_new_kv=False, declaration=KernelDeclaration(paths=(
        KernelPath("FlashAttention's compiled varlen forward (_vllm_fa3_C / _vllm_fa2_C), which checks its index "
                   "tensors are int32", index_dtypes=INT32_ONLY, reads=frozenset({"max_query_len", "max_seq_len"}),
                   source="vllm/vllm_flash_attn/flash_attn_interface.py flash_attn_varlen_func"),
    # FULL CUDA-graph padding: q is query[:num_actual_tokens] with num_tokens_padded rows, the pads' query_len 0
    # (vllm/v1/attention/backends/flash_attn.py FlashAttentionImpl.forward; gpu_model_runner.py _prepare_inputs)
    ), trailing_query_rows=True))

#: This family's checked kernels (the guard collects them through kvfuzz.fuzz.targets.registry.FAMILIES).
SIGNATURES = (FLASH_ATTN_VARLEN_FUNC,)


def _fa3_unsupported(fa: Any) -> str | None:
    """Why ``vllm.vllm_flash_attn`` cannot run FA3 here (``is_fa_version_supported(3)``), or None."""
    return None if fa.is_fa_version_supported(3) else f"FA3 unsupported here: {fa.fa_version_unsupported_reason(3)}"


class VllmFlashAttnVarlen(HopperTarget):
    """FlashAttention 3's paged varlen forward, ``flash_attn_varlen_func(..., fa_version=3)``, called as vLLM
    0.33.0's FLASH_ATTN backend calls it (module docstring): the strided views of one ``[NB, Hkv, BS, 2D]``
    cache, ``scheduler_metadata`` from ``get_scheduler_metadata`` as the metadata builder computes it, and
    ``num_splits`` the same value given to both.

    Contract: unified (every ``seq_len`` position read from the cache; mixed prefill and decode in one call),
    :class:`~kvfuzz.contracts.caches.layouts.NHDLayout` views. Output ``[T, H, D]`` (``out``).

    Paths drawn from the batch's seed (:meth:`num_splits`, :meth:`aot_schedule`): ``num_splits`` one of
    :data:`SPLIT_CHOICES` (0: FA3's heuristic, vLLM's eager mode; 32: a full-CUDA-graph batch; 1 and 3 forced),
    and the ahead-of-time ``scheduler_metadata`` (three seeds in four) or None (the spec-decode proposer's
    ``fast_build``). :meth:`path` reports both, with the GQA group size.

    Declared (module docstring): fp16/bf16; head sizes 32-256 in multiples of 8 (40, 72, 80 and 96 are padded to
    FA3's compiled sizes); block sizes 16, 32, 48, 64 and 544 (multiples of 16); sliding window (``[W - 1, 0]``)
    and softcap; kv_cache_dtype auto, and fp8/fp8_e4m3 with bf16 at head sizes that are multiples of 16 (the
    query quantized to e4m3 as vLLM's layer does, :meth:`call_data`; P rounded to e4m3 and the fp8 accumulator,
    :meth:`numerics_for`). Not declared: sinks (``s_aux`` is bf16 only); an undeclared sink batch gets ``s_aux`` as
    bf16 ``[H]``. States: shared prefix, freed window blocks and CUDA-graph padding (``"vllm"``: pads of seq_len 0
    and query_len 0 after a decode batch, module docstring). Needs a Hopper GPU and the extension (:data:`HOPPER_ONLY`).

    ``kernels()`` returns ``(flash_attn_varlen_func, get_scheduler_metadata)``; a subclass may hand others
    (tests run a torch stand-in on CPU with the exact arguments).
    """

    name = "vllm.flash_attn_varlen"
    checked_kernel = FLASH_ATTN_VARLEN_FUNC
    #: compiled ahead of time, so a short free chunk costs no compiles: with 5 s free chunks, 300 s on half an H200
    #: left no declared bin empty (12 of 258 and 4 of 171 without) and the window bug came sooner on 3 of 3 seeds
    #: (benchmarks/results/free-ab-h200.txt; kvfuzz.fuzz.campaign.chunks FREE_CHUNK_SECONDS)
    free_chunk_seconds = 5.0
    #: The softcap is ``cutlass::fast_tanh(scores * softmax_scale / softcap)`` (vllm-project/flash-attention
    #: hopper/utils.h ``apply_softcap``; FA2: csrc/flash_attn/src/utils.h, the same), PTX ``tanh.approx.f32`` on sm_75
    #: and later (cutlass/fast_math.h ``fast_tanh(float)``); FA4: ``cute.math.tanh(..., fastmath=True)``
    #: (flash_attn/cute/utils.py), which allows the approximate instruction (docs/tolerance.md, "Declared numerics").
    numerics = Numerics(tanh_approx=True)
    hopper = HopperKernel((FA3_EXTENSION,), HOPPER_ONLY, "FlashAttention 3", "vllm.vllm_flash_attn FA3",
                          "vllm.vllm_flash_attn", _fa3_unsupported,
                          ("flash_attn_varlen_func", "get_scheduler_metadata"))
    #: compiled ahead of time (the wheel's extension): nothing specializes on heads, block size or the window, so a
    #: pinned chunk draws them freely (a pinned window kept the serving tier's model windows out of FA3's chunks)
    runtime_fields = frozenset({"heads", "block_size", "window"})
    description = ("FlashAttention 3 paged varlen forward as vLLM's FLASH_ATTN backend calls it "
                   "(Hopper; unified contract)")
    #: Whether the call passes ``q_descale`` (``FlashAttentionImpl.supports_quant_query_input``): FA3's fp8 forward
    #: takes the query in fp8; FA4's SM90 fp8-KV path (``uses_sm90_fa4_fp8_kv_dequant``) takes it in fp16/bf16.
    #: Declared as ``Capabilities.quant_query`` from it (the strategies then draw ``Batch.q_scale``).
    fp8_query: ClassVar[bool] = True
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cuda",),
        dtypes=("float16", "bfloat16"),
        head_sizes=(32, 40, 64, 72, 80, 96, 128, 192, 256),
        block_sizes=(16, 32, 48, 64, 544),
        # fp8/fp8_e4m3 (FlashAttentionBackend.supported_kv_cache_dtypes; e4m3 on CUDA): the layer quantizes the query
        # too (call_data); FA3's fp8 forward writes bf16 only (hopper/flash_api.cpp "For FP8 input, output must have
        # dtype BF16": an fp16 model with an fp8 cache fails there, in vLLM as here) and takes head sizes that are
        # multiples of 16 ("head_size should be a multiple of 16": alignment 16 for e4m3)
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3"), fp8_dtypes=("bfloat16",),
        fp8_head_sizes=(32, 64, 80, 96, 128, 192, 256),
        features=("sliding_window", "softcap"),
        shared_prefix_blocks=True,  # vLLM's prefix caching shares full blocks
        # FLASH_ATTN supports sliding windows (vllm/v1/attention/backends/flash_attn.py supports_sliding_window);
        # vLLM's KV manager frees the blocks before the window for it as for every backend
        # (SlidingWindowManager, vllm/v1/core/single_type_kv_cache_manager.py, remove_skipped_blocks)
        freed_window_blocks=True,
        quant_query=fp8_query,  # an fp8 query, q_descale = layer._q_scale (Batch.q_scale)
        # FlashAttentionMetadataBuilder: AttentionCGSupport.ALWAYS for FA3, so uniform decode batches replay FULL
        # CUDA graphs, padded by gpu_model_runner.py (seq_lens 0, NULL_BLOCK_ID rows, query_start_loc repeated,
        # num_actual_tokens = num_tokens_padded) and passed through build() and forward() unchanged (module docstring)
        cuda_graph_padding="vllm",
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()

    def quantizes_query(self, batch: Batch) -> bool:
        """Whether vLLM's attention layer hands this kernel an fp8 query: an fp8 cache and :attr:`fp8_query`
        (``Attention.query_quant`` exists when ``impl.supports_quant_query_input`` and the cache is fp8)."""
        return self.fp8_query and batch.fp8_dtype is not None

    def call_data(self, batch: Batch, data: BatchData) -> BatchData:
        """For an fp8 cache (:meth:`quantizes_query`), the query as vLLM's attention layer quantizes it before the
        backend (vllm/model_executor/layers/attention/attention.py ``Attention.forward``: ``query_quant``, a static
        per-tensor ``QuantFP8``, with ``layer._q_scale``: ``batch.q_scale``, 1.0 unless a checkpoint sets it):
        ``round_e4m3(q / q_scale)`` saturated at +-448, times ``q_scale``, in ``batch.dtype`` (exact for the drawn
        scales; ValueError otherwise): the query the kernel gets times its ``q_descale``. Idempotent."""
        if not self.quantizes_query(batch):
            return data
        q8 = quantize_fp8(data.query, torch.float8_e4m3fn, batch.q_scale)
        return attrs.evolve(data, query=exactly_dequantized(q8, batch.q_scale, data.query.dtype))

    def numerics_for(self, batch: Batch) -> Numerics:
        """FA3's fp8 forward (:meth:`quantizes_query`) also rounds P to e4m3 before P@V (``p_fp8_e4m3``) and runs
        both GEMMs on fp8 tensor cores, whose accumulator keeps 13 fraction bits (``fp8_mma``; docs/tolerance.md);
        its 16-bit forward does neither."""
        if self.quantizes_query(batch) and self.fa_version == 3:
            return attrs.evolve(self.numerics, p_fp8_e4m3=True, fp8_mma=True)
        return self.numerics

    @staticmethod
    def num_splits(batch: Batch) -> int:
        """The ``num_splits`` (= the builder's ``max_num_splits``) this batch is called with: one of
        :data:`SPLIT_CHOICES` by ``batch.seed % 4``; a CUDA-graph padded batch (``num_pad_seqs``) runs in a FULL
        graph, whose builder sets :data:`CUDA_GRAPH_MAX_SPLITS` (``FlashAttentionMetadataBuilder.build``)."""
        if batch.num_pad_seqs:
            return CUDA_GRAPH_MAX_SPLITS
        return SPLIT_CHOICES[batch.seed % len(SPLIT_CHOICES)]

    @staticmethod
    def aot_schedule(batch: Batch) -> bool:
        """Whether the call gets ahead-of-time ``scheduler_metadata`` (``(batch.seed // 4) % 4 != 3``)."""
        return (batch.seed // 4) % 4 != 3

    @staticmethod
    def window_size(batch: Batch) -> list[int]:
        """The backend's ``window_size``: ``[W - 1, 0]`` for a window of W keys, ``[-1, -1]`` for none."""
        w = batch.sliding_window
        return [-1, -1] if w is None else [w - 1, 0]

    @staticmethod
    def backend_views(batch: Batch, cache: CacheState) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value caches as the backend hands them over: the materialized caches copied into one
        ``[NB, Hkv, BS, 2D]`` buffer, ``kv_cache.transpose(1, 2).split(D, dim=-1)``, size-1 strides canonical; an
        fp8 cache allocated as uint8 (vLLM's storage for every fp8 ``kv_cache_dtype``) and each view then viewed as
        ``current_platform.fp8_dtype()`` (e4m3fn on CUDA), as ``FlashAttentionImpl.forward`` does."""
        kc, vc = cache.key_cache, cache.value_cache
        nb, bs, hkv, d = kc.shape
        fp8 = batch.fp8_dtype is not None
        if fp8:
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        kv = torch.empty((nb, hkv, bs, 2 * d), dtype=kc.dtype, device=kc.device)
        k_view, v_view = kv.transpose(1, 2).split(d, dim=-1)
        k_view.copy_(kc)
        v_view.copy_(vc)
        k_view, v_view = _canonical_singleton_strides(k_view), _canonical_singleton_strides(v_view)
        if fp8:
            k_view, v_view = k_view.view(torch.float8_e4m3fn), v_view.view(torch.float8_e4m3fn)
        return k_view, v_view

    def descales(self, batch: Batch, num_seqs: int, dev) -> dict[str, torch.Tensor | None]:
        """``q_descale``/``k_descale``/``v_descale`` as ``forward`` passes them: ``layer._q_scale``/``_k_scale``/
        ``_v_scale`` (fp32 scalars: 1.0 for a 16-bit cache, ``batch.q_scale``/``k_scale``/``v_scale`` for fp8)
        ``.expand((num_seqs, num_kv_heads))``; ``q_descale`` None for an fp8 cache when :attr:`fp8_query` is off."""
        shape = (num_seqs, batch.num_kv_heads)

        def scale(x: float) -> torch.Tensor:
            return torch.tensor(float(x), dtype=torch.float32, device=dev).expand(shape)

        fp8 = batch.fp8_dtype is not None
        return dict(q_descale=scale(batch.q_scale) if (self.fp8_query or not fp8) else None,  # 1.0 unless fp8
                    k_descale=scale(batch.k_scale if fp8 else 1.0), v_descale=scale(batch.v_scale if fp8 else 1.0))

    #: The ``fa_version`` the backend passes (``get_flash_attn_version``).
    fa_version: ClassVar[int] = 3

    def alibi_slopes(self, batch: Batch, dev) -> torch.Tensor | None:
        """The ``alibi_slopes`` argument: None (FA3 and FA4 take none; an ALiBi model runs FA2). Raises ValueError
        for an ALiBi batch."""
        if batch.alibi:
            raise ValueError(f"{self.name}: FA{self.fa_version} takes no ALiBi (vLLM falls back to FA2 for ALiBi "
                             "models)")
        return None

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """``flash_attn_varlen_func`` kwargs as ``FlashAttentionImpl.forward`` builds them (module docstring),
        with ``scheduler_metadata`` computed here as the metadata builder does (None when
        :meth:`aot_schedule` says the batch has none). A padded batch (``num_pad_seqs``) is called as a FULL graph
        replay: ``q``/``out`` ``[T + pads, H, D]``, ``cu_seqlens_q``/``seqused_k``/``block_table``/descales and the
        scheduler's ``batch_size`` over ``N + pads`` sequences (:class:`~kvfuzz.contracts.model.padding.Padding`,
        ``"vllm"``). Raises ValueError for an ALiBi batch on FA3/FA4 (:meth:`alibi_slopes`)."""
        alibi = self.alibi_slopes(batch, getattr(getattr(cache, "key_cache", None), "device", None))  # raises first
        dev = cache.key_cache.device
        k_cache, v_cache = self.backend_views(batch, cache)
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads, as vLLM's FULL graphs
        n, t, h, d = pad.num_seqs, pad.num_rows, batch.num_heads, batch.head_size
        qsl, seq_lens = pad.query_start_loc_tensor(dev), pad.seq_lens_tensor(dev)
        splits, window = self.num_splits(batch), self.window_size(batch)
        scheduler_metadata = None
        if self.aot_schedule(batch):
            _, get_scheduler_metadata = self.kernels()
            scheduler_metadata = get_scheduler_metadata(
                batch_size=n, max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_seq_len, num_heads_q=h,
                num_heads_kv=batch.num_kv_heads, headdim=d, cache_seqlens=seq_lens,
                qkv_dtype=torch.float8_e4m3fn if batch.fp8_dtype is not None else batch.torch_dtype,
                cu_seqlens_q=qsl, page_size=batch.block_size, causal=True, window_size=tuple(window),
                num_splits=splits)
        out = torch.empty((t, h, d), dtype=batch.torch_dtype, device=dev)
        q = pad.query(data.query.to(dev))
        if self.quantizes_query(batch):  # call_data made it e4m3 values times q_scale: the division is exact
            q = quantize_fp8(q, torch.float8_e4m3fn, batch.q_scale)
        kwargs = dict(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=qsl,
            max_seqlen_q=batch.max_query_len, seqused_k=seq_lens, max_seqlen_k=batch.max_seq_len,
            softmax_scale=batch.scale, causal=True, alibi_slopes=alibi, window_size=window,
            block_table=pad.block_table_tensor(dev), softcap=batch.softcap or 0,
            scheduler_metadata=scheduler_metadata, fa_version=self.fa_version,
            **self.descales(batch, n, dev), num_splits=splits,
            s_aux=None if data.sinks is None else data.sinks.to(device=dev, dtype=self.sink_dtype),
        )
        return KernelCall(kwargs, cache.layout, k_cache, v_cache, out)

    #: The dtype ``s_aux`` is handed in: FA3's extension takes bf16 only ("We only support bf16 dtype for S aux.").
    sink_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def run(self, call: KernelCall) -> torch.Tensor:
        varlen, _ = self.kernels()
        varlen(**call.kwargs)
        return call.output

    def path(self, batch: Batch) -> str:
        splits = self.num_splits(batch)
        return (f"splits={'heuristic' if splits == 0 else splits},"
                f"sched={'aot' if self.aot_schedule(batch) else 'none'},gqa={batch.gqa_ratio}"
                + (",fp8" if self.quantizes_query(batch) else ""))


def _fa_available(version: int, label: str, pre: Availability) -> Availability:
    """Whether ``vllm.vllm_flash_attn`` imports here and supports FA ``version`` (``is_fa_version_supported``)."""
    if not pre.ok:
        return pre
    try:
        quiet_vllm()
        fa = importlib.import_module("vllm.vllm_flash_attn")
    except Exception as e:  # the extension fails to load: a wrong torch ABI, a missing CUDA library
        return Availability(False, f"importing vllm.vllm_flash_attn failed: {type(e).__name__}: {e}")
    if not fa.is_fa_version_supported(version):
        return Availability(False, f"FA{version} unsupported here: {fa.fa_version_unsupported_reason(version)}")
    return Availability(True, f"CUDA; vllm.vllm_flash_attn {label}", "cuda")


def _cuda_installed(files: tuple[str, ...], min_major: int, kernel: str, missing: str) -> Availability:
    """From what is installed, without importing vllm: the files in the vllm package and a CUDA device of compute
    capability ``min_major``.x or newer."""
    absent = vllm_files_missing(files)
    if absent:
        return Availability(False, f"the installed vllm has no {', '.join(absent)}; {missing}")
    if not torch.cuda.is_available():
        return Availability(False, f"{kernel} runs on CUDA only; this machine has no CUDA device ({missing})")
    major, minor = torch.cuda.get_device_capability()
    if major < min_major:
        return Availability(False, f"{kernel} needs compute capability {min_major}.0 or newer; this GPU is SM "
                                   f"{major}.{minor}")
    return Availability(True, f"CUDA (SM {major}.{minor}); {kernel}: {NOT_LOADED}", "cuda")


class VllmFlashAttn2Varlen(VllmFlashAttnVarlen):
    """FlashAttention 2's paged varlen forward, ``flash_attn_varlen_func(..., fa_version=2)``
    (``torch.ops._vllm_fa2_C.varlen_fwd``), as vLLM 0.33.0's FLASH_ATTN backend calls it: the default on Ampere and
    Ada (SM 8.x, ``get_flash_attn_version``), and on Hopper for every ALiBi model ("Cannot use FA version 3 with
    ALiBi, defaulting to FA version 2"). The backend's call is FA3's (the strided views of one cache, the window,
    the softcap, the layer's descales, which FA2's wrapper ignores) with ``alibi_slopes`` fp32 ``[num_heads]``, no
    ``scheduler_metadata`` (the builder schedules ahead of time for FA3 only), ``num_splits`` 0 (``max_num_splits``
    stays 0: its full-CUDA-graph bound is set only with ``aot_schedule``) or 1 (``VLLM_BATCH_INVARIANT``), drawn
    from the seed (:meth:`num_splits`). FA2's metadata builder declares ``AttentionCGSupport.UNIFORM_BATCH``, so a
    uniform decode batch still replays a FULL graph, padded as FA3's (``"vllm"``).

    Declared (read off the extension, vllm-project/flash-attention csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd``
    and vLLM's backend): fp16/bf16 ("FlashAttention only support fp16 and bf16 data type"); head sizes multiples of
    8 up to 256 ("query, key, value, and out_ must have a head_size that is a multiple of 8", "head dimension at most
    256"); block sizes multiples of 16 ("Paged KV cache block size must be divisible by 16"); sliding window,
    softcap and ALiBi; kv_cache_dtype auto (``flash_attn_supports_kv_cache_dtype``: no fp8 on FA2). Rejected: sinks
    (the wrapper raises "FA2 does not support s_aux"), ``num_splits > 1``. Its decode path transposes a GQA group
    into the query length (``seqlenq_ngroups_swapped``: one query token, more query than kv heads, no window, no
    ALiBi): :meth:`path` says when. Needs compute capability 8.0 or newer and ``_vllm_fa2_C.abi3.so`` (308 MB;
    benchmarks/fa_bundle.sh carries it)."""

    name = "vllm.flash_attn_varlen_fa2"
    fa_version = 2
    #: the driver compiles FA2's PTX for an H100/H200 in each kernel's first call (2-10 s): not FA3's short free chunks
    free_chunk_seconds = 0.0
    description = ("FlashAttention 2 paged varlen forward as vLLM's FLASH_ATTN backend calls it "
                   "(Ampere/Ada; Hopper with ALiBi; unified contract)")
    capabilities = attrs.evolve(
        VllmFlashAttnVarlen.capabilities,
        head_sizes=(32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256),
        features=("sliding_window", "softcap", "alibi"),
        kv_cache_dtypes=("auto",), fp8_dtypes=None, fp8_head_sizes=None, quant_query=False,  # no fp8 on FA2
    )

    def installed(self) -> Availability:
        return _cuda_installed((FA2_EXTENSION,), 8, "FlashAttention 2", "vLLM 0.33.0's "
                               f"vllm/{FA2_EXTENSION}, e.g. benchmarks/fa_bundle.sh")

    def availability(self) -> Availability:
        return _fa_available(2, "FA2", self.installed())

    def alibi_slopes(self, batch: Batch, dev) -> torch.Tensor | None:
        """vLLM's ``torch.tensor(alibi_slopes, dtype=torch.float32)`` ``[num_heads]``, on the device."""
        return batch.alibi_slopes_tensor(dev) if batch.alibi else None

    @staticmethod
    def num_splits(batch: Batch) -> int:
        """0 (the builder's ``max_num_splits``), or 1 (``VLLM_BATCH_INVARIANT``) for one seed in four."""
        return 1 if batch.seed % 4 == 3 else 0

    @staticmethod
    def aot_schedule(batch: Batch) -> bool:
        return False

    def path(self, batch: Batch) -> str:
        swapped = (batch.max_query_len == 1 and batch.gqa_ratio > 1 and batch.sliding_window is None
                   and not batch.alibi)
        return f"fa2,splits={self.num_splits(batch)},{'ngroups_swapped' if swapped else 'varlen'}"


class VllmFlashAttn4Varlen(VllmFlashAttnVarlen):
    """FlashAttention 4 (the CuTe-DSL kernels in ``vllm/vllm_flash_attn/cute``, JIT-compiled) through
    ``flash_attn_varlen_func(..., fa_version=4)``, which calls ``cute.interface._flash_attn_fwd`` with
    ``page_table=block_table``, ``learnable_sink=s_aux``, the window as ``window_size_left/right`` (None for -1) and
    the descales dropped for a 16-bit cache. vLLM 0.33.0 runs it on Hopper when FA3 cannot (``get_flash_attn_version``:
    head_size > 256, different K and V head sizes with sinks, per-sequence causal offsets), for an fp8 cache at head
    size 512 (``_get_sm90_fa4_fp8_kv_block_size``: block size 64), by default on SM 10.x, and wherever
    ``attention_config.flash_attn_version=4`` asks; the builder computes no ``scheduler_metadata`` (``aot_schedule``
    is FA3's) and ``max_num_splits`` stays 0.

    Declared (cute/interface.py ``_flash_attn_fwd`` and ``_validate_head_dims`` on SM90: head sizes 8-512 divisible
    by 8 for 16-bit inputs; vLLM's ``supports_head_size``: at most 512): fp16/bf16; head sizes 64, 128, 256 and
    512 (which only FA4 takes on Hopper; 288, 320, 384 and 448, which vLLM routes here too, fail to compile on
    SM90: docs/findings.md, Finding 18, so they are not declared); block sizes 16, 32, 64, 128 (multiples of 16);
    sliding window, softcap and sinks (``learnable_sink`` may be fp32: ``_LEARNABLE_SINK_DTYPES``, so kvfuzz's fp32
    sink logits go in unrounded); no ALiBi (the wrapper asserts "Alibi is not supported in FA4"); kv_cache_dtype
    fp8/fp8_e4m3 at head size 512 and block size 64 only (``fp8_head_sizes``/``fp8_block_sizes``; SM90's
    fp8-KV-dequant kernel, flash_fwd_sm90.py ``fp8_kv_dequant``: vLLM views the cache as e4m3, passes
    ``k_descale``/``v_descale`` fp32 ``[N, Hkv]`` and no ``q_descale``, the query stays fp16/bf16; the kernel
    widens K/V e4m3 -> fp16 exactly, narrows a bf16 query to fp16, computes in fp16 with fp32 accumulation and
    folds ``k_descale`` into the score scale and ``v_descale`` into the final output scale, both fp32; not
    declared on other GPU families, whose FA4 fp8 forward takes an fp8 query: :func:`_not_sm90_fields`); the fp16
    arithmetic is declared (:meth:`numerics_for`). Tested on CPU through vLLM's wrapper over the stand-in; on an H200
    (392 examples in 5 minutes) it met Finding 17's tail read at head size 512 and pages of 64, and two false alarms
    the fp16 declaration ends (benchmarks/results/sweep-baseline-h200.txt). Needs a GPU of
    compute capability 9.x or newer, ``nvidia-cutlass-dsl`` and ``quack-kernels`` (vLLM pins 4.8.0 and 0.6.5;
    benchmarks/fa_bundle.sh); each configuration compiles on first use."""

    name = "vllm.flash_attn_varlen_fa4"
    fa_version = 4
    #: each configuration JIT-compiles (CuTe DSL): not FA3's short free chunks
    free_chunk_seconds = 0.0
    sink_dtype = torch.float32
    #: SM90's fp8-KV path takes the query in fp16/bf16 (``uses_sm90_fa4_fp8_kv_dequant``: no ``q_descale``)
    fp8_query = False
    description = ("FlashAttention 4 (CuTe DSL) paged varlen forward as vLLM's FLASH_ATTN backend calls it "
                   "(Hopper past FA3's head sizes, Blackwell; unified contract)")
    capabilities = DeviceCapabilities(attrs.evolve(
        VllmFlashAttnVarlen.capabilities,
        head_sizes=(64, 128, 256, 512), block_sizes=(16, 32, 64, 128),
        features=("sliding_window", "softcap", "sinks"),
        # SM90's fp8-KV-dequant kernel (flash_fwd_sm90.py fp8_kv_dequant): e4m3 K/V at head size 512
        # (flash_attn_supports_kv_cache_dtype: FA4 on SM90 takes fp8 at head_size 512 only) and block size 64
        # (_get_sm90_fa4_fp8_kv_block_size: "a 64-token TMA tile/page"); fp8_e5m2 never (ibid.)
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3"), fp8_head_sizes=(512,), fp8_block_sizes=(64,),
        fp8_dtypes=None,  # the SM90 fp8-KV path takes a fp16 or bf16 query and writes that dtype
        quant_query=fp8_query,
    ), lambda cls: _not_sm90_fields())

    def installed(self) -> Availability:
        missing = next((m for m in ("cutlass", "quack") if importlib.util.find_spec(m) is None), None)
        if missing is not None:
            return Availability(False, f"FlashAttention 4 needs python package {missing!r} (nvidia-cutlass-dsl 4.8.0, "
                                       "quack-kernels 0.6.5, as vLLM 0.33.0 pins them; benchmarks/fa_bundle.sh)")
        return _cuda_installed((FA4_INTERFACE,), 9, "FlashAttention 4", "vLLM 0.33.0's vllm/vllm_flash_attn/cute")

    def availability(self) -> Availability:
        return _fa_available(4, "FA4 (CuTe DSL)", self.installed())

    @staticmethod
    def num_splits(batch: Batch) -> int:
        return 0

    @staticmethod
    def aot_schedule(batch: Batch) -> bool:
        return False

    def numerics_for(self, batch: Batch) -> Numerics:
        """SM90's fp8-KV kernel computes in fp16 whatever the query's dtype (flash_fwd_sm90.py ``fp8_kv_dequant``,
        "compute is always fp16"): the query narrowed and P rounded to fp16 (``Numerics.compute_dtype``; without
        it a bf16 batch's probabilities below 2**-14, which fp16 flushes, were a false alarm on an H200). Its
        16-bit forward computes in the batch's dtype."""
        if batch.fp8_dtype is not None:
            return attrs.evolve(self.numerics, compute_dtype="float16")
        return self.numerics

    def path(self, batch: Batch) -> str:
        kv = ",fp8_kv_dequant" if batch.fp8_dtype is not None else ""  # SM90's fp8-KV kernel (flash_fwd_sm90.py)
        return f"fa4,gqa={batch.gqa_ratio},{'paged64' if batch.block_size == 64 else 'paged'}{kv}"


def _not_sm90_fields() -> dict[str, Any]:
    """FA4's declaration on a CUDA device of another family than SM90 (Blackwell): no fp8 cache (its fp8 forward
    takes the query in fp8 too, ``is_fp8``, which the target does not build); on SM90 or without a readable device
    (a CPU: the stand-ins are SM90's) nothing changes."""
    if not torch.cuda.is_available():
        return {}
    try:
        major = torch.cuda.get_device_capability()[0]
    except Exception:  # no driver behind a patched is_available (benchmarks/draw_identity.py)
        return {}
    return {} if major == 9 else {"kv_cache_dtypes": ("auto",)}


def _canonical_singleton_strides(t: torch.Tensor) -> torch.Tensor:
    """vllm/utils/torch_utils.py ``canonicalize_singleton_dim_strides`` (copied: importing it imports vLLM's
    config stack): a size-1 dim's stride set to the product of the later dims, as the backend hands FA3 its
    caches (TMA needs 16-byte strides)."""
    if 1 not in t.shape:
        return t
    strides, prev, changed = list(t.stride()), 1, False
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1 and strides[i] != prev:
            strides[i], changed = prev, True
        prev = strides[i] * t.shape[i]
    return t.as_strided(t.shape, strides) if changed else t


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (VllmFlashAttnVarlen, VllmFlashAttn2Varlen, VllmFlashAttn4Varlen)

__all__ = ["CUDA_GRAPH_MAX_SPLITS", "FA2_EXTENSION", "FA3_EXTENSION", "FA4_INTERFACE", "FLASH_ATTN_VARLEN_FUNC",
           "HOPPER_ONLY", "SIGNATURES", "SPLIT_CHOICES", "VllmFlashAttn2Varlen", "VllmFlashAttn4Varlen",
           "VllmFlashAttnVarlen", "flash_attn_varlen_func_call"]
