"""The runtime guard: :mod:`.signatures` (how each kernel's arguments map onto a checked call),
:mod:`.interception` (patching kernels wherever imported; :func:`guard`, :class:`Guard`) and :mod:`.plugin`
(the pytest plugin). Names load lazily: pytest imports the plugin without torch."""

from kvfuzz.contracts.lazy import lazy_exports

_EXPORTS = {n: "interception" for n in ("MODES", "KERNELS", "CallerContractError", "Guard", "GuardRecord",
                                         "KvfuzzGuardWarning", "active_guard", "guard", "is_guarded", "original_of")}
_EXPORTS |= {"SIGNATURES": "signatures", "KernelSignature": "signatures", "check_kernel_call": "signatures"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
