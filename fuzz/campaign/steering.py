"""Coverage that steers (issue 52): each chunk's size tier and a bin it aims at, chosen from what the campaign has
not yet covered, where its near misses are and where it failed, instead of a fixed split of chunks between tiers.

A target *declares* bins (:func:`declared_bins`): every (ctx_len x query_len) log2 bin its size tiers can draw (the
batch's longest context by its longest query), every (head_size x window) bin of its head sizes and windows ("none"
and each log2 bin of windows its tiers draw, when it declares a sliding window), and each production state it
declares. The coverage labels of every example run (kvfuzz.fuzz.harness.coverage ``labels``) count into them
(:meth:`Steering.observe`), with the largest agreement error / bound of a passing example in each bin (its near
miss, ``Run.ratio``: Hypothesis's ``target()`` score) and the failures in each.

:meth:`Steering.plan` picks the next chunk's :class:`Plan`. Every :data:`FREE_EVERY`-th chunk is free: the small
tier on even chunks, the other tiers in turn on odd ones, as Hypothesis draws them (what finds what no one
thought to aim at, and the small tier's speed and shrinking). The others aim at the bin of each shape dimension
with the highest score: the need of a bin with few examples (``1 / (1 + examples)``, the examples in flight
counted, so parallel workers spread over bins), plus a near miss's pull (its ratio above :data:`NEAR_FROM`, fading
as the bin fills), the need raised for a bin that failed or borders one (a defect's region holds more); ties by a
seeded draw (a (head_size x window) bin with its window nearest the context aimed at first: a window bites where a
context runs past it). The tier is the cheapest that reaches the (ctx_len x query_len) bin (``small`` before
``serving`` before ``long``). A chunk aims only while some bin scores at least :data:`FOCUS_FROM` (fewer than about
4 examples, or a near miss); then it is free. A focused chunk holds at most :data:`FOCUS_EXAMPLES` examples, so it
moves on once its bin is reached. The strategies draw a :class:`~kvfuzz.strategies.focus.Focus` as the free
strategy's own choices, narrowed, so a failure found in one is shrunk and saved in the free strategy. In a pinned
campaign the chunks of a group of :data:`FREE_EVERY` (a free chunk and the ones after it) share one kernel
configuration, and the groups take the campaign's rotation in order (:attr:`Plan.pin_chunk`).

Deterministic in its inputs: the same counts, seed and chunk give the same plan (one worker: the same campaign).
"""

from __future__ import annotations

import collections
import random

import attrs

from kvfuzz.contracts.model.states import PRODUCTION_STATES
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.focus import Focus, bin_range, log2_bin
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.tiers import tier_limits

#: The dimension of declared production states: one bin per state tag (kvfuzz.fuzz.harness.coverage batch_states).
STATE_DIMENSION = "states"
#: Every FREE_EVERY-th chunk (chunk 0 first) draws freely.
FREE_EVERY = 3
#: The examples of a focused chunk at most: it moves on once its bin is reached.
FOCUS_EXAMPLES = 50
#: A chunk aims at a bin only if its score is at least this (a bin of fewer than about 4 examples, or a near miss).
FOCUS_FROM = 0.2
#: A near miss pulls from this ratio of error to bound up, with up to NEAR_WEIGHT, fading by half every
#: NEAR_EXAMPLES examples in its bin.
NEAR_FROM, NEAR_WEIGHT, NEAR_EXAMPLES = 0.25, 0.5, 200
#: A bin that failed, or borders one that did, counts its need this many times over.
FAILED_WEIGHT = 2.0
#: Tiers a focused chunk takes, cheapest first (the first whose bounds reach its bin).
CHEAPEST = ("small", "serving", "long", "wide", "big-cache")


def _length_bins(max_len: int, zero: bool = False) -> list[str]:
    return (["0"] if zero else []) + [f"2^{k}" for k in range(max(1, max_len).bit_length())]


def _max_window(tier: str, limits: Limits) -> int:
    """The longest window ``tier`` draws: the longest context in the serving tier, else context plus query."""
    return limits.max_ctx_len if tier == "serving" else limits.max_ctx_len + limits.max_query_len


def _shape_bins(target: Target, tier: str, limits: Limits) -> list[str]:
    lim = tier_limits(tier, limits)
    queries = ["2^0"] if target.capabilities.decode_only else _length_bins(lim.max_query_len)
    return [f"{c} x {q}" for c in _length_bins(lim.max_ctx_len, zero=True) for q in queries]


def _head_bins(target: Target, tier: str, limits: Limits) -> list[str]:
    caps = target.capabilities
    windows = ["none"]
    if "sliding_window" in caps.features:
        low = int(log2_bin(max(1, caps.min_sliding_window))[2:])
        windows += [f"2^{k}" for k in range(low, _max_window(tier, tier_limits(tier, limits)).bit_length())]
    return [f"{h} x {w}" for h in sorted(caps.head_sizes) for w in windows]


def _bin_key(label: str) -> tuple:
    """Sort key of a bin label: each axis by its lengths ("none" last)."""
    out = []
    for part in label.split(" x "):
        r = bin_range(part) if part != "none" else None
        out.append((1, 0) if r is None else (0, r[0]))
    return tuple(out)


def declared_bins(target: Target, tiers: tuple[str, ...], limits: Limits = Limits()) -> dict[str, tuple[str, ...]]:
    """The bins ``target`` declares for a campaign of ``tiers`` (module docstring), by dimension:
    :data:`~kvfuzz.fuzz.harness.coverage.SHAPE_DIMENSIONS` and :data:`STATE_DIMENSION` (the declared states'
    tags; left out when it declares none)."""
    shapes = {b for t in tiers for b in _shape_bins(target, t, limits)}
    heads = {b for t in tiers for b in _head_bins(target, t, limits)}
    out = {SHAPE_DIMENSIONS[0]: tuple(sorted(shapes, key=_bin_key)),
           SHAPE_DIMENSIONS[1]: tuple(sorted(heads, key=_bin_key))}
    caps = target.capabilities
    states = tuple(s.tag for s in PRODUCTION_STATES.values() if getattr(caps, s.name) != s.off)
    if states:
        out[STATE_DIMENSION] = states
    return out


def bin_counts(bins: dict[str, tuple[str, ...]], coverage: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Examples per declared bin (0: declared, never reached) from a campaign's coverage counts
    (``TargetStats.coverage``; states counted per tag): summary.json's ``bins``, whose zeros ``kvfuzz report``
    marks."""
    out = {}
    for dim, labels in bins.items():
        seen = coverage.get(dim, {})
        if dim == STATE_DIMENSION:
            out[dim] = {tag: sum(n for v, n in seen.items() if tag in v.split("+")) for tag in labels}
        else:
            out[dim] = {b: seen.get(b, 0) for b in labels}
    return out


@attrs.frozen
class Plan:
    """One chunk's tier, and the focus its draws aim at (None: free) with the bins it was chosen for.
    ``pin_chunk``: the place in the campaign's rotation of kernel configurations
    (kvfuzz.fuzz.campaign.chunks ``chunk_config``) the chunk draws in, None: the chunk's own number. A steered
    chunk ``k`` takes ``k // FREE_EVERY``: the chunks of one group (a free chunk and the two after it) share one
    configuration (a pinned campaign's focused chunks of 50 examples reuse what the free chunk compiled instead of
    compiling a new configuration each), and the groups visit the rotation in order, so every declared value of a
    round comes up in the round's first groups (taking the group's first chunk's number skipped two
    configurations of every three: bug.flashinfer-4401's seeds 0-2 visited only soft-cap-on ones,
    benchmarks/bug_draws.py)."""

    tier: str
    focus: Focus | None = None
    bins: tuple[tuple[str, str], ...] = ()
    pin_chunk: int | None = None
    #: A steered campaign's free chunk (:meth:`Steering._free_plan`; kvfuzz.fuzz.campaign.chunks
    #: ``free_chunk_seconds`` may limit it), not a chunk of an unsteered campaign.
    free: bool = False

    def config_chunk(self, chunk: int) -> int:
        """The chunk index whose kernel configuration chunk ``chunk`` of this plan draws in
        (kvfuzz.fuzz.campaign.chunks ``chunk_config``)."""
        return chunk if self.pin_chunk is None else self.pin_chunk

    def size(self, n: int) -> int:
        """A chunk's examples ``n`` (its tier's, from the budget), at most :data:`FOCUS_EXAMPLES` when focused."""
        return min(n, FOCUS_EXAMPLES) if self.focus is not None else n

    def to_dict(self) -> dict:
        return {"tier": self.tier, "focus": None if self.focus is None else self.focus.to_dict(),
                "bins": [list(b) for b in self.bins], "pin_chunk": self.pin_chunk, "free": self.free}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        focus = d.get("focus")
        return cls(d["tier"], None if focus is None else Focus.from_dict(focus),
                   tuple(tuple(b) for b in d.get("bins", ())), d.get("pin_chunk"), bool(d.get("free", False)))


def _neighbours(label: str) -> list[str]:
    """The bins next to a log2 bin label on each axis (the same head size for a head-size axis)."""
    parts = label.split(" x ")
    out = []
    for i, part in enumerate(parts):
        if not part.startswith("2^"):
            continue
        k = int(part[2:])
        for step in ([f"2^{k - 1}"] if k > 0 else ["0"]) + [f"2^{k + 1}"]:
            out.append(" x ".join(parts[:i] + [step] + parts[i + 1:]))
    return out


class Steering:
    """The policy of one target's campaign (module docstring): ``bins`` by dimension (:func:`declared_bins`),
    ``tiers`` its chunks may take, ``limits`` the campaign's, ``seed`` the campaign's (ties)."""

    def __init__(self, bins: dict[str, tuple[str, ...]], tiers: tuple[str, ...], limits: Limits = Limits(),
                 seed: int = 0, decode_only: bool = False) -> None:
        self.bins, self.tiers, self.limits, self.seed = bins, tuple(tiers), limits, seed
        self.decode_only = decode_only
        self.counts = {d: dict.fromkeys(b, 0) for d, b in bins.items()}
        self.pending = {d: collections.Counter() for d in bins}
        self.near: dict[str, dict[str, float]] = {d: {} for d in bins}
        self.failed: dict[str, set[str]] = {d: set() for d in bins}
        self._limits = {t: tier_limits(t, limits) for t in self.tiers}  # each tier's bounds, once

    @classmethod
    def of(cls, target: Target, config, tiers: tuple[str, ...]) -> "Steering | None":
        """The policy of ``target``'s campaign under ``config`` (a CampaignConfig), or None where chunks are not
        steered: ``config.steer`` off, the pre-merge gate (its budget is the same every run), ``undeclared``
        (outside the declaration) or ``big_cache``."""
        if not getattr(config, "steer", True) or config.gate or config.undeclared or config.big_cache:
            return None
        return cls(declared_bins(target, tiers, config.limits), tiers, config.limits, config.seed,
                   target.capabilities.decode_only)

    # ---- what the campaign ran --------------------------------------------------------------------------------
    def observe(self, labels: dict[str, str], ratio: float = 0.0, signature=None) -> None:
        """Count one example run: its coverage ``labels``, its error / bound ``ratio`` (passing) or its failure
        ``signature``."""
        for dim, counts in self.counts.items():
            values = labels.get(dim, "").split("+") if dim == STATE_DIMENSION else [labels.get(dim)]
            for b in values:
                if b not in counts:
                    continue
                counts[b] += 1
                if signature is not None:
                    self.failed[dim].add(b)
                elif ratio > self.near[dim].get(b, 0.0):
                    self.near[dim][b] = float(ratio)

    def started(self, plan: Plan | None, n: int) -> None:
        """A chunk of ``plan`` with ``n`` examples was handed out: its bins count them as coming."""
        for dim, b in plan.bins if plan is not None else ():
            self.pending[dim][b] += n

    def finished(self, plan: Plan | None, n: int) -> None:
        """That chunk ended (its examples are observed, or lost)."""
        for dim, b in plan.bins if plan is not None else ():
            self.pending[dim][b] = max(0, self.pending[dim][b] - n)

    def empty(self) -> dict[str, list[str]]:
        """The declared bins no example reached yet, by dimension."""
        return {d: [b for b, n in c.items() if not n] for d, c in self.counts.items()}

    # ---- the next chunk ----------------------------------------------------------------------------------------
    def score(self, dim: str, b: str) -> float:
        """How much a chunk aimed at bin ``b`` of ``dim`` is worth now (module docstring)."""
        n = self.counts[dim][b]
        need = 1.0 / (1 + n + self.pending[dim][b])
        if self.failed[dim] and (b in self.failed[dim] or any(x in self.failed[dim] for x in _neighbours(b))):
            need *= FAILED_WEIGHT
        near = max(0.0, self.near[dim].get(b, 0.0) - NEAR_FROM) / (1 - NEAR_FROM)
        return need + NEAR_WEIGHT * min(1.0, near) / (1 + n / NEAR_EXAMPLES)

    def _best(self, dim: str, rng: random.Random, allowed=None, near_to: str | None = None
              ) -> tuple[str, float] | None:
        """The bin of ``dim`` with the highest score (among those ``allowed``), and its score; of equal scores, the
        one whose window is nearest the context of the (ctx_len x query_len) bin ``near_to`` (a window bites where a
        context runs past it), then a seeded draw."""
        ctx = None if near_to is None else bin_range(near_to.split(" x ")[0])[0].bit_length()
        scored = []
        for b in self.bins.get(dim, ()):
            if allowed is None or allowed(b):
                window = b.split(" x ")[-1]
                gap = 0 if ctx is None else -abs((bin_range(window)[0].bit_length() if window != "none" else 0) - ctx)
                scored.append((round(self.score(dim, b), 9), gap, rng.random(), b))
        if not scored:
            return None
        s, _, _, b = max(scored)
        return b, s

    def tier_for(self, shape: str | None = None, heads: str | None = None) -> str | None:
        """The cheapest of the campaign's tiers whose bounds reach the (ctx_len x query_len) bin ``shape`` and the
        window of the (head_size x window) bin ``heads`` (None: any)."""
        for tier in CHEAPEST:
            if tier not in self.tiers:
                continue
            lim = self._limits[tier]
            if shape is not None:
                c, q = (bin_range(x) for x in shape.split(" x "))
                if c[0] > lim.max_ctx_len or q[0] > lim.max_query_len:
                    continue
            w = None if heads is None or heads.endswith("none") else bin_range(heads.split(" x ")[1])
            if w is None or w[0] <= _max_window(tier, lim):
                return tier
        return None

    def plan(self, chunk: int) -> Plan:
        """The plan of chunk ``chunk`` (module docstring). A campaign of no bins gets free chunks."""
        if chunk % FREE_EVERY == 0:
            return self._free_plan(chunk)
        rng = random.Random(f"kvfuzz-steer:{self.seed}:{chunk}")
        shape_dim, heads_dim = SHAPE_DIMENSIONS
        shape = self._best(shape_dim, rng)
        shape = shape[0] if shape is not None and shape[1] >= FOCUS_FROM else None
        tier = None if shape is None else self.tier_for(shape)
        heads = self._best(heads_dim, rng, allowed=lambda b: self.tier_for(shape, b) is not None, near_to=shape)
        heads = heads[0] if heads is not None and heads[1] >= FOCUS_FROM else None
        if shape is None and heads is None:
            return self._free_plan(chunk)
        tier = self.tier_for(shape, heads) or tier or self.tiers[0]
        bins = tuple((d, b) for d, b in ((shape_dim, shape), (heads_dim, heads)) if b is not None)
        return Plan(tier, Focus.of_bins(shape, heads), bins, chunk // FREE_EVERY)

    def _free_plan(self, chunk: int) -> Plan:
        """A free chunk: the small tier on even chunks, the other tiers in turn on odd ones (every other chunk of
        each :data:`FREE_EVERY`)."""
        k, config = chunk, chunk // FREE_EVERY
        others = [t for t in self.tiers if t != "small"]
        if "small" not in self.tiers:
            return Plan(others[k % len(others)], pin_chunk=config, free=True)
        if not others or k % 2 == 0:
            return Plan("small", pin_chunk=config, free=True)
        return Plan(others[k // 2 % len(others)], pin_chunk=config, free=True)


__all__ = ["CHEAPEST", "FAILED_WEIGHT", "FOCUS_EXAMPLES", "FOCUS_FROM", "FREE_EVERY", "NEAR_EXAMPLES", "NEAR_FROM",
           "NEAR_WEIGHT", "STATE_DIMENSION", "Plan", "Steering", "bin_counts", "declared_bins"]
