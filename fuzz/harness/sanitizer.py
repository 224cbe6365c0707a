"""The memory-safety oracle (``kvfuzz fuzz --sanitize SHARE``): a share of a campaign's examples re-run in a child
process under ``compute-sanitizer --tool memcheck``, so an out-of-bounds access whose value the kernel masks off
(no output oracle can see it: vLLM#56862, unified_attention's unmasked block-table load on the final tile) is a
kernel failure of its own kind, ``"memory safety"``, shrunk like any other.

What the child does (``python -m kvfuzz.fuzz.harness.sanitizer --target SPEC --example FILE``): prepares the example
with **exact-size allocations** and runs the kernel once. ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` makes every tensor
its own ``cudaMalloc`` (the caching allocator would hide an overrun inside a larger segment), and the batch's block
table is trimmed to the columns its longest sequence needs (:func:`exact_batch`), so a read one entry past the last
row's end is past the allocation the sanitizer tracks. Reads past a row that is not the last stay inside the
table (the next row), where no sanitizer sees them.

The report (:func:`parse_memcheck`) is compute-sanitizer's text::

    ========= Invalid __global__ read of size 4 bytes
    =========     at kernel_unified_attention+0x1b70 in /.../triton_unified_attention.py:432
    =========     by thread (0,0,0) in block (0,0,0)
    =========     Address 0x7f5e2a000204 is out of bounds
    =========     and is 1 bytes after the nearest allocation at 0x7f5e2a000200 of size 4 bytes
    ...
    ========= ERROR SUMMARY: 1 error

each access becoming a :class:`MemoryAccess` (kind, space, size in bytes, kernel, source file and line, address,
offset in bytes from the nearest allocation and on which side, that allocation's size).

Where it runs: on CUDA only (:func:`applies`). The pinned Triton 3.9's interpreter (``TRITON_INTERPRET=1``,
triton/runtime/interpreter.py) has no bounds checks: ``create_masked_load`` hands raw host addresses and the mask
to its C++ ``_interpreter.load``, which dereferences every unmasked lane whatever allocation it falls in (a read
past a tensor returns what lies there, or crashes the process on an unmapped page); its one sanitizer-like option,
``InterpreterOptions.sanitize_overflow``, concerns integer overflow, not memory. So ``--sanitize`` is off on CPU
(docs/fuzzing.md).

Cost: one child process (CUDA context, Triton load, the kernel under memcheck) per sanitized example, seconds
each; the share keeps it bounded. Once a worker has seen a memory-safety failure it sanitizes every example of that
target, so Hypothesis's shrinker sees the failure on every candidate (a share drawn by the example's key would
skip most of them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

from kvfuzz.contracts.checks.failures import HarnessError, MemorySafetyError

#: The check name of a memory-safety failure.
CHECK = "memory safety (compute-sanitizer memcheck)"
#: Where the GPU machines keep compute-sanitizer when it is not on PATH.
DEFAULT_PATHS = ("/usr/local/cuda/bin/compute-sanitizer",)
#: Environment variable naming the compute-sanitizer executable (tests plant a fake one).
ENV = "KVFUZZ_COMPUTE_SANITIZER"
#: Seconds a sanitized child may run (memcheck slows a kernel 10-100x; Triton compiles first).
TIMEOUT_S = 300.0


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

    def describe(self) -> str:
        where = f"{Path(self.file).name}:{self.line}" if self.file else "(no source line)"
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


_PREFIX = re.compile(r"^=+\s?")
_INVALID = re.compile(r"Invalid (__\w+__|\w+) (\w+) of size (\d+) bytes?")
_AT = re.compile(r"^\s*at (?:0x[0-9a-f]+ in )?(\S+?)(?:\+0x[0-9a-f]+)?(?: in (.+?):(\d+))?\s*$")
_ADDRESS = re.compile(r"Address (0x[0-9a-f]+)")
_NEAR = re.compile(r"is (\d+) bytes? (after|before) the nearest allocation at 0x[0-9a-f]+ of size (\d+) bytes?")
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")


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


def sanitizer_path() -> str | None:
    """The compute-sanitizer to run: ``$KVFUZZ_COMPUTE_SANITIZER``, else the one on PATH, else
    :data:`DEFAULT_PATHS`; None when there is none."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    return next((p for p in DEFAULT_PATHS if os.access(p, os.X_OK)), None)


def applies(target) -> bool:
    """Whether ``--sanitize`` runs for ``target`` here: it runs on CUDA (Triton's CPU interpreter offers no
    bounds checks: module docstring)."""
    return target.device == "cuda"


def selected(example, share: float) -> bool:
    """Whether ``example`` is in the sanitized ``share`` (0..1): a stable hash of its key, so a replay or a
    second worker picks the same examples."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    key = json.dumps(example.to_dict(), sort_keys=True)  # the campaign's example_key
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < share


def exact_batch(batch):
    """``batch`` with its block table trimmed to the columns its sequences need (the longest one's
    ``blocks_needed``, pads' rows likewise): no spare column for an overrun to land in. The same batch when
    nothing is spare."""
    need = max([batch.blocks_needed(i) for i in range(batch.num_seqs)] + [1])
    if need >= batch.max_blocks_per_seq:
        return batch
    return attrs.evolve(batch, block_table=[list(r[:need]) for r in batch.block_table])


def sanitize(target, example, spec: str, sanitizer: str | None = None, timeout: float = TIMEOUT_S) -> None:
    """Run ``example`` on ``target`` (loadable in a child as ``spec``: a registered name, ``module:CLASS`` or
    ``path.py:CLASS``) under ``compute-sanitizer --tool memcheck`` in a child process. Returns when the report
    says 0 errors; raises :class:`MemorySafetyError` naming the first invalid access (kernel, file:line, size,
    offset) when it reports any, or :class:`~kvfuzz.contracts.checks.failures.HarnessError` when there is no
    sanitizer, the child timed out, or the report is not one (no ERROR SUMMARY: nothing shown either way)."""
    exe = sanitizer or sanitizer_path()
    if exe is None:
        raise HarnessError("compute-sanitizer not found", "kvfuzz fuzz --sanitize needs compute-sanitizer (CUDA's, "
                           f"/usr/local/cuda/bin) on PATH or named by ${ENV}")
    with tempfile.TemporaryDirectory(prefix="kvfuzz-sanitize-") as d:
        path = Path(d) / "example.json"
        path.write_text(json.dumps(example.to_dict()))
        cmd = [exe, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-m", "kvfuzz.fuzz.harness.sanitizer",
               "--target", spec, "--example", str(path)]
        # compute-sanitizer does not attach to MPS clients: the child leaves the campaign's private MPS daemon
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise HarnessError("sanitized run timed out", f"{' '.join(cmd[:3])} ran past {timeout:.0f} s") from None
    text = p.stdout + "\n" + p.stderr
    report = parse_memcheck(text)
    if report.clean:
        return
    if report.accesses:
        first = report.accesses[0]
        more = f" (and {len(report.accesses) - 1} more)" if len(report.accesses) > 1 else ""
        raise MemorySafetyError(CHECK, first.describe() + more,
                                {"accesses": [attrs.asdict(a) for a in report.accesses],
                                 "error_count": report.error_count, "report": text[-4000:]})
    if report.error_count:  # errors that are not invalid accesses (a launch failure, a leak): the kernel's too
        raise MemorySafetyError(CHECK, f"{report.error_count} memcheck error(s): {'; '.join(report.other) or '?'}",
                                {"accesses": [], "error_count": report.error_count, "report": text[-4000:]})
    raise HarnessError("sanitized run gave no report", f"{' '.join(cmd[:3])} exited {p.returncode} without an "
                       f"ERROR SUMMARY: {text[-1500:]}")


def _child(argv: list[str]) -> int:
    """The sanitized child: load the target and the example, make the batch exact (:func:`exact_batch`),
    prepare it and run the kernel once. The output is not checked here (the parent's campaign did)."""
    import argparse

    from kvfuzz.contracts.model.example import Example
    from kvfuzz.fuzz.harness import properties
    from kvfuzz.fuzz.targets.registry import get_target

    ap = argparse.ArgumentParser(prog="python -m kvfuzz.fuzz.harness.sanitizer")
    ap.add_argument("--target", required=True)
    ap.add_argument("--example", required=True)
    a = ap.parse_args(argv)
    target = get_target(a.target)
    example = Example.from_dict(json.loads(Path(a.example).read_text()))
    example = attrs.evolve(example, batch=exact_batch(example.batch))
    run = properties.prepare(target, example)
    target.run(run.call)
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 0


__all__ = ["CHECK", "MemcheckReport", "MemoryAccess", "MemorySafetyError", "applies", "exact_batch",
           "parse_memcheck", "sanitize", "sanitizer_path", "selected"]

if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
