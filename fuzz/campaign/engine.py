"""The campaign runner: fuzz targets with Hypothesis, shrink each new failure, write reproducers.

Per target, a campaign
1. replays the failures the example database holds for this target (Hypothesis's reuse phase), so the
   next run tries them first;
2. explores in chunks of fresh seeds until the example or time budget is spent (the time budget is checked
   between examples of a chunk's size planned from the measured rate; a shrink in progress completes). A failure with a new
   signature (failure kind, invariant or oracle) is raised, shrunk by Hypothesis and written as a
   reproducer; a failure whose signature is already known is counted and exploration goes on;
3. journals every example to ``<out>/inflight.json`` before its kernel runs: if the process dies inside a
   kernel (segfault, abort), the next campaign finds the journal and writes that example as a
   "kernel crash" reproducer, so no crashing example is lost.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from pathlib import Path
from typing import Callable

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, event, given, seed, settings
from hypothesis import target as steer
from hypothesis.database import ExampleDatabase

from kvfuzz.contracts.example import Example
from kvfuzz.contracts.failures import Finding, KernelCrash, KernelHang
from kvfuzz.contracts.poison import Poison
from kvfuzz.fuzz.campaign.database import open_database
from kvfuzz.fuzz.campaign.reproducers import write_reproducer
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.attention import caller_finding, caller_violations
from kvfuzz.fuzz.harness.coverage import Coverage, labels
from kvfuzz.fuzz.harness.faults import CallerFault, get_fault
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.batches import Limits, big_cache_examples, examples, undeclared_examples

#: Set by a SIGTERM/SIGINT handler (kvfuzz fuzz): the campaign stops at the next example or chunk boundary by
#: raising KeyboardInterrupt there. Raising from the handler alone is not enough: code running inside a
#: kernel library can swallow the KeyboardInterrupt (seen: a SIGTERM during an interpreted Triton kernel left
#: the campaign running).
STOP = threading.Event()


@attrs.define
class FoundFailure:
    """One distinct failure: its minimal example, the finding, how often it was hit, its reproducer."""

    target: str
    finding: Finding
    example: Example
    run: Run | None
    count: int = 1
    reproducer: Path | None = None


@attrs.define
class TargetStats:
    target: str
    examples: int = 0
    elapsed: float = 0.0
    kernel_seconds: float = 0.0
    harness_seconds: float = 0.0
    paths: collections.Counter = attrs.Factory(collections.Counter)
    failures: dict = attrs.Factory(dict)  # signature -> FoundFailure
    max_error_ratio: float = 0.0
    coverage: Coverage = attrs.Factory(Coverage)
    rejections: collections.Counter = attrs.Factory(collections.Counter)  # --undeclared: error -> count
    #: Seconds and examples (counted from the campaign's start) until the first failing example, before any
    #: shrinking; None while nothing failed.
    first_failure_s: float | None = None
    first_failure_examples: int | None = None

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.elapsed if self.elapsed else 0.0

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "examples": self.examples,
            "elapsed_s": round(self.elapsed, 3),
            "examples_per_s": round(self.examples_per_second, 3),
            "kernel_s": round(self.kernel_seconds, 3),
            "harness_s": round(self.harness_seconds, 3),
            "paths": dict(self.paths),
            "coverage": self.coverage.to_dict(),
            "rejections": dict(self.rejections.most_common(20)),
            "max_error_ratio": self.max_error_ratio,
            "failures": [
                {"kind": f.finding.kind.value, "blame": f.finding.kind.blame, "check": f.finding.check,
                 "count": f.count, "message": f.finding.message,
                 "batch": f"{f.example.batch.summary()}, poison={f.example.poison.value}",
                 "reproducer": str(f.reproducer) if f.reproducer else None}
                for f in self.failures.values()
            ],
        }


@attrs.define
class CampaignConfig:
    """Budgets are per target: at most ``max_examples`` examples and ``duration`` seconds (None: no limit).
    ``poisons``: what may fill the slots the contract leaves unwritten (strictness: NaN and inf catch any read
    of them that reaches the output, stale finite values catch reads that change the answer)."""

    out: Path
    max_examples: int = 30
    duration: float | None = None
    seed: int = 0
    fault: CallerFault | None = None
    limits: Limits = Limits()
    poisons: tuple[Poison, ...] = tuple(Poison)
    chunk_examples: int = 25
    database: ExampleDatabase | None = None
    #: Stop exploring after the first distinct failure is shrunk (benchmarks of time-to-first-failure).
    stop_at_first_failure: bool = False
    #: Where this process journals its in-flight example and keeps its state (default: ``out``; a worker
    #: of a multi-process campaign uses ``out/workers/wN``).
    work_dir: Path | None = None
    #: Hypothesis database: None for ``out/hypothesis-db``, a directory path, or ``redis://host:port/db``.
    db_spec: str | None = None
    #: Run calls whose arguments could make a kernel read out of bounds (set in isolated worker processes).
    run_unsafe: bool = False
    #: Draw configurations the target does not declare (kvfuzz.fuzz.harness.properties.check_undeclared).
    undeclared: bool = False
    #: Place every batch's blocks past 2**31 elements of a multi-GiB cache (big_cache_examples).
    big_cache: bool = False

    def db(self) -> ExampleDatabase:
        if self.database is None:
            self.database = open_database(self.db_spec, self.out)
        return self.database

    @property
    def dir(self) -> Path:
        return self.work_dir or self.out


def _journal_path(work_dir: Path) -> Path:
    return work_dir / "inflight.json"


def recover_crashed(config: CampaignConfig, targets: dict[str, Target], hang: bool = False,
                    write: bool = True) -> list[FoundFailure]:
    """If a previous process died (or was killed for hanging) inside a kernel, turn its journaled example
    into a "kernel crash" (or "kernel hang") reproducer (``write=False``: recover without writing, for a
    failure already saved). Returns the recovered failures (0 or 1)."""
    path = _journal_path(config.dir)
    if not path.exists():
        return []
    entry = json.loads(path.read_text())
    path.unlink()
    example = Example.from_dict(entry["example"])
    if hang:
        finding = KernelHang("timeout", "the kernel ran past the per-example timeout and its worker was "
                             "killed; recovered from the worker's journal", {"path": entry.get("path", "")})
    else:
        finding = KernelCrash("process died", "the process died while this example's kernel was running "
                              "(segfault, abort or kill); recovered from the campaign journal",
                              {"path": entry.get("path", "")})
    target = targets.get(entry["target"])
    if target is not None and entry.get("fault"):
        # a faulty caller's call killed the kernel: blame the caller, with the crash as the kernel's outcome
        violations = caller_violations(target, properties.prepare(target, example, get_fault(entry["fault"])))
        if violations:
            outcome = "hung" if hang else "crashed (the process died)"
            finding = caller_finding(violations, {"outcome": outcome}, {"path": entry.get("path", "")})
    found = FoundFailure(entry["target"], finding, example, None)
    if target is not None and write:
        found.reproducer = write_reproducer(config.out, target, example, finding, None,
                                            fault_name=entry.get("fault"))
    return [found]


def fuzz_target(target: Target, config: CampaignConfig,
                on_example: Callable[[TargetStats], None] = lambda s: None,
                stats: TargetStats | None = None) -> TargetStats:
    """Fuzz one target within the config's budget; returns its statistics and distinct failures.

    Pass ``stats`` to keep what was counted if the run is interrupted (KeyboardInterrupt propagates
    after the in-flight example's journal entry is removed)."""
    stats = stats if stats is not None else TargetStats(target.name)
    config.out.mkdir(parents=True, exist_ok=True)
    config.dir.mkdir(parents=True, exist_ok=True)
    journal = _journal_path(config.dir)
    fault_name = config.fault.name if config.fault else None
    known: set[tuple[str, str]] = set()
    latest: dict[tuple[str, str], tuple[Example, Finding, Run | None]] = {}
    start = time.monotonic()
    if config.big_cache and not target.capabilities.contract.is_attention:
        raise ValueError(f"--big-cache fuzzes attention kernels; {target.name} is a cache writer (its property "
                         "compares whole caches before and after the call)")
    if config.undeclared:
        strategy = undeclared_examples(target.capabilities, target.faithful_dtypes(), config.limits, config.poisons)
    elif config.big_cache:
        strategy = big_cache_examples(target.capabilities, config.limits, config.poisons)
    else:
        strategy = examples(target.capabilities, config.limits, config.poisons)

    def body(example: Example) -> None:
        if STOP.is_set():
            raise KeyboardInterrupt
        lab = labels(target, example.batch)
        for k, v in lab.items():
            event(f"{k}: {v}")
        steer(stats.coverage.rarity(lab), label="rarely covered paths")
        journal.write_text(json.dumps({"target": target.name, "fault": fault_name, "path": lab["path"],
                                       "example": example.to_dict()}))
        if config.undeclared:
            from kvfuzz.contracts.layouts import LayoutError
            try:
                run = properties.prepare(target, example, config.fault)
            except LayoutError:
                journal.unlink(missing_ok=True)
                from hypothesis import reject
                reject()
        else:
            run = properties.prepare(target, example, config.fault)
        try:
            if config.undeclared:
                run, outcome = properties.check_undeclared(target, example, run=run)
                kind = outcome.split(":")[0]
                lab["undeclared"] = kind
                event(f"undeclared: {kind}")
                if kind == "rejected":
                    stats.rejections[outcome.removeprefix("rejected: ")] += 1
            else:
                properties.check(target, example, config.fault, run=run, run_unsafe=config.run_unsafe)
        except Finding as f:
            if stats.first_failure_s is None:
                stats.first_failure_s = time.monotonic() - start
                stats.first_failure_examples = stats.examples + 1
            sig = f.signature
            if sig in known:
                stats.failures[sig].count += 1
                return
            latest[sig] = (example, f, run)
            raise
        finally:
            journal.unlink(missing_ok=True)
            stats.examples += 1
            stats.paths[run.path] += 1
            stats.coverage.add(lab)
            stats.kernel_seconds += run.timings.kernel
            stats.harness_seconds += sum(attrs.astuple(run.timings)) - run.timings.kernel
            stats.max_error_ratio = max(stats.max_error_ratio, run.ratio)
            stats.elapsed = time.monotonic() - start
            on_example(stats)

    # How Hypothesis and Tyche name the property (must be an identifier): kvfuzz_vllm_cpu_attention.
    body.__name__ = body.__qualname__ = "kvfuzz_" + re.sub(r"\W", "_", target.name)
    key = f"kvfuzz:{target.name}:{fault_name}".encode()
    db = config.db()

    def make_test(phases, chunk_seed: int, max_examples: int):
        test = settings(
            database=db, max_examples=max_examples, deadline=None, phases=phases,
            suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=True,
            derandomize=False, print_blob=False,
        )(seed(chunk_seed)(given(strategy)(body)))
        test._hypothesis_internal_database_key = key  # one corpus per target and fault, as find() does
        return test

    def record(exc: BaseException) -> None:
        errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
        for e in errors:
            if not isinstance(e, Finding):
                raise e
            example, finding, run = latest[e.signature]
            known.add(e.signature)
            found = FoundFailure(target.name, finding, example, run)
            found.reproducer = write_reproducer(config.out, target, example, finding, run, fault_name=fault_name)
            stats.failures[e.signature] = found

    # 1. replay what the database remembers for this target
    try:
        if next(iter(db.fetch(key)), None) is not None:
            make_test([Phase.reuse, Phase.shrink], config.seed, 1)()
    except (Finding, BaseExceptionGroup) as e:
        record(e)
    # 2. explore fresh seeds in chunks; a resumed campaign continues the chunk sequence (new seeds)
    state_file = config.dir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    chunk = state.get(target.name, {}).get("chunks", 0)
    try:
        while stats.examples < config.max_examples:
            if STOP.is_set():
                raise KeyboardInterrupt
            if config.duration is not None and time.monotonic() - start > config.duration:
                break
            before = stats.examples
            n = min(config.chunk_examples, config.max_examples - stats.examples)
            if config.duration is not None and stats.examples:
                # size the chunk to the time left, so the budget overshoots by at most one example (or a shrink)
                per_example = (time.monotonic() - start) / stats.examples
                n = max(1, min(n, int((config.duration - (time.monotonic() - start)) / per_example)))
            try:
                make_test([Phase.generate, Phase.target, Phase.shrink], config.seed * 100_003 + chunk, n)()
            except (Finding, BaseExceptionGroup) as e:
                record(e)
            chunk += 1
            if stats.examples == before:  # nothing ran (e.g. every example rejected): do not spin
                break
            if config.stop_at_first_failure and stats.failures:
                break
    finally:  # also when interrupted: a resumed campaign starts after the chunk that was running
        state[target.name] = {"chunks": chunk + 1, "seed": config.seed}
        state_file.write_text(json.dumps(state))
    stats.elapsed = time.monotonic() - start
    return stats


__all__ = ["CampaignConfig", "FoundFailure", "TargetStats", "fuzz_target", "recover_crashed"]
