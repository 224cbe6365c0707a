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

Its report is parsed, and a whole one decided, by kvfuzz.fuzz.harness.sanitizer_report (:func:`parse_memcheck`,
``verdict``). A hit of the long-lived child is confirmed in a child that has run no other example: a pre-started
standby (kvfuzz.fuzz.harness.sanitizer_standby) or, without one, a fresh child (:func:`sanitize`).

Where it runs: on CUDA only (:func:`applies`). The pinned Triton 3.9's interpreter (``TRITON_INTERPRET=1``,
triton/runtime/interpreter.py) has no bounds checks: ``create_masked_load`` hands raw host addresses and the mask
to its C++ ``_interpreter.load``, which dereferences every unmasked lane whatever allocation it falls in (a read
past a tensor returns what lies there, or crashes the process on an unmapped page); its one sanitizer-like option,
``InterpreterOptions.sanitize_overflow``, concerns integer overflow, not memory. So ``--sanitize`` is off on CPU
(docs/fuzzing.md).

Cost: a long-lived child per worker (:class:`SanitizedChild`; its CUDA context, Triton load and the kernel under
memcheck, ~15 s to start, ~10 ms an example once warm, started in the background for the time share); the time
share keeps it bounded (on batches of at most :data:`TIME_SHARE_MAX_TOKENS` tokens), and :func:`gpu_slot` lets
one sanitized run at a time use each GPU. While a worker shrinks a new memory-safety failure it sanitizes every
example of that target, so Hypothesis's shrinker sees the failure on every candidate (a share drawn by the
example's key would skip most of them); once the failure is recorded it returns to the share.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import attrs

from kvfuzz.contracts.checks.failures import HarnessError, MemorySafetyError
from kvfuzz.fuzz.harness.sanitizer_report import (
    CHECK,
    DeviceFull,
    MemcheckReport,
    MemoryAccess,
    parse_memcheck,
    raise_accesses,
    verdict,
)

#: Where the GPU machines keep compute-sanitizer when it is not on PATH.
DEFAULT_PATHS = ("/usr/local/cuda/bin/compute-sanitizer",)
#: Environment variable naming the compute-sanitizer executable (tests plant a fake one).
ENV = "KVFUZZ_COMPUTE_SANITIZER"
#: Seconds a sanitized child may run (memcheck slows a kernel 10-100x; Triton compiles first).
TIMEOUT_S = 300.0
#: ``--sanitize auto`` (the default): the share of each worker's time spent on sanitized runs. Measured on an
#: H200 (benchmarks/results/sanitize-h200.txt): a fresh child costs ~15 s an example (CUDA context, imports and the
#: kernel's load under memcheck), the long-lived child ~10 ms once warm; a share of the examples by hash with fresh
#: children cost 33% of the examples/s at 0.002.
AUTO_TIME_SHARE = 0.1
#: Seconds a sanitized child takes to start and run its first example (CUDA context, imports, the kernel loaded
#: under memcheck: 8-16 s on an H200): no child starts closer than this to a campaign's --duration deadline.
START_SECONDS = 30.0
#: The persistent child's marker lines on its stdout (:class:`SanitizedChild`).
MARK = "KVFUZZ-SANITIZED"
#: The most cached tokens (the batch's seq_lens summed) of an example the time share (``--sanitize auto``) picks.
#: Memcheck slows every access of the child's data generation and kernel 10-100x, and one sanitized run at a time
#: uses each GPU (:func:`gpu_slot`), so the share goes furthest on small batches; the overruns it exists for sit at
#: tile and block-table edges, which batches of a few hundred tokens reach (vllm#56862: one 9-token prefill). A
#: hash share (``--sanitize SHARE``) and a shrink pick examples of any size.
TIME_SHARE_MAX_TOKENS = 4096
#: The phases of a sanitized example, in order (docs/fuzzing.md, "Where a sanitized example's time goes"): the
#: worker measures ``slot``, ``start``, ``ship``, ``readback``, ``verdict``, ``confirm`` and ``other``
#: (:class:`SanitizedChild`, kvfuzz.fuzz.campaign.runner.SanitizerSchedule); the child the rest (:func:`_run_example`).
PHASES = ("slot", "start", "ship", "load", "generate", "materialize", "compile", "queued", "kernel", "readback",
          "verdict", "confirm", "other")
#: The phases the child measures (:data:`PHASES`).
CHILD_PHASES = ("load", "generate", "materialize", "compile", "queued", "kernel")


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
    ``blocks_needed``, pads' rows likewise): no spare column for an overrun to land in; and a longest sequence last
    (:func:`_longest_last`). The same batch when nothing changes."""
    need = max([batch.blocks_needed(i) for i in range(batch.num_seqs)] + [1])
    if need < batch.max_blocks_per_seq:
        batch = attrs.evolve(batch, block_table=[list(r[:need]) for r in batch.block_table])
    return _longest_last(batch, need)


def _longest_last(batch, need: int):
    """``batch`` with a sequence that needs all ``need`` columns moved to the last row (an overrun of the last row
    is past the table's allocation; of any other row, inside the next one): the sanitized run checks no output, so
    the order is free. Unchanged when a longest sequence is last already, when a state appends rows after the real
    ones (``StateHooks.appends_rows``: they come last) or the batch has CSR tails, or when the reordered batch is not
    valid (it is then run as it is)."""
    from kvfuzz.fuzz.harness.states import active_hooks

    n = batch.num_seqs
    if n < 2 or batch.csr_tail or batch.blocks_needed(n - 1) >= need:
        return batch
    if any(h.appends_rows for h in active_hooks(batch)):
        return batch
    i = max(range(n), key=lambda j: (batch.blocks_needed(j), j))
    order = [j for j in range(n) if j != i] + [i]
    try:
        return attrs.evolve(batch, query_lens=[batch.query_lens[j] for j in order],
                            ctx_lens=[batch.ctx_lens[j] for j in order],
                            block_table=[list(batch.block_table[j]) for j in order])
    except (ValueError, TypeError):
        return batch


def sanitize(target, example, spec: str, sanitizer: str | None = None, timeout: float = TIMEOUT_S) -> None:
    """Run ``example`` on ``target`` (loadable in a child as ``spec``: a registered name, ``module:CLASS`` or
    ``path.py:CLASS``) under ``compute-sanitizer --tool memcheck`` in a child process. Returns when the report says
    0 errors; raises :class:`MemorySafetyError` naming the first invalid access (kernel, file:line, size, offset)
    when it reports any, :class:`DeviceFull` when its only errors are failed allocations, or
    :class:`~kvfuzz.contracts.checks.failures.HarnessError` when there is no sanitizer, the child timed out, or the
    report is not one (no ERROR SUMMARY: nothing shown either way)."""
    exe = sanitizer or sanitizer_path()
    if exe is None:
        raise HarnessError("compute-sanitizer not found", "kvfuzz fuzz --sanitize needs compute-sanitizer (CUDA's, "
                           f"/usr/local/cuda/bin) on PATH or named by ${ENV}")
    with tempfile.TemporaryDirectory(prefix="kvfuzz-sanitize-") as d:
        path = Path(d) / "example.json"
        path.write_text(json.dumps(example.to_dict()))
        cmd = [exe, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-m", "kvfuzz.fuzz.harness.sanitizer",
               "--target", spec, "--example", str(path)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_environment())
        except subprocess.TimeoutExpired:
            raise HarnessError("sanitized run timed out", f"{' '.join(cmd[:3])} ran past {timeout:.0f} s") from None
    verdict(p.stdout + "\n" + p.stderr, " ".join(cmd[:3]), p.returncode)


@contextlib.contextmanager
def gpu_slot(directory, wait: bool = False) -> Iterator[bool]:
    """At most one sanitized run at a time per GPU of a campaign: holds the exclusive lock
    ``directory/sanitize-gpu-<device>.lock`` (:func:`kvfuzz.fuzz.harness.memory.file_lock`; device:
    ``KVFUZZ_DEVICE``, the worker's physical GPU, else ``CUDA_VISIBLE_DEVICES``) and yields True; when another
    worker holds it, yields False at once (the caller skips sanitizing this example), or waits for it with
    ``wait`` (a shrink, which must sanitize every candidate). ``directory`` None, or a lock file that cannot be
    opened there: yields True.

    Why: a sanitized child is a CUDA context of its own beside the campaign's MPS server, so while its kernel runs
    under memcheck (10-100x slower) the GPU time-slices between them and every worker's kernel waits: one child per
    worker, each within its time share, still slows the whole campaign by a third (measured: docs/fuzzing.md,
    "Memory safety")."""
    if directory is None:
        yield True
        return
    from kvfuzz.fuzz.harness.memory import device_label, file_lock  # imports torch: not at import (baseline.py)

    path = Path(directory) / f"sanitize-gpu-{device_label()}.lock"
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(file_lock(path, wait))
        except OSError:  # no folder to coordinate in (a campaign's --out not made yet): run, as without one
            held = True
        yield held


def child_environment(env=None) -> dict:
    """The environment of a sanitized child: ``env`` (default ``os.environ``) without the campaign's MPS daemon
    (compute-sanitizer does not attach to MPS clients), with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (every tensor
    its own allocation) and, for a campaign's worker, ``CUDA_VISIBLE_DEVICES`` its physical GPU
    (``KVFUZZ_DEVICE``, kvfuzz.fuzz.campaign.workers.worker.gpu_environment): under MPS the worker's own
    ``CUDA_VISIBLE_DEVICES`` is unset or names the daemon's device, which outside MPS is another GPU."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("CUDA_MPS_")}
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    if env.get("KVFUZZ_DEVICE"):
        env["CUDA_VISIBLE_DEVICES"] = env["KVFUZZ_DEVICE"]
    return env


class SanitizedChild:
    """One long-lived child under ``compute-sanitizer --tool memcheck`` that runs a target's examples one at a
    time (``python -m kvfuzz.fuzz.harness.sanitizer --target SPEC --serve``): it reads an example file's path per
    line on stdin, runs it as :func:`sanitize`'s child does and prints ``KVFUZZ-SANITIZED done N {phases}`` (or
    ``raised N``) after each, ``{phases}`` its seconds per :data:`CHILD_PHASES` as JSON; what memcheck prints between
    two markers is that example's report. A fresh child per example costs ~15 s (CUDA context, imports, the
    kernel's load under memcheck); this one ~10 ms an example once warm.

    The child prints ``KVFUZZ-SANITIZED ready 0 {"target": s, "cuda": s, "warm": s, "warm_errors": n}`` once it has
    loaded the target, made its CUDA context and warmed up (sanitizer_warmup; what it printed before is dropped);
    :meth:`ready` starts one without waiting and says if it got there: a worker runs examples while its child starts
    (~15 s under memcheck), not holding its GPU's sanitizer slot (:class:`~.campaign.runner.SanitizerSchedule`).

    :meth:`check` is a screen: an example it passes is clean; anything else (an invalid access, an error, a child
    that died or hung) is decided in a child that has run no example, whose whole report (with its ERROR SUMMARY)
    cannot belong to another: ``confirmer``'s (kvfuzz.fuzz.harness.sanitizer_standby.StandbyConfirmer: a standby
    child pre-started with this one or once it is ready), else :func:`sanitize`'s fresh child. A child that still
    answered is kept (``--destroy-on-device-error kernel``); one that raised, died or hung is replaced on the next
    check. :meth:`close` ends it and removes its folder (not its confirmer's standby: the caller's); this
    process's end ends it too (its stdin closes).

    Where the time goes: after each :meth:`check`, :attr:`last` is ``{"seconds": {phase: s}, "child": c}``: its
    seconds per :data:`PHASES` (not ``slot`` nor ``other``: its caller's; a phase that did not happen left out), and
    what the child said of it: "first" (its first example), "new" (its kernel call compiled or loaded a kernel: the
    first call of that configuration in this child), "seen", or None (no report: it raised, died or hung); and
    after a confirmation ``"confirm"``: where it ran (sanitizer_standby.CONFIRMS). :attr:`started`: a start seen
    complete, ``{"seconds": spawn to ready marker, **the ready marker's phases}``."""

    #: compute-sanitizer's options. --destroy-on-device-error kernel: an invalid access ends the kernel, not the
    #: child's CUDA context, so the child answers the next example too (a shrink's candidates would otherwise each
    #: start a child). --print-limit 0: memcheck's limit counts for the process's whole life (with a limit, a
    #: long-lived child goes silent once it has printed that many errors); --show-backtrace no keeps each access to a
    #: few lines.
    FLAGS = ("--print-limit", "0", "--show-backtrace", "no", "--destroy-on-device-error", "kernel")

    def __init__(self, spec: str, sanitizer: str | None = None, timeout: float = TIMEOUT_S, confirmer=None):
        self.spec, self.exe, self.timeout, self.confirmer = spec, sanitizer, timeout, confirmer
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()  # (time.perf_counter() when read, line; None at the end)
        self._dir: str | None = None
        self._n, self._ready = 0, False
        self._spawned, self._ready_at = 0.0, None  # time.perf_counter() at its spawn and its ready marker read
        self.last: dict | None = None
        self.started: dict | None = None

    @property
    def running(self) -> bool:
        """Whether a child is up (the next :meth:`check` does not start one)."""
        return self._proc is not None and self._proc.poll() is None

    def ready(self) -> bool:
        """Whether a child is up and has printed its ready marker; starts one (without waiting) when none runs.
        Reads (drops) the lines before the marker. A child that ended before it counts as ready: the next
        :meth:`check` meets its end and :func:`sanitize` decides. Raises HarnessError as :meth:`check` does."""
        if not self.running:
            self._start()
        while not self._ready:
            try:
                at, line = self._lines.get_nowait()
            except queue.Empty:
                return False
            if line is None:  # it ended: leave the end for check() to meet
                self._lines.put((at, None))
                self._ready = True
            else:
                self._ready_marker(at, line)
        return True

    def _ready_marker(self, at: float, line: str) -> bool:
        """Whether ``line`` (read at ``at``) is the child's ready marker; if so the child is ready (:attr:`started`
        says how its start went)."""
        parts = line.split(maxsplit=3)
        if parts[:2] != [MARK, "ready"]:
            return False
        self._ready, self._ready_at = True, at
        self.started = {"seconds": at - self._spawned, **_phases_of(parts[3] if len(parts) > 3 else "")}
        if self.confirmer is not None:  # a standby started once this child is ready starts now
            self.confirmer.prestart(screen_ready=True)
        return True

    def _start(self) -> None:
        exe = self.exe or sanitizer_path()
        if exe is None:
            raise HarnessError("compute-sanitizer not found", "kvfuzz fuzz --sanitize needs compute-sanitizer "
                               f"(CUDA's, /usr/local/cuda/bin) on PATH or named by ${ENV}")
        self._dir = self._dir or tempfile.mkdtemp(prefix="kvfuzz-sanitize-")
        cmd = [exe, "--tool", "memcheck", *self.FLAGS, sys.executable, "-m", "kvfuzz.fuzz.harness.sanitizer",
               "--target", self.spec, "--serve"]
        self._spawned, self._ready_at = time.perf_counter(), None
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1, env=child_environment())
        self._lines = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc.stdout, self._lines), daemon=True).start()
        self._n, self._ready = 0, False
        if self.confirmer is not None:  # its standby starts beside it (a no-op while one waits)
            self.confirmer.prestart(screen_ready=False)

    @staticmethod
    def _read(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put((time.perf_counter(), line.rstrip("\n")))
        lines.put((time.perf_counter(), None))  # end of output: the child ended

    def _segment(self, n: int) -> tuple[str, list[str], dict]:
        """The child's lines up to its marker for example ``n``: ("done"/"raised"/"ended"/"timed out", lines, the
        child's seconds per phase from its marker, or {}). A ready marker on the way marks the child ready."""
        out: list[str] = []
        end = time.monotonic() + self.timeout
        while True:
            try:
                at, line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return "timed out", out, {}
            if line is None:
                return "ended", out, {}
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[0] == MARK and parts[2] == str(n):
                return parts[1], out, _phases_of(parts[3] if len(parts) > 3 else "")
            if not (parts[:1] == [MARK] and self._ready_marker(at, line)) and self._ready:
                out.append(line)  # not a line from before the ready marker (the child's start and warm-up)

    def check(self, target, example, confirm: bool = True) -> None:
        """Screen ``example`` in the long-lived child; returns when its run was clean. An invalid access in its
        segment raises MemorySafetyError: with ``confirm``, as a child that has run no example decides (the
        campaign's first memory-safety failure; the class docstring), without it from the segment itself (the
        shrink of a confirmed one, whose candidates would each cost a confirmation). A child that raised, died or
        hung is replaced and the confirmation decides. Its seconds per phase: :attr:`last`."""
        began = time.perf_counter()
        starting = not self.running or not self._ready
        self.last = {"seconds": (phases := {}), "child": None}
        if not self.running:
            self._start()
        spawned = time.perf_counter()
        phases["start"] = spawned - began
        self._n += 1
        path = Path(self._dir) / f"example-{self._n % 2}.json"
        path.write_text(json.dumps(example.to_dict()))
        shipped = time.perf_counter()  # before the path is sent: the child may start at once
        try:
            self._proc.stdin.write(f"{path}\n")
            self._proc.stdin.flush()
            status, lines, child = self._segment(self._n)
        except (BrokenPipeError, OSError):
            status, lines, child = "ended", [], {}
        got = time.perf_counter()
        phases["ship"] = shipped - spawned
        self._timed(phases, child, shipped, got, starting)
        text = "\n".join(lines)
        report = parse_memcheck(text)
        phases["verdict"] = time.perf_counter() - got
        if status == "done" and not report.accesses and not report.other:
            return
        if status == "done" and report.accesses and not confirm:
            raise_accesses(report, text)
        confirming = time.perf_counter()
        try:
            if status != "done":  # it raised, died or hung (memcheck may have destroyed its context): a new one next
                self.close(kill=status == "timed out")
            if self.confirmer is None:
                self.last["confirm"] = "fresh"
                sanitize(target, example, self.spec, self.exe, self.timeout)
            else:
                self.confirmer.confirm(target, example, self.last)
        finally:
            phases["confirm"] = time.perf_counter() - confirming

    def _timed(self, phases: dict, child: dict, shipped: float, got: float, starting: bool) -> None:
        """Split the wait for the child's marker (``shipped`` to ``got``) into ``phases``: the rest of the child's
        start when the example waited for it (``starting``; what its own phases leave: they came after its ready
        marker, however late that was read), the child's own phases (``child``, from its marker) and ``readback``,
        the rest; set what the child said of the example (:attr:`last`)."""
        wait, own = got - shipped, sum(float(child.get(k, 0.0)) for k in CHILD_PHASES)
        if not starting:
            del phases["start"]
        elif self._ready_at is not None:
            waited = min(max(0.0, wait - own), max(0.0, self._ready_at - shipped))
            phases["start"] += waited
            wait -= waited
        scale = min(1.0, wait / max(1e-9, own))
        for k in CHILD_PHASES:
            if child.get(k):
                phases[k] = float(child[k]) * scale  # within the wait that holds them
                wait -= phases[k]
        if child:
            self.last["child"] = "first" if self._n == 1 else "new" if child.get("new") else "seen"
        phases["readback"] = max(0.0, wait)

    def close(self, kill: bool = False) -> None:
        """End the child (idempotent): close its stdin and let it finish (at most 10 s, then it is killed), or
        ``kill`` it at once; remove its folder of example files."""
        p, self._proc = self._proc, None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if p is None:
            return
        if not kill:
            try:
                p.stdin.close()
                p.wait(timeout=10)
                return
            except (OSError, subprocess.SubprocessError):
                pass
        p.kill()
        p.wait()
        with contextlib.suppress(OSError):  # the program under it reads this pipe too: its end ends that one
            p.stdin.close()


def _phases_of(text: str) -> dict:
    """The child's seconds per phase from a marker's JSON tail (``{}`` when it has none or it is not JSON)."""
    with contextlib.suppress(ValueError):
        phases = json.loads(text or "{}")
        return {k: v for k, v in phases.items() if isinstance(v, (int, float))} if isinstance(phases, dict) else {}
    return {}


def _run_example(target, path: str) -> dict:
    """Load the example at ``path``, make its batch exact (:func:`exact_batch`), prepare it and run the kernel
    once, then wait for the device. The output is not checked here (the parent's campaign did). Returns its seconds
    per :data:`CHILD_PHASES` and ``new``: whether the kernel call compiled or loaded a kernel (Triton's JIT hooks,
    :data:`~kvfuzz.fuzz.harness.kernel_clock.COMPILES`: the first call of that configuration in this process)."""
    import torch

    from kvfuzz.contracts.model.example import Example
    from kvfuzz.fuzz.harness import properties
    from kvfuzz.fuzz.harness.kernel_clock import KernelClock

    began = time.perf_counter()
    example = Example.from_dict(json.loads(Path(path).read_text()))
    example = attrs.evolve(example, batch=exact_batch(example.batch))
    loaded = time.perf_counter()
    run = properties.prepare(target, example)
    prepared = time.perf_counter()
    cuda = torch.cuda.is_available()
    clock = KernelClock(cuda)
    target.run(run.call)
    clock.ran()
    if cuda:
        torch.cuda.synchronize()
    t = run.timings
    clock.stop(t)
    generate = min(t.generate, prepared - loaded)
    return {"load": loaded - began, "generate": generate, "materialize": prepared - loaded - generate,
            "compile": t.compile, "queued": t.queued, "kernel": t.kernel, "new": t.compile > 0}


def _marker(status: str, n: int, phases: dict) -> str:
    return f"{MARK} {status} {n} {json.dumps({k: round(v, 6) for k, v in phases.items()}, separators=(',', ':'))}"


def _child(argv: list[str]) -> int:
    """The sanitized child: ``--example FILE`` runs that one example (:func:`sanitize`); ``--serve`` runs the
    example files named on stdin, one per line, printing :data:`MARK` after each, with its seconds per phase
    (:class:`SanitizedChild`)."""
    import argparse

    from kvfuzz.fuzz.harness.kernel_clock import COMPILES
    from kvfuzz.fuzz.harness.sanitizer_warmup import warm_up
    from kvfuzz.fuzz.targets.registry import get_target

    ap = argparse.ArgumentParser(prog="python -m kvfuzz.fuzz.harness.sanitizer")
    ap.add_argument("--target", required=True)
    ap.add_argument("--example")
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args(argv)
    began = time.perf_counter()
    target = get_target(a.target)
    if not a.serve:
        _run_example(target, a.example)
        return 0
    COMPILES.listen()  # a kernel call's compiles told apart (a new configuration in this child)
    import torch

    loaded = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.init()  # the context, then the warm-up (sanitizer_warmup: never raises), before the parent sends
    phases = {"target": loaded - began, "cuda": time.perf_counter() - loaded}
    print(_marker("ready", 0, phases | warm_up(target, exact=exact_batch)), flush=True)
    n = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        n += 1
        try:
            phases = _run_example(target, line.strip())
        except BaseException as e:  # the parent re-runs it in a fresh child, whose report decides
            print(f"{MARK} raised {n} {type(e).__name__}", flush=True)
            return 3
        print(_marker("done", n, phases), flush=True)
    return 0


__all__ = ["AUTO_TIME_SHARE", "CHECK", "CHILD_PHASES", "MARK", "PHASES", "START_SECONDS", "TIMEOUT_S",
           "TIME_SHARE_MAX_TOKENS",
           "DeviceFull", "MemcheckReport", "MemoryAccess", "MemorySafetyError", "SanitizedChild", "applies",
           "child_environment", "exact_batch", "gpu_slot", "parse_memcheck", "sanitize", "sanitizer_path", "selected"]

if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
