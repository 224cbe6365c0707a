"""kvfuzz.contracts.checks: Ground truth and verdicts: the fp64 reference, the caller invariants against ground truth,
the oracles a kernel's output must pass, the one violation type and the failure taxonomy. Imports caches and the
model."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
