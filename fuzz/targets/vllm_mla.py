"""vLLM's MLA decode kernels over the latent cache: the TRITON_MLA backend's ``decode_attention_fwd`` (compiled
on CUDA, under Triton's interpreter on CPU: :mod:`kvfuzz.fuzz.targets.triton_runtime`).

How vLLM 0.33.0 calls it (vllm/v1/attention/backends/mla/triton_mla.py, ``TritonMLAImpl.forward_mqa``):

- ``q`` ``[B, H, 576]``: the query already in the latent space (``q_nope`` absorbed through ``W_UK``, 512,
  concatenated with ``q_pe``, 64: ``torch.cat(q, dim=-1)`` when the caller hands a tuple);
- ``k_buffer`` = ``kv_c_and_k_pe_cache.unsqueeze(2)``, ``[num_blocks, block_size, 1, 576]`` (``kv_c`` 512 then
  ``k_pe`` 64), and ``v_buffer`` = ``kv_c_cache = kv_c_and_k_pe_cache[..., :kv_lora_rank]``, a view of its
  first 512 dims; ``page_size`` = ``kv_c_and_k_pe_cache.size(1)``;
- ``o`` ``[B, H, 512]`` (``kv_lora_rank``), ``lse`` ``[B, H]``, ``attn_logits`` ``[B, H, num_kv_splits,
  512 + 1]`` fp32 from the shared workspace (reused across layers, uninitialised), ``num_kv_splits`` from
  ``_compute_num_kv_splits(max_seq_len, sm_count)``;
- ``sm_scale`` = ``self.scale``, the model's softmax scale (DeepSeek: ``1 / sqrt(qk_nope 128 + qk_rope 64)``
  = ``1 / sqrt(192)``, not ``1 / sqrt(576)``);
- ``block_table`` (``req_to_token``), ``seq_lens`` (``b_seq_len``), ``k_scale=layer._k_scale``,
  ``v_scale=layer._k_scale`` (one scale: one cached row), ``is_mla=True``.

In vllm/v1/attention/ops/triton_decode_attention.py (``decode_attention_fwd`` -> ``_decode_grouped_att_m_fwd``),
``is_mla`` with ``Lk == 576`` splits the key into ``BLOCK_DMODEL = 512`` and ``BLOCK_DPE = 64`` and takes the
value as the transposed key tile (``v = tl.trans(k)``): the value is read from ``k_buffer``'s first 512 dims,
never from ``v_buffer`` (whose last dim only sets ``Lv``). With one query head per kv head (``H == 1``)
``decode_attention_fwd`` takes the MHA kernel instead, which reads ``v_buffer`` (``is_mla`` is not passed to it).

FlashMLA (vllm/v1/attention/backends/mla/flashmla.py, ``FlashMLAImpl.forward_mqa``; Hopper only, the compiled
``vllm._flashmla_C`` and ``vllm._flashmla_extension_C`` with the Python interface in vllm/third_party/flashmla/):

- ``q`` ``[B, H, 576]`` (a tuple is concatenated) reshaped by ``reshape_query_for_spec_decode(q, num_decodes)``
  to ``[B, q_len, H, 576]``: the decode pathway takes a uniform query length (``query_len_support = UNIFORM``;
  ``reorder_batch_threshold = 128``: spec-decode drafts and small prefills go through it too);
- ``flash_mla_with_kvcache(q, k_cache=kv_c_and_k_pe_cache.unsqueeze(-2) [NB, 64, 1, 576], block_table,
  cache_seqlens=seq_lens, head_dim_v=kv_lora_rank (512), tile_scheduler_metadata=get_mla_metadata(seq_lens,
  q_len * H, 1, is_fp8_kvcache=False)[0] (an empty FlashMLASchedMeta, filled by the first call),
  softmax_scale=self.scale, causal=True, is_fp8_kvcache=False)``, returning ``(out [B, q_len, H, 512], lse)``,
  flattened back by ``reshape_attn_output_for_spec_decode``;
- an fp8 cache goes to ``flash_mla_with_kvcache_fp8`` (vllm/v1/attention/ops/flashmla.py) with the query in fp8
  too (``descale_q=layer._q_scale``, ``descale_k=layer._k_scale``) and ``get_mla_metadata_dense_fp8``'s tile
  metadata and splits;
- block size 64 only (``get_supported_kernel_block_sizes``), dtypes fp16/bf16, kv_cache_dtypes auto, fp8,
  fp8_e4m3; no ALiBi, sliding window or softcap (``FlashMLAImpl.__init__`` raises NotImplementedError);
- CUDA-graph padding (the ``"vllm"`` convention, :mod:`kvfuzz.contracts.model.padding`): ``FlashMLAMetadataBuilder``
  declares ``AttentionCGSupport.UNIFORM_BATCH``, so uniform decode batches replay FULL graphs under vLLM's default
  ``FULL_AND_PIECEWISE``; vllm/v1/worker/gpu_model_runner.py pads them to the capture size (pad ``seq_lens`` 0,
  ``NULL_BLOCK_ID`` block-table rows, ``query_start_loc`` repeated, ``num_actual_tokens = num_tokens_padded``);
  ``MLACommonMetadataBuilder.build`` (vllm/model_executor/layers/attention/mla_attention.py) takes
  ``split_decodes_and_prefills(..., require_uniform=True)`` (vllm/v1/attention/backends/utils.py), which counts
  query_len-0 pads as decodes ("ensures num_decodes matches the captured size"), and ``_build_decode`` gets
  ``seq_lens[:num_decodes]`` and ``block_table_tensor[:num_decodes]`` with the pads; ``get_mla_metadata`` is called
  on those padded ``seq_lens``, and ``forward_mqa`` calls FlashMLA on ``q`` of ``num_decode_tokens`` rows (one per pad
  token): each pad is a row of ``cache_seqlens`` 0 over the null block, whose output flows on into ``W_UV``.

The family's home: ``decode_attention_fwd``'s signature is the vLLM Triton family's
(:data:`kvfuzz.fuzz.targets.vllm_triton.DECODE_ATTENTION_FWD`; its builder reads the latent form, ``is_mla``
included; the guard's table refuses a kernel name twice); this module declares FlashMLA's two calls
(:data:`FLASH_MLA_WITH_KVCACHE`, :data:`FLASH_MLA_WITH_KVCACHE_FP8`, in :data:`SIGNATURES`). Importing this
module imports neither vllm, triton nor FlashMLA.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, LatentLayout, NHDLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.declaration import INT32_ONLY, KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.paged_call import CacheReads, NewTokensCached, PagedCall, is_tensor
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.padding import padding

from .base import KernelCall, require_decode
from .signature import KernelSignature
from .triton_runtime import HopperKernel, HopperTarget, poisoned_scratch, scales
from .vllm_triton import VllmDecodeAttentionFwd

#: DeepSeek-V2/V3's latent cache: ``kv_lora_rank`` (the value and the output) and the rope dims after it.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
#: DeepSeek's softmax scale, ``1 / sqrt(qk_nope_head_dim 128 + qk_rope_head_dim 64)`` (what the backend passes).
DEEPSEEK_SM_SCALE = 1.0 / (128 + 64) ** 0.5



def _flash_mla_call(args: Mapping[str, Any], key: Any, value: Any, kernel: str, k_scale: Any) -> PagedCall:
    q = args["q"]
    if args.get("indices") is not None or args.get("block_table") is None:
        raise ValueError(f"{kernel}: a sparse call (indices, no block_table) is not checked")
    b = s_q = 0
    if is_tensor(q) and q.dim() == 4:
        b, s_q = int(q.shape[0]), int(q.shape[1])
        query = q.reshape(b * s_q, *q.shape[2:])
    else:
        query = q
    kc = args["k_cache"]
    dv = int(args.get("head_dim_v") or 0)
    vc = kc[..., :dv] if is_tensor(kc) and dv > 0 else kc
    dev = q.device if is_tensor(q) else "cpu"
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * s_q
    return PagedCall(
        kernel=kernel, contract=Contract.UNIFIED, layout=NHDLayout(), query=query, key_cache=kc, value_cache=vc,
        block_table=args["block_table"], query_start_loc=qsl, seq_lens=args["cache_seqlens"], key=key, value=value,
        names=dict(query="q (flattened [B * s_q, H, D])", key_cache="k_cache",
                   value_cache="k_cache[..., :head_dim_v] (the value is the key row's first head_dim_v dims)",
                   query_start_loc="(implicit: s_q query tokens per sequence)", seq_lens="cache_seqlens"),
        kv_cache_dtype=None, k_scale=1.0 if k_scale is None else k_scale,
        v_scale=1.0 if k_scale is None else k_scale,
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL,
    )


def flash_mla_with_kvcache_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``flash_mla_with_kvcache(q [B, s_q, H, D], k_cache [NB, page_block_size, Hk, D], block_table [B, M] int32,
    cache_seqlens [B] int32, head_dim_v, tile_scheduler_metadata, num_splits=None, softmax_scale=None,
    causal=False, is_fp8_kvcache=False, indices=None, ...)`` (vllm/third_party/flashmla/flash_mla_interface.py)
    as a unified-contract call: ``s_q`` query tokens per sequence (``query_start_loc`` implicit, ``B * s_q``
    query rows), the last ``s_q`` of its ``cache_seqlens`` positions, all read from ``k_cache``; the value is the
    key row's first ``head_dim_v`` dims. A sparse call (``indices``) raises ValueError (not checked). The new
    tokens can be compared with the cache only when handed over (``key``/``value`` ``[B * s_q, Hk, D]``)."""
    return _flash_mla_call(args, key, value, "flash_mla_with_kvcache", None)


def flash_mla_with_kvcache_fp8_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
    num_splits, softmax_scale=None, causal=False, descale_q=None, descale_k=None)``
    (vllm/v1/attention/ops/flashmla.py): as :func:`flash_mla_with_kvcache_call`, with an fp8 ``k_cache`` whose
    scale is ``descale_k`` (one value)."""
    return _flash_mla_call(args, key, value, "flash_mla_with_kvcache_fp8", args.get("descale_k"))


_FLASHMLA_SOURCE = ("vllm/third_party/flashmla/flash_mla_interface.py flash_mla_with_kvcache; "
                    "FlashMLA csrc/api/dense_decode.cpp")
#: flash_mla_with_kvcache: the dense decode (``dense_decode_fwd``) checks ``block_table`` and ``seqlens_k`` are
#: int32 (csrc/api/dense_decode.cpp); it takes no max_* scalars.
FLASH_MLA_WITH_KVCACHE = KernelSignature(
    "flash_mla_with_kvcache", flash_mla_with_kvcache_call, "flash_mla_with_kvcache",
    # the defining module only: vllm/v1/attention/ops/flashmla.py re-exports it (the guard wraps every module-level
    # name bound to it), and binds it to a stub raising "FlashMLA is not available" where the extension is missing
    ("vllm.third_party.flashmla.flash_mla_interface",),
    takes_new_kv=False, declaration=KernelDeclaration(paths=(
        KernelPath("FlashMLA's dense decode (_flashmla_C dense_decode_fwd, int32 block_table and seqlens_k)",
                   index_dtypes=INT32_ONLY, source=_FLASHMLA_SOURCE),
    # FULL CUDA-graph padding: one query row of cache_seqlens 0 per pad (module docstring; FLASHMLA's forward_mqa)
    ), value_head_size_may_differ=True, empty_decode_rows=True))
#: flash_mla_with_kvcache_fp8: ``_flashmla_extension_C.fwd_kvcache_mla_fp8``, FlashMLA's fp8 dense decode.
FLASH_MLA_WITH_KVCACHE_FP8 = KernelSignature(
    "flash_mla_with_kvcache_fp8", flash_mla_with_kvcache_fp8_call, "flash_mla_with_kvcache_fp8",
    ("vllm.v1.attention.ops.flashmla",),
    takes_new_kv=False, declaration=KernelDeclaration(paths=(
        KernelPath("FlashMLA's fp8 dense decode (_flashmla_extension_C fwd_kvcache_mla_fp8)",
                   index_dtypes=INT32_ONLY, source="vllm/v1/attention/ops/flashmla.py flash_mla_with_kvcache_fp8"),
    # the fp8 cache's call gets the same padded seq_lens and block_table (FlashMLAImpl.forward_mqa)
    ), value_head_size_may_differ=True, empty_decode_rows=True))

#: This family's own checked kernels: FlashMLA's two calls (its Triton target checks vllm_triton's
#: DECODE_ATTENTION_FWD).
SIGNATURES = (FLASH_MLA_WITH_KVCACHE, FLASH_MLA_WITH_KVCACHE_FP8)


def latent_decode_only(name: str, batch: Batch) -> None:
    """Raise ValueError naming target ``name`` unless ``batch`` is all decode sequences over a latent cache (what
    both MLA decode calls take)."""
    require_decode(name, batch)
    if batch.value_head_size is None:
        raise ValueError(f"{name} reads a latent cache: the batch needs value_head_size ({KV_LORA_RANK}), got None")


#: What both MLA decode targets declare of the latent cache they read (module docstring): decode only, keys the
#: 576-wide latent rows and values their first 512 dims, one kv head shared by 1 to 128 query heads (vLLM's MLA heads
#: split by tensor parallelism: DeepSeek-V3 has 128, V2-Lite 16), prefix-shared blocks (vLLM's prefix caching shares
#: full blocks).
LATENT_MLA_FAMILY = dict(
    head_sizes=(KV_LORA_RANK + QK_ROPE_HEAD_DIM,),
    value_head_size=KV_LORA_RANK,
    decode_only=True,
    gqa_ratios=(1, 2, 4, 8, 16, 32, 64, 128),
    shared_prefix_blocks=True,
)


class VllmTritonMlaDecode(VllmDecodeAttentionFwd):
    """vLLM's TRITON_MLA decode: ``decode_attention_fwd(..., is_mla=True)`` on the latent cache, called as
    vllm/v1/attention/backends/mla/triton_mla.py ``TritonMLAImpl.forward_mqa`` calls it (module docstring).

    Contract: unified, decode only (every sequence ``query_len == 1``; the backend's multi-token rows are
    flattened to decode rows), MQA over the latent cache: ``num_kv_heads == 1``, keys ``head_size`` 576 and values
    the first 512 dims of the same cached row (:attr:`~kvfuzz.contracts.model.batch.Batch.value_head_size`,
    :class:`~kvfuzz.contracts.caches.layouts.LatentLayout`); the fp64 reference takes the query in the latent
    space, as the kernel does. Output ``[num_seqs, num_heads, 512]``.

    Declaration, from the backend's code: dtypes fp16/bf16 (``supported_dtypes``; on CPU fp16/fp32, the
    interpreter computes bf16 wrongly); kv_cache_dtypes auto, fp8, fp8_e4m3 (``supported_kv_cache_dtypes``; fp8
    needs SM89+ on CUDA; dequantized with ``k_scale`` inside the kernel); block sizes multiples of 16
    (``supports_block_size``): 16, 32, 64; any head count (no check in the backend; DeepSeek-V3's 128 heads
    split by tensor parallelism): group sizes 1 to 128 in powers of two, 1 taking the MHA kernel; no alibi,
    sliding window or softcap (``TritonMLAImpl.__init__`` raises NotImplementedError), no sinks.

    ``sm_scale``: the batch's (:attr:`~kvfuzz.contracts.model.batch.Batch.scale`; DeepSeek's is
    :data:`DEEPSEEK_SM_SCALE`). num_kv_splits: 4 by default, as :class:`VllmDecodeAttentionFwd` (``None``:
    vLLM's ``_compute_num_kv_splits``, which gives 1 for every batch small enough to interpret).
    """

    name = "vllm.triton_mla_decode"
    # inherited: checked_kernel (the same decode_attention_fwd), gate_states_off (live vllm#57017: no CUDA-graph pads
    # in the gate) and gate_value_ranges (docs/findings.md, Finding 3: group size 1 takes the MHA kernel, whose
    # input-dtype q.k sum "extreme" values overflow and "large"/"dominant" ones round past the envelope, head size 576
    # too: the shipped baseline's finding-3-mla-magnitudes)
    description = "vLLM TRITON_MLA decode over the 576/512 latent cache (decode only, MQA, unified contract)"
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
        **LATENT_MLA_FAMILY,
        block_sizes=(16, 32, 64),
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3"),
        # TritonMLAMetadataBuilder: AttentionCGSupport.UNIFORM_BATCH, so uniform decode batches replay FULL CUDA
        # graphs; the runner pads them (gpu_model_runner.py: seq_lens 0, NULL_BLOCK_ID rows, num_actual_tokens =
        # num_tokens_padded), split_decodes_and_prefills counts the pads as decodes and forward_mqa launches one
        # row per padded token ("Clamp holds padding rows at extent 0"): vllm#57017
        cuda_graph_padding="vllm",
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return LatentLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """``decode_attention_fwd`` kwargs as forward_mqa builds them: ``k_buffer`` the latent cache
        ``[NB, BS, 1, 576]``, ``v_buffer`` its first 512 dims (a view), ``o`` ``[N, H, 512]``, ``attn_logits``
        ``[N, H, splits, 513]`` (poisoned), ``v_scale`` = ``k_scale``, ``is_mla=True``. Raises ValueError for a
        prefill sequence or a batch that is not latent."""
        latent_decode_only(self.name, batch)
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads: one row each, after the real
        n, h, dv = pad.num_rows, batch.num_heads, batch.head_size_v
        splits = self.num_kv_splits(batch)
        k_scale, _ = scales(batch, dev)
        kwargs = dict(
            q=pad.query(data.query.to(dev)), k_buffer=cache.key_cache, v_buffer=cache.value_cache,
            o=torch.zeros((n, h, dv), dtype=batch.torch_dtype, device=dev),
            lse=torch.zeros((n, h), dtype=batch.torch_dtype, device=dev), req_to_token=pad.block_table_tensor(dev),
            b_seq_len=pad.seq_lens_tensor(dev),
            attn_logits=poisoned_scratch((n, h, splits, dv + 1), cache, batch.seed + 3),
            num_kv_splits=splits, sm_scale=batch.scale, page_size=batch.block_size,
            k_scale=k_scale, v_scale=k_scale, is_mla=True,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, kwargs["o"])

    def path(self, batch: Batch) -> str:
        stage1 = "normal" if batch.gqa_ratio == 1 else "grouped,mla"
        return f"{stage1},splits={self.num_kv_splits(batch)}"


#: FlashMLA's compiled files inside the vllm package (vLLM 0.33.0's CUDA wheel) and its Python interface.
FLASHMLA_FILES = ("_flashmla_C.abi3.so", "_flashmla_extension_C.abi3.so", "third_party/flashmla/flash_mla_interface.py")
#: Why FlashMLA cannot run without a Hopper GPU (``kvfuzz targets`` prints it).
FLASHMLA_HOPPER_ONLY = ("FlashMLA's dense decode runs on a Hopper GPU (SM 9.x) only; this machine has no CUDA device "
                        "(on an H100: vLLM 0.33.0 with vllm/_flashmla_C.abi3.so, vllm/_flashmla_extension_C.abi3.so "
                        "and vllm/third_party/flashmla/, e.g. `make device-bundle FA3=1`)")


def _dense_unsupported(ops: Any) -> str | None:
    """Why vllm/v1/attention/ops/flashmla.py's dense decode cannot run here (``is_flashmla_dense_supported``), or
    None."""
    ok, reason = ops.is_flashmla_dense_supported()
    return None if ok else f"FlashMLA dense unsupported here: {reason}"


class VllmFlashMlaDecode(HopperTarget):
    """FlashMLA's dense decode, ``flash_mla_with_kvcache``, called as vLLM 0.33.0's FLASHMLA backend calls it
    (``FlashMLAImpl.forward_mqa``, module docstring) over the latent cache.

    Contract: unified, decode only (``query_len == 1``: ``q`` ``[N, 1, H, 576]``; the backend also sends uniform
    query lengths up to 128 through this pathway, which kvfuzz's model does not draw), MQA over the latent
    cache (:class:`~kvfuzz.contracts.caches.layouts.LatentLayout` ``[NB, 64, 1, 576]``, values the first 512
    dims of each row). ``tile_scheduler_metadata``: a fresh ``get_mla_metadata(...)[0]`` per call (FlashMLA
    fills it on the first call and checks later calls against it). The kernel returns ``(out [N, 1, H, 512],
    lse)``; :meth:`run` returns ``out`` as ``[N, H, 512]``.

    Declared, from the backend's code: dtypes fp16/bf16, block size 64, kv_cache_dtype auto (the fp8 variant
    takes the query in fp8 too, which kvfuzz's reference does not model), group sizes 1 to 128 (vLLM's MLA
    heads split by tensor parallelism: DeepSeek-V3 has 128, V2-Lite 16), no features. ``sm_scale`` the
    batch's. States: shared prefix and CUDA-graph padding (``"vllm"``, one query row per pad: ``cache_seqlens``
    0, a null-block row; module docstring). Needs a Hopper GPU and FlashMLA's files (:data:`FLASHMLA_HOPPER_ONLY`).

    ``kernels()`` returns ``(flash_mla_with_kvcache, get_mla_metadata)``; a subclass may hand others (tests run a
    torch stand-in on CPU).
    """

    name = "vllm.flashmla_decode"
    checked_kernel = FLASH_MLA_WITH_KVCACHE
    hopper = HopperKernel(FLASHMLA_FILES, FLASHMLA_HOPPER_ONLY, "FlashMLA's dense decode", "vllm._flashmla_C",
                          "vllm.v1.attention.ops.flashmla", _dense_unsupported,
                          ("flash_mla_with_kvcache", "get_mla_metadata"))
    #: compiled ahead of time (the wheel's extension): nothing specializes on heads, block size or the window, so a
    #: pinned chunk draws them freely (a pinned window kept the serving tier's model windows out of FA3's chunks)
    runtime_fields = frozenset({"heads", "block_size", "window"})
    description = "FlashMLA dense decode over the 576/512 latent cache as vLLM's FLASHMLA backend calls it (Hopper)"
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cuda",),
        dtypes=("float16", "bfloat16"),
        **LATENT_MLA_FAMILY,
        block_sizes=(64,),
        kv_cache_dtypes=("auto",),
        # FlashMLAMetadataBuilder: AttentionCGSupport.UNIFORM_BATCH, so uniform decode batches replay FULL CUDA
        # graphs; the runner pads them (seq_lens 0, NULL_BLOCK_ID rows), split_decodes_and_prefills counts the pads
        # as decodes and forward_mqa hands FlashMLA one query row per pad (module docstring)
        cuda_graph_padding="vllm",
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return LatentLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """``flash_mla_with_kvcache`` kwargs as forward_mqa builds them (module docstring): ``q`` ``[N + pads, 1,
        H, 576]``, ``block_table`` and ``cache_seqlens`` over ``N + pads`` sequences (a CUDA-graph pad: seq_len 0,
        the null block; :class:`~kvfuzz.contracts.model.padding.Padding`, ``"vllm"``), ``get_mla_metadata`` on
        those ``cache_seqlens``. Raises ValueError for a prefill sequence or a batch that is not latent."""
        latent_decode_only(self.name, batch)
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads: one row each, after the real
        n, h, dv = pad.num_rows, batch.num_heads, batch.head_size_v
        _, get_mla_metadata = self.kernels()
        seq_lens = pad.seq_lens_tensor(dev)
        sched, _ = get_mla_metadata(seq_lens, 1 * h, 1, is_fp8_kvcache=False)
        q = pad.query(data.query.to(dev))
        kwargs = dict(
            q=q.view(n, -1, h, q.shape[-1]), k_cache=cache.key_cache, block_table=pad.block_table_tensor(dev),
            cache_seqlens=seq_lens, head_dim_v=dv, tile_scheduler_metadata=sched, softmax_scale=batch.scale,
            causal=True, is_fp8_kvcache=False,
        )
        # the kernel allocates its output; this buffer only stands for its shape [N, H, 512]
        out = torch.empty((n, h, dv), dtype=batch.torch_dtype, device=dev)
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def run(self, call: KernelCall) -> torch.Tensor:
        fn, _ = self.kernels()
        o, _lse = fn(**call.kwargs)
        return o.reshape(call.output.shape)

    def path(self, batch: Batch) -> str:
        return f"dense,heads={batch.num_heads}"


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (VllmTritonMlaDecode, VllmFlashMlaDecode)

__all__ = ["DEEPSEEK_SM_SCALE", "FLASHMLA_FILES", "FLASHMLA_HOPPER_ONLY", "FLASH_MLA_WITH_KVCACHE",
           "FLASH_MLA_WITH_KVCACHE_FP8", "KV_LORA_RANK", "LATENT_MLA_FAMILY", "QK_ROPE_HEAD_DIM", "SIGNATURES",
           "VllmFlashMlaDecode", "VllmTritonMlaDecode", "flash_mla_with_kvcache_call",
           "flash_mla_with_kvcache_fp8_call", "latent_decode_only"]
