"""Size tiers (issue 32, "Sizes"): how large the generated batches of a campaign chunk may be (no torch, no
Hypothesis at import: the CLI reads the names).

- ``small``: :class:`~kvfuzz.strategies.limits.Limits` as given (4 sequences, 96 cached tokens by default): fast
  on the Triton interpreter, the default on CPU;
- ``serving``: batches as vLLM's and SGLang's schedulers compose them (:mod:`kvfuzz.strategies.serving`): up to
  :data:`SERVING_NUM_SEQS` sequences, decodes (and speculative ``k + 1`` steps) first, then chunked-prefill chunks
  filling a token budget of up to :data:`SERVING_TOKENS`, contexts log-uniform up to :data:`SERVING_CTX_LEN`,
  real models' heads and windows (:mod:`kvfuzz.strategies.models`), prefill chunks straddling the window;
- ``long``: contexts up to :data:`LONG_CTX_LEN` (128k) tokens in at most :data:`LONG_NUM_SEQS` sequences: many
  tiles, many KV splits, sliding windows far from the start;
- ``wide``: up to :data:`WIDE_NUM_SEQS` (256) sequences with the small tier's contexts: FlashInfer's ``plan()``
  partitioning, FA3's scheduler, split-KV work lists;
- ``big-cache``: the small tier's batches with every used block past 2**31 elements of the cache
  (:func:`kvfuzz.strategies.batches.big_cache_examples`; ``kvfuzz fuzz --big-cache``).

Every bound is a maximum: the minimum of each drawn length stays 0 (1 sequence), so Hypothesis's shrinker walks a
long or wide failure back down to the smallest batch that still fails. A campaign mixes tiers by chunk
(:func:`tier_of_chunk`).
"""

from __future__ import annotations

import attrs

from .limits import Limits

#: The size tiers, smallest first.
TIERS = ("small", "serving", "long", "wide", "big-cache")
#: Longest context of the long tier (128k tokens), and its sequences at most.
LONG_CTX_LEN, LONG_NUM_SEQS = 131072, 2
#: Sequences at most in the wide tier.
WIDE_NUM_SEQS = 256
#: Sequences, cached tokens and new tokens (the token budget) at most in the serving tier.
SERVING_NUM_SEQS, SERVING_CTX_LEN, SERVING_TOKENS = 35, 65536, 8192
#: Query heads at most in the serving tier: a 128-head model on one rank (DeepSeek-V3 under data-parallel attention,
#: Falcon-7B's 71 over one kv head, Falcon-180B's 116 over 4 at tp 2).
SERVING_NUM_HEADS = 128
#: In a mix that includes ``small``, it gets 4 chunks of every 5 (:func:`tier_of_chunk`); 3 of every 5 when the
#: mix also includes ``serving``.
SMALL_EVERY = 5
#: Where each 5 chunks of a mix with ``small`` and ``serving`` put them: serving on the second, and on the fourth
#: of every other five (of every five without another large tier; the other large tiers in turn on the rest),
#: small on the first, third and fifth.
SERVING_SLOTS = (1, 3)


def tier_limits(tier: str, base: Limits = Limits()) -> Limits:
    """The bounds of ``tier``'s batches, derived from ``base`` (the campaign's own limits: the small tier and
    big-cache use them unchanged, so ``tier_limits("small", base) is base``; long raises ``max_ctx_len`` to
    :data:`LONG_CTX_LEN` with at most :data:`LONG_NUM_SEQS` sequences; wide raises ``max_num_seqs`` to
    :data:`WIDE_NUM_SEQS`; serving raises the sequences, contexts, new tokens and query heads to
    :data:`SERVING_NUM_SEQS`, :data:`SERVING_CTX_LEN`, :data:`SERVING_TOKENS` and :data:`SERVING_NUM_HEADS`).
    Raises ValueError for a name not in :data:`TIERS`."""
    if tier in ("small", "big-cache"):
        return base
    if tier == "serving":
        return attrs.evolve(base, max_num_seqs=max(base.max_num_seqs, SERVING_NUM_SEQS),
                            max_ctx_len=max(base.max_ctx_len, SERVING_CTX_LEN),
                            max_query_len=max(base.max_query_len, SERVING_TOKENS),
                            max_num_heads=max(base.max_num_heads, SERVING_NUM_HEADS))
    if tier == "long":
        return attrs.evolve(base, max_num_seqs=min(base.max_num_seqs, LONG_NUM_SEQS),
                            max_ctx_len=max(base.max_ctx_len, LONG_CTX_LEN))
    if tier == "wide":
        return attrs.evolve(base, max_num_seqs=max(base.max_num_seqs, WIDE_NUM_SEQS))
    raise ValueError(f"unknown size tier {tier!r}; known: {', '.join(TIERS)}")


def tier_of_chunk(tiers: tuple[str, ...], chunk: int) -> str:
    """The tier campaign chunk ``chunk`` draws from (a warm-up chunk ``-1 - i`` as chunk ``i``): with one tier,
    it; with ``small`` among several, ``small`` on 4 chunks of every :data:`SMALL_EVERY` (80%, so a mix keeps
    >= 80% of a small-only campaign's small examples) and the others in turn on the second of each five (a short
    campaign reaches a large tier by its second chunk). With both ``small`` and ``serving``: serving on the second
    of each five and on the fourth of every other five (30%; with no other large tier on both, 40%), the other
    large tiers in turn on the remaining fourths (10% together), small on the other three (60%): the serving
    tier is where a serving-sized bug is found (issue 38: FA3's sliding window at head sizes 192/256 needs a
    prefill chunk whose context runs past a window of hundreds of keys, which the small tier never draws), the
    small tier keeps the majority for its speed and shrinking. Measured with this split on an H200: FA3's window
    bug found on 3 of 3 seeds at 20, 69 and 50 s (benchmarks/results/serving-fa3-h200.json); other splits were
    not compared. Without ``small``, the tiers in turn.
    Raises ValueError for no tiers."""
    if not tiers:
        raise ValueError("tiers must name at least one tier")
    k = chunk if chunk >= 0 else -1 - chunk
    if len(tiers) == 1:
        return tiers[0]
    others = [t for t in tiers if t != "small"]
    if len(others) == len(tiers):
        return others[k % len(others)]
    if "serving" in others:
        rest = [t for t in others if t != "serving"]
        slot, block = k % SMALL_EVERY, k // SMALL_EVERY
        if slot == SERVING_SLOTS[0]:
            return "serving"
        if slot == SERVING_SLOTS[1]:
            return rest[block // 2 % len(rest)] if rest and block % 2 else "serving"
        return "small"
    k %= SMALL_EVERY * len(others)
    return others[k // SMALL_EVERY] if k % SMALL_EVERY == 1 else "small"


__all__ = ["LONG_CTX_LEN", "LONG_NUM_SEQS", "SERVING_CTX_LEN", "SERVING_NUM_HEADS", "SERVING_NUM_SEQS", "SERVING_SLOTS",
           "SERVING_TOKENS", "SMALL_EVERY", "TIERS", "WIDE_NUM_SEQS", "tier_limits", "tier_of_chunk"]
