"""One failure taxonomy for fuzz summaries, reproducers (case.json) and checks.

Every finding names whose fault it is: the caller's (a broken cache contract: the kernel was handed a cache
that did not hold what its contract requires) or the kernel's (it was handed a correct call and got the
answer wrong, produced NaN/inf, or crashed).
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    CALLER_VIOLATION = "caller contract violation"
    KERNEL_MISMATCH = "kernel mismatch"
    NON_FINITE = "non-finite output"
    KERNEL_CRASH = "kernel crash"
    KERNEL_HANG = "kernel hang"

    @property
    def blame(self) -> str:
        """"caller" or "kernel"."""
        return "caller" if self is FailureKind.CALLER_VIOLATION else "kernel"

    @property
    def slug(self) -> str:
        return self.name.lower().replace("_", "-")
