"""Reproducer directories: everything needed to see, re-run and share one failure.

<out>/<target>-<kind>-<check>-<hash>/
    case.json           target (and, for an adapter loaded from a file or module, its spec), contract, failure
                        kind and blame, the violated invariant or oracle, the message and details, the example
                        (batch + poison), the caller fault, versions
    tensors.safetensors the call's tensors (query, key, value, caches, index tensors), the ground-truth
                        keys/values, the kernel output and the fp64 reference, as they were (absent when the
                        call could not even be built: case.json says why)
    test_case.py        a standalone pytest file that re-runs the case (isolated) and fails while it reproduces

Reading one back (:func:`load_case`) validates every field it needs and raises :class:`BadReproducer` naming the
file, the field and the fix, so a broken file is never mistaken for a failure that came back. Replaying
(:func:`replay`) runs the case in a child process with a timeout, so a case that segfaults or hangs is reported
("kernel crash: SIGSEGV", "kernel hang: timeout") instead of taking the replaying process down; and it imports
no code the user did not name: registered targets (built-in, entry points) resolve by name, while an adapter
loaded from a file or module needs ``target_spec`` (the user names it) or ``trust_target=True``. Tensors are
stored as safetensors; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import attrs

from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.checks.failures import FailureKind, Finding
from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.fuzz.campaign.store.cases import CASE_FORMAT, BadReproducer, Case, load_case
from kvfuzz.fuzz.campaign.workers.endings import classify, finding_for
from kvfuzz.fuzz.campaign.store.journal import json_safe
from kvfuzz.fuzz.harness import attention, properties
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import get_target, is_registered, load_spec, spec_of

#: Seconds a replay may run before it is reported as a hang.
REPLAY_TIMEOUT = 300.0


def versions() -> dict[str, str | None]:
    """Versions of everything that can change a result."""
    import torch

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("kvfuzz", "torch", "triton", "vllm", "hypothesis"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["torch_cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return out


def case_dict(target: Target, example: Example, finding: Finding, fault_name: str | None) -> dict[str, Any]:
    b = example.batch
    return {
        "format": CASE_FORMAT,
        "target": target.name,
        "target_spec": spec_of(target),
        "contract": target.capabilities.contract.value,
        "kind": finding.kind.value,
        "blame": finding.kind.blame,
        "check": finding.check,
        "message": finding.message,
        "details": json_safe(finding.details),
        "caller_fault": fault_name,
        "example": example.to_dict(),
        "derived": {"seq_lens": list(b.seq_lens), "query_start_loc": list(b.query_start_loc),
                    "decode_seqs": list(b.decode_seqs), "max_seq_len": b.max_seq_len,
                    "max_query_len": b.max_query_len, "scale": b.scale},
        "versions": versions(),
    }


def _tensors(run: Run) -> dict:
    """What a reproducer stores: inputs, ground truth, caches, index tensors, output and reference. A cache
    over FULL_POISON_MAX_BYTES (``--big-cache``) is stored as its referenced blocks (``key_cache_blocks``,
    ``value_cache_blocks``) with their ids (``cache_block_ids``), not as several GiB."""
    import torch

    from kvfuzz.contracts.caches.materialize import is_big, referenced_blocks

    t: dict[str, torch.Tensor] = {
        "query": run.data.query, "keys_ground_truth": run.data.keys, "values_ground_truth": run.data.values,
    }
    kc, vc = run.call.key_cache, run.call.value_cache
    if is_big(kc, vc):
        ids = referenced_blocks(run.example.batch)
        t["cache_block_ids"] = ids
        t["key_cache_blocks"], t["value_cache_blocks"] = kc[ids.to(kc.device)], vc[ids.to(vc.device)]
    else:
        t["key_cache"], t["value_cache"] = kc, vc
    if run.data.sinks is not None:
        t["sinks"] = run.data.sinks
    if run.example.batch.alibi:
        t["alibi_slopes"] = run.example.batch.alibi_slopes_tensor()
    for name in ("block_table", "seq_lens", "query_start_loc"):
        if isinstance(run.call.kwargs.get(name), torch.Tensor):
            t[name] = run.call.kwargs[name]
    if run.call.key is not None:
        t["key"], t["value"] = run.call.key, run.call.value
    if run.output is not None:
        t["output"] = run.output
    if run.reference is not None:
        t["reference"] = run.reference
    return {k: v.detach().cpu().contiguous().clone() for k, v in t.items()}


_TEST_TEMPLATE = '''"""kvfuzz reproducer: {kind} ({check}) on {target}.

{message}

Re-run: pytest {dirname}/test_case.py   (or: kvfuzz replay {dirname})
{verdict} It replays this directory in a child
process (a crash or a hang fails the test instead of killing pytest).
"""

from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign.store.reproducers import TargetUnavailable, replay


def test_case():
    # running this file is your consent to import the target it names (trust_target)
    try:
        r = replay(Path(__file__).parent, trust_target=True)
    except TargetUnavailable as e:  # e.g. a CUDA-only kernel on a CPU machine: nothing to replay here
        pytest.skip(str(e))
    assert r.got is None, f"{{r.got[0]}} ({{r.got[1]}}): {{r.message}}"
'''


#: What a case recording a refused undeclared configuration tests (test_case.py's docstring).
_VERDICT_REJECTED = ("An undeclared configuration: the test passes while the kernel refuses it with an error (or\n"
                     "computes it right) and fails if it computes it wrongly.")


def write_reproducer(out: Path, target: Target, example: Example, finding: Finding, run: Run | None,
                     fault_name: str | None = None) -> Path:
    """Write a reproducer directory under ``out``; returns its path. With ``run=None`` (a crash recovered by the
    supervisor) the tensors are rebuilt from the example without running the kernel; when even that fails (the
    adapter cannot build the call), case.json says so and tensors.safetensors is left out.

    Raises :class:`~kvfuzz.fuzz.campaign.store.journal.OutOfSpace` when the disk (or quota) is full; a directory this
    call created is then removed, so no half-written reproducer or temporary file is left."""
    from kvfuzz.fuzz.campaign.store.journal import stop_when_full

    case = case_dict(target, example, finding, fault_name)
    digest = hashlib.sha1(json.dumps(case["example"], sort_keys=True).encode()).hexdigest()[:10]
    slug = "".join(c if c.isalnum() or c in "._" else "-" for c in finding.check)
    d = Path(out) / f"{target.name}-{finding.kind.slug}-{slug}-{digest}"
    if run is None:
        try:
            run = properties.prepare(target, example, get_fault(fault_name) if fault_name else None)
        except Exception as e:  # the finding itself may be that the call cannot be built
            case["tensors"] = f"not written: building the call raised {type(e).__name__}: {e}"
    existed = d.is_dir()
    try:
        with stop_when_full(d):
            _write_files(d, target, case, finding, run)
    except BaseException:
        if not existed:
            shutil.rmtree(d, ignore_errors=True)
        else:  # an earlier write of the same example stands, whole
            (d / f".tensors.safetensors.{os.getpid()}.tmp").unlink(missing_ok=True)
            (d / f".test_case.py.{os.getpid()}.tmp").unlink(missing_ok=True)
        raise
    return d


def _write_files(d: Path, target: Target, case: dict, finding: Finding, run: Run | None) -> None:
    from safetensors.torch import save_file

    from kvfuzz.fuzz.campaign.store.journal import write_json

    d.mkdir(parents=True, exist_ok=True)
    if run is not None:
        # this process's own temporary names: two workers that found the same example write the same directory
        tmp = d / f".tensors.safetensors.{os.getpid()}.tmp"
        save_file(_tensors(run), str(tmp))
        tmp.replace(d / "tensors.safetensors")
    write_json(d / "case.json", case)
    tmp = d / f".test_case.py.{os.getpid()}.tmp"
    verdict = (_VERDICT_REJECTED if finding.kind is FailureKind.CONFIG_REJECTED else
               "The test fails while the failure reproduces and passes once it is fixed.")
    tmp.write_text(_TEST_TEMPLATE.format(
        kind=case["kind"], check=check_label(case["check"]), target=target.name, message=finding.message[:2000].replace('"""', "'''"),
        dirname=d.name, verdict=verdict))
    tmp.replace(d / "test_case.py")


# ---- replaying ------------------------------------------------------------------------------------------------
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
        data = None if inputs_match or properties.is_writer(target) else stored_data(case.example, stored)
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
    target cannot run here)."""
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


def replay(directory: str | Path, *, target_spec: str | None = None, trust_target: bool = False,
           timeout: float | None = None) -> ReplayResult:
    """Re-run a reproducer directory in a child process and compare with what it recorded. A child that dies
    inside the kernel gives got = ("kernel crash", "<signal or exit status>"); one whose kernel call runs past
    ``timeout`` seconds (None: the campaign's own example timeout for a hang case, :func:`hang_timeout`, else
    :data:`REPLAY_TIMEOUT`) is killed and gives ("kernel hang", "timeout"); outside the kernel (the whole
    replay past :data:`REPLAY_TIMEOUT`, or ``timeout`` when larger), ("harness error", ...).

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
    deadline = time.monotonic() + max(REPLAY_TIMEOUT, kernel_timeout)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
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
                    if phase == "kernel":  # the campaign timed the kernel call: so does the replay
                        deadline = min(deadline, time.monotonic() + kernel_timeout)
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
    finding = finding_for(ending, phase or "prepare",
                          timeout=kernel_timeout if phase == "kernel" else max(REPLAY_TIMEOUT, kernel_timeout))
    if finding is None:  # killed from outside
        return ReplayResult(case.directory, expected, ("harness error", f"replay {ending.detail}"),
                            f"the replay process was {ending.kind.value} ({ending.detail}) before it answered", None)
    return ReplayResult(case.directory, expected, finding.signature, finding.message, None)


__all__ = ["BadReproducer", "CASE_FORMAT", "Case", "ReplayResult", "TargetUnavailable", "UntrustedTarget", "load_case",
           "replay", "replay_here", "resolve_target", "unavailable", "versions", "write_reproducer"]
