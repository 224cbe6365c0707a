"""The runtime guard: :mod:`.signatures` (the table of every kernel's call signature, built from the kernel
families of :mod:`kvfuzz.fuzz.targets.registry`),
:mod:`.interception` (:func:`guard`, :class:`Guard`, its records and errors), :mod:`.patching` (patching kernels
wherever imported, and restoring them) and :mod:`.plugin` (the pytest plugin). Names load lazily: pytest
imports the plugin without torch."""

from kvfuzz.contracts.lazy import lazy_exports

_EXPORTS = {n: "interception" for n in ("MODES", "CallerContractError", "Guard", "GuardRecord", "KvfuzzGuardWarning",
                                         "guard")}
_EXPORTS |= {n: "patching" for n in ("KERNELS", "active_guard", "is_guarded", "original_of")}
_EXPORTS |= {n: "signatures" for n in ("PAGE_LIST_SIGNATURES", "SIGNATURES", "KernelSignature", "PageListSignature",
                                        "check_kernel_call", "signature_of")}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
