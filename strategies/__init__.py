"""kvfuzz.strategies: Hypothesis strategies that build kvfuzz.contracts models. No kernels here."""

from .batches import (ARRANGEMENTS, GQA_RATIOS, KINDS, Limits, batches, block_tables, boundary_lengths,
                      examples, gqa_heads, sequence_lengths)

__all__ = ["ARRANGEMENTS", "GQA_RATIOS", "KINDS", "Limits", "batches", "block_tables", "boundary_lengths",
           "examples", "gqa_heads", "sequence_lengths"]
