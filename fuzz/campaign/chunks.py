"""Chunk arithmetic: a campaign explores a target in chunks of examples, chunk ``k`` from Hypothesis seed
``seed * CHUNK_SEED_STRIDE + k`` and, when pinned, inside chunk ``k``'s kernel configuration (warm-up chunk
``-1 - i``: the ``i``-th); how many examples a chunk gets, from the budget left."""

from __future__ import annotations

import os

from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.configs import KernelConfig, config_for
from kvfuzz.strategies.tiers import tier_of_chunk

#: Chunk k of a campaign with seed s explores Hypothesis seed ``s * CHUNK_SEED_STRIDE + k``.
CHUNK_SEED_STRIDE = 100_003
#: Examples per chunk when each example draws its own configuration, and when a chunk is pinned to one. A pinned
#: chunk pays its configuration's compiles once (~7 s per worker on an H100: ~10 specializations, ~1 s each, and
#: a campaign's configurations almost never repeat) against ~12 ms per example (14 workers under MPS), so the
#: compiles are ~37% of a 1,000-example chunk's time and ~74% of a 200-example one's. Measured cold on an H100
#: (benchmarks/gpu_chunks.sh, vllm.unified_attention, 120 s): 200 -> 290 examples/s, 1,000 -> 630/s, 3,000 ->
#: 787/s; every declared value drawn in each. Longer chunks visit fewer configurations a minute (~0.6/s at
#: 1,000 against ~1.5/s at 200; every declared value still comes up in each round of the rotation), which
#: ``--chunk-examples`` trades back.
CHUNK_EXAMPLES, PINNED_CHUNK_EXAMPLES = 25, 1000
#: A pinned chunk generates for at most this share of ``--duration`` after its first example (which pays its
#: configuration's compiles; :func:`chunk_time_limit`), then gives way to the next chunk, so a campaign whose
#: examples are slow still visits several configurations: a FlashInfer decode example took ~0.5 s on an H200, so a
#: 1,000-example chunk outlasted a 240 s campaign and every seed stayed in its first JIT module (three seeds, three
#: soft-cap-on modules: bug.flashinfer-4401, which needs a soft cap off, was never drawable;
#: benchmarks/results/flashinfer-4401-h200.txt, benchmarks/bug_draws.py). Consecutive configurations of a round
#: differ in every dimension with a value left to see (kvfuzz.strategies.configs), so two configurations already have a
#: soft cap on and off. A fast target's chunk ends by its example count first once --duration is long enough: vLLM's
#: Triton chunk of 1,000 examples took ~22 s per worker on an H100 (630/s over 14 workers), so from about 90 s.
PINNED_CHUNK_SHARE = 0.25
#: A chunk aimed at a bin (kvfuzz.fuzz.campaign.steering, at most ``FOCUS_EXAMPLES`` examples) generates for at most
#: this many seconds after its first example (which pays its configuration's compiles), with ``--duration``: it is
#: there to reach its bin. A serving bin's examples cost ~0.45 s each on an H200 (FA3, 8 workers), so 50 of them held
#: a worker ~22 s per bin, and 57 of FA3's 258 (ctx_len x query_len) bins were still empty after 300 s; with 3 s, 21
#: (benchmarks/results/focus-ab-h200.txt). A small example (~25 ms) still runs the chunk's 50.
#: Environment: KVFUZZ_FOCUS_SECONDS (:func:`focus_chunk_seconds`; 0: no time limit, only the example count).
FOCUS_CHUNK_SECONDS = 3.0
FOCUS_SECONDS_ENV = "KVFUZZ_FOCUS_SECONDS"
#: A steered campaign's free chunk (every FREE_EVERY-th) generates for at most this many seconds after its first
#: example, with ``--duration`` (0: no limit of its own, only a pinned chunk's share of ``--duration``), unless its
#: target sets its own (``Target.free_chunk_seconds``; FlashAttention 3: 5). A free pinned chunk may hold its worker
#: for a quarter of ``--duration`` where a focused one takes ~3-4 s: in 300 s on half an H200 the free chunks took
#: 75% (FA3) and 65% (unified) of the workers' time and left 12 of 258 (ctx_len x query_len) bins empty on each; with
#: 5 s none was empty on either, and FA3 found its window bug sooner on 3 of 3 seeds, while vLLM's Triton unified
#: kernel, which compiles each configuration, drew 6.5x fewer examples and found vllm#56862 later on 3 of 3 seeds
#: (benchmarks/results/free-ab-h200.txt). So the default stays 0 and targets opt in. Environment: KVFUZZ_FREE_SECONDS
#: (every target).
FREE_CHUNK_SECONDS = 0.0
FREE_SECONDS_ENV = "KVFUZZ_FREE_SECONDS"
#: What a chunk's time limit counts (:func:`chunk_clock`): "wall", every second after its first example (the
#: default), or "work", those seconds less the worker's kernel compiles and loads in them
#: (kvfuzz.fuzz.harness.kernel_clock ``COMPILES``). A candidate for the Triton targets, not measured: 5 s free chunks of
#: vLLM's unified kernel spent 62% of their workers' time compiling and found vllm#56862 later
#: (benchmarks/results/free-ab-h200.txt); with "work" each would get its 5 s of examples whatever its compiles cost.
#: Environment: KVFUZZ_CHUNK_CLOCK.
CHUNK_CLOCKS = ("wall", "work")
CHUNK_CLOCK_ENV = "KVFUZZ_CHUNK_CLOCK"
#: Examples of a warm-up chunk (CampaignConfig.warmup): one compiles the configuration, a second catches an
#: integer specialization of its lengths.
WARMUP_EXAMPLES = 2


def campaign_tiers(target: Target, config: CampaignConfig) -> tuple[str, ...]:
    """The size tiers ``target``'s chunks rotate through (:data:`kvfuzz.strategies.tiers.TIERS` order):
    ("big-cache",) with ``config.big_cache`` (``--big-cache``: any attention target, declared or not);
    ("small",) when ``config.tiers`` is None or with ``undeclared``;
    "auto": every tier the target declares (``Target.size_tiers``) when it runs on CUDA, ("small",) on CPU;
    otherwise those of ``config.tiers`` it declares. Raises ValueError when none is left (the message names the
    target's tiers)."""
    if config.big_cache:  # as before tiers: any attention target (strategy_for refuses a cache writer)
        return ("big-cache",)
    if config.tiers is None or config.undeclared:
        return ("small",)
    if "auto" in config.tiers:
        return target.size_tiers() if target.device == "cuda" else ("small",)
    wanted = config.tiers
    declared = target.size_tiers()
    tiers = tuple(t for t in declared if t in wanted)
    if not tiers:
        raise ValueError(f"{target.name} declares the size tiers {', '.join(declared)}, not "
                         f"{', '.join(wanted)}")
    return tiers


def pins_configs(target: Target, config: CampaignConfig) -> bool:
    """Whether ``target``'s chunks each stay in one kernel configuration (``config.pin_configs``; auto: on
    CUDA). Never with ``undeclared`` (it draws outside the declaration)."""
    if config.undeclared:
        return False
    return config.pin_configs if config.pin_configs is not None else target.device == "cuda"


def examples_per_chunk(target: Target, config: CampaignConfig) -> int:
    """``config.chunk_examples``, or its default for how ``target`` is fuzzed (:data:`CHUNK_EXAMPLES`)."""
    if config.chunk_examples is not None:
        return config.chunk_examples
    return PINNED_CHUNK_EXAMPLES if pins_configs(target, config) else CHUNK_EXAMPLES


def chunk_config(target: Target, config: CampaignConfig, chunk: int) -> KernelConfig | None:
    """The kernel configuration chunk ``chunk`` of this campaign stays in (warm-up chunk ``-1 - i``: the
    ``i``-th), or None when it draws freely (:func:`pins_configs`). The target's ``runtime_fields`` are left free
    inside it."""
    if not pins_configs(target, config):
        return None
    return config_for(target.capabilities, config.limits, config.seed, chunk if chunk >= 0 else -1 - chunk,
                      free=target.runtime_fields)


def _env_seconds(name: str, default: float, what: str) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{name}={raw!r}: {what}, a number >= 0 (0: no time limit; unset: {default:g})")
    return seconds


def focus_chunk_seconds() -> float:
    """A focused chunk's seconds after its first example: ``$KVFUZZ_FOCUS_SECONDS`` when set (0: no limit), else
    :data:`FOCUS_CHUNK_SECONDS`. Raises ValueError naming the variable when it is not a number >= 0 (the fuzz
    command checks it before any worker starts: exit 2)."""
    return _env_seconds(FOCUS_SECONDS_ENV, FOCUS_CHUNK_SECONDS, "a focused chunk's seconds after its first example")


def free_chunk_seconds(default: float = FREE_CHUNK_SECONDS) -> float:
    """A steered campaign's free chunk's seconds after its first example: ``$KVFUZZ_FREE_SECONDS`` when set, else
    ``default`` (the target's ``Target.free_chunk_seconds``; :data:`FREE_CHUNK_SECONDS`; 0: no limit but a pinned
    chunk's share of ``--duration``). Raises ValueError as :func:`focus_chunk_seconds`."""
    return _env_seconds(FREE_SECONDS_ENV, default, "a steered free chunk's seconds after its first example")


def chunk_clock() -> str:
    """What a chunk's time limit counts: ``$KVFUZZ_CHUNK_CLOCK`` when set, else "wall" (:data:`CHUNK_CLOCKS`).
    Raises ValueError naming the variable for another value (the fuzz command checks it before any worker starts:
    exit 2)."""
    raw = os.environ.get(CHUNK_CLOCK_ENV, "").strip() or CHUNK_CLOCKS[0]
    if raw not in CHUNK_CLOCKS:
        raise ValueError(f"{CHUNK_CLOCK_ENV}={raw!r}: what a chunk's time limit counts, one of "
                         f"{', '.join(CHUNK_CLOCKS)} (wall: every second; work: less the kernel compiles; unset: wall)")
    return raw


def chunk_time_limit(config: CampaignConfig, pinned: bool, focused: bool = False, free: bool = False,
                     free_default: float = FREE_CHUNK_SECONDS) -> float | None:
    """Seconds a chunk may generate for after its first example (kvfuzz.fuzz.campaign.runner
    ``ExampleRunner.limit_chunk``), with ``--duration`` (None without one: a campaign bounded by examples stays
    deterministic in its seed): the least of :data:`PINNED_CHUNK_SHARE` of ``--duration`` for a chunk that stays in
    one kernel configuration (``pinned``), :func:`focus_chunk_seconds` for one aimed at a bin (``focused``) and
    :func:`free_chunk_seconds` (``free_default``: the target's own) for a steered campaign's free chunk (``free``),
    those that apply and are not 0; None (no limit) when none does."""
    if config.duration is None:
        return None
    limits = [PINNED_CHUNK_SHARE * config.duration] if pinned else []
    limits += [s for s in (focus_chunk_seconds() if focused else 0.0,
                           free_chunk_seconds(free_default) if free else 0.0) if s > 0]
    return min(limits) if limits else None


class ChunkTimeUp(BaseException):
    """A pinned chunk has generated for its share of ``--duration`` (:class:`ChunkLimit`): raised from the property
    body, it ends the chunk's Hypothesis run (a BaseException, as the runner's PastDeadline); the campaign goes on
    with its next chunk."""


class ChunkLimit:
    """How long the chunk in progress may generate for (:func:`chunk_time_limit`; None: no limit), counted from
    the end of its first example, which pays its configuration's compiles (the kvfuzz.fuzz.campaign.runner
    ExampleRunner asks :meth:`up` at the start of every example). ``compiled``: a running total of the worker's
    compile seconds (``COMPILES.seconds``, :func:`chunk_clock` "work"), whose growth since the first example is not
    counted; None counts every second."""

    def __init__(self, seconds: float | None = None, compiled=None) -> None:
        self.seconds, self.since, self.begun, self.compiled, self.compiled_since = seconds, None, False, compiled, 0.0

    def up(self, now: float, may_stop: bool) -> bool:
        """Whether the chunk's time is up at ``now`` (``time.monotonic()``, as an example starts) and it
        ``may_stop`` (Hypothesis is generating and no new failure is being shrunk)."""
        if self.seconds is None:
            return False
        if self.since is None:
            self.since, self.begun = (now if self.begun else None), True
            if self.compiled is not None:
                self.compiled_since = self.compiled()
            return False
        spent = now - self.since - (self.compiled() - self.compiled_since if self.compiled is not None else 0.0)
        return may_stop and spent > self.seconds


def chunk_tier(tiers: tuple[str, ...], chunk: int) -> str:
    """The size tier chunk ``chunk`` of a campaign of ``tiers`` draws from (a warm-up chunk ``-1 - i`` as chunk
    ``i``): the one place the engine and the supervisor choose it, today the fixed rotation
    :func:`~kvfuzz.strategies.tiers.tier_of_chunk`."""
    return tier_of_chunk(tiers, chunk)


def chunk_size(config: CampaignConfig, done: int, elapsed: float, workers: int = 1,
               per_chunk: int = CHUNK_EXAMPLES) -> int:
    """Examples in the next chunk: at most ``per_chunk`` (:func:`examples_per_chunk`) and what is left of the
    example budget; with a time budget, no more than the time left allows at the rate measured so far (so the
    budget overshoots by at most one example per worker, or a shrink). No rate yet at ``elapsed`` 0: the examples
    ``done`` before a target's turn (its warm-up chunks, its retries) took none of its time."""
    n = min(per_chunk, config.max_examples - done)
    if config.duration is not None and done and elapsed > 0:
        per_example = elapsed / done * workers
        n = min(n, int((config.duration - elapsed) / per_example))
    return max(1, n)


#: Examples of a large-tier chunk (long, wide, big-cache) of a mix before that tier's speed is measured: a long
#: example can take a thousand small ones' time, so the first chunks of a large tier are probes.
TIER_PROBE_EXAMPLES = 8


def tier_chunk_size(tier: str, tiers: tuple[str, ...], per_chunk: int, times: dict[str, list[float]],
                    time_left: float | None) -> int | None:
    """Examples in the next chunk of a large tier (``tier`` not "small") of a mix that includes "small", or None
    where :func:`chunk_size` decides (the small tier, or a campaign without it). ``times`` holds what finished
    chunks took per tier: ``{tier: [chunks, examples, worker seconds]}`` (the supervisor's
    ``TargetState.tier_times``). A large chunk gets the examples that take as long as an average small chunk
    did, at the tier's own seconds per example (compiles included), so the chunk rotation's 4 small chunks in
    every 5 (:func:`~kvfuzz.strategies.tiers.tier_of_chunk`) are also >= 80% of the workers' time;
    :data:`TIER_PROBE_EXAMPLES` until both are measured. Never more than ``per_chunk``, nor than ``time_left``
    (seconds, with a time budget) allows at the tier's rate; at least 1."""
    if tier == "small" or "small" not in tiers:
        return None
    small, large = times.get("small"), times.get(tier)
    if not small or not large or not small[0] or not large[1] or large[2] <= 0:
        return max(1, min(per_chunk, TIER_PROBE_EXAMPLES))
    per_example = large[2] / large[1]
    n = min(per_chunk, int(small[2] / small[0] / per_example))
    if time_left is not None:
        n = min(n, int(time_left / per_example))
    return max(1, n)


def record_tier_time(times: dict[str, list[float]], tier: str, examples: int, seconds: float) -> None:
    """Add a finished chunk of ``tier`` (``examples`` counted in ``seconds`` of its worker's time) to ``times``
    (:func:`tier_chunk_size`'s ``{tier: [chunks, examples, seconds]}``); a chunk that counted nothing (its worker
    died first) is left out."""
    if examples > 0:
        entry = times.setdefault(tier, [0, 0, 0.0])
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + examples, entry[2] + seconds


__all__ = ["CHUNK_CLOCKS", "CHUNK_CLOCK_ENV", "CHUNK_EXAMPLES", "CHUNK_SEED_STRIDE", "ChunkLimit", "ChunkTimeUp",
           "FOCUS_CHUNK_SECONDS", "FOCUS_SECONDS_ENV", "FREE_CHUNK_SECONDS", "FREE_SECONDS_ENV",
           "PINNED_CHUNK_EXAMPLES", "PINNED_CHUNK_SHARE", "TIER_PROBE_EXAMPLES", "WARMUP_EXAMPLES", "campaign_tiers",
           "chunk_clock", "chunk_config", "chunk_size", "chunk_tier", "chunk_time_limit", "examples_per_chunk",
           "focus_chunk_seconds", "free_chunk_seconds", "pins_configs", "record_tier_time", "tier_chunk_size"]
