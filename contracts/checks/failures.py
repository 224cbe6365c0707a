"""One failure taxonomy for fuzz summaries, reproducers (case.json) and checks, and the exceptions a property
raises, one class per failure kind (so Hypothesis shrinks each kind separately).

Every finding names whose fault it is: the caller's (a broken cache contract: the kernel was handed a cache
that did not hold what its contract requires), the kernel's (it was handed a correct call and got the
answer wrong, produced NaN/inf, crashed or hung), or the harness's (kvfuzz or the target's adapter raised,
crashed or hung outside the kernel call: building the call, checking its output). Configurations outside a target's
declaration have two outcomes of their own: rejected with an error (expected, not a failure) or silently accepted and
computed wrongly (a failure: wrong answers instead of an error).
"""

from __future__ import annotations

import enum
from typing import Any


class FailureKind(enum.Enum):
    CALLER_VIOLATION = "caller contract violation"
    KERNEL_MISMATCH = "kernel mismatch"
    NON_FINITE = "non-finite output"
    KERNEL_CRASH = "kernel crash"
    KERNEL_HANG = "kernel hang"
    CONFIG_REJECTED = "configuration rejected"
    SILENT_UNSUPPORTED = "silently accepted but unsupported"
    HARNESS_ERROR = "harness error"
    MEMORY_SAFETY = "memory safety"

    @property
    def blame(self) -> str:
        """"caller", "kernel", "harness" (kvfuzz or the target's adapter), or "none" for a rejected
        configuration (the expected outcome)."""
        if self is FailureKind.CONFIG_REJECTED:
            return "none"
        if self is FailureKind.HARNESS_ERROR:
            return "harness"
        return "caller" if self is FailureKind.CALLER_VIOLATION else "kernel"

    @property
    def is_failure(self) -> bool:
        return self is not FailureKind.CONFIG_REJECTED

    @property
    def slug(self) -> str:
        return self.name.lower().replace("_", "-")


class Finding(AssertionError):
    """A failed example: ``kind`` (whose fault), ``check`` (the invariant or oracle, a string: a
    :class:`~kvfuzz.contracts.checks.violations.Check` value or an oracle name), a message, and details (violations and
    oracle failures as dicts, the kernel path, what the kernel computed)."""

    kind: FailureKind

    def __init__(self, check: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(f"[{self.kind.value}] {check}: {message}")
        self.check = check
        self.message = message
        self.details = details or {}
        #: The id of the findings-baseline entry this finding is (``kvfuzz fuzz --baseline``), or None: new.
        self.known: str | None = None

    @property
    def signature(self) -> tuple[str, ...]:
        """What makes two findings the same bug for deduplication: failure kind and check, and for a finding
        a baseline accepts its entry's id (so a known finding never hides a new one of the same kind and
        check)."""
        return (self.kind.value, self.check) if self.known is None else (self.kind.value, self.check, self.known)


def _finding_class(name: str, kind: FailureKind) -> type[Finding]:
    """The :class:`Finding` subclass ``name`` of failure kind ``kind``, for a kind whose class adds nothing but its
    kind (one class a kind: Hypothesis shrinks each kind separately)."""
    return type(name, (Finding,), {"kind": kind, "__module__": __name__})


CallerContractViolation = _finding_class("CallerContractViolation", FailureKind.CALLER_VIOLATION)
KernelMismatch = _finding_class("KernelMismatch", FailureKind.KERNEL_MISMATCH)
NonFiniteOutput = _finding_class("NonFiniteOutput", FailureKind.NON_FINITE)
KernelCrash = _finding_class("KernelCrash", FailureKind.KERNEL_CRASH)
KernelHang = _finding_class("KernelHang", FailureKind.KERNEL_HANG)
SilentlyUnsupported = _finding_class("SilentlyUnsupported", FailureKind.SILENT_UNSUPPORTED)


class ConfigurationRejected(Finding):
    """Not a failure (its kind's ``is_failure`` is False): a configuration outside the target's declaration that
    the kernel refused with a clear error, the expected answer. A campaign only counts these
    (``rejections``); written as a case (``check``: the text the error must contain) it lets a replay confirm
    the refusal stays clear (kvfuzz.fuzz.campaign.store.reproducers)."""

    kind = FailureKind.CONFIG_REJECTED


class HarnessError(Finding):
    """kvfuzz or the target's adapter failed outside the kernel call (``build_call`` raised, a layout could not
    hold a declared batch, the process died or hung in ``prepare``/``check``): never blamed on the kernel."""

    kind = FailureKind.HARNESS_ERROR


class MemorySafetyError(Finding):
    """An invalid memory access by the kernel (``kvfuzz fuzz --sanitize``: compute-sanitizer memcheck on CUDA,
    kvfuzz.fuzz.harness.sanitizer): ``details["accesses"]`` each access (kernel, source file and line, size in bytes,
    offset from the nearest allocation), ``details["report"]`` the report's tail. Blamed on the kernel."""

    kind = FailureKind.MEMORY_SAFETY


FINDING_CLASSES: dict[FailureKind, type[Finding]] = {
    c.kind: c for c in (CallerContractViolation, KernelMismatch, NonFiniteOutput, KernelCrash, KernelHang,
                        ConfigurationRejected, SilentlyUnsupported, HarnessError, MemorySafetyError)}


def hide_frame_for_finding(excinfo) -> bool:
    """pytest's ``__tracebackhide__`` for the frames of kvfuzz's property (``__tracebackhide__ =
    hide_frame_for_finding`` in a function's body): a :class:`Finding` raised through them shows the user's test,
    the finding and the shrunk example only, not kvfuzz's code; any other exception (a bug in an adapter or in
    kvfuzz) keeps every frame. ``excinfo``: pytest's ExceptionInfo, or None (then the frame is shown)."""
    return excinfo is not None and excinfo.errisinstance(Finding)


__all__ = ["FINDING_CLASSES", "CallerContractViolation", "ConfigurationRejected", "FailureKind", "Finding",
           "HarnessError", "KernelCrash", "KernelHang", "KernelMismatch", "MemorySafetyError", "NonFiniteOutput",
           "SilentlyUnsupported", "hide_frame_for_finding"]
