"""What a kernel family declares about each kernel whose calls kvfuzz checks: its call signature, the types a
family module (``fuzz/targets/<family>.py``) lists in its ``SIGNATURES`` tuple next to its targets.

- :class:`KernelSignature`: a kernel the guard intercepts where it is defined (a function, or a ``torch.ops``
  op): how its arguments, bound by parameter name, map onto a
  :class:`~kvfuzz.contracts.calls.paged_call.PagedCall`, where it lives, and what it needs of its caller
  (:class:`~kvfuzz.contracts.calls.declaration.KernelDeclaration`).
- :class:`PageListSignature`: a call whose contract is split between a wrapper's ``plan()`` and ``run()``, or a
  cache append taking page lists (FlashInfer): checked from the arguments of both, by name, with the family's
  own check function.

A target names one of them as its ``checked_kernel`` (:class:`~kvfuzz.fuzz.targets.base.Target`); the guard
builds its table from every registered family (:func:`kvfuzz.fuzz.targets.registry.families`, read by
:func:`kvfuzz.fuzz.guard.signatures.table`). Nothing here imports a kernel library.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from kvfuzz.contracts.calls.call_checks import check_call
from kvfuzz.contracts.calls.declaration import KernelDeclaration
from kvfuzz.contracts.calls.paged_call import PagedCall
from kvfuzz.contracts.checks.violations import Violation


@attrs.frozen
class KernelSignature:
    """One kernel kvfuzz intercepts and checks. name: its key in the guard's table
    (:data:`kvfuzz.fuzz.guard.signatures.SIGNATURES`; stable: reports and reproducers carry it).
    build: ``(args, key=None, value=None) -> PagedCall`` from the call's arguments bound by parameter name
    (``key``/``value``: a unified kernel's new tokens ``[T, Hkv, D]``, when known). takes_new_kv: the kernel
    takes the new tokens' key/value as arguments. attr and modules: the function's name and the modules that
    may define it (the guard patches them); op_namespace: for a ``torch.ops`` op instead, its namespace.
    declaration: what the kernel needs of its caller, per path; every PagedCall built through
    :meth:`build_call` carries it."""

    name: str
    build: Callable[..., PagedCall]
    attr: str
    modules: tuple[str, ...] = ()
    op_namespace: str | None = None
    takes_new_kv: bool = attrs.field(kw_only=True)
    declaration: KernelDeclaration = attrs.field(kw_only=True)

    def build_call(self, args: Mapping[str, Any], key: Any = None, value: Any = None) -> PagedCall:
        """The :class:`PagedCall` of one call from its arguments bound by parameter name. ``key``/``value``
        (``[T, Hkv, D]``): the new tokens of a unified kernel's call, when known (ignored by kernels that take
        them as arguments). Raises KeyError when a required argument is missing."""
        call = self.build(args) if self.takes_new_kv else self.build(args, key, value)
        call.declaration = self.declaration
        return call

    def check(self, args: Mapping[str, Any], *, key: Any = None, value: Any = None, **kw: Any) -> list[Violation]:
        """:func:`~kvfuzz.contracts.calls.call_checks.check_call` on one call (see :meth:`build_call`); ``kw``
        goes to check_call (``rocm_arch``, ``portability_archs``, ``vacuity``)."""
        return check_call(self.build_call(args, key, value), **kw)


#: What a :class:`PageListSignature` runs on a call: ``(name, args, kv_layout, key=None, value=None)`` ->
#: violations (FlashInfer's: kvfuzz.fuzz.targets.flashinfer.check_call).
PageListCheck = Callable[..., list[Violation]]


@attrs.frozen
class PageListSignature:
    """One call checked from page lists (kv_indptr/kv_indices/kv_last_page_len) rather than intercepted as one
    function: a wrapper class whose ``plan()`` takes the lists and ``run()`` the query and cache, or an append
    function. name: its key in the guard's table (:data:`kvfuzz.fuzz.guard.signatures.PAGE_LIST_SIGNATURES`;
    stable, e.g. ``"flashinfer.BatchDecodeWithPagedKVCacheWrapper"``). kind: ``"decode"``, ``"prefill"`` (a
    wrapper's plan/run) or ``"append"``. attr: the class or function the guard wraps in ``package``.
    checker: the family's check of one call (:data:`PageListCheck`)."""

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(("decode", "prefill", "append")))
    attr: str
    package: str
    checker: PageListCheck

    def check(self, args: Mapping[str, Any], kv_layout: str = "NHD", *, key: Any = None,
              value: Any = None) -> list[Violation]:
        """Everything the guard's hooks check on one call, from its arguments by name (a wrapper: plan()'s and
        run()'s together), for a cache of ``kv_layout``; ``key``/``value`` ``[rows, Hkv, D]``: the call's new
        tokens, when known. Raises KeyError when an argument is missing."""
        return self.checker(self.name, args, kv_layout, key=key, value=value)


#: Either kind of signature: what ``Target.checked_kernel`` names.
CheckedKernel = KernelSignature | PageListSignature

__all__ = ["CheckedKernel", "KernelSignature", "PageListCheck", "PageListSignature"]
