"""Ground-truth tensors of a :class:`~kvfuzz.contracts.batch.Batch`, drawn from its seed.

Everything is generated in float32 from a seeded ``torch.Generator`` and rounded once to the batch dtype, so
the kernel and the fp64 reference see bit-identical inputs.
"""

from __future__ import annotations

import attrs
import torch

from .batch import Batch, positions


@attrs.frozen(eq=False)
class BatchData:
    """Tensors of one batch (all on CPU, in ``batch.dtype``).

    query:  ``[num_tokens, num_heads, head_size]``, in query order (``query_start_loc``).
    keys, values: ``[sum(seq_lens), num_kv_heads, head_size]``: every position ``0 .. seq_len-1`` of every
        sequence, sequence ``i`` starting at ``batch.seq_start_loc[i]``. Positions ``ctx_len ..`` are the
        new tokens, whose k/v the split contract passes separately.
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def token_rows(self, batch: Batch, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Row indices into ``keys``/``values`` of positions ``pos`` of sequences ``seq`` (int64)."""
        return torch.tensor(batch.seq_start_loc[:-1], dtype=torch.int64)[seq] + pos

    def new_kv(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``: the new tokens in query order, as a
        split-contract kernel receives them."""
        rows = self.token_rows(batch, *positions(batch.query_lens, offsets=batch.ctx_lens))
        return self.keys[rows], self.values[rows]


def make_batch_data(batch: Batch) -> BatchData:
    """Draw the queries and the keys/values of every position from ``batch.seed`` (standard normal,
    rounded to ``batch.dtype``). Deterministic across runs and machines for one torch version."""
    gen = torch.Generator().manual_seed(batch.seed)
    total = sum(batch.seq_lens)
    shape_kv = (total, batch.num_kv_heads, batch.head_size)
    query = torch.randn((batch.num_tokens, batch.num_heads, batch.head_size), generator=gen)
    keys = torch.randn(shape_kv, generator=gen)
    values = torch.randn(shape_kv, generator=gen)
    dt = batch.torch_dtype
    return BatchData(query=query.to(dt), keys=keys.to(dt), values=values.to(dt))
