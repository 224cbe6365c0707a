"""Reproducer directories: everything needed to see, re-run and share one failure, written by
:func:`write_reproducer`.

<out>/<target>-<kind>-<check>-<hash>/
    case.json           target (and, for an adapter loaded from a file or module, its spec), contract, failure
                        kind and blame, the violated invariant or oracle, the message and details, the example
                        (batch + poison), the caller fault, versions
    tensors.safetensors the call's tensors (query, key, value, caches, index tensors), the ground-truth
                        keys/values, the kernel output and the fp64 reference, as they were (absent when the
                        call could not even be built: case.json says why)
    test_case.py        a standalone pytest file that re-runs the case (isolated) and fails while it reproduces;
                        it imports ``replay`` from :mod:`kvfuzz.fuzz.campaign` (the room's face), so a stored
                        case does not depend on where in the room the replay lives
    standalone.py       the same without kvfuzz: torch, safetensors and the kernel's package only; the call's
                        arguments are stored too (``call.storage<N>``, the ``envelope`` of the bound):
                        :mod:`kvfuzz.fuzz.campaign.store.standalone`

Reading one back: :mod:`kvfuzz.fuzz.campaign.store.cases` (:func:`~kvfuzz.fuzz.campaign.store.cases.load_case`
validates every field). Replaying one, in a child process with a timeout:
:mod:`kvfuzz.fuzz.campaign.workers.replay`. Tensors are stored as safetensors; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import textwrap
from pathlib import Path
from typing import Any

from kvfuzz.contracts.checks.failures import FailureKind, Finding
from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.store.cases import CASE_FORMAT
from kvfuzz.fuzz.campaign.store.journal import json_safe
from kvfuzz.fuzz.campaign.store.standalone import (
    MAX_RECORD_BYTES,
    Unrecordable,
    family,
    patched_sources,
    record_target_call,
    standalone_script,
)
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import spec_of


def versions() -> dict[str, str | None]:
    """Versions of everything that can change a result."""
    import torch

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("kvfuzz", "torch", "triton", "vllm", "hypothesis", "sglang", "flashinfer-python"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["torch_cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    if torch.cuda.is_available():  # the driver, for an upstream issue (kvfuzz report --issue)
        try:
            import subprocess

            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    return out


#: case.json ``stage``: how far the example was shrunk. "final": shrunk (Hypothesis's shrink, then the structural
#: one); "hypothesis": by Hypothesis only (the structural shrink did not finish); "unshrunk": the first hit as found
#: (a provisional reproducer whose shrink did not finish, a crash or hang a worker died of, a baseline's known
#: finding, which is never shrunk). A case.json without it was written shrunk.
STAGES = ("final", "hypothesis", "unshrunk")


def case_dict(target: Target, example: Example, finding: Finding, fault_name: str | None,
              stage: str = "final") -> dict[str, Any]:
    """case.json's content (module docstring); ``stage`` one of :data:`STAGES`."""
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
        "stage": "unshrunk" if finding.known is not None else stage,
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

    from kvfuzz.contracts.caches.materialize import is_big, referenced_blocks, referenced_rows

    t: dict[str, torch.Tensor] = {
        "query": run.data.query, "keys_ground_truth": run.data.keys, "values_ground_truth": run.data.values,
    }
    kc, vc = run.call.key_cache, run.call.value_cache
    if is_big(kc, vc):
        t["cache_block_ids"] = referenced_blocks(run.example.batch)
        t["key_cache_blocks"], t["value_cache_blocks"] = referenced_rows(run.example.batch, run.call.layout, kc, vc)
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
    if run.envelope is not None:
        t["envelope"] = run.envelope
    return {k: v.detach().cpu().contiguous().clone() for k, v in t.items()}


_TEST_TEMPLATE = '''"""kvfuzz reproducer: {kind} ({check}) on {target}.

{message}

Re-run: pytest {dirname}/test_case.py
    (or: kvfuzz replay {dirname})
{verdict} It replays this directory in a child
process (a crash or a hang fails the test instead of killing pytest).
"""

from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign import TargetUnavailable, replay


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


def _wrapped(text: str, width: int = 120) -> str:
    """``text`` with every line longer than ``width`` broken at spaces (test_case.py's docstring: the message
    and the names it quotes); a word longer than a line is kept whole."""
    return "\n".join(textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False)
                     if len(line) > width else line for line in text.split("\n"))


def write_reproducer(out: Path, target: Target, example: Example, finding: Finding, run: Run | None,
                     fault_name: str | None = None, stage: str = "final") -> Path:
    """Write a reproducer directory under ``out``; returns its path. With ``run=None`` (a crash recovered by the
    supervisor) the tensors are rebuilt from the example without running the kernel; when even that fails (the
    adapter cannot build the call), case.json says so and tensors.safetensors is left out. ``stage``: how far the
    example was shrunk (:data:`STAGES`; case.json ``stage``, which ISSUE.md reads).

    Raises :class:`~kvfuzz.fuzz.campaign.store.journal.OutOfSpace` when the disk (or quota) is full; a directory this
    call created is then removed, so no half-written reproducer or temporary file is left."""
    from kvfuzz.fuzz.campaign.store.journal import stop_when_full

    case = case_dict(target, example, finding, fault_name, stage)
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
        else:  # an earlier write of the same example stands, whole (write_json and write_text remove their own)
            (d / f".tensors.safetensors.{os.getpid()}.tmp").unlink(missing_ok=True)
        raise
    return d


def _write_files(d: Path, target: Target, case: dict, finding: Finding, run: Run | None) -> None:
    from safetensors.torch import save_file

    from kvfuzz.fuzz.campaign.store.journal import write_json, write_text

    d.mkdir(parents=True, exist_ok=True)
    spec, why_not, call_tensors = None, case.get("tensors"), {}
    if run is not None:
        try:
            call_tensors, spec = _recorded_call(target, run)
        except Exception as e:  # noqa: BLE001 - the script then reports the finding without a call
            why_not = f"the call could not be recorded ({type(e).__name__}: {e})"
    if run is not None:
        # this process's own temporary names: two workers that found the same example write the same directory
        tmp = d / f".tensors.safetensors.{os.getpid()}.tmp"
        save_file({**_tensors(run), **call_tensors}, str(tmp))
        tmp.replace(d / "tensors.safetensors")
    write_json(d / "case.json", case)
    verdict = (_VERDICT_REJECTED if finding.kind is FailureKind.CONFIG_REJECTED else
               "The test fails while the failure reproduces and passes once it is fixed.")
    text = _TEST_TEMPLATE.format(
        kind=case["kind"], check=check_label(case["check"]), target=target.name,
        message=finding.message[:2000].replace('"""', "'''"),
        dirname=d.name, verdict=verdict)
    doc, end, code = text.partition('\n"""\n')
    write_text(d / "test_case.py", _wrapped(doc) + end + code)
    if spec is not None:
        _write_patched(d, target, spec)
    if family(target) is None:
        why_not = f"kvfuzz writes no standalone call for {target.name}'s family yet"
    write_text(d / "standalone.py", standalone_script(target, case, spec, why_not))


def _recorded_call(target: Target, run: Run) -> tuple[dict, dict | None]:
    """The call a standalone script repeats, recorded before any kernel ran: a fresh ``prepare`` of the
    run's example (the same data and arguments; the run's own call may hold the kernel's writes), or None for
    a target without a standalone family."""
    if family(target) is None:
        return {}, None
    for c in (run.call.key_cache, run.call.value_cache):  # a --big-cache call: not a second copy of its cache
        if c.untyped_storage().nbytes() > MAX_RECORD_BYTES:
            raise Unrecordable(f"a {c.untyped_storage().nbytes()}-byte cache (over {MAX_RECORD_BYTES})")
    fresh = run if run.output is None else properties.prepare(target, run.example, run.fault)
    return record_target_call(target, fresh.call)


def _write_patched(d: Path, target: Target, spec: dict) -> None:
    """A re-injected bug's patched kernel sources beside standalone.py (:func:`patched_sources`)."""
    patched = patched_sources(target)
    if patched is None:
        return
    files, spec["patched"] = patched
    for name, text in files.items():
        (d / name).write_text(text)


__all__ = ["STAGES", "case_dict", "versions", "write_reproducer"]
