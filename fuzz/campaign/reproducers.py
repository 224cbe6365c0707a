"""Reproducer directories: everything needed to see, re-run and share one failure.

<out>/<target>-<kind>-<check>-<hash>/
    case.json           target, contract, failure kind and blame, the violated invariant or oracle, the
                        message and details, the example (batch + poison), the caller fault, versions
    tensors.safetensors the call's tensors (query, key, value, caches, index tensors), the ground-truth
                        keys/values, the kernel output and the fp64 reference, as they were
    test_case.py        a standalone pytest file that re-runs the case and fails the same way
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

from kvfuzz.contracts.example import Example
from kvfuzz.contracts.failures import FINDING_CLASSES, Finding
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.faults import CallerFault, get_fault
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target

CASE_FORMAT = 1


def versions() -> dict[str, str | None]:
    """Versions of everything that can change a result."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("kvfuzz", "torch", "triton", "vllm", "hypothesis"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["torch_cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return out


def _json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def case_dict(target: Target, example: Example, finding: Finding, fault_name: str | None) -> dict[str, Any]:
    b = example.batch
    return {
        "format": CASE_FORMAT,
        "target": target.name,
        "contract": target.capabilities.contract.value,
        "kind": finding.kind.value,
        "blame": finding.kind.blame,
        "check": finding.check,
        "message": finding.message,
        "details": _json_safe(finding.details),
        "caller_fault": fault_name,
        "example": example.to_dict(),
        "derived": {"seq_lens": list(b.seq_lens), "query_start_loc": list(b.query_start_loc),
                    "decode_seqs": list(b.decode_seqs), "max_seq_len": b.max_seq_len,
                    "max_query_len": b.max_query_len, "scale": b.scale},
        "versions": versions(),
    }


def _tensors(run: Run) -> dict[str, torch.Tensor]:
    """What a reproducer stores: inputs, ground truth, caches, index tensors, output and reference. A cache
    over FULL_POISON_MAX_BYTES (``--big-cache``) is stored as its referenced blocks (``key_cache_blocks``,
    ``value_cache_blocks``) with their ids (``cache_block_ids``), not as several GiB."""
    from kvfuzz.contracts.materialize import is_big, referenced_blocks

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
The test fails while the failure reproduces.
"""

import json

from kvfuzz.fuzz.campaign.reproducers import rerun

CASE = json.loads(r"""{case_json}""")


def test_case():
    rerun(CASE["target"], CASE["example"], CASE["caller_fault"])
'''


def write_reproducer(out: Path, target: Target, example: Example, finding: Finding, run: Run | None,
                     fault_name: str | None = None) -> Path:
    """Write a reproducer directory under ``out``; returns its path. With ``run=None`` (a crash recovered
    from the journal) the tensors are rebuilt from the example without running the kernel."""
    case = case_dict(target, example, finding, fault_name)
    digest = hashlib.sha1(json.dumps(case["example"], sort_keys=True).encode()).hexdigest()[:10]
    name = f"{target.name}-{finding.kind.slug}-{finding.check.replace(' ', '-')}-{digest}"
    d = Path(out) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "case.json").write_text(json.dumps(case, indent=2) + "\n")
    if run is None:
        run = properties.prepare(target, example, get_fault(fault_name) if fault_name else None)
    save_file(_tensors(run), str(d / "tensors.safetensors"))
    compact = json.dumps({"target": case["target"], "example": case["example"], "caller_fault": fault_name})
    (d / "test_case.py").write_text(_TEST_TEMPLATE.format(
        kind=case["kind"], check=case["check"], target=target.name, message=finding.message[:2000],
        dirname=d.name, case_json=compact))
    return d


def rerun(target_name: str, example: dict, fault_name: str | None) -> Run:
    """Re-run one example; raises the Finding if it still fails (used by test_case.py)."""
    from kvfuzz.fuzz.targets import get_target

    target = get_target(target_name)
    avail = target.availability()
    if not avail.ok:
        raise RuntimeError(f"target {target_name} is not available here: {avail.reason}")
    fault = get_fault(fault_name) if fault_name else None
    return properties.check(target, Example.from_dict(example), fault)


@attrs.frozen
class ReplayResult:
    """expected: the case's recorded (kind, check). got: what the re-run found, None if it passed.
    inputs_match: whether the regenerated inputs equal the stored tensors bit for bit."""

    directory: Path
    expected: tuple[str, str]
    got: tuple[str, str] | None
    message: str
    inputs_match: bool

    @property
    def reproduced(self) -> bool:
        return self.got == self.expected


def replay(directory: str | Path) -> ReplayResult:
    """Re-run a reproducer directory and compare with what it recorded.

    Raises FileNotFoundError if ``directory`` has no case.json, ValueError if case.json is not a kvfuzz case.
    """
    d = Path(directory)
    case_file = d / "case.json"
    if not case_file.exists():
        raise FileNotFoundError(f"{d} has no case.json: pass a reproducer directory written by `kvfuzz fuzz`")
    case = json.loads(case_file.read_text())
    if case.get("format") != CASE_FORMAT or "example" not in case:
        raise ValueError(f"{case_file} is not a kvfuzz case (format {case.get('format')!r})")
    expected = (case["kind"], case["check"])
    from kvfuzz.fuzz.targets import get_target

    target = get_target(case["target"])
    fault = get_fault(case["caller_fault"]) if case.get("caller_fault") else None
    example = Example.from_dict(case["example"])
    inputs_match = True
    tensors_file = d / "tensors.safetensors"
    run = properties.prepare(target, example, fault)
    if tensors_file.exists():
        stored = load_file(str(tensors_file))
        inputs_match = all(torch.equal(stored[k].view(torch.uint8), v.contiguous().view(torch.uint8))
                           for k, v in (("query", run.data.query), ("keys_ground_truth", run.data.keys)))
    try:
        properties.check(target, example, fault, run=run)
    except Finding as f:
        return ReplayResult(d, expected, f.signature, f.message, inputs_match)
    return ReplayResult(d, expected, None, "the example passes now", inputs_match)


__all__ = ["replay", "rerun", "write_reproducer", "versions", "ReplayResult", "FINDING_CLASSES", "CallerFault"]
