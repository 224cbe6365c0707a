"""The runtime guard: :mod:`.signatures` (how each kernel's arguments map onto a checked call),
:mod:`.interception` (:func:`guard`, :class:`Guard`, its records and errors), :mod:`.patching` (patching kernels
wherever imported, and restoring them) and :mod:`.plugin` (the pytest plugin). Names load lazily: pytest
imports the plugin without torch."""

from kvfuzz.contracts.lazy import lazy_exports

_EXPORTS = {n: "interception" for n in ("MODES", "CallerContractError", "Guard", "GuardRecord", "KvfuzzGuardWarning",
                                         "guard")}
_EXPORTS |= {n: "patching" for n in ("KERNELS", "active_guard", "is_guarded", "original_of")}
_EXPORTS |= {"SIGNATURES": "signatures", "KernelSignature": "signatures", "check_kernel_call": "signatures"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
