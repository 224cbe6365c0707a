"""Exceptions a property raises, one class per failure kind, so Hypothesis shrinks each kind separately."""

from __future__ import annotations

from typing import Any

from kvfuzz.contracts.failures import FailureKind


class Finding(AssertionError):
    """A failed example: ``kind`` (whose fault), ``check`` (the invariant or oracle), a message, and details
    (violations/oracle failures as dicts, the kernel path, what the kernel computed)."""

    kind: FailureKind

    def __init__(self, check: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(f"[{self.kind.value}] {check}: {message}")
        self.check = check
        self.message = message
        self.details = details or {}

    @property
    def signature(self) -> tuple[str, str]:
        """What makes two findings the same bug for deduplication: failure kind and check."""
        return (self.kind.value, self.check)


class CallerContractViolation(Finding):
    kind = FailureKind.CALLER_VIOLATION


class KernelMismatch(Finding):
    kind = FailureKind.KERNEL_MISMATCH


class NonFiniteOutput(Finding):
    kind = FailureKind.NON_FINITE


class KernelCrash(Finding):
    kind = FailureKind.KERNEL_CRASH


class KernelHang(Finding):
    kind = FailureKind.KERNEL_HANG


class SilentlyUnsupported(Finding):
    kind = FailureKind.SILENT_UNSUPPORTED


FINDING_CLASSES = {c.kind: c for c in (CallerContractViolation, KernelMismatch, NonFiniteOutput, KernelCrash,
                                       KernelHang, SilentlyUnsupported)}
