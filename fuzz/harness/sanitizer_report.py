"""compute-sanitizer memcheck's report (kvfuzz.fuzz.harness.sanitizer's children print it): parsed into its invalid
accesses (:func:`parse_memcheck`), and what a whole report decides about one example (:func:`verdict`: clean, a
memory-safety failure, a device that was full, or no report at all).

The report is compute-sanitizer's text::

    ========= Invalid __global__ read of size 4 bytes
    =========     at kernel_unified_attention+0x1b70 in /.../triton_unified_attention.py:432
    =========     by thread (0,0,0) in block (0,0,0)
    =========     Address 0x7f5e2a000204 is out of bounds
    =========     and is 1 bytes after the nearest allocation at 0x7f5e2a000200 of size 4 bytes
    ...
    ========= ERROR SUMMARY: 1 error

each access becoming a :class:`MemoryAccess` (kind, space, size in bytes, kernel, source file and line, address,
offset in bytes from the nearest allocation and on which side, that allocation's size). Lines not prefixed
``=========`` are the program's own output and are ignored.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from kvfuzz.contracts.checks.failures import HarnessError, MemorySafetyError

#: The check name of a memory-safety failure.
CHECK = "memory safety (compute-sanitizer memcheck)"


@attrs.frozen
class MemoryAccess:
    """One invalid access of a report: ``access`` ("read"/"write"/"atomic"/other as printed), ``space``
    ("global", "shared", "local"), ``size`` (bytes), ``kernel`` (name, without the ``+0x..`` offset), ``file`` and
    ``line`` (the source line, None when not printed), ``address`` (hex text), ``offset`` (bytes from the nearest
    allocation, None when not printed), ``side`` ("after" / "before" / None), ``allocation_size`` (bytes, or
    None)."""

    access: str
    space: str
    size: int
    kernel: str | None = None
    file: str | None = None
    line: int | None = None
    address: str | None = None
    offset: int | None = None
    side: str | None = None
    allocation_size: int | None = None

    @property
    def location(self) -> str | None:
        """``"file:line"`` with the file's basename (as a baseline entry's ``locations`` name it), or None when the
        report printed no source line."""
        return f"{Path(self.file).name}:{self.line}" if self.file and self.line is not None else None

    def describe(self) -> str:
        where = self.location or "(no source line)"
        near = (f", {self.offset} bytes {self.side} the nearest allocation of {self.allocation_size} bytes"
                if self.offset is not None else "")
        return f"invalid {self.space} {self.access} of {self.size} bytes in {self.kernel} at {where}{near}"


@attrs.frozen
class MemcheckReport:
    """A parsed report: the accesses, the ``ERROR SUMMARY`` count (None when the report has none: the child
    did not finish) and the other errors' headlines (e.g. "Program hit cudaErrorLaunchFailure")."""

    accesses: tuple[MemoryAccess, ...]
    error_count: int | None
    other: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return self.error_count == 0 and not self.accesses

    @property
    def out_of_memory(self) -> bool:
        """No invalid access, and every other error an allocation that failed ("Program hit
        cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to ..."): the device was full,
        so the example never ran under memcheck; nothing about the kernel's accesses."""
        return not self.accesses and bool(self.other) and all(_OUT_OF_MEMORY.search(o) for o in self.other)


_PREFIX = re.compile(r"^=+\s?")
_INVALID = re.compile(r"Invalid (__\w+__|\w+) (\w+) of size (\d+) bytes?")
_AT = re.compile(r"^\s*at (?:0x[0-9a-f]+ in )?(\S+?)(?:\+0x[0-9a-f]+)?(?: in (.+?):(\d+))?\s*$")
_ADDRESS = re.compile(r"Address (0x[0-9a-f]+)")
_NEAR = re.compile(r"is (\d+) bytes? (after|before) the nearest allocation at 0x[0-9a-f]+ of size (\d+) bytes?")
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_OUT_OF_MEMORY = re.compile(r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|out of memory")


class DeviceFull(Exception):
    """The sanitized run could not get device memory (:attr:`MemcheckReport.out_of_memory`: other processes had
    filled the GPU, e.g. several campaigns sharing it): the example was not sanitized. Not a finding: a
    campaign counts the example with the coverage label ``sanitize: skipped: device full``
    (kvfuzz.fuzz.campaign.runner). memcheck reports it as an error of a CUDA API call ("Program hit
    cudaErrorMemoryAllocation ... on CUDA API call to ..."), which is the device being full, not the kernel's
    access."""


def parse_memcheck(text: str) -> MemcheckReport:
    """Parse compute-sanitizer memcheck output (module docstring); lines not prefixed ``=========`` (the
    program's own output) are ignored. Never raises."""
    accesses: list[dict] = []
    other: list[str] = []
    count = None
    for raw in text.splitlines():
        if not raw.startswith("="):
            continue
        line = _PREFIX.sub("", raw)
        if m := _SUMMARY.search(line):
            count = int(m.group(1))
        elif m := _INVALID.search(line):
            accesses.append(dict(space=m.group(1).strip("_"), access=m.group(2), size=int(m.group(3))))
        elif accesses and (m := _AT.match(line)) and "kernel" not in accesses[-1]:
            accesses[-1].update(kernel=m.group(1), file=m.group(2), line=int(m.group(3)) if m.group(3) else None)
        elif accesses and (m := _ADDRESS.search(line)):
            accesses[-1]["address"] = m.group(1)
        elif accesses and (m := _NEAR.search(line)):
            accesses[-1].update(offset=int(m.group(1)), side=m.group(2), allocation_size=int(m.group(3)))
        elif line.startswith("Program hit") or line.startswith("Error"):
            other.append(line.strip())
    return MemcheckReport(tuple(MemoryAccess(**a) for a in accesses), count, tuple(other))


def verdict(text: str, what: str, returncode: int | None) -> None:
    """What the whole memcheck ``text`` of one child that ran one example (it ended: its ``ERROR SUMMARY`` is there,
    and no other example's report can be) decides: returns when it is clean; raises :class:`MemorySafetyError`
    naming the first invalid access, :class:`DeviceFull` when its only errors are failed allocations,
    MemorySafetyError when it counts other errors (a launch failure: the kernel's too), or
    :class:`~kvfuzz.contracts.checks.failures.HarnessError` when it is not a report (no ERROR SUMMARY: nothing
    shown either way). ``what``: the child's command, as the errors name it; ``returncode``: its exit status."""
    report = parse_memcheck(text)
    if report.clean:
        return
    if report.accesses:
        raise_accesses(report, text)
    if report.out_of_memory:
        raise DeviceFull(f"{what}: {'; '.join(report.other)[:500]}")
    if report.error_count:  # errors that are not invalid accesses (a launch failure, a leak): the kernel's too
        raise MemorySafetyError(CHECK, f"{report.error_count} memcheck error(s): {'; '.join(report.other) or '?'}",
                                {"accesses": [], "error_count": report.error_count, "report": text[-4000:]})
    raise HarnessError("sanitized run gave no report", f"{what} exited {returncode} without an "
                       f"ERROR SUMMARY: {text[-1500:]}")


def raise_accesses(report: MemcheckReport, text: str):
    """Raise the MemorySafetyError of ``report``'s first invalid access (``text``: the report, kept)."""
    first = report.accesses[0]
    more = f" (and {len(report.accesses) - 1} more)" if len(report.accesses) > 1 else ""
    raise MemorySafetyError(CHECK, first.describe() + more, {"accesses": [attrs.asdict(a) for a in report.accesses],
                                                            "error_count": report.error_count or len(report.accesses),
                                                            "report": text[-4000:]})


__all__ = ["CHECK", "DeviceFull", "MemcheckReport", "MemoryAccess", "parse_memcheck", "raise_accesses", "verdict"]
