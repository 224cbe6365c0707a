"""The pre-merge gate: a deterministic fuzz budget on every available target plus a replay of a committed
regression corpus, with JUnit XML for CI.

Deterministic: fixed seeds, an in-memory example database (a corpus named with ``--db`` is read, never
written),
and each target's ``gate_poisons``. A corpus is a directory of reproducer directories (as ``kvfuzz fuzz``
writes them); each must pass now — a case that fails again is a regression.

A gate never passes by accident: a target that did not spend its budget (the gate was interrupted, or its
campaign could not run) is an *error*, never a pass, and so is a corpus case that was not replayed; the JUnit
file says so (``<error>``), and :func:`write_junit` is first called with every case an error
(:func:`unfinished`), so a gate killed outright leaves a file that fails the CI job, not the last run's.
"""

from __future__ import annotations

import contextlib
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import attrs

from kvfuzz.contracts.checks.oracles import check_label
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig, WorkerPool
from kvfuzz.fuzz.campaign.store.cases import BadReproducer
from kvfuzz.fuzz.campaign.workers.replay import TargetUnavailable, replay
from kvfuzz.fuzz.campaign.workers.supervisor import Supervisor
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
    #: the case could not be read or its target not loaded (exit 2: bad input, not a regression)
    bad_input: bool = False
    #: why the case was not replayed: its target cannot run on this machine (a CUDA-only kernel on a CPU)
    skipped: str | None = None
    #: why the case did not finish (the gate was interrupted, its campaign could not run): a JUnit <error>,
    #: never a pass (exit 3)
    error: str | None = None
    #: the reproducer directories of what the case found
    reproducers: tuple[str, ...] = ()


class GateInterrupted(Exception):
    """The gate was stopped (Ctrl-C, SIGTERM, SIGHUP) before it finished: ``results`` holds every case, those
    that did not finish as errors (:attr:`CheckResult.error`)."""

    def __init__(self, results: list[CheckResult], why: str = "interrupted") -> None:
        super().__init__(why)
        self.results = results


def unfinished(targets: list[str], corpus: list[str], why: str) -> list[CheckResult]:
    """Every case of a gate as an error saying ``why``: what :func:`write_junit` writes before the gate starts,
    so that a gate killed outright (SIGKILL, a lost machine) leaves a JUnit file that fails, never a pass."""
    return ([CheckResult("property", t, 0.0, error=why) for t in targets]
            + [CheckResult("regression", c, 0.0, error=why) for c in corpus])


def corpus_cases(corpus: Path) -> list[Path]:
    """The reproducer directories of ``corpus`` (each holds a case.json), sorted by name."""
    return sorted(p for p in corpus.iterdir() if p.is_dir() and (p / "case.json").exists())


def check_targets(targets: list[Target], out: Path, max_examples: int, seed: int,
                  limits: Limits = CHECK_LIMITS, db_spec: str | None = None,
                  names: list[str] | None = None) -> list[CheckResult]:
    """A deterministic budget per target: fixed seeds (chunk 0 on, whatever ran before in ``out``), each target's
    ``gate_poisons``, an in-memory database (plus, with ``db_spec``, a read-only view of that corpus, whose
    failures are replayed first), run in one supervised worker so a kernel that crashes or hangs is a failed
    result, not a dead gate. ``names``: how the user named each target (file/module specs).

    A target that did not spend ``max_examples`` without a failure (the gate was stopped, or ran none) is an error
    (:attr:`CheckResult.error`), and so are the campaign's problems (a worker that could not start, an example
    lost). Raises :class:`GateInterrupted` with every target's result when the gate was stopped."""
    config = CampaignConfig(out=out, max_examples=max_examples, seed=seed, limits=limits, poisons=tuple(Poison),
                            db_spec=db_spec, gate=True)
    run = Supervisor(targets, names or [t.name for t in targets], config, pool=WorkerPool(workers=1),
                     resume=False).run()
    results = []
    for stats in run.targets:
        problems = [f"{f.kind} ({check_label(f.check)}): {f.message} [reproducer: {f.reproducer}]"
                    for f in stats.failures.values()]
        if stats.stopped:
            problems.append(stats.stopped)
        error = None
        if not problems and stats.examples < max_examples and (run.interrupted or not stats.examples):
            error = (f"not finished: the gate was interrupted after {stats.examples} of {max_examples} examples"
                     if run.interrupted else "no example ran")
        results.append(CheckResult("property", stats.target, stats.elapsed, "; ".join(problems) or None,
                                   f"{stats.examples} examples, paths {dict(stats.paths)}", error=error,
                                   reproducers=tuple(str(f.reproducer) for f in stats.failures.values()
                                                     if f.reproducer)))
    if run.problems:
        results.append(CheckResult("property", "campaign", 0.0, error="; ".join(run.problems)))
    if run.interrupted:
        raise GateInterrupted(results)
    return results


def check_corpus(corpus: Path, trust_targets: bool = False, timeout: float | None = None) -> list[CheckResult]:
    """Replay every reproducer directory under ``corpus``, each isolated in a child process with ``timeout``
    seconds for its kernel call (None: as :func:`~kvfuzz.fuzz.campaign.workers.replay.replay`, a hang case's own
    recorded example timeout) (a case that crashes or hangs is a failed result, "kernel crash"/"kernel hang",
    and the gate goes on). A
    case that cannot be read or whose target is not trusted is a failed result whose ``bad_input`` is set; one
    whose target cannot run on this machine is skipped (``skipped`` says why), not failed. Stopped (Ctrl-C, or
    SIGTERM/SIGHUP turned into KeyboardInterrupt by the command), it raises :class:`GateInterrupted` with the
    cases replayed so far and the rest as errors."""
    results: list[CheckResult] = []
    cases = corpus_cases(corpus)
    for i, d in enumerate(cases):
        try:
            results.append(_replay_one(d, trust_targets, timeout))
        except KeyboardInterrupt:  # the replay's child is killed by replay()'s own cleanup
            rest = [c.name for c in cases[i:]]
            raise GateInterrupted(results + unfinished([], rest, "not replayed: the gate was interrupted")) from None
    return results


def _replay_one(d: Path, trust_targets: bool, timeout: float | None) -> CheckResult:
    """One corpus case replayed (:func:`check_corpus`)."""
    s = time.monotonic()
    bad, skipped = False, None
    try:
        r = replay(d, trust_target=trust_targets, timeout=timeout)
        failure = None if r.got is None else f"{r.got[0]} ({r.got[1]}): {r.message}"
    except BadReproducer as e:
        failure, bad = f"bad reproducer: {e}", True
    except TargetUnavailable as e:
        failure, skipped = None, str(e)
    except ValueError as e:  # an untrusted or unloadable target
        failure, bad = f"cannot replay: {e}", True
    return CheckResult("regression", d.name, time.monotonic() - s, failure, bad_input=bad, skipped=skipped)


def write_junit(results: list[CheckResult], path: Path) -> None:
    """JUnit XML: one <testsuite> per suite ("property", "regression"), one <testcase> per result: <failure>,
    <error> (not finished) or <skipped>. Written atomically (a temporary file beside it, then ``os.replace``): a
    reader sees the old file or the new one, never half of one. Raises OSError when it cannot be written."""
    root = ET.Element("testsuites", name="kvfuzz check")
    for suite in ("property", "regression"):
        rs = [r for r in results if r.suite == suite]
        el = ET.SubElement(root, "testsuite", name=f"kvfuzz.{suite}", tests=str(len(rs)),
                           failures=str(sum(r.failure is not None for r in rs)),
                           errors=str(sum(r.error is not None and r.failure is None for r in rs)),
                           skipped=str(sum(r.skipped is not None for r in rs)),
                           time=f"{sum(r.seconds for r in rs):.3f}")
        for r in rs:
            tc = ET.SubElement(el, "testcase", classname=f"kvfuzz.{suite}", name=r.name, time=f"{r.seconds:.3f}")
            if r.skipped is not None:
                ET.SubElement(tc, "skipped", message=r.skipped[:500])
            if r.failure is not None:
                f = ET.SubElement(tc, "failure", message=r.failure.splitlines()[0][:500])
                f.text = r.failure
            elif r.error is not None:
                e = ET.SubElement(tc, "error", message=r.error.splitlines()[0][:500])
                e.text = r.error
            if r.detail:
                ET.SubElement(tc, "system-out").text = r.detail
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


__all__ = ["CHECK_LIMITS", "CheckResult", "GateInterrupted", "check_corpus", "check_targets", "corpus_cases",
           "unfinished", "write_junit"]
