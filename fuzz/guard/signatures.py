"""The guard's table of kernel signatures, built from the registered kernel families: every
:class:`~kvfuzz.fuzz.targets.signature.KernelSignature` (a kernel the guard intercepts where it is defined, and
checks through :func:`~kvfuzz.contracts.calls.call_checks.check_call`) and every
:class:`~kvfuzz.fuzz.targets.signature.PageListSignature` (a call checked from its page lists: FlashInfer's
plan()/run() and append, hooked by :mod:`kvfuzz.fuzz.guard.flashinfer`), by name.

A family's signatures live in its home, ``fuzz/targets/<family>.py`` (its ``SIGNATURES``, next to its targets);
:data:`kvfuzz.fuzz.targets.registry.FAMILIES` lists the homes, and :func:`table` collects them here, once, at
import. Nothing here imports a kernel library: the family modules load theirs lazily.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Mapping

from kvfuzz.contracts.calls.paged_call import PagedCall
from kvfuzz.contracts.checks.violations import Violation
from kvfuzz.fuzz.targets.registry import families
from kvfuzz.fuzz.targets.signature import CheckedKernel, KernelSignature, PageListSignature


def table(homes: Iterable[ModuleType]) -> tuple[dict[str, KernelSignature], dict[str, PageListSignature]]:
    """The signatures listed by ``homes`` (family modules, each with a ``SIGNATURES`` tuple), by name: the
    intercepted kernels, then the page-list calls. Raises ValueError naming the module when a family lists no
    ``SIGNATURES``, lists something that is not a signature, or reuses a name another family took."""
    kernels: dict[str, KernelSignature] = {}
    page_lists: dict[str, PageListSignature] = {}
    for home in homes:
        sigs = getattr(home, "SIGNATURES", None)
        if not isinstance(sigs, tuple):
            raise ValueError(f"kernel family {home.__name__} has no SIGNATURES tuple (add `SIGNATURES = ()` when "
                             "none of its kernels is checked)")
        for sig in sigs:
            if not isinstance(sig, (KernelSignature, PageListSignature)):
                raise ValueError(f"{home.__name__}.SIGNATURES holds {sig!r}, not a KernelSignature or "
                                 "PageListSignature (kvfuzz.fuzz.targets.signature)")
            if sig.name in kernels or sig.name in page_lists:
                raise ValueError(f"{home.__name__} declares kernel {sig.name!r}, which another family declares "
                                 "already: give it a name of its own (e.g. prefixed with the library)")
            (kernels if isinstance(sig, KernelSignature) else page_lists)[sig.name] = sig
    return kernels, page_lists


#: SIGNATURES: every kernel the guard intercepts and the harness checks, by name; PAGE_LIST_SIGNATURES: every
#: call checked from its page lists (FlashInfer's), by name. Both from every registered family.
SIGNATURES, PAGE_LIST_SIGNATURES = table(families())


def signature_of(kernel: CheckedKernel | str) -> CheckedKernel:
    """The signature ``kernel`` names: a signature itself (a target's ``checked_kernel``), or its name in
    :data:`SIGNATURES` or :data:`PAGE_LIST_SIGNATURES`. Raises KeyError naming the known kernels."""
    if isinstance(kernel, (KernelSignature, PageListSignature)):
        return kernel
    found = SIGNATURES.get(kernel) or PAGE_LIST_SIGNATURES.get(kernel)
    if found is None:
        raise KeyError(f"unknown kernel {kernel!r}; kvfuzz knows {', '.join([*SIGNATURES, *PAGE_LIST_SIGNATURES])}")
    return found


def _kernel_signature(kernel: KernelSignature | str) -> KernelSignature:
    if isinstance(kernel, KernelSignature):
        return kernel
    try:
        return SIGNATURES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r}; kvfuzz knows {', '.join(SIGNATURES)}") from None


def build_call(kernel: KernelSignature | str, args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
    """The :class:`PagedCall` of one call of ``kernel`` (a signature, or its name in :data:`SIGNATURES`) from its
    arguments bound by parameter name (:meth:`KernelSignature.build_call`). ``key``/``value`` (``[T, Hkv, D]``):
    the new tokens of a unified kernel's call, when known (ignored by kernels that take them as arguments).
    Raises KeyError naming the known kernels."""
    return _kernel_signature(kernel).build_call(args, key, value)


def check_kernel_call(kernel: KernelSignature | str, args: Mapping[str, Any], *, key: Any = None,
                      value: Any = None, **kw: Any) -> list[Violation]:
    """:func:`~kvfuzz.contracts.calls.call_checks.check_call` on one call of ``kernel`` (see :func:`build_call`);
    ``kw`` goes to check_call (``rocm_arch``, ``portability_archs``, ``vacuity``)."""
    return _kernel_signature(kernel).check(args, key=key, value=value, **kw)


__all__ = ["KernelSignature", "PAGE_LIST_SIGNATURES", "PageListSignature", "SIGNATURES", "build_call",
           "check_kernel_call", "signature_of", "table"]
