"""Each production state's draw (:data:`DRAWS`, one per state of
:data:`kvfuzz.contracts.model.states.PRODUCTION_STATES`, whose homes hold the states' models): how the batch
strategies (:func:`kvfuzz.strategies.batches.batches` and the serving tier's
:func:`kvfuzz.strategies.serving.serving_batches`) put a batch in a state its target declares. Both call
:func:`draw_states` right after the block table is drawn, and again (``last=True``) for the states of :data:`LAST`
once every other field is; a state's draw always makes its choices (whether the state ends up on or not), so a
lowered choice shifts no other (the rule of kvfuzz.strategies.batches).
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import strategies as st

from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.states import PRODUCTION_STATES

from .per_call import per_call


@st.composite
def shared_prefixes(draw, table: list[list[int]], ctx_lens: list[int], block_size: int) -> list[list[int]]:
    """``table`` with some sequences sharing leading full-context blocks with an earlier sequence, as a
    radix (prefix) cache hands a request the pages of a prefix it has seen: sequence ``j`` takes the first
    ``k`` blocks of sequence ``src < j`` (``k`` at most the full context blocks of both; its own blocks for
    those columns become unused). Shrinks to no sharing (``k = 0``), then to the previous sequence."""
    table = [list(r) for r in table]
    for j in range(1, len(table)):
        k = draw(st.integers(0, ctx_lens[j] // block_size))
        if k:  # from the nearest earlier sequence first (shrinks there), with enough full context blocks
            src = j - draw(st.integers(1, j))
            k = min(k, ctx_lens[src] // block_size)
            table[j][:k] = table[src][:k]
    return table


#: :func:`shared_prefixes` drawn per call (:mod:`kvfuzz.strategies.per_call`): its arguments are each batch's own
_shared_prefixes_per_call = per_call(shared_prefixes, [], [], 1)
#: A coin, built once (``st.sampled_from`` of a tuple is a new strategy per call, validated on its first draw)
_COIN = st.sampled_from((False, True))


#: The most CUDA-graph pad sequences a batch draws (``Batch.num_pad_seqs``): vLLM's capture sizes step by 8
#: past 8 (1, 2, 4, 8, 16, ...), so a real batch is at most 7 short of its size; a few find what more would.
MAX_PAD_SEQS = 3


def cuda_graph_pads() -> st.SearchStrategy[int]:
    """How many CUDA-graph pad sequences follow a decode batch (``Batch.num_pad_seqs``, the "CUDA-graph
    padding" state of :mod:`kvfuzz.contracts.model.padding`): 0 .. :data:`MAX_PAD_SEQS`, shrinking to 0."""
    return st.integers(0, MAX_PAD_SEQS)


def freed_window_table(table: list[list[int]], query_lens: list[int], ctx_lens: list[int], block_size: int,
                       num_blocks: int, window: int) -> tuple[int, list[list[int]]]:
    """``(num_blocks, table)`` in the state of a sliding-window KV manager that frees what no query sees
    (:attr:`~kvfuzz.contracts.model.batch.Batch.freed_window_blocks`): every used block id moved up by one so
    that no live position uses the null block (:data:`~kvfuzz.contracts.model.batch.NULL_BLOCK`, id 0, as vLLM's
    ``BlockPool`` reserves it), then the ``max(0, ctx_len - window + 1) // block_size`` leading columns of each
    sequence pointed at the null block (vLLM's ``SlidingWindowManager.remove_skipped_blocks``,
    vllm/v1/core/single_type_kv_cache_manager.py). Padding columns keep 0."""
    out = []
    for row, q, c in zip(table, query_lens, ctx_lens):
        need = -(-(q + c) // block_size)
        freed = max(0, c - window + 1) // block_size
        out.append([0 if k < freed else b + 1 if k < need else b for k, b in enumerate(row)])
    return num_blocks + 1, out


def capture_size(num_seqs: int) -> int:
    """The CUDA-graph capture size a pure-decode batch of ``num_seqs`` is padded to (vLLM's default sizes
    1, 2, 4, then multiples of 8)."""
    for s in (1, 2, 4):
        if num_seqs <= s:
            return s
    return -(-num_seqs // 8) * 8


#: A state's draw: ``(draw, capabilities, kw, serving) -> updates``. ``kw``: the Batch keyword arguments drawn so
#: far (at least query_lens, ctx_lens, block_size, num_blocks, block_table and the attention parameters, e.g.
#: sliding_window); ``serving``: drawn for the serving tier; returns the keyword arguments it sets or replaces.
StateDraw = Callable[[Callable, Capabilities, dict[str, Any], bool], dict[str, Any]]


def _draw_shared_prefix(draw, capabilities: Capabilities, kw: dict[str, Any], serving: bool) -> dict[str, Any]:
    """Some sequences share leading full context blocks (:func:`shared_prefixes`); the serving tier keeps its
    tables (its shapes are the engine's; sharing there is not modeled)."""
    if serving:
        return {}
    return {"block_table": draw(_shared_prefixes_per_call(kw["block_table"], kw["ctx_lens"], kw["block_size"]))}


def _draw_freed_window(draw, capabilities: Capabilities, kw: dict[str, Any], serving: bool) -> dict[str, Any]:
    """About half the windowed batches have their blocks before the window freed (:func:`freed_window_table`);
    drawn whether a window is on or not (no shifts while shrinking)."""
    free = draw(_COIN)
    if not free or kw.get("sliding_window") is None:
        return {}
    num_blocks, table = freed_window_table(kw["block_table"], kw["query_lens"], kw["ctx_lens"], kw["block_size"],
                                           kw["num_blocks"], kw["sliding_window"])
    return {"num_blocks": num_blocks, "block_table": table, "freed_window_blocks": True}


def _draw_padding(draw, capabilities: Capabilities, kw: dict[str, Any], serving: bool) -> dict[str, Any]:
    """A pure-decode batch (engines pad decode batches only, kvfuzz.contracts.model.padding) gets pad
    sequences: 0 .. :data:`MAX_PAD_SEQS` (shrinking to none), or in the serving tier, half the time, up to its
    CUDA-graph :func:`capture_size`."""
    decode = all(q == 1 for q in kw["query_lens"])
    n = len(kw["query_lens"])
    if serving:
        pad = draw(_COIN)
        return {"num_pad_seqs": capture_size(n) - n} if pad and decode else {}
    pads = draw(cuda_graph_pads())
    return {"num_pad_seqs": pads} if decode else {}


#: Every production state's draw, by the state's name (tests/test_states.py: one per registered state).
DRAWS: dict[str, StateDraw] = {
    "shared_prefix_blocks": _draw_shared_prefix,
    "freed_window_blocks": _draw_freed_window,
    "cuda_graph_padding": _draw_padding,
}


#: States drawn after every other field of the batch (:func:`draw_states` with ``last=True``): CUDA-graph pads,
#: whose choices come last so a case shrinks to no pads, then away from them.
LAST = frozenset({"cuda_graph_padding"})


def draw_states(draw, capabilities: Capabilities, kw: dict[str, Any], serving: bool = False,
                last: bool = False) -> dict[str, Any]:
    """``kw`` (Batch keyword arguments, see :data:`StateDraw`) with every state ``capabilities`` declares drawn
    into it, in :data:`~kvfuzz.contracts.model.states.PRODUCTION_STATES` order: those of :data:`LAST` with
    ``last``, the others without (right after the block table); returns ``kw``."""
    for name, state in PRODUCTION_STATES.items():
        if (name in LAST) == last and getattr(capabilities, name) != state.off:
            kw.update(DRAWS[name](draw, capabilities, kw, serving))
    return kw


__all__ = ["DRAWS", "LAST", "MAX_PAD_SEQS", "StateDraw", "capture_size", "cuda_graph_pads", "draw_states",
           "freed_window_table", "shared_prefixes"]
