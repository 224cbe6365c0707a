"""The runtime guard for FlashInfer, whose caller contract is split between a wrapper's ``plan()`` and its
``run()``: :func:`install` wraps ``plan``/``run`` of ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper`` (class attributes, so wrappers made before installing are covered)
and ``append_paged_kv_cache`` (flashinfer.page's and the package's attribute), and reports to the innermost
active :class:`~kvfuzz.fuzz.guard.interception.Guard` (``guard()`` or the pytest plugin's), with its mode:

- ``plan()``: the page lists are remembered on the wrapper instance (``_kvfuzz_plan``) and checked
  (:func:`kvfuzz.contracts.calls.page_lists.check_plan`: index dtypes, kv_indptr, kv_last_page_len, kv_len vs
  qo_len);
- ``run()``: q and the cache against the plan, page ids in range (``check_run``; a wrapper planned before
  install() is not checked, only counted in ``guard.unchecked``), and, inside
  ``guard.new_kv(k, v)`` (the call's new tokens, ``[rows, Hkv, D]`` in qo_indptr order), that every query row's
  own token is in the pages where the lists put it (``check_current_tokens``: a decode's current token at slot
  ``last_page_len - 1`` of its last page);
- ``append_paged_kv_cache``: ``check_append``.

Each checked call counts in ``guard.calls`` under ``flashinfer.<Class>.plan``/``.run`` or
``flashinfer.append_paged_kv_cache``; its violations become one :class:`GuardRecord`.

What the hooks know of FlashInfer's calls lives in the family's home, :mod:`kvfuzz.fuzz.targets.flashinfer`:
which calls there are (its ``SIGNATURES``, each a :class:`~kvfuzz.fuzz.targets.signature.PageListSignature`:
the wrapper classes and functions patched here are read from them, :data:`WRAPPERS`) and their checks
(``plan_of``, ``run_checks``, ``append_checks``). The same checks run on every example of a FlashInfer campaign:
a target names its call's signature as ``checked_kernel`` and the harness runs its ``check`` on the call it
builds (kvfuzz.fuzz.harness.caller), so a caller fault is reported under the names the hooks use
(``kv_last_page_len``, ``kv_indptr``, ``kv_indices range``, ``plan/run agreement``, ``unified invariant``,
``append positions``).

Hooking it in: ``with flashinfer_guard(): ...`` (or ``install()`` ... ``uninstall()``) while a guard is
active; the guard's own ``__enter__`` does not install it. The pytest plugin (``--kvfuzz-guard``) installs it
for the session when flashinfer is installed. ``install`` imports flashinfer (or takes ``module=``, e.g. a stand-in in
tests) and returns False when there is none. Nested installs are counted; the last ``uninstall`` restores the originals.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator

from kvfuzz.contracts.calls.page_lists import check_plan
from kvfuzz.contracts.checks.violations import Violation
from kvfuzz.fuzz.guard.interception import Guard, active_guard
from kvfuzz.fuzz.guard.signatures import PAGE_LIST_SIGNATURES
from kvfuzz.fuzz.targets.flashinfer import append_checks, plan_of, run_checks

#: FlashInfer's wrapper classes whose plan()/run() are wrapped: class name -> "decode" or "prefill" (read off
#: the family's signatures).
WRAPPERS = {s.attr: s.kind for s in PAGE_LIST_SIGNATURES.values() if s.package == "flashinfer" and s.kind != "append"}
#: FlashInfer's functions taking page lists to append to the cache (flashinfer.page's and the package's attribute).
APPENDS = tuple(s.attr for s in PAGE_LIST_SIGNATURES.values() if s.package == "flashinfer" and s.kind == "append")
_PLAN_ATTR = "_kvfuzz_plan"
_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"count": 0, "patched": []}
_TLS = threading.local()


def _guard() -> Guard | None:
    g = active_guard()
    return None if g is None or g.paused or getattr(_TLS, "depth", 0) else g


def _caller(depth: int) -> str:
    try:
        f = sys._getframe(depth)
    except ValueError:
        return ""
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def report(guard: Guard, kernel: str, check: Callable[[], list[Violation]], caller: str) -> None:
    """Run ``check`` and act on its violations as :meth:`Guard.report` does for the kernels it intercepts."""
    guard.report(kernel, check, caller, stacklevel=5)


def _bind(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        b = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    b.apply_defaults()
    out = dict(b.arguments)
    out.update(out.pop("kwargs", {}) or {})
    return out


def _wrap_plan(cls_name: str, kind: str, original: Callable) -> Callable:
    kernel = f"flashinfer.{cls_name}.plan"

    @functools.wraps(original)
    def plan(self, *args, **kwargs):
        g = _guard()
        self.__dict__.pop(_PLAN_ATTR, None)  # a plan made unguarded leaves no stale one behind
        if g is not None:
            a = _bind(original, (self, *args), kwargs)
            if a is not None:
                try:
                    p = plan_of(kind, a, getattr(self, "_kv_layout", "NHD"))
                except Exception:
                    p = None
                self.__dict__[_PLAN_ATTR] = p  # None: run() is then not checked (counted in guard.unchecked)
                if p is not None:
                    report(g, kernel, lambda: check_plan(p), _caller(2))
        return original(self, *args, **kwargs)

    plan.__kvfuzz_guard_original__ = original
    return plan


def _wrap_run(cls_name: str, original: Callable) -> Callable:
    kernel = f"flashinfer.{cls_name}.run"

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        g = _guard()
        if g is not None:
            a = _bind(original, (self, *args), kwargs)
            if a is not None:
                p = self.__dict__.get(_PLAN_ATTR)
                new = g._new_kv

                def checks() -> list[Violation]:
                    return run_checks(p, a, kernel, new)

                if p is None:  # planned before install() or a plan() the guard could not read: nothing to compare
                    g.unchecked[kernel] += 1
                else:
                    report(g, kernel, checks, _caller(2))
        _TLS.depth = getattr(_TLS, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _TLS.depth -= 1

    run.__kvfuzz_guard_original__ = original
    return run


def _wrap_append(attr: str, original: Callable) -> Callable:
    kernel = f"flashinfer.{attr}"

    @functools.wraps(original)
    def append_paged_kv_cache(*args, **kwargs):
        g = _guard()
        if g is not None:
            a = _bind(original, args, kwargs)
            if a is not None:
                report(g, kernel, lambda: append_checks(a), _caller(2))
        return original(*args, **kwargs)

    append_paged_kv_cache.__kvfuzz_guard_original__ = original
    return append_paged_kv_cache


def _set(owner: Any, attr: str, new: Any) -> None:
    _STATE["patched"].append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
    setattr(owner, attr, new)


def install(module: Any = None) -> bool:
    """Wrap FlashInfer's wrapper classes' plan/run and append_paged_kv_cache (module docstring). ``module``:
    the flashinfer package (default: import it). Returns False (nothing patched) when there is no
    flashinfer; nested calls only count."""
    with _LOCK:
        if _STATE["count"]:
            _STATE["count"] += 1
            return True
        if module is None:
            try:
                module = importlib.import_module("flashinfer")
            except Exception:
                return False
        for cls_name, kind in WRAPPERS.items():
            cls = getattr(module, cls_name, None)
            if not isinstance(cls, type):
                continue
            if "plan" in cls.__dict__:
                _set(cls, "plan", _wrap_plan(cls_name, kind, cls.__dict__["plan"]))
            if "run" in cls.__dict__:
                _set(cls, "run", _wrap_run(cls_name, cls.__dict__["run"]))
        page = getattr(module, "page", None) or sys.modules.get(f"{module.__name__}.page")
        for attr in APPENDS:
            fn = getattr(module, attr, None)
            if fn is not None:
                w = _wrap_append(attr, fn)
                _set(module, attr, w)
                if page is not None and getattr(page, attr, None) is fn:
                    _set(page, attr, w)
        _STATE["count"] = 1
        return True


def uninstall() -> None:
    """Undo the last :func:`install` (the originals come back when every install is undone)."""
    with _LOCK:
        if not _STATE["count"]:
            return
        _STATE["count"] -= 1
        if _STATE["count"]:
            return
        for owner, attr, original in reversed(_STATE["patched"]):
            setattr(owner, attr, original)
        _STATE["patched"].clear()


def installed() -> bool:
    return _STATE["count"] > 0


@contextlib.contextmanager
def flashinfer_guard(module: Any = None) -> Iterator[bool]:
    """``install()`` for the block; yields whether flashinfer was there to patch."""
    ok = install(module)
    try:
        yield ok
    finally:
        if ok:
            uninstall()


__all__ = ["APPENDS", "WRAPPERS", "flashinfer_guard", "install", "installed", "report", "uninstall"]
