"""kvfuzz.strategies: Hypothesis strategies that build kvfuzz.contracts models. No kernels here; names load
lazily (``kvfuzz.strategies.limits`` imports without torch or Hypothesis)."""

from kvfuzz.contracts.lazy import lazy_exports

_EXPORTS = {
    "Limits": "limits", "GQA_RATIOS": "configs",
    **{n: "batches" for n in ("ARRANGEMENTS", "KINDS", "UNIVERSE_BLOCK_SIZES", "UNIVERSE_HEAD_SIZES",
                              "big_cache_examples", "block_tables", "boundary_lengths", "examples",
                              "gqa_heads", "sequence_lengths", "undeclared_examples")},
}
# ``batches`` (the strategy) is not exported here: importing the submodule of that name rebinds the package
# attribute to the module. Import it from kvfuzz.strategies.batches (or as kvfuzz.batches).
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
