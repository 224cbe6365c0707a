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

Cost: the checks copy the index tensors to the CPU (a device sync on GPUs) and read the cache only at the decode
tokens' slots plus a sample of the read region (see benchmarks/guard_overhead.py for measured numbers).

What is intercepted, and what is not: :mod:`kvfuzz.fuzz.guard.patching`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator

import attrs

from kvfuzz.contracts.calls.rocm import ROCM_PORTABILITY_ARCHS, current_rocm_arch
from kvfuzz.contracts.checks.failures import CallerContractViolation, FailureKind
from kvfuzz.contracts.checks.violations import Check, Violation
from kvfuzz.fuzz.guard.patching import active_guard, enter, leave
from kvfuzz.fuzz.guard.signatures import SIGNATURES, check_kernel_call

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
        SGLang's decode_attention_fwd) are also checked for the unified invariant: ``key``/``value`` ``[T, Hkv, D]`` are
        the new tokens of the call, in query_start_loc order, and must already be in the cache."""
        prev, self._new_kv = self._new_kv, (key, value)
        try:
            yield self
        finally:
            self._new_kv = prev

    # activation
    def __enter__(self) -> "Guard":
        enter(self)
        return self

    def __exit__(self, *exc) -> None:
        leave(self)

    def __call__(self, fn: Callable) -> Callable:
        """Decorator: run ``fn`` with this guard on."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return run

    # checking
    def check_call(self, kernel: str, bound: dict[str, Any], caller: str) -> None:
        """Check one intercepted call (the patching machinery's wrappers call it), as ``mode`` says."""
        key = value = None
        if not SIGNATURES[kernel].takes_new_kv and self._new_kv is not None:
            key, value = self._new_kv
        self.report(kernel, lambda: check_kernel_call(kernel, bound, key=key, value=value, rocm_arch=self.rocm_arch,
                                                      portability_archs=self.portability_archs,
                                                      vacuity=self.vacuity), caller, stacklevel=4)

    def report(self, kernel: str, check: Callable[[], list[Violation]], caller: str, stacklevel: int = 3) -> None:
        """Run ``check`` (one call's checks) and act on its violations as ``mode`` says: count the call, append
        a :class:`GuardRecord`, raise :class:`CallerContractError` in mode "raise" when a violation is an
        error, warn in "raise"/"warn". A check that itself fails is counted in ``unchecked`` with a warning,
        never breaking the caller's program. ``stacklevel``: the warnings' (the caller of the kernel)."""
        try:
            violations = _with_torch_defaults(check)
        except Exception as e:  # a bug or an unforeseen argument: never break the caller's program
            self.unchecked[kernel] += 1
            warnings.warn(f"kvfuzz guard could not check a {kernel} call from {caller}: {type(e).__name__}: {e}",
                          KvfuzzGuardWarning, stacklevel=stacklevel)
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
            warnings.warn(f"[{rec.kind.value}] {rec.message}", KvfuzzGuardWarning, stacklevel=stacklevel)

    def summary(self) -> str:
        """A few lines: calls checked, calls stopped and calls the guard could not check, violating calls and
        their violations per check (:func:`summary_lines`)."""
        return "\n".join(summary_lines(dict(self.calls), [r.to_dict() for r in self.records], dict(self.unchecked),
                                        self.stopped))


def _with_torch_defaults(fn: Callable[[], list[Violation]]) -> list[Violation]:
    """``fn()`` with torch's default device and dtype as the checks assume them (CPU, float32), whatever the
    caller set: vLLM's test_flashmla.py runs under ``torch.set_default_device("cuda")`` and
    ``set_default_dtype(torch.bfloat16)``, which would put the checks' index tensors on the GPU and their
    sample positions in bf16 (rounded past the end). The caller's defaults are restored afterwards."""
    import torch

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            return fn()
    finally:
        torch.set_default_dtype(dtype)


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


# active_guard: the innermost active Guard (kept here too: code that checks calls for a guard, e.g. other
# interceptors in this package, imports it with Guard)
__all__ = ["MODES", "CallerContractError", "Guard", "GuardRecord", "KvfuzzGuardWarning", "active_guard", "guard",
           "summary_lines"]
