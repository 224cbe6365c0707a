"""kvfuzz.strategies: Hypothesis strategies that build kvfuzz.contracts models. No kernels here."""

from .batches import (ARRANGEMENTS, GQA_RATIOS, KINDS, UNIVERSE_BLOCK_SIZES, UNIVERSE_HEAD_SIZES, Limits, batches,
                      block_tables, boundary_lengths, examples, gqa_heads, sequence_lengths, undeclared_examples)

__all__ = ["ARRANGEMENTS", "GQA_RATIOS", "KINDS", "Limits", "batches", "block_tables", "boundary_lengths",
           "examples", "gqa_heads", "sequence_lengths", "undeclared_examples", "UNIVERSE_HEAD_SIZES",
           "UNIVERSE_BLOCK_SIZES"]
