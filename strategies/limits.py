"""Size bounds of generated batches (no torch, no Hypothesis at import: the CLI reads the defaults)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Limits:
    """Size bounds for generated batches (keep them small on CPU: the Triton interpreter is slow).

    max_num_seqs: sequences per batch. max_ctx_len: cached tokens per sequence. max_query_len: new tokens
    of a prefill. max_num_heads: query heads. max_spare_blocks: unused physical blocks beyond those needed.
    """

    max_num_seqs: int = 4
    max_ctx_len: int = 96
    max_query_len: int = 40
    max_num_heads: int = 16
    max_spare_blocks: int = 6

    def __attrs_post_init__(self) -> None:
        for a in attrs.fields(Limits):
            v = getattr(self, a.name)
            lo = 0 if a.name in ("max_ctx_len", "max_spare_blocks") else 1
            if a.name == "max_query_len":
                lo = 2
            if not isinstance(v, int) or v < lo:
                from hypothesis.errors import InvalidArgument  # here, so the CLI's defaults need no Hypothesis

                raise InvalidArgument(f"Limits.{a.name}={v!r} must be an int >= {lo}")
