"""Replaying a reproducer directory (as :mod:`kvfuzz.fuzz.campaign.store.reproducers` writes them) and comparing
with what it recorded: ``kvfuzz replay``, ``kvfuzz check``'s corpus and every reproducer's test_case.py.

:func:`replay` runs the case in a child process with a timeout, as a campaign's workers run examples: the child
tells its parent each phase over a pipe, and how it ended (:mod:`kvfuzz.fuzz.campaign.workers.endings`) decides
the verdict when it gives none, so a case that segfaults or hangs is reported ("kernel crash: SIGSEGV", "kernel
hang: timeout") instead of taking the replaying process down. It imports no code the user did not name:
registered targets (built-in, entry points) resolve by name, while an adapter loaded from a file or module needs
``target_spec`` (the user names it) or ``trust_target=True``. :func:`replay_here` re-runs a case in this process.
The case is read by :func:`~kvfuzz.fuzz.campaign.store.cases.load_case`, which raises
:class:`~kvfuzz.fuzz.campaign.store.cases.BadReproducer` for a broken file.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from pathlib import Path

import attrs

from kvfuzz.contracts.checks.failures import FailureKind, Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.store.cases import Case, load_case
from kvfuzz.fuzz.campaign.workers.endings import classify, compile_wait, finding_for
from kvfuzz.fuzz.harness import attention, properties
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.fuzz.harness.isolation import ISOLATED
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import get_target, is_registered, load_spec

#: Seconds a replay may run before it is reported as a hang.
REPLAY_TIMEOUT = 300.0


@attrs.frozen
class ReplayResult:
    """expected: the case's recorded (kind, check). got: what the re-run found, None if it passed.
    inputs_match: whether the regenerated inputs equal the stored tensors bit for bit (None: no tensors); when
    they differ, an attention target's case is re-run on the stored ground truth (:func:`stored_data`).
    outcome: for a configuration outside the target's declaration, the answer of
    :func:`~kvfuzz.fuzz.harness.properties.check_undeclared` ("rejected: <error>" or "accepted, correct", both
    not failures: got is None), else None."""

    directory: Path
    expected: tuple[str, str]
    got: tuple[str, str] | None
    message: str
    inputs_match: bool | None
    outcome: str | None = None

    @property
    def reproduced(self) -> bool:
        """The recorded finding again; for a recorded rejection, a rejection whose error names the case's check."""
        if self.expected[0] == FailureKind.CONFIG_REJECTED.value:
            return bool(self.outcome and self.outcome.startswith("rejected") and self.expected[1] in self.outcome)
        return self.got == self.expected


class UntrustedTarget(ValueError):
    """The case names an adapter loaded from a file or module; replaying it would run that code."""


class TargetUnavailable(Exception):
    """The case's target cannot run on this machine (its ``installed()``/``availability()`` says why: no CUDA, a
    package missing): nothing was replayed. ``kvfuzz replay`` exits 3 on it, ``kvfuzz check`` skips the case."""


def resolve_target(case: Case, target_spec: str | None = None, trust_target: bool = False) -> Target:
    """The case's target: by name when it is registered (built-in or entry point); from ``target_spec`` when the
    user names one (its name must be the case's); from the case's own spec only with ``trust_target``. Raises
    UntrustedTarget (use exit 2) with the way out, or ValueError when the spec cannot be loaded."""
    if target_spec is not None:
        t = load_spec(target_spec) if ":" in target_spec else get_target(target_spec)
        if t.name != case.target:
            raise ValueError(f"--target {target_spec} loads a target named {t.name!r}, but {case.directory}/case.json "
                             f"was written for {case.target!r}")
        return t
    if is_registered(case.target):
        return get_target(case.target)
    if case.target_spec is None:
        raise ValueError(f"{case.directory}/case.json names target {case.target!r}, which is not registered here "
                         "and has no target_spec; pass --target path/to/file.py:CLASS or package.module:CLASS")
    if not trust_target:
        raise UntrustedTarget(
            f"{case.directory}/case.json names target {case.target!r}, loaded from {case.target_spec!r}; replaying "
            f"it would import and run that code, so kvfuzz does not do it on its own. Pass --target "
            f"{case.target_spec} to name it yourself, or --trust-target to use the spec in case.json")
    spec = case.target_spec
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py") and not Path(module_part).exists():
        local = case.directory / Path(module_part).name  # a reproducer shared with its adapter beside it
        if local.exists():
            spec = f"{local}:{attr}"
    return load_spec(spec)


def unavailable(case: Case, target: Target, load: bool = False) -> str | None:
    """Why ``target`` cannot replay ``case`` here (``target.installed()``, the cheap forecast; with ``load``, or
    when it cannot tell, ``availability()``), or None when it can."""
    a = None if load else target.installed()
    a = a if a is not None else target.availability()
    if a.ok:
        return None
    return (f"{case.directory.name} needs {case.target}, which cannot run on this machine: {a.reason}; replay it "
            "where the target runs")


def stored_data(example: Example, stored: dict):
    """The ground truth a reproducer stored (query, keys/values_ground_truth, sinks) as a CPU
    :class:`~kvfuzz.contracts.model.data.BatchData` of ``example.batch``, or None when it lacks a tensor or
    the tensors do not fit the batch (dtype, shape; for an fp8 cache, keys that are not exact fp8 multiples
    of the scale). A reproducer written before kvfuzz changed how a seed's data is drawn (issue 21's
    counter-based generator) replays on the data it failed with: its seed now draws other data."""
    import torch

    from kvfuzz.contracts.model.data import BatchData, fp8_batch_data

    b = example.batch
    names = ("query", "keys_ground_truth", "values_ground_truth") + (("sinks",) if b.sinks else ())
    if any(n not in stored for n in names):
        return None
    q, k, v = stored["query"], stored["keys_ground_truth"], stored["values_ground_truth"]
    sinks = stored.get("sinks") if b.sinks else None
    dt, shape_kv = b.torch_dtype, (sum(b.seq_lens), b.num_kv_heads, b.head_size)  # as make_batch_data draws them
    want = ((q, dt, (b.num_tokens, b.num_heads, b.head_size)), (k, dt, shape_kv), (v, dt, shape_kv),
            (sinks, torch.float32, (b.num_heads,)))
    if any(got is not None and (got.dtype != d or tuple(got.shape) != s) for got, d, s in want):
        return None
    if b.fp8_dtype is None:
        return BatchData(query=q, keys=k, values=v, sinks=sinks)
    try:  # the cache codes as make_batch_data derives them; the stored keys must be their exact values
        data = fp8_batch_data(b, q, k, v, sinks)
    except ValueError:
        return None
    return data if torch.equal(data.keys, k) and torch.equal(data.values, v) else None


def replay_here(case: Case, target: Target, on_phase=None) -> ReplayResult:
    """Re-run ``case`` in this process (a crash takes this process down: prefer :func:`replay`). A batch outside
    the target's declaration is checked as ``kvfuzz fuzz --undeclared`` does (a clear error is the expected
    answer, ``ReplayResult.outcome``)."""
    import torch
    from safetensors.torch import load_file

    fault = get_fault(case.fault) if case.fault else None
    run = properties.prepare(target, case.example, fault)
    inputs_match = None
    tensors = case.directory / "tensors.safetensors"
    if tensors.exists():
        stored = load_file(str(tensors))
        inputs_match = all(k in stored and torch.equal(stored[k].view(torch.uint8),
                                                       v.cpu().contiguous().view(torch.uint8))
                           for k, v in (("query", run.data.query), ("keys_ground_truth", run.data.keys)))
        # an attention case written before the seed's data changed: re-run on its stored ground truth
        data = None if inputs_match or not target.capabilities.contract.is_attention \
            else stored_data(case.example, stored)
        if data is not None:
            run = attention.prepare(target, case.example, fault, data=data.to(run.data.query.device))
    expected = (case.kind, case.check)
    try:
        if not target.capabilities.accepts(case.example.batch):
            if on_phase is not None:  # check_undeclared runs the kernel without phases: time it as a kernel call
                on_phase("kernel")
            _, outcome = properties.check_undeclared(target, case.example, run=run)
            outside = ", ".join(target.capabilities.outside(case.example.batch))
            return ReplayResult(case.directory, expected, None, f"an undeclared configuration ({outside}): {outcome}",
                                inputs_match, outcome)
        properties.check(target, case.example, fault, run=run, run_unsafe=True, on_phase=on_phase)
    except Finding as f:
        return ReplayResult(case.directory, expected, f.signature, f.message, inputs_match)
    return ReplayResult(case.directory, expected, None, "the example passes now", inputs_match)


def _child(directory: str, target_spec: str | None, trust_target: bool, conn) -> None:
    """The isolated replay's child: run the case, telling the parent each phase and the result (or that the
    target cannot run here). Ctrl-C and SIGHUP reach the whole process group: the child leaves them to its parent,
    which stops and kills it (a child that took them printed a KeyboardInterrupt traceback)."""
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    ISOLATED.set()  # a kernel that breaks the device ends this child, as in a campaign's worker
    case = load_case(directory)
    target = resolve_target(case, target_spec, trust_target)
    why = unavailable(case, target, load=True)
    if why is not None:
        conn.send(("unavailable", why))
        conn.send(("bye",))
        return
    conn.send(("phase", "prepare"))
    r = replay_here(case, target, on_phase=lambda p: conn.send(("phase", p)))
    conn.send(("result", r.got, r.message, r.inputs_match, r.outcome))
    conn.send(("bye",))


def hang_timeout(case: Case) -> float | None:
    """The seconds the campaign gave an example before it called this case a hang (case.json
    ``details.timeout_s``, written since kvfuzz records it), or None (not a hang, or not recorded)."""
    t = (case.raw.get("details") or {}).get("timeout_s")
    hang = case.kind == "kernel hang" or case.check.startswith("hung in")
    return float(t) if hang and isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 else None


class _Deadlines:
    """When a replay's child is called hung: a kernel call (phase "kernel") ``kernel_timeout`` seconds after it
    began, as the campaign timed it; every other phase (prepare, check) when the whole replay's time is up
    (``max(REPLAY_TIMEOUT, kernel_timeout)`` from ``start``), never at a kernel call's deadline: a check slower
    than what was left of it is not hung (a replay with --timeout 2 had its check called "hung" on a busy machine).
    A compile wait gives the call its timeout again and moves the whole replay's end past it."""

    def __init__(self, start: float, kernel_timeout: float):
        self.kernel_timeout = kernel_timeout
        self.end = start + max(REPLAY_TIMEOUT, kernel_timeout)
        self.deadline = self.end

    def enter(self, phase: str | None, now: float) -> None:
        self.deadline = min(self.end, now + self.kernel_timeout) if phase == "kernel" else self.end

    def wait_again(self, now: float) -> None:
        self.deadline = now + self.kernel_timeout
        self.end = max(self.end, self.deadline)


def replay(directory: str | Path, *, target_spec: str | None = None, trust_target: bool = False,
           timeout: float | None = None) -> ReplayResult:
    """Re-run a reproducer directory in a child process and compare with what it recorded. A child that dies
    inside the kernel gives got = ("kernel crash", "<signal or exit status>"); one whose kernel call runs past
    ``timeout`` seconds (None: the campaign's own example timeout for a hang case, :func:`hang_timeout`, else
    :data:`REPLAY_TIMEOUT`) is killed and gives ("kernel hang", "timeout"), unless a compiler runs under it (the
    kernel's JIT compile: the timeout starts again, :func:`~kvfuzz.fuzz.campaign.workers.endings.compile_wait`);
    outside the kernel (the whole replay past :data:`REPLAY_TIMEOUT`, or ``timeout`` when larger), ("harness error",
    ...).

    Raises BadReproducer (a broken file), UntrustedTarget (an adapter the user did not name), or ValueError
    (the named target cannot be loaded) before anything runs; TargetUnavailable when the target cannot run
    here (said by its ``installed()`` before, or by its ``availability()`` in the child)."""
    case = load_case(directory)
    target = resolve_target(case, target_spec, trust_target)  # refuse untrusted or unknown targets here
    why = unavailable(case, target)
    if why is not None:
        raise TargetUnavailable(why)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(str(case.directory), target_spec, trust_target, child), daemon=True)
    proc.start()
    child.close()
    phase, result, goodbye, hung = None, None, False, False
    kernel_timeout = timeout if timeout is not None else (hang_timeout(case) or REPLAY_TIMEOUT)
    clock = _Deadlines(time.monotonic(), kernel_timeout)
    waits, compiling = 0, None  # a kernel call past its timeout while a compiler runs under the child: compiling
    try:
        while True:
            left = clock.deadline - time.monotonic()
            if left <= 0:
                again, compiling = compile_wait(proc.pid, waits) if phase == "kernel" else (False, None)
                if again:  # compiling its kernel, as a campaign's supervisor sees it
                    waits = waits + 1
                    clock.wait_again(time.monotonic())
                    continue
                hung = True
                proc.kill()
                break
            if parent.poll(min(left, 0.5)):
                try:
                    msg = parent.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "phase":
                    phase = msg[1]
                    clock.enter(phase, time.monotonic())
                elif msg[0] == "result":
                    result = msg[1:]
                elif msg[0] == "unavailable":
                    result = msg
                elif msg[0] == "bye":
                    goodbye = True
            elif not proc.is_alive() and not parent.poll():
                break
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    expected = (case.kind, case.check)
    if result is not None and result[0] == "unavailable":
        raise TargetUnavailable(result[1])
    if result is not None:
        got, message, inputs_match, outcome = result
        return ReplayResult(case.directory, expected, None if got is None else tuple(got), message, inputs_match,
                            outcome)
    ending = classify(proc.exitcode, said_goodbye=goodbye, killed_for_hang=hung)
    finding = finding_for(ending, phase or "prepare", {"compiling": compiling} if compiling else None,
                          timeout=kernel_timeout if phase == "kernel" else max(REPLAY_TIMEOUT, kernel_timeout))
    if finding is None:  # killed from outside
        return ReplayResult(case.directory, expected, ("harness error", f"replay {ending.detail}"),
                            f"the replay process was {ending.kind.value} ({ending.detail}) before it answered", None)
    return ReplayResult(case.directory, expected, finding.signature, finding.message, None)


__all__ = ["REPLAY_TIMEOUT", "ReplayResult", "TargetUnavailable", "UntrustedTarget", "hang_timeout", "replay",
           "replay_here", "resolve_target", "stored_data", "unavailable"]
