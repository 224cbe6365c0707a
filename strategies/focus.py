"""Focused draws (issue 52): a chunk of a steered campaign aims its batches at a coverage bin
(:mod:`kvfuzz.fuzz.campaign.steering` chooses which), and what it finds still shrinks and replays in the free
strategy.

A :class:`Focus` names ranges: the batch's longest context (``ctx_len``) and longest query (``query_len``), a head
size, and a sliding-window range (the feature on). The strategies (:func:`kvfuzz.strategies.batches.batches`,
:func:`kvfuzz.strategies.serving.serving_batches`) take one and draw *the same choices* the free strategy draws,
each only narrowed to a sub-range of the free one (an index range of a ``sampled_from``, a narrower
``integers``), never a choice of another type or a choice the free strategy does not make. So a focused example's
choice sequence replays unchanged in the free strategy (as a pinned configuration's does,
:func:`kvfuzz.strategies.batches.choice`): Hypothesis's shrinker and the example database work on it there, free
to leave the bin.

Bins are the coverage labels' (kvfuzz.fuzz.harness.coverage ``SHAPE_DIMENSIONS``): log2 bins of lengths
(:func:`log2_bin`: "0", "2^k" for ``2**k <= n < 2**(k+1)``) and plain head sizes. No torch at import.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from kvfuzz.contracts.model.capabilities import Capabilities

from .configs import KernelConfig

Range = tuple[int, int]


def log2_bin(n: int) -> str:
    """The log2 bin of a length: "0" for 0, else "2^k" with ``2**k <= n < 2**(k+1)``."""
    return "0" if n <= 0 else f"2^{int(n).bit_length() - 1}"


def bin_range(label: str) -> Range | None:
    """The lengths of a bin label, inclusive: "0" -> (0, 0), "2^k" -> (2**k, 2**(k+1) - 1), a plain integer
    "128" -> (128, 128); None for "none" (no window). Raises ValueError for another label."""
    if label == "none":
        return None
    if label.startswith("2^"):
        k = int(label[2:])
        return (1 << k, (1 << (k + 1)) - 1)
    n = int(label)
    return (n, n)


def intersect(a: Range | None, lo: int, hi: int) -> Range | None:
    """``a`` cut to ``[lo, hi]``; None when ``a`` is None or nothing is left."""
    if a is None or max(a[0], lo) > min(a[1], hi):
        return None
    return (max(a[0], lo), min(a[1], hi))


@attrs.frozen
class Focus:
    """Where a focused chunk's batches aim (module docstring). ``ctx_len``, ``query_len``: inclusive ranges of the
    batch's longest context and query (one sequence is drawn inside them, every other at most their upper end).
    ``head_size``: one declared head size. ``window``: an inclusive range of sliding windows, the feature on;
    (0, 0): the feature off. None: free. Unreachable parts (a range a tier cannot draw, a head size a pinned
    configuration overrides) are dropped by the strategies, which then draw those fields freely."""

    ctx_len: Range | None = None
    query_len: Range | None = None
    head_size: int | None = None
    window: Range | None = None

    @classmethod
    def of_bins(cls, shape: str | None = None, heads: str | None = None) -> "Focus":
        """The focus of a (ctx_len x query_len) bin label ``shape`` ("2^9 x 2^6") and a (head_size x window) bin
        label ``heads`` ("192 x 2^8"; "192 x none": no window)."""
        ctx = query = head = window = None
        if shape is not None:
            c, q = shape.split(" x ")
            ctx, query = bin_range(c), bin_range(q)
        if heads is not None:
            h, w = heads.split(" x ")
            head, window = int(h), bin_range(w) or (0, 0)
        return cls(ctx, query, head, window)

    @property
    def lengths(self) -> bool:
        return self.ctx_len is not None or self.query_len is not None

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Focus":
        """The inverse of :meth:`to_dict`. Raises TypeError/ValueError for a malformed dict."""
        def rng(v):
            return None if v is None else (int(v[0]), int(v[1]))
        return cls(rng(d.get("ctx_len")), rng(d.get("query_len")),
                   None if d.get("head_size") is None else int(d["head_size"]), rng(d.get("window")))

    def summary(self) -> str:
        """One line: ``ctx 512-1023, query 64-127, head_size 192, window 256-511`` ("free" for nothing)."""
        parts = [f"{name} {r[0]}-{r[1]}" for name, r in (("ctx", self.ctx_len), ("query", self.query_len),
                                                         ("window", self.window)) if r is not None]
        if self.head_size is not None:
            parts.insert(2 if len(parts) > 1 else len(parts), f"head_size {self.head_size}")
        return ", ".join(parts) or "free"


def aim_pin(pin: KernelConfig | None, focus: Focus | None, capabilities: Capabilities) -> KernelConfig | None:
    """A pinned chunk's configuration moved to ``focus``: its head size where the configuration's kv_cache_dtype
    takes it, the sliding window on (at the focus's smallest window, where the configuration pins the window's
    size) or off as the focus asks, where its other features combine with one. What cannot move stays (the pin
    wins in the draw: that part of the focus is not reached in the chunk). A moved configuration is a new compile
    for a compiled kernel."""
    if pin is None or focus is None:
        return pin
    if focus.head_size is not None and focus.head_size != pin.head_size \
            and focus.head_size in capabilities.head_sizes_for(pin.kv_cache_dtype):
        pin = attrs.evolve(pin, head_size=focus.head_size)
    if focus.window is None:
        return pin
    on = "sliding_window" in pin.features
    if focus.window == (0, 0):
        return attrs.evolve(pin, features=pin.features - {"sliding_window"}, sliding_window=None) if on else pin
    if not on and capabilities.combinable([*pin.features, "sliding_window"]):
        pin = attrs.evolve(pin, features=pin.features | {"sliding_window"}, sliding_window=focus.window[0])
    elif on and pin.pins("window"):
        pin = attrs.evolve(pin, sliding_window=focus.window[0])
    return pin


# ---- narrowed choices: the same choice the free strategy draws, in a sub-range ----------------------------------
@functools.lru_cache(maxsize=4096)
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """``integers(lo, hi)``, built once (a narrowed ``sampled_from`` index, or a narrowed ``integers``)."""
    return st.integers(lo, hi)


def index_range(values: Sequence[int], within: Range | None) -> Range | None:
    """The indices of the sorted ``values`` that lie in ``within`` (a contiguous range), or None when none does
    or ``within`` is None."""
    if within is None:
        return None
    i, j = bisect.bisect_left(values, within[0]), bisect.bisect_right(values, within[1]) - 1
    return (i, j) if i <= j else None


def exponents(within: Range | None, bits: int) -> Range:
    """The exponents ``e`` (``0 .. bits``) of a log-uniform length (``(1 << e) >> 1`` plus a mantissa below it:
    ``[2**(e-1), 2**e)``, e = 0 the length 0) whose lengths meet ``within`` (all of them for None)."""
    if within is None:
        return (0, bits)
    return (min(bits, within[0].bit_length()), min(bits, within[1].bit_length()))


def log_value(max_value: int, e: int, m: int) -> int:
    """The length of exponent ``e`` and mantissa ``m`` (:func:`exponents`), at most ``max_value``."""
    lo = (1 << e) >> 1
    return min(max_value, lo + (m % lo if lo else 0))


__all__ = ["Focus", "Range", "aim_pin", "bin_range", "exponents", "index_range", "ints", "intersect", "log2_bin",
           "log_value"]
