"""Hypothesis strategies for mixed paged-attention batches.

Structure is drawn before contents: the number of sequences, each sequence's kind and lengths, heads, sizes
and the block-table arrangement come first, and the tensor data only as a seed (``Batch.seed``), so
shrinking works on structure and reaches small batches: one sequence, short lengths, few heads.
Every ``sampled_from`` lists its simplest choice first, since Hypothesis shrinks toward it.

So that lowering one choice does not shift the others (which makes the shrinker's step fail and the case stay
big), every choice is drawn whatever the earlier ones were: the kv heads independently of the GQA ratio, every
sequence's query and context lengths whatever its kind, every optional parameter (fp8 scales, each feature's
on/off, the window, the softcap) whether it is used or not; head size before kv_cache_dtype (so an fp8 cache
shrinks to "auto" with the head size kept); the block-table arrangement near the end, a permutation drawn as one
seed (a shuffle drew one choice per block, and serving-sized tables overran Hypothesis's choice buffer).
Lengths shrink to their smallest value, not only to block boundaries: the plain integer is the first branch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from kvfuzz.contracts.model.batch import FEATURES, VALUE_RANGES, Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.counter_rng import MAX_STREAM_ELEMENTS
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison

from .configs import GQA_RATIOS, NUM_KV_HEADS, KernelConfig, window_edges
from .focus import Focus, Range, index_range, intersect, ints
from .limits import Limits
from .per_call import per_call
from .states import (  # noqa: F401 (re-exported: the states' draws moved to their home, kvfuzz.strategies.states)
    MAX_PAD_SEQS,
    cuda_graph_pads,
    draw_states,
    freed_window_table,
    shared_prefixes,
)

#: Sequence kinds, simplest first.
KINDS = ("decode", "prefill", "prefill-no-ctx")
#: Block-table arrangements, simplest first. "high": the batch's blocks end at a high id (up to HIGH_IDS) with
#: unused ones below, as in a long-running server's cache (block ids past 2**k catch id truncation without a big
#: cache).
ARRANGEMENTS = ("contiguous", "reversed", "permuted", "fragmented", "high")
HIGH_IDS = 64
#: k_scale/v_scale of fp8 caches, 1.0 first. Each has at most 2 significant bits, so ``fp8 * scale`` is exact
#: in fp16 and bf16 (:func:`kvfuzz.contracts.model.data.make_batch_data` checks); 3/64 is the order of a calibrated
#: e4m3 scale for N(0, 1) data (amax / 448), 2.0 one above 1.
KV_SCALES = (1.0, 0.5, 0.375, 3 / 64, 2.0)
#: Softcap values: Gemma 2's 50 (mild on N(0, 1) logits) and 4 (bends most logits).
SOFTCAPS = (50.0, 4.0)


_FREE = object()


def choice(elements: Sequence, pin=_FREE) -> st.SearchStrategy:
    """``sampled_from(elements)``; with ``pin``, always that element, drawn as the *same choice* (its index,
    from ``integers(i, i)``), so an example drawn pinned replays unchanged in the free strategy: a failure found
    inside one kernel configuration is saved, replayed and shrunk across all of them
    (:mod:`kvfuzz.strategies.configs`). Raises InvalidArgument if ``pin`` is not an element."""
    return _choice(tuple(elements), pin)


@functools.lru_cache(maxsize=4096)
def _choice(elements: tuple, pin) -> st.SearchStrategy:
    """:func:`choice`, built once per ``(elements, pin)``: a strategy is validated the first time it is drawn
    from, which costs more than the draw (pinned campaigns drew a fresh mapped strategy per field per example)."""
    if pin is _FREE:
        return sampled(elements)
    if pin not in elements:
        raise InvalidArgument(f"pinned value {pin!r} is not one of {elements}")
    if len(elements) == 1:
        return st.just(pin)
    return _forced(elements.index(pin)).map(elements.__getitem__)


@functools.lru_cache(maxsize=1024)
def sampled(elements: tuple) -> st.SearchStrategy:
    return st.sampled_from(elements)


@functools.lru_cache(maxsize=1024)
def _forced(i: int) -> st.SearchStrategy[int]:
    return st.integers(i, i)


@functools.lru_cache(maxsize=1024)
def _edges(sizes: tuple[int, ...], min_value: int, max_value: int, shift: int) -> tuple[int, ...]:
    """:func:`boundary_lengths`' block boundaries, sorted."""
    edges = {0, 1, 2}
    for bs in sizes:
        for k in range(1, (max_value + shift) // bs + 2):
            edges |= {k * bs - 1 - shift, k * bs - shift, k * bs + 1 - shift}
    return tuple(sorted(e for e in edges if min_value <= e <= max_value))


@functools.lru_cache(maxsize=1024)
def boundary_lengths(block_size: int | tuple[int, ...], min_value: int, max_value: int,
                     shift: int = 0, within: Range | None = None) -> st.SearchStrategy[int]:
    """Integers in ``[min_value, max_value]`` biased toward block boundaries: 0, 1, and ``k*block_size``
    plus or minus one (for every block size given), where off-by-one bugs in masking and block arithmetic live.
    ``shift``: the boundaries are those of ``value + shift`` (a context length c whose sequence ends at c + 1).
    ``within``: only values in this inclusive range, drawn as the same choices in sub-ranges
    (:mod:`kvfuzz.strategies.focus`); ignored where it leaves nothing."""
    if min_value > max_value:
        raise InvalidArgument(f"min_value={min_value} > max_value={max_value}")
    sizes = (block_size,) if isinstance(block_size, int) else tuple(block_size)
    edges = _edges(sizes, min_value, max_value, shift)
    narrow = intersect(within, min_value, max_value)
    if narrow is not None:
        return _boundary_within(edges, narrow)
    # the plain integers first: the shrinker prefers the first branch, and reaches any minimum from there
    return st.one_of(st.integers(min_value, max_value), st.sampled_from(edges))


@st.composite
def _boundary_within(draw, edges: tuple[int, ...], within: Range) -> int:
    """:func:`boundary_lengths`' choices (one_of's branch index, then the branch's own) inside ``within``."""
    idx = index_range(edges, within)
    if not draw(ints(0, 1 if idx else 0)):
        return draw(ints(*within))
    return edges[draw(ints(*idx))] if len(edges) > 1 else edges[0]


@st.composite
def gqa_heads(draw, max_num_heads: int = 64, ratios: tuple[int, ...] | None = None,
              pin: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)``: a group size of :data:`GQA_RATIOS` (MHA first, GQA, groups past 16) times
    a kv head count of :data:`NUM_KV_HEADS` (one: MQA), halved until the heads fit ``max_num_heads``; ``ratios``:
    only these group sizes; ``pin``: always these heads (see :func:`choice`)."""
    ratios = [r for r in (GQA_RATIOS if ratios is None else ratios) if r <= max_num_heads]
    ratio = draw(choice(ratios, *(() if pin is None else (pin[0] // pin[1],))))
    # independent of the ratio: lowering one does not shift the other
    kv = draw(choice(NUM_KV_HEADS, *(() if pin is None else (pin[1],))))
    while kv > 1 and kv * ratio > max_num_heads:
        kv //= 2
    return kv * ratio, kv


@st.composite
def sequence_lengths(draw, block_sizes: int | tuple[int, ...], limits: Limits,
                     allowed: tuple[str, ...] = KINDS, aim: tuple | None = None) -> tuple[int, int]:
    """``(query_len, ctx_len)`` of one sequence: its kind (see :data:`KINDS`) and two lengths, always all three
    drawn, biased to the boundaries of ``block_sizes``. With ``c`` the second length: a decode sequence has
    ctx_len ``c`` (seq_len ``c + 1``); a prefill has query_len = the first length (>= 2) and ctx_len ``c + 1``
    ("prefill") or 0 ("prefill-no-ctx"). So a prefill turns into the decode of the same context by lowering its
    kind and raising ``c`` by one, a step Hypothesis's shrinker takes. ``aim``: ``(query range, ctx range)`` the
    sequence's lengths are drawn inside (:func:`_kinds_within`; the same choices, narrowed: a focused draw)."""
    kinds = _kinds_within(len(allowed), *aim) if aim is not None else None
    kind = allowed[draw(ints(*kinds))] if kinds is not None and len(allowed) > 1 else draw(sampled(tuple(allowed)))
    q_rng, c_rng = aim if aim is not None else (None, None)
    query_len = draw(boundary_lengths(block_sizes, 2, limits.max_query_len, within=None if kind == "decode" else q_rng))
    if kind == "prefill" and c_rng is not None:
        c_rng = (c_rng[0] - 1, c_rng[1] - 1)
    cached = draw(boundary_lengths(block_sizes, 0, limits.max_ctx_len, shift=1,
                                   within=None if kind == "prefill-no-ctx" else c_rng))
    if kind == "decode":
        return 1, cached
    if kind == "prefill-no-ctx" or not limits.max_ctx_len:
        return query_len, 0
    return query_len, min(cached + 1, limits.max_ctx_len)


def _kinds_within(n: int, q_rng: Range | None, c_rng: Range | None) -> Range:
    """The :data:`KINDS` indices (of ``n`` allowed) whose sequences can have a query_len in ``q_rng`` and a
    ctx_len in ``c_rng``: a decode has query_len 1, a prefill a context of at least 1, a prefill-no-ctx none."""
    if n == 1 or (q_rng is not None and q_rng[1] <= 1):
        return (0, 0)
    if c_rng is not None and c_rng[1] == 0:
        return (2, 2)  # no context: a prefill without one (a decode of no context is a query of 1)
    lo = 0 if q_rng is None or q_rng[0] <= 1 else 1
    return (lo, 1) if c_rng is not None and c_rng[0] >= 1 else (lo, 2)


@functools.lru_cache(maxsize=256)
def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


#: Seeds of a "permuted" block table's permutation (:func:`permutation`).
PERMUTATION_SEEDS = 2**32 - 1


def permutation(n: int, seed: int) -> list[int]:
    """A permutation of ``range(n)`` from ``seed``: the identity for 0 (where a shrunk seed lands), else numpy's
    PCG64 shuffle, fast for the serving tier's tens of thousands of blocks."""
    if not seed:
        return list(range(n))
    return np.random.Generator(np.random.PCG64(seed)).permutation(n).tolist()


@functools.lru_cache(maxsize=4096)
def cached_strategy(factory, *args, **kwargs) -> st.SearchStrategy:
    """``factory(*args, **kwargs)``, built once: a strategy is validated the first time it is drawn from, which
    costs more than the draw (hashable arguments only)."""
    return factory(*args, **kwargs)


@st.composite
def block_tables(draw, blocks_needed: list[int], max_spare_blocks: int = 6):
    """``(num_blocks, block_table, arrangement)`` giving each sequence its own blocks: contiguous, reversed,
    permuted, fragmented (sequences interleaved) or high (contiguous above :data:`HIGH_IDS` unused blocks),
    with spare blocks and spare table columns."""
    arrangement = draw(sampled(ARRANGEMENTS))
    spare = draw(_ints(0, max_spare_blocks))
    extra_cols = draw(_ints(0, 2))
    high = draw(_ints(1, HIGH_IDS))  # always drawn; shrinks to the lowest top id that still shows a bug
    # a permutation as one seed, always drawn (0: the identity): a shuffle of num_blocks choices overran
    # Hypothesis's choice buffer on ~4-8% of serving batches, which were silently discarded (issue 52)
    shuffle = draw(_ints(0, PERMUTATION_SEEDS))
    total = sum(blocks_needed)
    num_blocks = total + spare
    if arrangement == "contiguous":
        ids = list(range(total))
    elif arrangement == "reversed":
        ids = list(range(num_blocks - 1, num_blocks - 1 - total, -1))
    elif arrangement == "high":  # the last block at id ``high`` (or as low as fits): deleting a sequence keeps it
        top = max(high, total - 1)
        num_blocks = top + 1 + spare
        ids = list(range(top - total + 1, top + 1))
    elif arrangement == "permuted":
        ids = permutation(num_blocks, shuffle)[:total]
    else:  # fragmented: round-robin over sequences, with spare blocks scattered in between
        order = [(j, i) for i, n in enumerate(blocks_needed) for j in range(n)]
        order.sort()
        stride = 1 + (spare > 0)
        slots = list(range(0, num_blocks, stride))[: total]
        taken = set(slots)  # once: rebuilt per block it was quadratic (1.6 s a batch of 4,000 blocks)
        slots += [b for b in range(num_blocks) if b not in taken][: total - len(slots)]
        assigned = {key: slots[k] for k, key in enumerate(order)}
        ids = [assigned[(j, i)] for i, n in enumerate(blocks_needed) for j in range(n)]
    width = max(1, max(blocks_needed)) + extra_cols
    table, k = [], 0
    for n in blocks_needed:
        table.append(list(ids[k : k + n]) + [0] * (width - n))  # vLLM pads unused columns with 0
        k += n
    return num_blocks, table, arrangement


#: :func:`block_tables` drawn per call (:mod:`kvfuzz.strategies.per_call`): its ``blocks_needed`` are each batch's own,
#: so a strategy cached per arguments (cached_strategy) missed on most serving batches and built a new one
block_tables_per_call = per_call(block_tables, [])


@st.composite
def _sequence(draw, block_sizes: tuple[int, ...], limits: Limits, allowed: tuple[str, ...], aim: tuple | None,
              on: bool | None):
    """One sequence slot of a batch: whether it is in the batch (``on``: always, a focused draw's sequence in the
    bin), and its ``(query_len, ctx_len)``."""
    flag = draw(sampled((False, True))) if on is None else bool(draw(ints(1, 1)))
    return flag, draw(cached_strategy(sequence_lengths, block_sizes, limits, allowed, aim))


@functools.lru_cache(maxsize=256)
def _sequence_slot(block_sizes: tuple[int, ...], limits: Limits, allowed: tuple[str, ...], aim: tuple | None = None,
                   on: bool | None = None):
    return _sequence(block_sizes, limits, allowed, aim, on)


def _slots(block_sizes: tuple[int, ...], limits: Limits, allowed: tuple[str, ...], focus: Focus | None) -> list:
    """The ``limits.max_num_seqs`` sequence slots of a batch: all free, or for a ``focus`` on lengths the first one
    in the batch and inside its ranges, every other at most their upper ends (so the batch's longest context and
    query fall in the focus's ranges)."""
    if focus is None or not focus.lengths:
        return [_sequence_slot(block_sizes, limits, allowed)] * limits.max_num_seqs
    q, c = focus.query_len, focus.ctx_len
    below = (None if q is None else (1, q[1]), None if c is None else (0, c[1]))
    return [_sequence_slot(block_sizes, limits, allowed, (q, c), True)] + \
        [_sequence_slot(block_sizes, limits, allowed, below)] * (limits.max_num_seqs - 1)


def pinned_field(pin: KernelConfig | None, field: str):
    """``(value,)`` of a pinned configuration's field, ``()`` when free (no pin, or a field the configuration
    leaves free): ``choice(xs, *pinned_field(pin, f))``."""
    return () if pin is None or not pin.pins(field) else (getattr(pin, field),)


def head_size_of(pin: KernelConfig | None, focus: Focus | None, capabilities: Capabilities):
    """``(head_size,)`` a draw keeps (the pin's, else a declared one the focus names), ``()`` when free."""
    pinned = pinned_field(pin, "head_size")
    if pinned or focus is None or focus.head_size not in capabilities.head_sizes:
        return pinned
    return (focus.head_size,)


@st.composite
def batches(draw, capabilities: Capabilities, limits: Limits = Limits(), pin: KernelConfig | None = None,
            focus: Focus | None = None) -> Batch:
    """A mixed batch inside ``capabilities``: decode sequences, prefills with and without context. ``pin``: a
    :class:`~kvfuzz.strategies.configs.KernelConfig` inside ``capabilities`` every batch keeps (dtype, heads,
    head size, kv_cache_dtype, block size, which features are on, the window; not those the configuration
    leaves free), drawn as the same choices the free strategy makes, so a pinned example replays and shrinks in
    the free one (:func:`choice`). ``focus``: a :class:`~kvfuzz.strategies.focus.Focus` the batch aims at (its
    longest context and query, head size, window), drawn the same way (the pin wins where they differ)."""
    dtype = draw(choice(capabilities.dtypes, *pinned_field(pin, "dtype")))
    # heads right before the head size: the shrinker can trade fewer heads for a larger head size (it lowers
    # one choice and raises one up to four choices later), the order a developer reads a case in
    heads = None if pin is None or not pin.pins("heads") else (pin.num_heads, pin.num_kv_heads)
    ratios = capabilities.gqa_ratios
    if pin is not None and heads is None and capabilities.fp8_gqa_ratios is not None:  # the pinned cache's groups
        ratios = tuple(r for r in (ratios or GQA_RATIOS) if capabilities.fp8_accepts_gqa(pin.kv_cache_dtype, r))
    num_heads, num_kv_heads = draw(cached_strategy(gqa_heads, limits.max_num_heads, ratios=ratios, pin=heads))
    if capabilities.value_head_size is not None:  # a latent cache: MQA, one kv head for the group drawn
        num_heads, num_kv_heads = num_heads // num_kv_heads, 1
    head_size = draw(choice(sorted(capabilities.head_sizes), *head_size_of(pin, focus, capabilities)))
    cache_dtypes = list(capabilities.kv_cache_dtypes_for(dtype, head_size, num_heads // num_kv_heads))
    assume(cache_dtypes)  # a target declaring only fp8 caches, none with this head size or GQA group
    kv_cache_dtype = draw(choice(cache_dtypes, *pinned_field(pin, "kv_cache_dtype")))
    allowed = ("decode",) if capabilities.decode_only else KINDS
    # max_num_seqs sequences, each drawn whole (kind and lengths adjacent) with a flag saying whether it is in
    # the batch: the shrinker removes any sequence by lowering its flag, with nothing after it shifting (a count
    # and a loop let it delete only the last one drawn, and sorting puts the simplest first)
    drawn = [draw(slot) for slot in _slots(tuple(capabilities.block_sizes), limits, allowed, focus)]
    lens = [sizes for on, sizes in drawn if on] or [drawn[-1][1]]
    # the data generator draws at most MAX_STREAM_ELEMENTS keys (contracts/model/counter_rng.py): each sequence's
    # context is cut to its share of that (only the long tier's 128k contexts with many heads come near it)
    share = MAX_STREAM_ELEMENTS // (num_kv_heads * head_size) // len(lens)
    lens = [(q, min(c, max(0, share - q))) for q, c in lens]
    # after the lengths, largest first: a case shrinks to its fewest tokens, then to the fewest blocks that
    # still show the bug with them
    block_size = draw(choice(sorted(capabilities.block_sizes_for(kv_cache_dtype), reverse=True),
                             *pinned_field(pin, "block_size")))
    query_lens = [q for q, _ in lens]
    ctx_lens = [c for _, c in lens]
    # None (the kernel's default), the default passed explicitly, or half of it: catches a kernel that
    # ignores the argument or derives its default from the wrong dimension (docs/contracts.md §5, bug 13)
    sm_scale = draw(sampled((None, 1.0, 0.5)))
    if sm_scale is not None:
        sm_scale /= head_size**0.5
    params = draw(cached_strategy(attention_params, capabilities, kv_cache_dtype, block_size,
                                  limits.max_ctx_len + limits.max_query_len, pin=pin,
                                  value_ranges=limits.value_ranges, window=None if focus is None else focus.window))
    seed = draw(SEEDS)
    # the block tables after the lengths and parameters: what they hold depends on every length
    needed = [-(-(q + c) // block_size) for q, c in lens]
    num_blocks, table, _ = draw(block_tables_per_call(tuple(needed), limits.max_spare_blocks))
    # the production states the target declares (kvfuzz.strategies.states): shared prefix blocks, freed window
    # blocks here; CUDA-graph pad sequences last (states.LAST: shrinks to no pads, then away)
    kw = draw_states(draw, capabilities, dict(query_lens=query_lens, ctx_lens=ctx_lens, block_size=block_size,
                                              num_blocks=num_blocks, block_table=table, **params))
    if capabilities.metadata == "csr":
        kw["csr_tail"] = draw(csr_tails(kw["num_blocks"] * block_size))
    if capabilities.value_head_size is not None:
        kw["value_head_size"] = capabilities.value_head_size
        if "v_scale" in kw:  # one latent row, one scale
            kw["v_scale"] = kw["k_scale"]
    draw_states(draw, capabilities, kw, last=True)
    return Batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                 kv_cache_dtype=kv_cache_dtype, seed=seed, sm_scale=sm_scale, **kw)


SEEDS = st.integers(0, 2**31 - 1)


def csr_tails(num_slots: int) -> st.SearchStrategy[list[int]]:
    """Entries past ``kv_indptr[-1]`` of a CSR ``kv_indices`` (``Batch.csr_tail``): ids no kernel may read,
    out of the pool (-1, ``num_slots``) or any slot (written or poisoned); shrinks to none."""
    return st.lists(st.one_of(st.sampled_from((-1, num_slots)), st.integers(0, num_slots - 1)), max_size=3)


@st.composite
def attention_params(draw, capabilities: Capabilities, kv_cache_dtype: str, block_size: int,
                     max_seq_len: int, pin: KernelConfig | None = None,
                     value_ranges: tuple[str, ...] = VALUE_RANGES, window: Range | None = None) -> dict:
    """The optional parameters of a call, as :class:`Batch` keyword arguments, each off by default (Hypothesis
    shrinks to the plain call): fp8 ``k_scale``/``v_scale`` (:data:`KV_SCALES`), and ``q_scale`` for a target
    that takes an fp8 query (``Capabilities.quant_query``), the features the target
    declares (``sliding_window`` biased to 1, 2 and ``block_size - 1 .. + 1``; ``alibi``; ``sinks``;
    ``softcap`` from :data:`SOFTCAPS`), skipping a feature declared exclusive with one already drawn, and the
    ``value_range`` (one of ``value_ranges``, :data:`~kvfuzz.contracts.model.batch.VALUE_RANGES` by default). ``pin``:
    which features are on and the window are those of this configuration (see :func:`batches`). ``window``: a
    focused draw's window range (:class:`~kvfuzz.strategies.focus.Focus`; (0, 0): no window), where ``pin``
    leaves it free."""
    # every value is drawn whether it is used or not (module docstring: no shifts while shrinking)
    k_scale, v_scale = draw(sampled(KV_SCALES)), draw(sampled(KV_SCALES))
    q_scale = draw(sampled(KV_SCALES)) if capabilities.quant_query else 1.0  # a checkpoint's query scale
    aimed = _aimed_features(capabilities, window) if pin is None and window is not None else {}
    wanted = [f for f in FEATURES
              if draw(choice((False, True), *((f in pin.features,) if pin is not None else
                                              ((aimed[f],) if f in aimed else ()))))]
    edges = window_edges(block_size, max_seq_len)
    # the window: a plain integer (first: it shrinks to any minimum) or a block edge
    pinned_window = pin is not None and pin.sliding_window is not None and pin.pins("window")
    narrow = None if pinned_window or window is None else intersect(window, 1, max(1, max_seq_len))
    edge_idx = index_range(edges, narrow)
    if narrow is not None:
        branch = draw(ints(0, 1 if edge_idx else 0))
    else:
        branch = draw(choice((0, 1), *((0,) if pinned_window else ())))
    if branch == 0:
        window = draw(_forced(pin.sliding_window) if pinned_window else
                      ints(*narrow) if narrow is not None else _windows(max(1, max_seq_len)))
    else:
        window = edges[draw(ints(*edge_idx))] if narrow is not None and len(edges) > 1 else draw(sampled(edges))
    softcap = draw(sampled(SOFTCAPS))
    value_range = draw(sampled(tuple(value_ranges)))
    chosen: list[str] = []
    for feature in wanted:  # declared features, skipping one declared exclusive with a feature already on
        if capabilities.combinable([*chosen, feature]):
            chosen.append(feature)
    out: dict = {"value_range": value_range, "alibi": "alibi" in chosen, "sinks": "sinks" in chosen}
    if kv_cache_dtype != "auto":
        out["k_scale"], out["v_scale"] = k_scale, v_scale
        if capabilities.quant_query:
            out["q_scale"] = q_scale
    if "sliding_window" in chosen:
        out["sliding_window"] = max(window, capabilities.min_sliding_window)
    if "softcap" in chosen:
        out["softcap"] = softcap
    return out


def _aimed_features(capabilities: Capabilities, window: Range) -> dict[str, bool]:
    """The feature flags a focus on ``window`` sets: the sliding window on (off for (0, 0)), and, with it on, every
    declared feature exclusive with it off."""
    if "sliding_window" not in capabilities.features:
        return {}
    if window == (0, 0):
        return {"sliding_window": False}
    return {"sliding_window": True, **{f: False for f in FEATURES
                                       if f != "sliding_window" and not capabilities.combinable(["sliding_window", f])}}


@functools.lru_cache(maxsize=256)
def _windows(max_window: int) -> st.SearchStrategy[int]:
    return st.integers(1, max_window)


#: Head and block sizes real deployments use, declared or not: where undeclared configurations are drawn.
UNIVERSE_HEAD_SIZES = (16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256)
UNIVERSE_BLOCK_SIZES = (1, 8, 16, 32, 48, 64, 128)


def undeclared_examples(capabilities: Capabilities, dtypes: tuple[str, ...], limits: Limits = Limits(),
                        poisons: tuple[Poison, ...] = tuple(Poison)) -> st.SearchStrategy[Example]:
    """Examples *outside* ``capabilities``: head size, block size or dtype (from ``dtypes``, those the
    environment computes faithfully) the target does not declare, a combination of its features it
    declares exclusive (e.g. ALiBi with a sliding window), or an fp8 cache with a GQA group size it declares
    for the model dtype only. A kernel must reject them with an error or compute
    them right (kvfuzz's taxonomy: "configuration rejected" vs "silently accepted but unsupported")."""
    if not dtypes:
        raise InvalidArgument("dtypes must name at least one dtype the environment computes faithfully")
    dv = capabilities.value_head_size or 0  # a latent target: only head sizes its latent row can have
    universe = attrs.evolve(capabilities, dtypes=dtypes, exclusive=(), fp8_gqa_ratios=None, gqa_ratios=None,
                            head_sizes=tuple(sorted(h for h in set(UNIVERSE_HEAD_SIZES) | set(capabilities.head_sizes)
                                                    if h > dv)),
                            block_sizes=tuple(sorted(set(UNIVERSE_BLOCK_SIZES) | set(capabilities.block_sizes))))
    return examples(universe, limits, poisons).filter(lambda e: not capabilities.accepts(e.batch))


#: Element offset a big-cache example's blocks start past (int32 overflow territory).
INT32_OFFSETS = 2**31


def relocate_high(batch: Batch, min_element_offset: int = INT32_OFFSETS) -> Batch:
    """``batch`` with every used block moved up by the same number of ids, so that the first element of its
    lowest block sits at or past ``min_element_offset`` elements into the cache (one block holds
    ``block_size * num_kv_heads * head_size`` elements in every vLLM layout), and ``num_blocks`` grown to
    match. Unused table columns keep pointing at block 0."""
    per_block = batch.block_size * batch.num_kv_heads * batch.head_size
    shift = -(-min_element_offset // per_block)
    table = [[b + shift if batch.freed_blocks(i) <= c < batch.blocks_needed(i) else b for c, b in enumerate(row)]
             for i, row in enumerate(batch.block_table)]
    return attrs.evolve(batch, block_table=table, num_blocks=batch.num_blocks + shift)


def big_cache_examples(capabilities: Capabilities, limits: Limits = Limits(),
                       poisons: tuple[Poison, ...] = tuple(Poison),
                       min_element_offset: int = INT32_OFFSETS, pin: KernelConfig | None = None
                       ) -> st.SearchStrategy[Example]:
    """:func:`examples` whose blocks sit past ``min_element_offset`` elements of a cache (default 2**31: a
    kernel computing ``block_id * block_stride`` in int32 overflows). The cache is several GiB (at fp16, at
    least 4 GiB per cache); kvfuzz allocates it without initialising it and poisons only the blocks the
    batch references (:data:`kvfuzz.contracts.caches.materialize.FULL_POISON_MAX_BYTES`). Meant for GPUs, or CPUs
    with the memory: untouched pages of ``torch.empty`` cost no RAM, a kernel that copies the whole cache
    does."""
    return examples(capabilities, limits, poisons, pin=pin).map(
        lambda e: attrs.evolve(e, batch=relocate_high(e.batch, min_element_offset)))


def examples(capabilities: Capabilities, limits: Limits = Limits(),
             poisons: tuple[Poison, ...] = tuple(Poison), pin: KernelConfig | None = None,
             focus: Focus | None = None) -> st.SearchStrategy[Example]:
    """A batch plus the poison for the slots the contract leaves unwritten (NaN first: it shrinks there).
    ``pin``: every batch inside this kernel configuration; ``focus``: aimed at this bin (:func:`batches`)."""
    if not poisons:
        raise InvalidArgument("poisons must name at least one Poison")
    return st.builds(Example, batches(capabilities, limits, pin=pin, focus=focus), st.sampled_from(poisons))


__all__ = ["ARRANGEMENTS", "HIGH_IDS", "INT32_OFFSETS", "KINDS", "KV_SCALES", "SEEDS", "SOFTCAPS",
           "UNIVERSE_BLOCK_SIZES", "UNIVERSE_HEAD_SIZES", "attention_params", "batches", "big_cache_examples",
           "block_tables", "block_tables_per_call", "boundary_lengths", "cached_strategy", "choice", "csr_tails",
           "cuda_graph_pads", "examples", "freed_window_table", "gqa_heads", "head_size_of", "permutation",
           "pinned_field", "relocate_high", "sampled", "sequence_lengths", "shared_prefixes", "undeclared_examples"]
