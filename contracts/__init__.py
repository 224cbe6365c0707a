"""kvfuzz.contracts: the model of one paged-attention call (Batch), its ground-truth tensors, the fp64
reference, cache layouts and the materializer, the invariants a caller must meet, the checks of a real call's
arguments, and the oracles a kernel must pass. Depends on torch and attrs only; names load lazily."""

from .lazy import lazy_exports

_EXPORTS = {
    "DTYPES": "model.space", "KV_CACHE_DTYPES": "model.space", "FEATURES": "model.space", "VALUE_RANGES": "model.space",
    "Batch": "model.batch",
    "positions": "model.space",
    "Capabilities": "model.capabilities",
    "Contract": "model.contract",
    "BatchData": "model.data", "make_batch_data": "model.data",
    "Example": "model.example",
    "FailureKind": "checks.failures", "Finding": "checks.failures",
    "check_contract": "checks.invariants", "check_decode_invariant": "checks.invariants",
    "check_prefill_invariant": "checks.invariants",
    "check_unified_invariant": "checks.invariants",
    "CacheLayout": "caches.layouts", "LayoutError": "caches.layouts", "NHDLayout": "caches.layouts",
    "VllmPagedLayout": "caches.layouts",
    "CacheState": "caches.materialize",
    "Oracle": "checks.oracles", "OracleFailure": "checks.oracles", "check_agreement": "checks.oracles",
    "check_finite": "checks.oracles",
    "PagedCall": "calls.paged_call",
    "Poison": "model.poison",
    "reference_attention": "checks.reference", "same_precision_attention": "checks.reference",
    "Check": "checks.violations", "Severity": "checks.violations", "Violation": "checks.violations",
}
# A function named like its module (materialize) is not exported here: importing the submodule rebinds the
# package attribute to the module. Import it from kvfuzz.contracts.caches.materialize.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
