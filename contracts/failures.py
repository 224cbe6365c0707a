"""One failure taxonomy for fuzz summaries, reproducers (case.json) and checks.

Every finding names whose fault it is: the caller's (a broken cache contract: the kernel was handed a cache
that did not hold what its contract requires) or the kernel's (it was handed a correct call and got the
answer wrong, produced NaN/inf, crashed or hung). Configurations outside a target's declaration have two
outcomes of their own: rejected with an error (expected, not a failure) or silently accepted and computed
wrongly (a failure: wrong answers instead of an error).
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    CALLER_VIOLATION = "caller contract violation"
    KERNEL_MISMATCH = "kernel mismatch"
    NON_FINITE = "non-finite output"
    KERNEL_CRASH = "kernel crash"
    KERNEL_HANG = "kernel hang"
    CONFIG_REJECTED = "configuration rejected"
    SILENT_UNSUPPORTED = "silently accepted but unsupported"

    @property
    def blame(self) -> str:
        """"caller", "kernel", or "none" for a rejected configuration (the expected outcome)."""
        if self is FailureKind.CONFIG_REJECTED:
            return "none"
        return "caller" if self is FailureKind.CALLER_VIOLATION else "kernel"

    @property
    def is_failure(self) -> bool:
        return self is not FailureKind.CONFIG_REJECTED

    @property
    def slug(self) -> str:
        return self.name.lower().replace("_", "-")
