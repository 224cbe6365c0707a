"""kvfuzz: property-based fuzzing of paged KV-cache attention kernels and of the contracts their callers keep.

The public API, what an adapter or a test imports (every name loads lazily; ``import kvfuzz`` costs no torch)::

    import kvfuzz

    class MyKernel(kvfuzz.Target): ...                       # an adapter: declare, lay out, build, run
    kvfuzz.Capabilities(contract=kvfuzz.Contract.UNIFIED, ...)
    with kvfuzz.guard(mode="raise"): run_my_kernel_tests()   # the runtime guard

    @given(kvfuzz.examples(MyKernel.capabilities))            # the Hypothesis strategies
    def test_my_kernel(example):
        kvfuzz.check_example(MyKernel(), example)             # the property: a Run, or raises a kvfuzz.Finding

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


def _from(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


_EXPORTS = {
    # the model of one call, its data and its cache
    **_from("contracts.model.batch", "Batch", "contiguous_batch"), **_from("contracts.model.data", "BatchData"),
    **_from("contracts.model.example", "Example"), **_from("contracts.model.poison", "Poison"),
    **_from("contracts.model.capabilities", "Capabilities"), **_from("contracts.model.contract", "Contract"),
    **_from("contracts.caches.layouts", "CacheLayout", "NHDLayout", "VllmPagedLayout", "LayoutError"),
    **_from("contracts.caches.materialize", "CacheState"),
    # what a check finds
    **_from("contracts.checks.violations", "Check", "Violation"),
    **_from("contracts.checks.failures", "FailureKind", "Finding", "CallerContractViolation", "KernelCrash",
            "KernelMismatch", "NonFiniteOutput"),
    # the Hypothesis strategies
    **_from("strategies.limits", "Limits"), **_from("strategies.batches", "batches", "examples"),
    # the Target API and the registry; the CSR lists an adapter of an SGLang- or FlashInfer-style kernel builds
    **_from("fuzz.targets.base", "Target", "KernelCall", "Availability"),
    **_from("contracts.model.csr", "token_slot_lists", "page_lists"),
    **_from("fuzz.targets.registry", "get_target", "registered"),
    # the property: one example against a target, and the caller faults it can plant
    **_from("fuzz.harness.properties", "check_example"), **_from("fuzz.harness.run", "Run"),
    **_from("fuzz.harness.faults", "CallerFault", "get_fault"),
    # the runtime guard
    **_from("fuzz.guard.interception", "guard", "Guard", "GuardRecord", "CallerContractError", "KvfuzzGuardWarning"),
}
# tests/test_public_api.py lists these names too: a change to the public surface is a change to that test.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["__version__", *sorted(_EXPORTS)]
