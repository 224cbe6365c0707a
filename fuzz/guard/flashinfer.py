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

The same checks run on every example of a FlashInfer campaign: a target names one of :data:`CHECKED_KERNELS`
as its ``checked_kernel`` and the harness calls :func:`check_call` on the call it builds (kvfuzz.fuzz.harness.
caller), so a caller fault is reported under the names the hooks use (``kv_last_page_len``, ``kv_indptr``,
``kv_indices range``, ``plan/run agreement``, ``unified invariant``, ``append positions``).

Hooking it in: ``with flashinfer_guard(): ...`` (or ``install()`` ... ``uninstall()``) while a guard is
active; the guard's own ``__enter__`` does not install it. The pytest plugin (``--kvfuzz-guard``) installs it
for the session when flashinfer is installed. ``install`` imports flashinfer (or takes ``module=``, e.g. a stand-in in tests) and returns
False when there is none. Nested installs are counted; the last ``uninstall`` restores the originals.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator

from kvfuzz.contracts.calls.page_contents import check_append, check_current_tokens
from kvfuzz.contracts.calls.page_lists import PagePlan, check_plan, check_run, make_plan
from kvfuzz.contracts.checks.violations import Check, Violation
from kvfuzz.fuzz.guard.interception import Guard, active_guard

WRAPPERS = {"BatchDecodeWithPagedKVCacheWrapper": "decode", "BatchPrefillWithPagedKVCacheWrapper": "prefill"}
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


def plan_of(kind: str, a: dict[str, Any], kv_layout: str = "NHD") -> PagePlan:
    """The :class:`PagePlan` of a plan() call's arguments by name (decode: flashinfer/decode.py
    ``BatchDecodeWithPagedKVCacheWrapper.plan`` names; prefill: flashinfer/prefill.py
    ``BatchPrefillWithPagedKVCacheWrapper.plan`` names) for a wrapper of ``kv_layout``. ``data_type`` (decode,
    deprecated) stands for both dtypes when given. Raises KeyError when a page-list argument is missing."""
    q_dt = a.get("q_data_type", "float16")
    kv_dt = a.get("kv_data_type")
    if a.get("data_type") is not None:
        q_dt = q_dt or a["data_type"]
        kv_dt = kv_dt or a["data_type"]
    if kind == "decode":
        return make_plan("decode", a["indptr"], a["indices"], a["last_page_len"], a["num_qo_heads"],
                         a["num_kv_heads"], a["head_dim"], a["page_size"], q_data_type=q_dt, kv_data_type=kv_dt,
                         kv_layout=kv_layout, window_left=a.get("window_left", -1))
    return make_plan("prefill", a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"],
                     a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"], a["page_size"],
                     qo_indptr=a["qo_indptr"], q_data_type=q_dt, kv_data_type=kv_dt, kv_layout=kv_layout,
                     window_left=a.get("window_left", -1), causal=a.get("causal", False))


def run_checks(plan: PagePlan | None, a: dict[str, Any], kernel: str, new_kv: tuple | None = None,
               tokens: bool = True) -> list[Violation]:
    """What the run() hook checks: run()'s ``q`` and ``paged_kv_cache`` against ``plan``
    (:func:`~kvfuzz.contracts.calls.page_lists.check_run`) and, with the call's new tokens ``new_kv = (k, v)``
    (``[rows, Hkv, D]`` in qo_indptr order) and ``tokens``, the current tokens in the pages
    (:func:`~kvfuzz.contracts.calls.page_contents.check_current_tokens`, skipped after a memory-unsafe
    violation: the lists cannot be followed then)."""
    out = check_run(plan, a.get("q"), a.get("paged_kv_cache"), kernel)
    if new_kv is not None and tokens and plan is not None and not any(v.check.memory_unsafe for v in out):
        out += check_current_tokens(plan, a["paged_kv_cache"], new_kv[0], new_kv[1], a.get("k_scale"),
                                    a.get("v_scale"))
    return out


def append_checks(a: dict[str, Any]) -> list[Violation]:
    """What the append_paged_kv_cache hook checks (:func:`~kvfuzz.contracts.calls.page_contents.check_append`),
    on its arguments by name (flashinfer/page.py ``append_paged_kv_cache``)."""
    return check_append(a["append_key"], a["append_value"], a["batch_indices"], a["positions"], a["paged_kv_cache"],
                        a["kv_indices"], a["kv_indptr"], a["kv_last_page_len"], a.get("kv_layout", "NHD"))


#: FlashInfer calls a target names as its ``checked_kernel`` (kvfuzz.fuzz.targets.base.Target): every example
#: of its campaigns then goes through the checks these hooks apply (:func:`check_call`), by the same names.
CHECKED_KERNELS = {"flashinfer.BatchDecodeWithPagedKVCacheWrapper": "decode",
                   "flashinfer.BatchPrefillWithPagedKVCacheWrapper": "prefill",
                   "flashinfer.append_paged_kv_cache": "append"}


def check_call(kernel: str, args: dict[str, Any], kv_layout: str = "NHD", key: Any = None,
               value: Any = None) -> list[Violation]:
    """Everything the hooks check on one call of ``kernel`` (a key of :data:`CHECKED_KERNELS`), from its
    arguments by name: for a wrapper, plan()'s (:func:`~kvfuzz.contracts.calls.page_lists.check_plan`) then
    run()'s (:func:`run_checks`, the current tokens when ``key``/``value`` ``[rows, Hkv, D]`` are given and the
    plan is well formed) for a wrapper of ``kv_layout``; for append_paged_kv_cache, :func:`append_checks`.
    Raises KeyError for an unknown kernel or a missing argument."""
    kind = CHECKED_KERNELS[kernel]
    if kind == "append":
        return append_checks(args)
    plan = plan_of(kind, args, kv_layout)
    out = check_plan(plan)
    sound = not any(v.check.memory_unsafe or v.check in (Check.KV_INDPTR, Check.INDEX_DTYPE) for v in out)
    return out + run_checks(plan, args, kernel, None if key is None else (key, value), tokens=sound)


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


def _wrap_append(original: Callable) -> Callable:
    kernel = "flashinfer.append_paged_kv_cache"

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
        fn = getattr(module, "append_paged_kv_cache", None)
        page = getattr(module, "page", None) or sys.modules.get(f"{module.__name__}.page")
        if fn is not None:
            w = _wrap_append(fn)
            _set(module, "append_paged_kv_cache", w)
            if page is not None and getattr(page, "append_paged_kv_cache", None) is fn:
                _set(page, "append_paged_kv_cache", w)
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


__all__ = ["CHECKED_KERNELS", "WRAPPERS", "append_checks", "check_call", "flashinfer_guard", "install", "installed",
           "plan_of", "report", "run_checks", "uninstall"]
