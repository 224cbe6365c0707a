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
first: the off-table heads before a model row, each decode and chunk slot with a flag the shrinker lowers to drop
it, contexts log-uniform as ``(exponent, mantissa)`` shrinking to 0, and a chunk's context source (plain, an
earlier chunk boundary, around the window) with the plain length first. A serving failure shrinks to one
sequence with small lengths.
"""

from __future__ import annotations

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
    block_tables,
    cached_strategy,
    choice,
    csr_tails,
    gqa_heads,
    pinned_field,
    sampled,
)
from .configs import GQA_RATIOS, KernelConfig
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


@functools.lru_cache(maxsize=64)
def _log_len(max_value: int) -> st.SearchStrategy[int]:
    """Integers in ``[0, max_value]``, log-uniform: an exponent ``e`` and a mantissa, ``[2**(e-1), 2**e)``;
    both shrink to 0 (e = 0 is the length 0)."""
    bits = max(1, max_value.bit_length())

    def build(em):
        e, m = em
        lo = (1 << e) >> 1
        return min(max_value, lo + (m % lo if lo else 0))

    return st.tuples(st.integers(0, bits), st.integers(0, (1 << bits) - 1)).map(build)


@st.composite
def _decode_slot(draw, max_ctx_len: int):
    """One running request: whether it is in the batch, speculative or not, ``k``, and its context."""
    return draw(sampled((False, True))), draw(sampled((False, True))), draw(sampled(SPEC_TOKENS)), \
        draw(_log_len(max_ctx_len))


@st.composite
def _chunk_slot(draw, max_ctx_len: int, budget_cap: int):
    """One prefill chunk: whether it is in the batch, its length, its context's source (0 plain, 1 a multiple of
    an earlier chunk's length, 2 around the window), the plain context, the multiple, and the offset from the
    window."""
    return (draw(sampled((False, True))), draw(_log_len(budget_cap)), draw(sampled((0, 1, 2))),
            draw(_log_len(max_ctx_len)), draw(st.integers(1, 64)), draw(st.integers(-budget_cap, budget_cap)))


@functools.lru_cache(maxsize=64)
def _decode_strategy(max_ctx_len: int):
    return _decode_slot(max_ctx_len)


@functools.lru_cache(maxsize=64)
def _chunk_strategy(max_ctx_len: int, budget_cap: int):
    return _chunk_slot(max_ctx_len, budget_cap)


@functools.lru_cache(maxsize=64)
def _windows(max_window: int) -> st.SearchStrategy[int]:
    """A window: a plain integer first (it shrinks to any minimum), one of the models' (:data:`MODEL_WINDOWS`),
    a tile edge ``k * t + d`` of at least 128 keys (t in :data:`TILE_EDGES`, d in -1, 0, 1: the small tier draws
    the short ones), or log-uniform."""
    edges = sorted({k * t + d for t in TILE_EDGES for k in (*range(1, 17), 32, 64, 128, 256) for d in (-1, 0, 1)
                    if k * t >= 128 and k * t + d <= max_window}) or [max_window]
    models = [w for w in MODEL_WINDOWS if w <= max_window] or [max_window]
    return st.one_of(st.integers(1, max_window), st.sampled_from(models), st.sampled_from(edges),
                     _log_len(max_window).map(lambda w: max(1, w)))


def _lengths(draw, limits: Limits, budget: int, window: int | None, decode_only: bool) -> list[tuple[int, int]]:
    """``[(query_len, ctx_len)]``: decodes first, then prefill chunks filling what the decodes left of
    ``budget`` (every slot drawn whatever the others are)."""
    ctx_cap = limits.max_ctx_len
    cap = max(2, min(budget, limits.max_query_len))
    decodes = [draw(_decode_strategy(ctx_cap)) for _ in range(min(DECODE_SLOTS, limits.max_num_seqs))]
    chunks = [draw(_chunk_strategy(ctx_cap, cap)) for _ in range(CHUNK_SLOTS)]
    out, used = [], 0
    for on, spec, k, ctx in decodes:
        q = k + 1 if spec and not decode_only else 1
        if on and used + q <= budget:
            out.append((q, ctx))
            used += q
    if decode_only:
        return out or [(1, decodes[0][3])]
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


@st.composite
def serving_batches(draw, capabilities: Capabilities, limits: Limits, pin: KernelConfig | None = None) -> Batch:
    """A batch as a serving engine's scheduler composes it (module docstring), inside ``capabilities``:
    ``limits.max_num_seqs`` caps the sequences (:data:`DECODE_SLOTS` decodes and :data:`CHUNK_SLOTS` prefill
    chunks at most), ``limits.max_ctx_len`` the contexts, ``limits.max_query_len`` a chunk and the token budget
    (:data:`TOKEN_BUDGETS`). ``pin``: as :func:`kvfuzz.strategies.batches.batches` (a pinned field is kept; a
    model row whose heads, head size or window differ from the pin's is not used)."""
    dtype = draw(choice(capabilities.dtypes, *pinned_field(pin, "dtype")))
    pinned_heads = None if pin is None or not pin.pins("heads") else (pin.num_heads, pin.num_kv_heads)
    ratios = capabilities.gqa_ratios
    if pin is not None and pinned_heads is None and capabilities.fp8_gqa_ratios is not None:  # as batches()
        ratios = tuple(r for r in (ratios or GQA_RATIOS) if capabilities.fp8_accepts_gqa(pin.kv_cache_dtype, r))
    num_heads, num_kv_heads = draw(cached_strategy(gqa_heads, limits.max_num_heads, ratios=ratios, pin=pinned_heads))
    if capabilities.value_head_size is not None:
        num_heads, num_kv_heads = num_heads // num_kv_heads, 1
    head_size = draw(choice(sorted(capabilities.head_sizes), *pinned_field(pin, "head_size")))
    # a real model's shape: drawn always (off-table first, so a failure shrinks off the table)
    use_model = draw(sampled((False, True)))
    shapes = tuple(s for s in model_shapes(capabilities) if s.num_heads <= limits.max_num_heads)
    row = draw(st.integers(0, max(0, len(shapes) - 1)))
    shape = shapes[row] if use_model and shapes else None
    if shape is not None and pin is not None and (
            shape.head_size != pin.head_size
            or (pinned_heads and pinned_heads != (shape.num_heads, shape.num_kv_heads))
            or not capabilities.fp8_accepts_gqa(pin.kv_cache_dtype, shape.num_heads // shape.num_kv_heads)):
        shape = None  # the pinned configuration wins: a row it does not fit is not used
    if shape is not None:
        num_heads, num_kv_heads, head_size = shape.num_heads, shape.num_kv_heads, shape.head_size
    cache_dtypes = [k for k in capabilities.kv_cache_dtypes
                    if head_size in capabilities.head_sizes_for(k)
                    and capabilities.fp8_accepts_gqa(k, num_heads // num_kv_heads)]
    assume(cache_dtypes)
    kv_cache_dtype = draw(choice(cache_dtypes, *pinned_field(pin, "kv_cache_dtype")))
    block_size = draw(choice(sorted(capabilities.block_sizes, reverse=True), *pinned_field(pin, "block_size")))
    budget = draw(sampled(tuple(min(b, limits.max_query_len) for b in TOKEN_BUDGETS)))
    max_seq_len = limits.max_ctx_len + limits.max_query_len
    params = draw(cached_strategy(attention_params, capabilities, kv_cache_dtype, block_size, max_seq_len, pin=pin,
                          value_ranges=limits.value_ranges))
    window = draw(_windows(max(1, limits.max_ctx_len)))  # at most the longest context: a chunk can run past it
    pinned_window = pin is not None and pin.pins("window")
    if "sliding_window" in params and not pinned_window:
        if shape is not None and shape.sliding_window is not None and shape.sliding_window <= limits.max_ctx_len:
            window = shape.sliding_window  # the model's (unless no context could run past it)
        params["sliding_window"] = max(window, capabilities.min_sliding_window)
    if shape is not None and "softcap" in params and shape.softcap is not None:
        params["softcap"] = shape.softcap
    lens = _lengths(draw, limits, budget, params.get("sliding_window"), capabilities.decode_only)
    lens = lens[: limits.max_num_seqs]
    share = MAX_STREAM_ELEMENTS // (num_kv_heads * head_size) // len(lens)  # counter_rng's cap, as batches()
    lens = [(q, min(c, max(0, share - q))) for q, c in lens]
    query_lens, ctx_lens = [q for q, _ in lens], [c for _, c in lens]
    sm_scale = draw(sampled((None, 1.0, 0.5)))
    if sm_scale is not None:
        sm_scale /= head_size**0.5
    seed = draw(SEEDS)
    needed = [-(-(q + c) // block_size) for q, c in lens]
    num_blocks, table, _ = draw(cached_strategy(block_tables, tuple(needed), limits.max_spare_blocks))
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
                     pin: KernelConfig | None = None) -> st.SearchStrategy[Example]:
    """A serving batch (:func:`serving_batches`) plus the poison for the unwritten slots (NaN first), as
    :func:`kvfuzz.strategies.batches.examples`. Raises InvalidArgument for no poisons."""
    if not poisons:
        raise InvalidArgument("poisons must name at least one Poison")
    return st.builds(Example, serving_batches(capabilities, limits, pin=pin), st.sampled_from(poisons))


__all__ = ["CHUNK_SLOTS", "DECODE_SLOTS", "SPEC_TOKENS", "TILE_EDGES", "TOKEN_BUDGETS", "capture_size",
           "serving_batches", "serving_examples"]
