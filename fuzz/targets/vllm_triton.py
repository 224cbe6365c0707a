"""vLLM's Triton paged-attention kernels: compiled on CUDA, under Triton's interpreter on CPU.

On a machine without CUDA the adapter sets ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` before
triton or vllm is first imported (without the second, vllm.triton_utils swaps real Triton for a placeholder
when no GPU driver is active), and registers a stub ``vllm.platforms.rocm`` whose
``use_rocm_custom_paged_attention`` returns False (the real module needs a GPU to import). Triton's
interpreter computes bf16 wrongly (triton-lang/triton#11584), so on CPU these targets declare fp16/fp32 only.

The family's home: the calls its kernels take (each a :class:`~kvfuzz.fuzz.targets.signature.KernelSignature`:
arguments -> PagedCall, the modules defining the kernel, what it needs of its caller), listed in
:data:`SIGNATURES` for the guard, then its targets, each naming its signature as ``checked_kernel``. Importing
this module imports neither vllm nor triton.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.calls.declaration import INT32_ONLY, KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.paged_call import CacheReads, NewTokensCached, PagedCall, is_tensor
from kvfuzz.contracts.calls.rocm import ROCM_CUSTOM_KV_CACHE_DTYPES, rocm_custom_path_taken
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.padding import padding

from .base import KernelCall, require_decode
from .decode_attention import DECODE_ATTENTION_FAMILY, stage1
from .signature import KernelSignature
from .triton_runtime import (  # noqa: F401
    VllmTritonTarget,
    fp8_storage,
    module_file,
    on_cuda,
    poisoned_scratch,
    prepare_triton_runtime,  # module_file, prepare_triton_runtime: re-exported
    scales,
    sinks,
)

# ---- the calls this family's kernels take: arguments (bound by parameter name) -> PagedCall, where each kernel
# lives, and what it needs of its caller (read off vLLM 0.33.0 vllm/v1/attention/ops/;
# tests/fuzz/targets/test_declarations.py runs the Triton kernels with int64 indices and MLA head sizes to back the
# claims that run on CPU) ----------------------------------------------------------------------------------------

def chunked_prefill_paged_decode_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``chunked_prefill_paged_decode(query, key, value, output, kv_cache_dtype, key_cache, value_cache,
    block_table, query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes=None,
    sliding_window=None, sm_scale=None, output_scale=None, sinks=None, is_block_table_ptr=False,
    use_interleaved_v_cache=False, causal=True)`` (bound arguments by name) as a split-contract call.
    ``key=None`` (cross-attention decode) skips the key/value checks."""
    sw = args.get("sliding_window")
    return PagedCall(
        kernel="chunked_prefill_paged_decode", contract=Contract.SPLIT, layout=VllmPagedLayout(),
        query=args["query"], key_cache=args["key_cache"], value_cache=args["value_cache"],
        block_table=args["block_table"], query_start_loc=args["query_start_loc"], seq_lens=args["seq_lens"],
        key=args.get("key"), value=args.get("value"), max_seq_len=args.get("max_seq_len"),
        max_query_len=args.get("max_query_len"), kv_cache_dtype=args.get("kv_cache_dtype", "auto"),
        k_scale=args.get("k_scale", 1.0), v_scale=args.get("v_scale", 1.0),
        new_tokens_cached=NewTokensCached.DECODE, cache_reads=CacheReads.SPLIT,
        sliding_window=int(sw) if isinstance(sw, (int, float)) and sw > 0 else 0,
        has_alibi=args.get("alibi_slopes") is not None, has_sinks=args.get("sinks") is not None,
        skip_blocks=bool(args.get("is_block_table_ptr", False)),
        skip_value_layout=bool(args.get("use_interleaved_v_cache", False)),
    )


#: context_attention_fwd's argument names for what chunked_prefill_paged_decode (and PagedCall) name query,
#: key, ...: its calls are built (_split_family_call) and its arguments named in messages with them.
PREFIX_PREFILL_NAMES = dict(query="q", key="k", value="v", output="o", key_cache="k_cache", value_cache="v_cache",
                            block_table="b_loc", query_start_loc="b_start_loc", seq_lens="b_seq_len",
                            max_query_len="max_input_len")


def context_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
    max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
    skip_decode=False, ...)``: the split contract's prefill half. Context positions come from the cache, new
    tokens from ``k``/``v``; no sequence's new token must be in the cache. With ``skip_decode=True`` decode
    sequences are skipped (nothing of them is read); ``k=None`` reads everything from the cache."""
    skip_decode = bool(args.get("skip_decode", False))
    kv_from_cache = args.get("k") is None
    sw = args.get("sliding_window")
    return PagedCall(
        kernel="context_attention_fwd", contract=Contract.SPLIT if skip_decode else Contract.PREFIX,
        layout=VllmPagedLayout(),
        query=args["q"], key_cache=args["k_cache"], value_cache=args["v_cache"], block_table=args["b_loc"],
        query_start_loc=args["b_start_loc"], seq_lens=args["b_seq_len"], key=args.get("k"),
        value=args.get("v"), max_seq_len=args.get("max_seq_len"), max_query_len=args.get("max_input_len"),
        names=PREFIX_PREFILL_NAMES,
        kv_cache_dtype=args.get("kv_cache_dtype", "auto"), k_scale=args.get("k_scale", 1.0),
        v_scale=args.get("v_scale", 1.0), new_tokens_cached=NewTokensCached.NONE,
        cache_reads=CacheReads.ALL if kv_from_cache else (CacheReads.SPLIT_PREFILL if skip_decode else CacheReads.CTX),
        sliding_window=int(sw) if isinstance(sw, (int, float)) and sw > 0 else 0,
        has_alibi=args.get("alibi_slopes") is not None, has_sinks=args.get("sinks") is not None,
        skip_blocks=bool(args.get("is_block_table_ptr", False)),
        skip_value_layout=bool(args.get("interleaved_v_pack_factor", 0)),
    )


def _window_of(window_size: Any) -> int:
    """The window W (keys) of unified_attention's ``window_size = (W - 1, 0)`` (vllm/v1/attention/backends/
    triton_attn.py), 0 for none (``(-1, -1)``) or anything else."""
    try:
        left = int(window_size[0])
    except (TypeError, ValueError, IndexError):
        return 0
    return left + 1 if left >= 0 else 0


def unified_attention_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
    causal, window_size, block_table, softcap, q_descale, k_descale, v_descale, ...)``: ``k``/``v`` are the
    caches ``[NB, BS, Hkv, D]``; unified contract. The kernel takes no new-token key/value, so the new tokens
    can be compared with the cache only when the caller hands them over separately (``key``/``value``)."""
    return PagedCall(
        kernel="unified_attention", contract=Contract.UNIFIED, layout=NHDLayout(), query=args["q"],
        key_cache=args["k"], value_cache=args["v"], block_table=args["block_table"],
        query_start_loc=args["cu_seqlens_q"], seq_lens=args["seqused_k"], key=key, value=value,
        max_seq_len=args.get("max_seqlen_k"), max_query_len=args.get("max_seqlen_q"),
        names=dict(query="q", key_cache="k", value_cache="v", query_start_loc="cu_seqlens_q",
                   seq_lens="seqused_k", max_seq_len="max_seqlen_k", max_query_len="max_seqlen_q"),
        kv_cache_dtype=None, k_scale=args.get("k_descale") if args.get("k_descale") is not None else 1.0,
        v_scale=args.get("v_descale") if args.get("v_descale") is not None else 1.0,
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, sliding_window=_window_of(args.get("window_size")),
        has_alibi=args.get("alibi_slopes") is not None, has_sinks=args.get("sinks") is not None,
        descales_ignored=(is_tensor(args["k"]) and args["k"].dtype.is_floating_point
                          and args["k"].element_size() == 1
                          and (args.get("k_descale") is not None or args.get("v_descale") is not None)
                          and int(args.get("kv_quant_mode", 0) or 0) == 0),
    )


def decode_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``decode_attention_fwd(q [N, H, D], k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
    num_kv_splits, sm_scale, page_size=1, logit_cap=0.0, k_scale=None, v_scale=None)``
    (vllm/v1/attention/ops/triton_decode_attention.py): decode-only, one query token per sequence, so
    query_start_loc is implicit (``arange(N + 1)``); caches ``[num_pages, page_size, Hkv, D]`` (NHD) read
    through ``req_to_token`` (the block table); unified contract: all seq_len positions in the cache. The
    new tokens can be compared with the cache only when handed over (``key``/``value``).

    ``is_mla=True`` (vLLM's TRITON_MLA, vllm/v1/attention/backends/mla/triton_mla.py): the grouped kernel reads
    each value from the key row's first ``Lv`` dims (``v = tl.trans(k)``), not from ``v_buffer``, so the value
    cache checked is ``k_buffer[..., :Lv]`` (``Lv`` = ``v_buffer``'s last dim), what the kernel reads. Without
    ``is_mla``, or with one query head per kv head (the MHA kernel, which is not told), ``v_buffer``."""
    q = args["q"]
    n = int(q.shape[0]) if isinstance(q, torch.Tensor) else 0
    kc = args["k_buffer"]
    if isinstance(kc, torch.Tensor) and kc.dim() == 3:  # flat [slots, Hkv, D]: pages of page_size
        ps = int(args.get("page_size", 1))
        kc = kc.view(-1, ps, *kc.shape[1:])
        vc = args["v_buffer"].view(-1, ps, *args["v_buffer"].shape[1:])
    else:
        vc = args["v_buffer"]
    v_name = "v_buffer"
    if args.get("is_mla") and is_tensor(kc) and is_tensor(vc) and is_tensor(q) and kc.dim() == 4 \
            and vc.dim() == 4 and q.dim() == 3 and int(q.shape[1]) != int(vc.shape[-2]):
        vc, v_name = kc[..., : vc.shape[-1]], "k_buffer[..., :Lv] (is_mla: the value is the key row's first Lv dims)"
    qsl = torch.arange(n + 1, dtype=torch.int32, device=q.device if isinstance(q, torch.Tensor) else "cpu")
    table = args["req_to_token"]
    if is_tensor(table) and table.dim() > 2 and all(int(d) == 1 for d in table.shape[2:]):
        # [B, pages, 1] (vLLM's test_triton_decode_attention.py): the kernel reads entry j of row b at
        # req_to_token + b * stride(0) + j, so trailing unit dims change nothing it reads
        table = table.reshape(table.shape[0], table.shape[1])
    return PagedCall(
        kernel="decode_attention_fwd", contract=Contract.UNIFIED, layout=NHDLayout(), query=q, key_cache=kc,
        value_cache=vc, block_table=table, query_start_loc=qsl, seq_lens=args["b_seq_len"],
        key=key, value=value,
        names=dict(query="q", key_cache="k_buffer", value_cache=v_name, block_table="req_to_token",
                   query_start_loc="(implicit: one query token per sequence)", seq_lens="b_seq_len"),
        kv_cache_dtype=None, k_scale=args.get("k_scale") if args.get("k_scale") is not None else 1.0,
        v_scale=args.get("v_scale") if args.get("v_scale") is not None else 1.0,
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL,
    )


_V1 = "vllm/v1/attention/ops/"


def _ops_modules(module: str) -> tuple[str, str]:
    """Where vLLM's attention op ``module`` may be defined, both of which the guard patches: vllm/v1/attention/ops/
    (vLLM 0.33.0) and vllm/attention/ops/ (earlier releases, before the ops moved under v1)."""
    return f"vllm.v1.attention.ops.{module}", f"vllm.attention.ops.{module}"


def _triton_only(name: str, build: Callable[..., PagedCall], module: str, *, takes_new_kv: bool,
                 reads: frozenset[str] = frozenset(), **declared: bool) -> KernelSignature:
    """The signature of vLLM's Triton op ``name``, defined in vllm/v1/attention/ops/``module``.py, with one path:
    its Triton kernels, which read the ``max_*`` scalars in ``reads``. ``declared``: the
    :class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration` flags of its calls."""
    return KernelSignature(name, build, name, _ops_modules(module), takes_new_kv=takes_new_kv,
                           declaration=KernelDeclaration(paths=(
                               KernelPath(f"{name}'s Triton kernels", reads=reads, source=f"{_V1}{module}.py {name}"),
                           ), **declared))


#: chunked_prefill_paged_decode: everywhere, prefill through context_attention_fwd (``if max_query_len > 1``,
#: its grid sized by max_query_len) and decode through Triton's kernel_paged_attention_2d (block_table
#: ``.to(torch.int32)``, seq_lens loaded with their own type); on ROCm, decode through the custom HIP kernel
#: when use_rocm_custom_paged_attention selects it, which sizes its partitions from max_seq_len and reads
#: block_tables/seq_lens/query_start_loc through ``data_ptr<int>()``.
CHUNKED_PREFILL_PAGED_DECODE = KernelSignature(
    "chunked_prefill_paged_decode", chunked_prefill_paged_decode_call, "chunked_prefill_paged_decode",
    _ops_modules("chunked_prefill_paged_decode"),
    takes_new_kv=True, declaration=KernelDeclaration(paths=(
        KernelPath("the Triton path (context_attention_fwd for prefill, kernel_paged_attention_2d for decode)",
                   reads=frozenset({"max_query_len"}),
                   source=_V1 + "chunked_prefill_paged_decode.py chunked_prefill_paged_decode"),
        KernelPath("the ROCm custom kernel (csrc/rocm/attention.cu paged_attention, which reads index tensors "
                   "through data_ptr<int>())",
                   index_dtypes=INT32_ONLY, reads=frozenset({"max_seq_len"}),
                   kv_cache_dtypes=ROCM_CUSTOM_KV_CACHE_DTYPES, taken_on=rocm_custom_path_taken,
                   source="vllm/platforms/rocm.py use_rocm_custom_paged_attention; csrc/rocm/attention.cu"),
    )))
#: context_attention_fwd: Triton only; b_loc cast to int32 (the ALiBi kernel loads it as passed), b_start_loc and
#: b_seq_len loaded with their own type; grid ``cdiv(max_input_len, BLOCK_M)``; max_seq_len normalized and unused.
CONTEXT_ATTENTION_FWD = _triton_only("context_attention_fwd", context_attention_fwd_call, "prefix_prefill",
                                     takes_new_kv=True, reads=frozenset({"max_query_len"}))
#: unified_attention: Triton only; max_seqlen_q picks the 2-D or 3-D launch; max_seqlen_k is read only by the
#: INT4 KV path (unified_attention_int4), which kvfuzz does not model.
UNIFIED_ATTENTION = _triton_only("unified_attention", unified_attention_call, "triton_unified_attention",
                                 takes_new_kv=False, reads=frozenset({"max_query_len"}), trailing_query_rows=True)
#: decode_attention_fwd: Triton only, no max_* arguments; the value head size may differ (MLA: Lk 576, Lv 512).
DECODE_ATTENTION_FWD = _triton_only("decode_attention_fwd", decode_attention_fwd_call, "triton_decode_attention",
                                    takes_new_kv=False, value_head_size_may_differ=True, empty_decode_rows=True)

#: This family's checked kernels (the guard collects them through kvfuzz.fuzz.targets.registry.FAMILIES).
SIGNATURES = (CHUNKED_PREFILL_PAGED_DECODE, CONTEXT_ATTENTION_FWD, UNIFIED_ATTENTION, DECODE_ATTENTION_FWD)


# ---- the targets ----------------------------------------------------------------------------------------------
#: What the two prefix-prefill kernels declare alike (ROCm's ROCM_ATTN backend calls both): both devices, fp8
#: caches, the window, ALiBi and sinks, ALiBi exclusive with the other two.
PREFIX_PREFILL_FAMILY = dict(
    devices=("cpu", "cuda"),
    dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
    kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    features=("sliding_window", "alibi", "sinks"),
    exclusive=(("alibi", "sinks"), ("alibi", "sliding_window")),
    shared_prefix_blocks=True,  # vLLM's prefix caching shares full blocks
    # vLLM's SlidingWindowManager.remove_skipped_blocks (vllm/v1/core/single_type_kv_cache_manager.py) frees the
    # blocks wholly before the window whatever the backend; the ROCm backend (ROCM_ATTN,
    # vllm/v1/attention/backends/rocm_attn.py) calls these kernels on them (vllm#53628)
    freed_window_blocks=True,
)


class _PrefixPrefillKernel(VllmTritonTarget):
    """What ``chunked_prefill_paged_decode`` and its prefill half ``context_attention_fwd`` share besides their
    declaration (:data:`PREFIX_PREFILL_FAMILY`): the 5-D paged cache, and the live bug the gate leaves undrawn."""

    #: live vllm#53628 (docs/bugs.md): the gate leaves the freed-window state undrawn; `kvfuzz fuzz` draws it
    gate_states_off = ("freed_window_blocks",)

    def layout(self, batch: Batch) -> CacheLayout:
        return VllmPagedLayout()


class VllmChunkedPrefillPagedDecode(_PrefixPrefillKernel):
    """``chunked_prefill_paged_decode`` (vllm/v1/attention/ops/chunked_prefill_paged_decode.py, vllm 0.33.0).

    Split contract: prefill sequences are computed by ``context_attention_fwd(..., skip_decode=True)`` from
    the cache (positions ``0 .. ctx_len-1``) plus ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
    (the new tokens, in query order); decode sequences by ``kernel_paged_attention_2d`` from the cache alone
    (positions ``0 .. seq_len-1``). Cache: :class:`~kvfuzz.contracts.caches.layouts.VllmPagedLayout`, uint8
    storage for fp8 kv_cache_dtypes. Index tensors int32; ``k_scale``/``v_scale`` float32 scalar tensors.

    Features, in the kernel's conventions: ``sliding_window = W`` (keys with ``pos_q - pos_k < W``),
    ``alibi_slopes`` float32 ``[H]``, ``sinks`` float32 ``[H]``; no softcap argument. Declared exclusive:
    ALiBi with sinks (``context_attention_fwd`` asserts ``sinks is None``) and ALiBi with a sliding window
    (the prefill path's ``_fwd_kernel_alibi`` has no window: it ignores one silently).
    """

    name = "vllm.chunked_prefill_paged_decode"
    #: live vllm#53628 (docs/bugs.md): the gate leaves the freed-window state undrawn; `kvfuzz fuzz` draws it
    gate_states_off = ("freed_window_blocks",)
    #: docs/findings.md, Finding 15: the decode kernel masks keys before the window with the finite score -10000,
    #: which "shifted" logits (~-40,000) and some "extreme" ones lie below; the gate draws the other ranges,
    #: `kvfuzz fuzz` all
    gate_value_ranges = ("normal", "large", "equal", "dominant")
    checked_kernel = CHUNKED_PREFILL_PAGED_DECODE
    description = "vLLM Triton prefix-prefill + paged decode (split contract)"
    capabilities = Capabilities(
        contract=Contract.SPLIT,
        head_sizes=(32, 64, 128),  # context_attention_fwd pads other sizes; the 5-D cache needs D % x == 0
        block_sizes=(16, 32),
        **PREFIX_PREFILL_FAMILY,
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        return _split_family_call(batch, data, cache, sm_scale=batch.sm_scale)

    def path(self, batch: Batch) -> str:
        parts = []
        if batch.prefill_seqs:
            parts.append("context_attention_fwd")
        if batch.decode_seqs:
            parts.append("kernel_paged_attention_2d")
        return "+".join(parts)


def _split_family_call(batch: Batch, data: BatchData, cache: CacheState, names: dict[str, str] | None = None,
                       **extra) -> KernelCall:
    """One call of chunked_prefill_paged_decode, or (``names=PREFIX_PREFILL_NAMES``) of context_attention_fwd,
    whose signature takes the same values under other names: the new tokens' ``key``/``value`` in query
    order, the caches (uint8 storage for fp8), int32 index tensors, float32 scalar scales, ``alibi_slopes``,
    ``sliding_window = W`` and ``sinks``; ``extra`` adds kernel-specific arguments (``sm_scale``,
    ``skip_decode``)."""
    dev = cache.key_cache.device
    key, value = data.new_kv(batch)
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype, device=dev)
    k_scale, v_scale = scales(batch, dev)
    values = dict(
        query=data.query.to(dev), key=key.to(dev), value=value.to(dev), output=out,
        kv_cache_dtype=batch.kv_cache_dtype, key_cache=fp8_storage(batch, cache.key_cache),
        value_cache=fp8_storage(batch, cache.value_cache),
        block_table=batch.block_table_tensor(dev), query_start_loc=batch.query_start_loc_tensor(dev),
        seq_lens=batch.seq_lens_tensor(dev), max_seq_len=batch.max_seq_len,
        max_query_len=batch.max_query_len, k_scale=k_scale, v_scale=v_scale,
        alibi_slopes=batch.alibi_slopes_tensor(dev), sliding_window=batch.sliding_window,
        sinks=sinks(data, dev), **extra,
    )
    kwargs = {(names or {}).get(k, k): v for k, v in values.items()}
    return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out,
                      key=values["key"], value=values["value"])


class VllmContextAttentionFwd(_PrefixPrefillKernel):
    """``context_attention_fwd`` (vllm/v1/attention/ops/prefix_prefill.py, vllm 0.33.0) called directly with
    ``skip_decode=False``.

    Prefix contract: every sequence, decode included, is computed by ``_fwd_kernel`` from the cache
    (positions ``0 .. ctx_len-1``, :class:`~kvfuzz.contracts.caches.layouts.VllmPagedLayout`) plus ``k``/``v``
    ``[num_tokens, num_kv_heads, head_size]`` (its new tokens, in query order); the kernel never reads a
    sequence's new tokens from the cache. Index tensors int32 (``b_loc`` = block table, ``b_start_loc`` =
    query_start_loc, ``b_seq_len`` = seq_lens); ``k_scale``/``v_scale`` float32 scalar tensors; uint8 cache
    storage for fp8 kv_cache_dtypes. Features as for chunked_prefill_paged_decode (``sliding_window = W``,
    ``alibi_slopes``, ``sinks``; ALiBi exclusive with sinks and with a window).

    Block sizes: the kernel walks the context in tiles of 32 tokens and resolves each token's physical block
    separately (``_paged_kv_cache_offsets``), so the physical block size need not be a power of 2 nor divide
    32 (vLLM's comment names 544, Qwen3-Next). Declared, each run interpreted on mixed batches with head
    sizes 24-128: 1 (a tile spans 32 blocks), 16 and 32 (vLLM's usual sizes), 48 (not a power of 2; tiles
    straddle blocks) and 544 (the hybrid-model size; one block per sequence at kvfuzz's lengths).
    """

    name = "vllm.context_attention_fwd"
    checked_kernel = CONTEXT_ATTENTION_FWD
    description = "vLLM Triton prefix-prefill kernel for every sequence, decode included (prefix contract)"
    capabilities = Capabilities(
        contract=Contract.PREFIX,
        head_sizes=(32, 40, 64, 80, 128),  # padded to a power of 2 inside; the 5-D cache needs D % x == 0
        block_sizes=(1, 16, 32, 48, 544),
        fp8_head_sizes=(32, 64, 128),  # x = 16 one-byte elements
        **PREFIX_PREFILL_FAMILY,
    )

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        return _split_family_call(batch, data, cache, names=PREFIX_PREFILL_NAMES, sm_scale=batch.scale,
                                  skip_decode=False)

    def path(self, batch: Batch) -> str:
        kinds = [k for k, seqs in (("prefill", batch.prefill_seqs), ("decode", batch.decode_seqs)) if seqs]
        return "_fwd_kernel(" + "+".join(kinds) + ")"


#: vllm/v1/attention/backends/triton_attn.py (vllm 0.33.0): the 2-D grid is (q blocks, kv heads); below
#: MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads sequences the backend prefers the 3-D split-softmax kernel with
#: NUM_PAR_SOFTMAX_SEGMENTS segments. (Copied: the backend module needs pydantic to import.)
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16


class VllmUnifiedAttention(VllmTritonTarget):
    """``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py, vllm 0.33.0).

    Unified contract: every sequence's ``seq_len`` positions are read from the cache
    (:class:`~kvfuzz.contracts.caches.layouts.NHDLayout`, ``[num_blocks, block_size, num_kv_heads, head_size]``).
    Called as vLLM's TRITON_ATTN backend calls it (vllm/v1/attention/backends/triton_attn.py, eager mode, or
    a FULL CUDA graph's padded call when the batch has pads, :mod:`kvfuzz.contracts.model.padding`): ``cu_seqlens_q`` =
    query_start_loc int32, ``seqused_k`` = seq_lens int32, ``window_size = (W - 1, 0)`` for a sliding window of W keys
    (else ``(-1, -1)``), ``softcap`` (0: off), ``alibi_slopes`` and ``sinks`` float32 ``[H]``, causal; an fp8 cache as
    an fp8 view with ``kv_quant_mode=FP8_PER_TENSOR`` and ``k_descale``/``v_descale`` = the scale expanded to
    ``[num_seqs, num_kv_heads]`` (no descales for ``auto``). (vLLM's TRITON_ATTN views every fp8 cache as
    ``current_platform.fp8_dtype()``, so its "fp8_e5m2" cache is written and read as e4m3; kvfuzz hands the kernel the
    format the batch names.) ALiBi with sinks is declared exclusive: the linear ALiBi bias is ``slope * (k_pos -
    context_len)`` (``apply_alibi_to_score``), which differs from ``slope * (k_pos - q_pos)`` by a per-row constant that
    softmax cancels, except against a sink, whose logit gets no bias: prefill row ``j`` weighs its sink ``exp(slope *
    j)`` times too little (kvfuzz found it; docs/findings.md). And the split-softmax scratch: ``seq_threshold_3D = 128
    // num_kv_heads``, 16 segments, fp32 ``softmax_segm_output [T, H, 16, next_pow2(D)]``,
    ``softmax_segm_max``/``softmax_segm_expsum [T, H, 16]``. vLLM sizes the scratch for ``min(threshold, max_num_seqs) *
    max_query_len_3d`` tokens, which is >= T whenever the other 3-D conditions hold and speculative decoding allows
    8-token queries; kvfuzz allocates exactly T rows, which gives the same kernel choice. The scratch is filled with the
    example's poison (vLLM reuses it uninitialised across layers).

    Paths (the kernel's own rule, :meth:`path`): "3d" (16-segment split softmax + ``reduce_segments``) for
    small batches with ``max_query_len <= 8``; "2d" otherwise.

    Head sizes: the backend accepts ``head_size >= 32`` (``supports_head_size``); 40 and 80 exercise the
    padding masks. Block sizes: the backend accepts multiples of 16 (``supports_block_size``); tiles of
    16/32 tokens may span blocks (each token's block is looked up separately). Declared 16, 32, 48, 64 and
    544 (the hybrid-model size); the kernel also ran correctly interpreted with 1 and 8, which vLLM never
    passes it.
    """

    name = "vllm.unified_attention"
    checked_kernel = UNIFIED_ATTENTION
    description = "vLLM Triton unified attention, 2-D and 3-D split-softmax paths (unified contract)"
    capabilities = Capabilities(
        contract=Contract.UNIFIED,
        devices=("cpu", "cuda"),
        dtypes=("float16", "float32"),  # per device: see VllmTritonTarget
        head_sizes=(32, 40, 64, 80, 128),
        block_sizes=(16, 32, 48, 64, 544),
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        features=("sliding_window", "alibi", "sinks", "softcap"),
        # accepted without complaint but position-dependent: see docs/findings.md, Finding 5
        # (tests/fuzz/targets/test_vllm_triton.py)
        exclusive=(("alibi", "sinks"),),
        shared_prefix_blocks=True,  # vLLM's prefix caching shares full blocks
        # vLLM's TRITON_ATTN (AttentionCGSupport.ALWAYS) runs decode batches in FULL CUDA graphs, padded
        cuda_graph_padding="vllm",
        # vLLM's SlidingWindowManager frees the blocks before the window (null block in their columns); the
        # kernel skips tiles wholly before the window (triton_attention_helpers.py compute_tile_loop_bounds) and
        # zeroes V outside it (the V mask of vLLM PR #30887)
        freed_window_blocks=True,
    )

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()

    @staticmethod
    def seq_threshold_3d(batch: Batch) -> int:
        return MIN_LAUNCH_GRID_SIZE_2D // batch.num_kv_heads

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads, as vLLM's FULL graphs
        t, h, d = pad.num_rows, batch.num_heads, batch.head_size
        dpad = 1 << (d - 1).bit_length()
        out = torch.empty((t, h, d), dtype=batch.torch_dtype, device=dev)
        segs = NUM_PAR_SOFTMAX_SEGMENTS
        quant: dict = {}
        descale = [None, None]
        if batch.fp8_dtype is not None:
            from vllm.v1.kv_cache_interface import KVQuantMode

            quant = dict(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
            descale = [s.expand((pad.num_seqs, batch.num_kv_heads)) for s in scales(batch, dev)]
        w = batch.sliding_window
        kwargs = dict(
            q=pad.query(data.query.to(dev)), k=cache.key_cache, v=cache.value_cache, out=out,
            cu_seqlens_q=pad.query_start_loc_tensor(dev), max_seqlen_q=batch.max_query_len,
            seqused_k=pad.seq_lens_tensor(dev), max_seqlen_k=batch.max_seq_len, softmax_scale=batch.scale,
            causal=True, window_size=(-1, -1) if w is None else (w - 1, 0),
            block_table=pad.block_table_tensor(dev), softcap=batch.softcap or 0,
            q_descale=None, k_descale=descale[0], v_descale=descale[1],
            alibi_slopes=batch.alibi_slopes_tensor(dev), sinks=sinks(data, dev), **quant,
            seq_threshold_3D=self.seq_threshold_3d(batch), num_par_softmax_segments=segs,
            softmax_segm_output=poisoned_scratch((t, h, segs, dpad), cache, batch.seed + 3),
            softmax_segm_max=poisoned_scratch((t, h, segs), cache, batch.seed + 4),
            softmax_segm_expsum=poisoned_scratch((t, h, segs), cache, batch.seed + 5),
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def path(self, batch: Batch) -> str:
        """The kernel path, "3d" or "2d", by ``unified_attention``'s own selection rule for the arguments
        :meth:`build_call` passes (scratch always given, causal, no mm-prefix; ``MAX_3D_QUERY_LEN``,
        ``is_batch_invariant`` and the Blackwell large-head tuning read from vLLM itself)."""
        max_q, gqa = batch.max_query_len, batch.gqa_ratio
        block_m = 16 if gqa <= 16 else 1 << (gqa - 1).bit_length()
        block_q = block_m // gqa
        max_3d_q, batch_invariant, tuned_large_head = 8, False, False
        if self.availability().ok:
            from vllm.platforms import current_platform
            from vllm.v1.attention.ops import triton_unified_attention as tua

            max_3d_q, batch_invariant = tua.MAX_3D_QUERY_LEN, bool(tua.is_batch_invariant)
            tuned_large_head = (batch.head_size == 256 and max_q > 1 and gqa <= 16
                                and current_platform.is_device_capability_family(100))
        use_3d = not ((max_q > 1 and (max_q > max_3d_q or tuned_large_head))
                      or batch.num_seqs * -(-max_q // block_q) > self.seq_threshold_3d(batch)
                      or batch_invariant)
        # the scratch has batch.num_tokens rows, so the kernel's "scratch rows < query tokens" fallback never fires
        return "3d" if use_3d else "2d"


class VllmDecodeAttentionFwd(VllmTritonTarget):
    """``decode_attention_fwd`` (vllm/v1/attention/ops/triton_decode_attention.py, vllm 0.33.0; from SGLang).

    Decode only (one query token per sequence), unified contract: every sequence's ``seq_len`` positions
    are read from the cache. The kernel reads ``k_buffer``/``v_buffer`` as ``[num_pages, page_size,
    num_kv_heads, head_size]`` (its strides: page ``stride(-4)``, token ``stride(-3)``, head ``stride(-2)``)
    = :class:`~kvfuzz.contracts.caches.layouts.NHDLayout` with ``page_size = block_size``, and ``req_to_token`` =
    the block table (page ids, int32). Arguments: ``q``/``o`` ``[N, H, D]``, ``lse`` ``[N, H]`` fp32,
    ``attn_logits`` ``[N, H, num_kv_splits, D + 1]`` fp32 (filled with the example's poison: vLLM serves it
    from a reused workspace), ``k_scale``/``v_scale`` float32 scalars, an fp8 cache as an fp8 view (as
    SGLang allocates it), ``logit_cap`` = softcap (0: off). No window, ALiBi or sinks arguments.

    Two stage-1 kernels: ``_fwd_kernel_stage1`` for MHA (``H == Hkv``) and ``_fwd_grouped_kernel_stage1``
    for GQA/MQA; then ``_fwd_kernel_stage2`` merges the splits.

    num_kv_splits: vLLM's Triton MLA backend (vllm/v1/attention/backends/mla/triton_mla.py,
    ``_compute_num_kv_splits``) uses ``next_pow2(max(1, max_seq_len // 512))`` capped at 2 x SMs, which is
    1 for every batch small enough to interpret; kvfuzz fixes ``num_kv_splits = 4`` by default (pass
    ``num_kv_splits=None`` for vLLM's rule) so the split merge, splits shorter than a tile and empty splits
    (``seq_len < 4``) are exercised.
    """

    name = "vllm.decode_attention_fwd"
    #: live vllm#57017 (docs/bugs.md): the gate draws no CUDA-graph pads; `kvfuzz fuzz` does
    gate_states_off = ("cuda_graph_padding",)
    checked_kernel = DECODE_ATTENTION_FWD
    #: docs/findings.md, Finding 3: the MHA path sums q.k in the input dtype, which "extreme" values overflow (NaN
    #: output) and "large"/"dominant" ones round past the envelope (the shipped baseline's finding-3-magnitudes);
    #: the gate draws normal and equal values, `kvfuzz fuzz` all
    gate_value_ranges = ("normal", "equal")
    description = "vLLM Triton split-KV decode attention (decode only, unified contract)"
    capabilities = Capabilities(
        **DECODE_ATTENTION_FAMILY,
        block_sizes=(1, 16, 32, 48, 64),  # page_size 1 is SGLang's default; vLLM's MLA backends use 16*k
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        features=("softcap",),
        # vLLM calls it from TRITON_MLA (VllmTritonMlaDecode's docstring), whose decode batches run in FULL CUDA
        # graphs padded with seq_len-0, null-block rows (vllm#57017)
        cuda_graph_padding="vllm",
    )

    #: vllm/v1/attention/backends/mla/triton_mla.py
    MIN_WORK_PER_SPLIT = 512
    SPLIT_OCCUPANCY_MULTIPLIER = 2

    def __init__(self, num_kv_splits: int | None = 4) -> None:
        super().__init__()
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1 or None (vLLM's rule), got {num_kv_splits}")
        self.fixed_splits = num_kv_splits

    def num_kv_splits(self, batch: Batch) -> int:
        if self.fixed_splits is not None:
            return self.fixed_splits
        ideal = 1 << (max(1, batch.max_seq_len // self.MIN_WORK_PER_SPLIT) - 1).bit_length()
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count if on_cuda() else 1
        return min(ideal, sm_count * self.SPLIT_OCCUPANCY_MULTIPLIER)

    def layout(self, batch: Batch) -> CacheLayout:
        return NHDLayout()

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        require_decode(self.name, batch)
        dev = cache.key_cache.device
        pad = padding(batch, self.capabilities.cuda_graph_padding)  # CUDA-graph pads: one row each, after the real
        n, h, d = pad.num_rows, batch.num_heads, batch.head_size
        splits = self.num_kv_splits(batch)
        out = torch.empty((n, h, d), dtype=batch.torch_dtype, device=dev)
        k_scale, v_scale = scales(batch, dev)
        kwargs = dict(
            q=pad.query(data.query.to(dev)), k_buffer=cache.key_cache, v_buffer=cache.value_cache, o=out,
            lse=torch.empty((n, h), dtype=torch.float32, device=dev), req_to_token=pad.block_table_tensor(dev),
            b_seq_len=pad.seq_lens_tensor(dev),
            attn_logits=poisoned_scratch((n, h, splits, d + 1), cache, batch.seed + 3),
            num_kv_splits=splits, sm_scale=batch.scale, page_size=batch.block_size,
            logit_cap=batch.softcap or 0.0, k_scale=k_scale, v_scale=v_scale,
        )
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def path(self, batch: Batch) -> str:
        return f"{stage1(batch)},splits={self.num_kv_splits(batch)}"


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (VllmChunkedPrefillPagedDecode, VllmContextAttentionFwd, VllmUnifiedAttention, VllmDecodeAttentionFwd)

__all__ = ["CHUNKED_PREFILL_PAGED_DECODE", "CONTEXT_ATTENTION_FWD", "DECODE_ATTENTION_FWD", "NUM_PAR_SOFTMAX_SEGMENTS",
           "PREFIX_PREFILL_NAMES", "SIGNATURES", "UNIFIED_ATTENTION", "VllmChunkedPrefillPagedDecode",
           "VllmContextAttentionFwd", "VllmDecodeAttentionFwd", "VllmUnifiedAttention",
           "chunked_prefill_paged_decode_call", "context_attention_fwd_call", "decode_attention_fwd_call",
           "module_file", "prepare_triton_runtime", "unified_attention_call"]
