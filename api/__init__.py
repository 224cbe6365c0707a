"""kvfuzz: property-based fuzzing of paged KV-cache attention kernels and of the contracts their callers keep.

The public API, what an adapter or a test imports (every name loads lazily; ``import kvfuzz`` costs no torch)::

    import kvfuzz

    class MyKernel(kvfuzz.Target): ...                       # an adapter: declare, lay out, build, run
    kvfuzz.Capabilities(contract=kvfuzz.Contract.UNIFIED, ...)
    with kvfuzz.guard(mode="raise"): run_my_kernel_tests()   # the runtime guard
    @given(kvfuzz.examples(capabilities))                     # the Hypothesis strategies

The rooms underneath: :mod:`kvfuzz.contracts` (the model, reference, invariants, oracles),
:mod:`kvfuzz.strategies` (Hypothesis strategies), :mod:`kvfuzz.fuzz` (CLI, campaigns, the per-example harness,
the guard, targets, benchmarks); docs/architecture.md in the repository shows how they fit.
"""

from importlib.metadata import PackageNotFoundError, version

from kvfuzz.contracts.lazy import lazy_exports

try:
    __version__ = version("kvfuzz")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Batch": "contracts.model.batch", "Capabilities": "contracts.model.capabilities", "Contract": "contracts.model.contract",
    "BatchData": "contracts.model.data", "Example": "contracts.model.example", "FailureKind": "contracts.checks.failures",
    "Finding": "contracts.checks.failures", "CacheLayout": "contracts.caches.layouts", "LayoutError": "contracts.caches.layouts",
    "NHDLayout": "contracts.caches.layouts", "VllmPagedLayout": "contracts.caches.layouts", "CacheState": "contracts.caches.materialize",
    "Poison": "contracts.model.poison", "Check": "contracts.checks.violations", "Violation": "contracts.checks.violations",
    "Limits": "strategies.limits", "batches": "strategies.batches", "examples": "strategies.batches",
    "Availability": "fuzz.targets.base", "KernelCall": "fuzz.targets.base", "Target": "fuzz.targets.base",
    "get_target": "fuzz.targets.registry", "registered": "fuzz.targets.registry",
    "Guard": "fuzz.guard.interception", "guard": "fuzz.guard.interception", "GuardRecord": "fuzz.guard.interception",
    "CallerContractError": "fuzz.guard.interception", "KvfuzzGuardWarning": "fuzz.guard.interception",
}
# tests/test_public_api.py lists these names too: a change to the public surface is a change to that test.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["__version__", *sorted(_EXPORTS)]
