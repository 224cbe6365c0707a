"""Bounds of generated batches: sizes and value ranges (no torch, no Hypothesis at import: the CLI reads the
defaults)."""

from __future__ import annotations

import attrs

#: kvfuzz.contracts.model.batch.VALUE_RANGES, spelled out: that module imports torch, and the CLI reads these defaults
#: (tests/strategies/test_strategies.py keeps the two equal).
VALUE_RANGES = ("normal", "large", "equal", "dominant", "extreme", "shifted")

#: The largest value of each size bound (``kvfuzz fuzz --max-num-seqs/--max-ctx-len/--max-query-len`` refuse more
#: at parse time, exit 2): past them a batch cannot be held, let alone checked against an fp64 reference, on any
#: machine kvfuzz runs on. 1,024 sequences (vLLM's largest default max_num_seqs); 2**20 cached tokens a sequence
#: (the longest contexts served; the long tier draws up to 128k); 2**17 new tokens (a whole 128k prompt in one
#: prefill); 256 query heads; 2**20 spare blocks.
BOUNDS = {"max_num_seqs": 1024, "max_ctx_len": 1 << 20, "max_query_len": 1 << 17, "max_num_heads": 256,
          "max_spare_blocks": 1 << 20}
#: The most tokens the small tier's largest batch may hold, ``max_num_seqs * (max_ctx_len + max_query_len)``: 2**22,
#: as many as the serving tier's largest batch (35 sequences of up to 65,536 + 8,192 tokens) with room to spare.
#: Each token's keys and values are drawn in the batch dtype and again in fp64 for the reference.
MAX_BATCH_TOKENS = 1 << 22


@attrs.frozen
class Limits:
    """Bounds for generated batches (keep the sizes small on CPU: the Triton interpreter is slow).

    max_num_seqs: sequences per batch. max_ctx_len: cached tokens per sequence. max_query_len: new tokens
    of a prefill. max_num_heads: query heads (64: every group size of :data:`kvfuzz.strategies.configs.GQA_RATIOS`,
    up to 64 query heads over one kv head). max_spare_blocks: unused physical blocks beyond those needed.
    value_ranges: how queries and keys may be drawn, a non-empty subset of
    :data:`kvfuzz.contracts.model.batch.VALUE_RANGES` (the pre-merge gate narrows it for a target's documented
    limitation: ``Target.gate_value_ranges``). Raises InvalidArgument for a bound out of range (below its minimum,
    or past :data:`BOUNDS`).
    """

    max_num_seqs: int = 4
    max_ctx_len: int = 96
    max_query_len: int = 40
    max_num_heads: int = 64
    max_spare_blocks: int = 6
    value_ranges: tuple[str, ...] = VALUE_RANGES

    def __attrs_post_init__(self) -> None:
        if not self.value_ranges or not set(self.value_ranges) <= set(VALUE_RANGES):
            from hypothesis.errors import InvalidArgument

            raise InvalidArgument(f"Limits.value_ranges={self.value_ranges!r} must be a non-empty subset of "
                                  f"{VALUE_RANGES}")
        for a in attrs.fields(Limits):
            if a.name == "value_ranges":
                continue
            v = getattr(self, a.name)
            lo = 0 if a.name in ("max_ctx_len", "max_spare_blocks") else 1
            if a.name == "max_query_len":
                lo = 2
            if not isinstance(v, int) or not lo <= v <= BOUNDS[a.name]:
                from hypothesis.errors import InvalidArgument  # here, so the CLI's defaults need no Hypothesis

                raise InvalidArgument(f"Limits.{a.name}={v!r} must be an int in [{lo}, {BOUNDS[a.name]}]")

    @property
    def batch_tokens(self) -> int:
        """Tokens of the largest batch these bounds allow (:data:`MAX_BATCH_TOKENS` at most, checked by the CLI)."""
        return self.max_num_seqs * (self.max_ctx_len + self.max_query_len)


__all__ = ["BOUNDS", "MAX_BATCH_TOKENS", "VALUE_RANGES", "Limits"]
