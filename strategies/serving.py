"""The serving size tier: batches as a serving engine's scheduler composes them (issue 38).

vLLM's v1 scheduler (vllm/v1/core/sched/scheduler.py ``Scheduler.schedule``) spends a token budget
(``max_num_batched_tokens``) on the running requests first (a decode: 1 token, or ``k + 1`` with ``k`` speculative
tokens), then on waiting ones, cutting a long prompt into chunks that fill what is left of the budget (chunked
prefill: a request resumes at the boundary of its earlier chunks, so its ctx_len is a sum of earlier chunk sizes);
the model runner then puts decodes before prefills (vllm/v1/attention/backends/utils.py
``reorder_batch_to_split_decodes_and_prefills``, ``split_decodes_and_prefills``), and a pure-decode batch is padded
to a CUDA-graph capture size (vllm/config/compilation.py ``cudagraph_capture_sizes``: 1, 2, 4, then multiples of
8). SGLang's ``PrefillAdder`` (python/sglang/srt/managers/schedule_policy.py) does the same with
``chunked_prefill_size`` as the chunk budget. Heads, head size, window, softcap and sinks come from real models
(:mod:`kvfuzz.strategies.models`) or, as in the small tier, from anywhere the target declares, so shrinking and
novelty are not lost.

Shrinking (strategies/batches.py's discipline): every choice is drawn whatever the earlier ones were, simplest
first: the off-table heads before a model row, each decode slot's tokens (0: out of the batch) and each chunk slot's
flag, which the shrinker lowers to drop it, contexts log-uniform as ``(exponent, mantissa)`` shrinking to 0, and a
chunk's context source (plain, an earlier chunk boundary, around the window) with the plain length first. A
serving failure shrinks to one sequence with small lengths. A focused draw (:mod:`kvfuzz.strategies.focus`) makes
the same choices in narrower ranges, so it replays in this strategy.
"""

from __future__ import annotations

import bisect
import functools

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.counter_rng import MAX_STREAM_ELEMENTS
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison

from .batches import (
    SEEDS,
    attention_params,
    block_tables_per_call,
    cached_strategy,
    choice,
    csr_tails,
    gqa_heads,
    head_size_of,
    pinned_field,
    sampled,
)
from .configs import GQA_RATIOS, KernelConfig
from .focus import Focus, Range, exponents, index_range, intersect, ints, log_value
from .limits import Limits
from .models import MODEL_WINDOWS, model_shapes
from .states import capture_size, draw_states

#: Token budgets per step (vLLM's ``max_num_batched_tokens``: 2048 and 8192 are its v1 defaults for online and
#: offline serving, vllm/engine/arg_utils.py; SGLang's ``chunked_prefill_size`` defaults to 2048 or 8192), smallest
#: first; a budget is capped at the tier's ``max_query_len``.
TOKEN_BUDGETS = (256, 512, 2048, 8192)
#: Decode slots and prefill-chunk slots of a serving batch.
DECODE_SLOTS, CHUNK_SLOTS = 32, 3
#: Speculative tokens per decode step: query_len ``k + 1``.
SPEC_TOKENS = tuple(range(1, 8))
#: Tile widths whose multiples +- 1 a window is drawn near.
TILE_EDGES = (16, 32, 64, 128)


@functools.lru_cache(maxsize=256)
def _log_len(max_value: int, within: Range | None = None) -> st.SearchStrategy[int]:
    """Integers in ``[0, max_value]``, log-uniform: an exponent ``e`` and a mantissa, ``[2**(e-1), 2**e)``;
    both shrink to 0 (e = 0 is the length 0). ``within``: only exponents whose lengths meet this range
    (:func:`~kvfuzz.strategies.focus.exponents`; a log2 bin's range holds exactly one)."""
    bits = max(1, max_value.bit_length())
    return st.tuples(ints(*exponents(within, bits)), ints(0, (1 << bits) - 1)).map(
        lambda em: log_value(max_value, *em))


def _draw_log(draw, max_value: int, within: Range | None = None) -> int:
    """:func:`_log_len`'s two choices drawn in place (a slot draws several: no tuple and map around them)."""
    bits = max(1, max_value.bit_length())
    e = draw(ints(*exponents(within, bits)))
    return log_value(max_value, e, draw(ints(0, (1 << bits) - 1)))


#: A decode slot's tokens by the index drawn, simplest first: out of the batch (half of the indices), a plain
#: decode (a quarter), a speculative step of ``k + 1`` tokens (``k`` in :data:`SPEC_TOKENS`). One choice where a
#: flag, a speculative flag and ``k`` were three: 32 slots drew 96 (issue 52), and sorted by tokens, so that a
#: focused draw caps a slot's tokens with one index range.
DECODE_TOKENS = (0,) * 14 + (1,) * 7 + tuple(k + 1 for k in SPEC_TOKENS)


@st.composite
def _decode_slot(draw, max_ctx_len: int, tokens: Range, ctx: Range | None):
    """One running request: its tokens (:data:`DECODE_TOKENS`, the index inside ``tokens``) and its context
    (inside ``ctx``: a focused draw)."""
    return DECODE_TOKENS[draw(ints(*tokens))], _draw_log(draw, max_ctx_len, ctx)


@st.composite
def _chunk_slot(draw, max_ctx_len: int, budget_cap: int, on: Range, size: Range | None, source: Range,
                ctx: Range | None):
    """One prefill chunk: whether it is in the batch, its length, its context's source (0 plain, 1 a multiple of
    an earlier chunk's length, 2 around the window), the plain context, the multiple, and the offset from the
    window; ``on``, ``source`` (index ranges), ``size`` and ``ctx`` (length ranges) narrow a focused draw."""
    return (bool(draw(ints(*on))), _draw_log(draw, budget_cap, size), draw(ints(*source)),
            _draw_log(draw, max_ctx_len, ctx), draw(ints(1, 64)), draw(ints(-budget_cap, budget_cap)))


@functools.lru_cache(maxsize=1024)
def _decode_strategy(max_ctx_len: int, tokens: Range = (0, len(DECODE_TOKENS) - 1), ctx: Range | None = None):
    return _decode_slot(max_ctx_len, tokens, ctx)


@functools.lru_cache(maxsize=1024)
def _chunk_strategy(max_ctx_len: int, budget_cap: int, on: Range = (0, 1), size: Range | None = None,
                    source: Range = (0, 2), ctx: Range | None = None):
    return _chunk_slot(max_ctx_len, budget_cap, on, size, source, ctx)


@functools.lru_cache(maxsize=64)
def _window_edges(max_window: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The models' windows (:data:`MODEL_WINDOWS`) and the tile edges ``k * t + d`` of at least 128 keys (t in
    :data:`TILE_EDGES`, d in -1, 0, 1: the small tier draws the short ones), each sorted, at most ``max_window``."""
    edges = sorted({k * t + d for t in TILE_EDGES for k in (*range(1, 17), 32, 64, 128, 256) for d in (-1, 0, 1)
                    if k * t >= 128 and k * t + d <= max_window}) or [max_window]
    models = sorted(w for w in MODEL_WINDOWS if w <= max_window) or [max_window]
    return tuple(models), tuple(edges)


@functools.lru_cache(maxsize=256)
def _windows(max_window: int, within: Range | None = None) -> st.SearchStrategy[int]:
    """A window: a plain integer first (it shrinks to any minimum), one of the models' (:data:`MODEL_WINDOWS`),
    a tile edge (:func:`_window_edges`), or log-uniform. ``within``: only windows in this range, as the same
    choices (the branches that have none in it are not drawn)."""
    models, edges = _window_edges(max_window)
    narrow = intersect(within, 1, max_window)
    if narrow is None:
        return st.one_of(st.integers(1, max_window), st.sampled_from(models), st.sampled_from(edges),
                         _log_len(max_window).map(lambda w: max(1, w)))
    return _window_within(max_window, models, edges, narrow)


@st.composite
def _window_within(draw, max_window: int, models: tuple[int, ...], edges: tuple[int, ...], within: Range) -> int:
    """:func:`_windows`' choices (one_of's branch index, then the branch's) inside ``within``: the branches up to
    the first that has no window there (the plain integers and the log-uniform branch always have)."""
    ranges = [index_range(models, within), index_range(edges, within)]
    last = 3 if all(ranges) else (1 if ranges[0] else 0)
    branch = draw(ints(0, last))
    if branch == 0:
        return draw(ints(*within))
    if branch == 3:
        return max(1, draw(_log_len(max_window, within)))
    values, idx = (models, ranges[0]) if branch == 1 else (edges, ranges[1])
    return values[draw(ints(*idx))] if len(values) > 1 else values[0]


def _lengths(draw, limits: Limits, budget: int, window: int | None, decode_only: bool,
             focus: Focus | None = None, stream: int = 0) -> list[tuple[int, int]]:
    """``[(query_len, ctx_len)]``: decodes first, then prefill chunks filling what the decodes left of
    ``budget`` (every slot drawn whatever the others are). ``focus``: the batch's longest context and query in
    its ranges (:func:`_aims`); ``stream``: the generator's keys per sequence, times the sequences (what the
    contexts are cut to)."""
    ctx_cap = limits.max_ctx_len
    cap = max(2, min(budget, limits.max_query_len))
    aims = _Aims(focus, limits, budget, decode_only, stream, cap)
    decodes = [draw(aims.decode(i)) for i in range(min(DECODE_SLOTS, limits.max_num_seqs))]
    chunks = [draw(aims.chunk(i)) for i in range(CHUNK_SLOTS)]
    out, used = [], 0
    for tokens, ctx in decodes:
        q = min(tokens, 1) if decode_only else tokens
        if q and used + q <= budget:
            out.append((q, ctx))
            used += q
    if decode_only:
        return out or [(1, decodes[0][1])]
    sizes: list[int] = []
    for on, size, source, ctx, mult, offset in chunks:
        q = max(1, min(size, budget - used, limits.max_query_len))
        if source == 1 and sizes:  # resuming at an earlier chunk's boundary
            ctx = min(ctx_cap, mult * sizes[-1])
        elif source == 2 and window is not None:  # straddling the window
            ctx = min(ctx_cap, max(0, window + offset))
        if on and used + q <= budget:
            out.append((q, ctx))
            used += q
            sizes.append(q)
    if not out:  # one sequence, the first chunk's (or the first decode's in a decode-only target)
        on, size, _, ctx, _, _ = chunks[0]
        out = [(max(1, min(size, cap)), ctx)]
    return out


class _Aims:
    """The slots' strategies of one serving batch's lengths (:func:`_lengths`): free, or aimed at a focus's ranges.
    The first chunk (the first decode where only decodes count) is in the batch inside the ranges, a plain context
    of its own; every other slot at most their upper ends; the decodes leave the budget room for that chunk; no
    more sequences than keep the focus's context uncut by the generator's stream (``stream``)."""

    def __init__(self, focus: Focus | None, limits: Limits, budget: int, decode_only: bool, stream: int,
                 cap: int) -> None:
        self.ctx_cap, self.cap, self.decode_only = limits.max_ctx_len, cap, decode_only
        self.q = self.c = None
        if focus is not None:
            self.q = intersect(focus.query_len, 1, 1 if decode_only else min(budget, limits.max_query_len))
            self.c = intersect(focus.ctx_len, 0, limits.max_ctx_len)
        self.allowance = budget - (self.q[0] if self.q and not decode_only else 0)  # decode tokens at most
        self.seqs = max(1, stream // (self.c[1] + cap + 1)) if self.c and stream else limits.max_num_seqs
        self.taken = 0  # slots whose index range lets them in so far (decodes, then chunks)

    def _admit(self, forced: bool) -> bool:
        """Whether the next slot may be in the batch (the one in the focus's ranges always)."""
        if forced or self.taken < self.seqs - (0 if self.decode_only or self.q is None and self.c is None else 1):
            self.taken += 1
            return True
        return False

    def decode(self, i: int):
        if self.q is None and self.c is None:
            return _decode_strategy(self.ctx_cap)
        forced = self.decode_only and i == 0
        top = 0 if not self._admit(forced) else min(self.allowance, 1 if self.decode_only else (self.q or (0, 8))[1])
        top = bisect.bisect_right(DECODE_TOKENS, max(0, top)) - 1
        low = DECODE_TOKENS.index(1) if forced else 0
        self.allowance -= DECODE_TOKENS[top]
        ctx = self.c if forced else (None if self.c is None else (0, self.c[1]))
        return _decode_strategy(self.ctx_cap, (low, max(low, top)), ctx)

    def chunk(self, i: int):
        if self.q is None and self.c is None or self.decode_only:
            return _chunk_strategy(self.ctx_cap, self.cap)
        forced = i == 0
        on = (1, 1) if forced else (0, 1 if self._admit(False) else 0)
        if forced:
            return _chunk_strategy(self.ctx_cap, self.cap, on, self.q, (0, 0), self.c)
        size = None if self.q is None else (0, self.q[1])
        return _chunk_strategy(self.ctx_cap, self.cap, on, size, (0, 2) if self.c is None else (0, 0),
                               None if self.c is None else (0, self.c[1]))


@functools.lru_cache(maxsize=64)
def _shapes(capabilities: Capabilities, max_num_heads: int) -> tuple:
    """The model shapes a serving batch of ``capabilities`` may take (:func:`model_shapes`, at most
    ``max_num_heads`` query heads), computed once per target and limit (it was per batch: ~0.2 ms of a serving
    draw on a 2-core CPU)."""
    return tuple(s for s in model_shapes(capabilities) if s.num_heads <= max_num_heads)


@st.composite
def serving_batches(draw, capabilities: Capabilities, limits: Limits, pin: KernelConfig | None = None,
                    focus: Focus | None = None) -> Batch:
    """A batch as a serving engine's scheduler composes it (module docstring), inside ``capabilities``:
    ``limits.max_num_seqs`` caps the sequences (:data:`DECODE_SLOTS` decodes and :data:`CHUNK_SLOTS` prefill
    chunks at most), ``limits.max_ctx_len`` the contexts, ``limits.max_query_len`` a chunk and the token budget
    (:data:`TOKEN_BUDGETS`). ``pin``: as :func:`kvfuzz.strategies.batches.batches` (a pinned field is kept; a
    model row whose heads, head size or window differ from the pin's is not used). ``focus``: aimed at a bin
    (:class:`~kvfuzz.strategies.focus.Focus`), drawn as the same choices: a focus on the head size or window draws
    no model row, one on lengths a budget that holds its query (:class:`_Aims` for the rest)."""
    dtype = draw(choice(capabilities.dtypes, *pinned_field(pin, "dtype")))
    pinned_heads = None if pin is None or not pin.pins("heads") else (pin.num_heads, pin.num_kv_heads)
    ratios = capabilities.gqa_ratios
    if pin is not None and pinned_heads is None and capabilities.fp8_gqa_ratios is not None:  # as batches()
        ratios = tuple(r for r in (ratios or GQA_RATIOS) if capabilities.fp8_accepts_gqa(pin.kv_cache_dtype, r))
    num_heads, num_kv_heads = draw(cached_strategy(gqa_heads, limits.max_num_heads, ratios=ratios, pin=pinned_heads))
    if capabilities.value_head_size is not None:
        num_heads, num_kv_heads = num_heads // num_kv_heads, 1
    head_size = draw(choice(sorted(capabilities.head_sizes), *head_size_of(pin, focus, capabilities)))
    # a real model's shape: drawn always (off-table first, so a failure shrinks off the table)
    off_table = focus is not None and (focus.head_size is not None or focus.window is not None)
    use_model = bool(draw(ints(0, 0))) if off_table else draw(sampled((False, True)))
    shapes = _shapes(capabilities, limits.max_num_heads)
    row = draw(st.integers(0, max(0, len(shapes) - 1)))
    shape = shapes[row] if use_model and shapes else None
    if shape is not None and pin is not None and (
            shape.head_size != pin.head_size
            or (pinned_heads and pinned_heads != (shape.num_heads, shape.num_kv_heads))
            or not capabilities.fp8_accepts_gqa(pin.kv_cache_dtype, shape.num_heads // shape.num_kv_heads)):
        shape = None  # the pinned configuration wins: a row it does not fit is not used
    if shape is not None:
        num_heads, num_kv_heads, head_size = shape.num_heads, shape.num_kv_heads, shape.head_size
    cache_dtypes = list(capabilities.kv_cache_dtypes_for(dtype, head_size, num_heads // num_kv_heads))
    assume(cache_dtypes)
    kv_cache_dtype = draw(choice(cache_dtypes, *pinned_field(pin, "kv_cache_dtype")))
    block_size = draw(choice(sorted(capabilities.block_sizes_for(kv_cache_dtype), reverse=True),
                             *pinned_field(pin, "block_size")))
    budgets = tuple(min(b, limits.max_query_len) for b in TOKEN_BUDGETS)
    held = index_range(budgets, None if focus is None or focus.query_len is None else
                       (focus.query_len[0], limits.max_query_len))
    budget = budgets[draw(ints(held[0], len(budgets) - 1))] if held else draw(sampled(budgets))
    max_seq_len = limits.max_ctx_len + limits.max_query_len
    aimed = None if focus is None else focus.window
    params = draw(cached_strategy(attention_params, capabilities, kv_cache_dtype, block_size, max_seq_len, pin=pin,
                                  value_ranges=limits.value_ranges, window=aimed))
    # at most the longest context: a chunk can run past it
    window = draw(_windows(max(1, limits.max_ctx_len), None if aimed == (0, 0) else aimed))
    pinned_window = pin is not None and pin.pins("window")
    if "sliding_window" in params and not pinned_window:
        if shape is not None and shape.sliding_window is not None and shape.sliding_window <= limits.max_ctx_len:
            window = shape.sliding_window  # the model's (unless no context could run past it)
        params["sliding_window"] = max(window, capabilities.min_sliding_window)
    if shape is not None and "softcap" in params and shape.softcap is not None:
        params["softcap"] = shape.softcap
    stream = MAX_STREAM_ELEMENTS // (num_kv_heads * head_size)  # counter_rng's cap, as batches()
    lens = _lengths(draw, limits, budget, params.get("sliding_window"), capabilities.decode_only, focus, stream)
    lens = lens[: limits.max_num_seqs]
    share = stream // len(lens)
    lens = [(q, min(c, max(0, share - q))) for q, c in lens]
    query_lens, ctx_lens = [q for q, _ in lens], [c for _, c in lens]
    sm_scale = draw(sampled((None, 1.0, 0.5)))
    if sm_scale is not None:
        sm_scale /= head_size**0.5
    seed = draw(SEEDS)
    needed = [-(-(q + c) // block_size) for q, c in lens]
    num_blocks, table, _ = draw(block_tables_per_call(tuple(needed), limits.max_spare_blocks))
    kw = draw_states(draw, capabilities, dict(query_lens=query_lens, ctx_lens=ctx_lens, block_size=block_size,
                                              num_blocks=num_blocks, block_table=table, **params), serving=True)
    if capabilities.metadata == "csr":
        kw["csr_tail"] = draw(csr_tails(kw["num_blocks"] * block_size))
    if capabilities.value_head_size is not None:
        kw["value_head_size"] = capabilities.value_head_size
        if "v_scale" in kw:
            kw["v_scale"] = kw["k_scale"]
    draw_states(draw, capabilities, kw, serving=True, last=True)
    return Batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                 kv_cache_dtype=kv_cache_dtype, seed=seed, sm_scale=sm_scale, **kw)


def serving_examples(capabilities: Capabilities, limits: Limits, poisons: tuple[Poison, ...] = tuple(Poison),
                     pin: KernelConfig | None = None, focus: Focus | None = None) -> st.SearchStrategy[Example]:
    """A serving batch (:func:`serving_batches`) plus the poison for the unwritten slots (NaN first), as
    :func:`kvfuzz.strategies.batches.examples`. Raises InvalidArgument for no poisons."""
    if not poisons:
        raise InvalidArgument("poisons must name at least one Poison")
    return st.builds(Example, serving_batches(capabilities, limits, pin=pin, focus=focus), st.sampled_from(poisons))


__all__ = ["CHUNK_SLOTS", "DECODE_SLOTS", "DECODE_TOKENS", "SPEC_TOKENS", "TILE_EDGES", "TOKEN_BUDGETS", "capture_size",
           "serving_batches", "serving_examples"]
