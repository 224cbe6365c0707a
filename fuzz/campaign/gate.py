"""The pre-merge gate: a deterministic fuzz budget on every available target plus a replay of a committed
regression corpus, with JUnit XML for CI.

Deterministic: fixed seeds, an in-memory example database (a corpus named with ``--db`` is read, never
written),
and each target's ``gate_poisons``. A corpus is a directory of reproducer directories (as ``kvfuzz fuzz``
writes them); each must pass now — a case that fails again is a regression.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from pathlib import Path

import attrs

from kvfuzz.contracts.poison import Poison
from kvfuzz.fuzz.campaign.database import read_only_view
from kvfuzz.fuzz.campaign.engine import CampaignConfig, fuzz_target
from kvfuzz.fuzz.campaign.reproducers import replay
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.limits import Limits

#: Small batches keep the gate under five minutes on a 2-core CPU with the Triton interpreter.
CHECK_LIMITS = Limits(max_num_seqs=3, max_ctx_len=48, max_query_len=16, max_num_heads=8)


@attrs.frozen
class CheckResult:
    """One JUnit test case: ``suite`` "property" (a target's contract property) or "regression" (a corpus
    case); ``failure`` None when it passed."""

    suite: str
    name: str
    seconds: float
    failure: str | None = None
    detail: str = ""


def check_targets(targets: list[Target], out: Path, max_examples: int, seed: int,
                  limits: Limits = CHECK_LIMITS, db_spec: str | None = None) -> list[CheckResult]:
    """A deterministic budget per target: fixed seeds, each target's ``gate_poisons``, an in-memory database
    (plus, with ``db_spec``, a read-only view of that corpus, whose failures are replayed first)."""
    results = []
    for t in targets:
        config = CampaignConfig(out=out, max_examples=max_examples, seed=seed, limits=limits,
                                poisons=t.gate_poisons or tuple(Poison), database=read_only_view(db_spec),
                                work_dir=out / "work")
        s = time.monotonic()
        stats = fuzz_target(t, config)
        failure = None
        if stats.failures:
            failure = "; ".join(f"{f.finding.kind.value} ({f.finding.check}): {f.finding.message} "
                                f"[reproducer: {f.reproducer}]" for f in stats.failures.values())
        results.append(CheckResult("property", t.name, time.monotonic() - s, failure,
                                   f"{stats.examples} examples, paths {dict(stats.paths)}"))
    return results


def check_corpus(corpus: Path) -> list[CheckResult]:
    results = []
    for d in sorted(p for p in corpus.iterdir() if (p / "case.json").exists()):
        s = time.monotonic()
        try:
            r = replay(d)
            failure = None if r.got is None else f"{r.got[0]} ({r.got[1]}): {r.message}"
        except Exception as e:  # a case that cannot even be replayed is a failure of the gate, named
            failure = f"could not replay: {type(e).__name__}: {e}"
        results.append(CheckResult("regression", d.name, time.monotonic() - s, failure))
    return results


def write_junit(results: list[CheckResult], path: Path) -> None:
    """JUnit XML: one <testsuite> per suite ("property", "regression"), one <testcase> per result."""
    root = ET.Element("testsuites", name="kvfuzz check")
    for suite in ("property", "regression"):
        rs = [r for r in results if r.suite == suite]
        el = ET.SubElement(root, "testsuite", name=f"kvfuzz.{suite}", tests=str(len(rs)),
                           failures=str(sum(r.failure is not None for r in rs)), errors="0",
                           time=f"{sum(r.seconds for r in rs):.3f}")
        for r in rs:
            tc = ET.SubElement(el, "testcase", classname=f"kvfuzz.{suite}", name=r.name, time=f"{r.seconds:.3f}")
            if r.failure is not None:
                f = ET.SubElement(tc, "failure", message=r.failure.splitlines()[0][:500])
                f.text = r.failure
            if r.detail:
                ET.SubElement(tc, "system-out").text = r.detail
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
