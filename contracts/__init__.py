"""kvfuzz.contracts: the model of one paged-attention call (Batch), its ground-truth tensors, the fp64
reference, cache layouts and the materializer, the invariants a caller must meet, the checks of a real call's
arguments, and the oracles a kernel must pass. Depends on torch and attrs only; names load lazily."""

from .lazy import lazy_exports

_EXPORTS = {
    "DTYPES": "batch", "KV_CACHE_DTYPES": "batch", "FEATURES": "batch", "VALUE_RANGES": "batch", "Batch": "batch",
    "positions": "batch",
    "Capabilities": "capabilities",
    "Contract": "contract",
    "BatchData": "data", "make_batch_data": "data",
    "Example": "example",
    "FailureKind": "failures", "Finding": "failures",
    "check_contract": "invariants", "check_decode_invariant": "invariants", "check_prefill_invariant": "invariants",
    "check_unified_invariant": "invariants",
    "CacheLayout": "layouts", "LayoutError": "layouts", "NHDLayout": "layouts", "VllmPagedLayout": "layouts",
    "CacheState": "materialize",
    "Oracle": "oracles", "OracleFailure": "oracles", "check_agreement": "oracles", "check_finite": "oracles",
    "PagedCall": "paged_call",
    "Poison": "poison",
    "reference_attention": "reference", "same_precision_attention": "reference",
    "Check": "violations", "Severity": "violations", "Violation": "violations",
}
# A function named like its module (materialize) is not exported here: importing the submodule rebinds the
# package attribute to the module. Import it from kvfuzz.contracts.materialize.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
