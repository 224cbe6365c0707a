"""The campaign engine: one target's Hypothesis campaign, run in pieces a scheduler chooses.

A :class:`Campaign` holds what stays fixed for one target in one process: the strategy (drawn inside the
target's declaration, or outside it with ``undeclared``), the property body, the database key and the
signatures of failures already known. A scheduler runs it piece by piece:

- :meth:`Campaign.replay_database` replays the failures the example database holds for this target
  (Hypothesis's reuse phase), so a new campaign tries them first;
- :meth:`Campaign.run_chunk` explores ``n`` examples from chunk ``k``'s seed (``seed * 100_003 + k``), all inside
  chunk ``k``'s kernel configuration (:func:`kvfuzz.strategies.configs.config_for`: dtype, heads, head size,
  kv_cache_dtype, block size, features; what a compiled kernel specializes on, so a chunk compiles once and
  then runs at the kernel's speed): a failure with a new signature (failure kind and check) is shrunk inside
  the configuration (no recompiles), then *widened*: its choices replay unchanged in the free strategy, which
  shrinks it across configurations (fewer heads, a smaller head size, no fp8, ...; compiling what it needs),
  and the result is written as a reproducer; a failure whose signature is known is counted and exploration
  goes on;
- :meth:`Campaign.check_one` re-runs one given example (one a killed worker had in flight).

Every example is reported to a :class:`~kvfuzz.fuzz.campaign.records.Listener` as it happens: ``begin`` (the example,
before anything runs), ``phase`` ("kernel" right before the kernel call, "check" after it), ``end`` (an
:class:`Outcome`, what it adds to the counts) and ``failure`` (a new distinct failure, a :class:`FailureRecord`). The
supervisor (:mod:`kvfuzz.fuzz.campaign.workers.supervisor`) gets these over a pipe, so it knows at every moment which
example each worker runs and in which phase; :func:`fuzz_target` runs a whole budget in this process for library use
(the gate, benchmarks, tests), counting with :class:`TargetStats`.

Two Hypothesis details the engine relies on: the settings decorator is applied outside ``@seed`` (``@seed`` resets the
database of the settings it finds to None, so settings applied inside it would lose the database), and the database key
is set with the private attribute ``_hypothesis_internal_database_key`` so that the key is ``kvfuzz:<target>:<fault>``
instead of a digest of this file's source (which would change, and orphan every saved failure, with each kvfuzz
release). tests/fuzz/campaign/test_database.py checks saved failures replay.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
import traceback
from pathlib import Path
from typing import Callable

import attrs
import hypothesis
from hypothesis import HealthCheck, Phase, Verbosity, currently_in_test_context, event, given, reject, seed, settings
from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase

from kvfuzz.contracts.caches.layouts import LayoutError
from kvfuzz.contracts.checks.failures import FailureKind, Finding, HarnessError, MemorySafetyError
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.chunks import (
    CHUNK_SEED_STRIDE,
    campaign_tiers,
    chunk_config,
    chunk_size,
    examples_per_chunk,
    record_tier_time,
    tier_chunk_size,
)
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import (
    SKIPPED_FOR_MEMORY,
    FailureRecord,
    Listener,
    Outcome,
    Quiet,
    TargetStats,
    example_key,
)
from kvfuzz.fuzz.campaign.reduce import shrink_seconds, smaller, structural
from kvfuzz.fuzz.campaign.steering import Plan, Steering
from kvfuzz.fuzz.campaign.store.baseline import classify
from kvfuzz.fuzz.campaign.store.journal import OutOfSpace, disk_full
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.harness import memory, properties, sanitizer
from kvfuzz.fuzz.harness.coverage import labels
from kvfuzz.fuzz.harness.isolation import STOP, exit_if_device_unusable
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import spec_of
from kvfuzz.strategies.batches import big_cache_examples, examples, undeclared_examples
from kvfuzz.strategies.configs import KernelConfig
from kvfuzz.strategies.focus import Focus, aim_pin
from kvfuzz.strategies.serving import serving_examples
from kvfuzz.strategies.tiers import tier_limits, tier_of_chunk

#: The label of the ``hypothesis.target()`` score every passing example reports: its agreement error's largest
#: ratio to its bound (``Run.ratio``, kvfuzz.contracts.checks.oracles.agreement).
TARGET_LABEL = "error/bound"


def strategy_for(target: Target, config: CampaignConfig, pin: KernelConfig | None = None, tier: str = "small",
                 focus: Focus | None = None):
    """The examples a campaign draws for ``target``: inside its declaration, outside it (``undeclared``), or
    with every block past 2**31 elements (``big_cache``); ``pin``: inside one kernel configuration (not with
    ``undeclared``, which draws outside the declaration); ``tier`` "serving": batches shaped as a serving
    engine's scheduler composes them (:mod:`kvfuzz.strategies.serving`, within ``config.limits``); ``focus``:
    aimed at a coverage bin (kvfuzz.fuzz.campaign.steering). Raises ValueError for a big-cache cache writer."""
    if config.gate and target.gate_poisons:
        config = attrs.evolve(config, poisons=target.gate_poisons)
    if config.gate and target.gate_value_ranges:
        config = attrs.evolve(config, limits=attrs.evolve(config.limits, value_ranges=target.gate_value_ranges))
    # a live upstream bug's state (docs/bugs.md, Target.gate_states_off): not in the gate
    caps = target.gate_capabilities() if config.gate else target.capabilities
    if config.undeclared:
        return undeclared_examples(caps, target.faithful_dtypes(), config.limits, config.poisons)
    if config.big_cache:
        if not caps.contract.is_attention:
            raise ValueError(f"--big-cache fuzzes attention kernels; {target.name} is a cache writer (its "
                             "property compares whole caches before and after the call)")
        return big_cache_examples(caps, config.limits, config.poisons, pin=pin)
    if tier == "serving":
        return serving_examples(caps, config.limits, config.poisons, pin=pin, focus=focus)
    return examples(caps, config.limits, config.poisons, pin=pin, focus=focus)


def _tier_config(config: CampaignConfig, tier: str) -> CampaignConfig:
    """``config`` for the chunks of size tier ``tier``: itself where nothing changes (the small tier of a
    campaign without ``big_cache``), else with the tier's limits and ``big_cache`` set for "big-cache"."""
    limits, big = tier_limits(tier, config.limits), tier == "big-cache"
    if limits is config.limits and big == config.big_cache:
        return config
    return attrs.evolve(config, limits=limits, big_cache=big)


#: ``--duration``'s allowance: a campaign ends within the larger of this share of it and
#: :data:`DURATION_SLACK_SECONDS` past it (what a shrink stopped at the deadline, or an example in flight, may take).
DURATION_SLACK_SHARE, DURATION_SLACK_SECONDS = 0.10, 15.0


def duration_allowance(duration: float) -> float:
    """Seconds a campaign of ``--duration`` ``duration`` seconds may run past it: max(10%, 15 s)."""
    return max(DURATION_SLACK_SHARE * duration, DURATION_SLACK_SECONDS)


#: Seconds past ``--duration`` a shrink of a failure found before it may go on (Hypothesis's shrink, the
#: widening across configurations and the structural shrink): a reproducer shrunk to a few sequences is what a
#: kernel's maintainers can use, an unshrunk serving batch of 19 sequences is not (an H200 run of FA3 recorded
#: one so). No new example is drawn past ``--duration``; a shrink that overran says so in the summary's warnings.
#: Environment: KVFUZZ_SHRINK_GRACE (seconds; 0 holds --duration through any shrink).
SHRINK_GRACE_SECONDS = float(os.environ.get("KVFUZZ_SHRINK_GRACE", "120"))


def _event(text: str) -> None:
    """``hypothesis.event(text)`` inside Hypothesis's test; nothing in the structural shrink, which runs outside it
    and where event() raises InvalidArgument (two workers died of it on an H200, each leaving a harness error)."""
    if currently_in_test_context():
        event(text)


class PastDeadline(BaseException):
    """The campaign's ``--duration`` ran out (:attr:`Campaign.deadline`): raised from the property body, it ends the
    Hypothesis run at once, generating or shrinking (a BaseException not Exception, SystemExit or GeneratorExit
    gets through: ``hypothesis.core.failure_exceptions_to_catch``); :meth:`Campaign._execute` records each failure
    found so far as it stands."""


class _OutOfMemory(Exception):
    """The device ran out of memory (kvfuzz.fuzz.harness.memory.is_out_of_memory) outside the kernel call, or in
    it while other processes filled the device: :meth:`Campaign._attempt` runs it again holding the device-memory
    lock, after each of :data:`OUT_OF_MEMORY_PAUSES`; skipped (:data:`SKIPPED_FOR_MEMORY`) if it never fits."""


#: Seconds :meth:`Campaign._attempt` waits, holding the device-memory lock, before each re-run of an example that
#: ran out of device memory in kvfuzz's own phases (other workers' examples end and free theirs meanwhile).
#: Environment: KVFUZZ_OOM_PAUSES (comma-separated seconds; the tests' planted out-of-memory wait 0).
OUT_OF_MEMORY_PAUSES = tuple(float(x) for x in os.environ.get("KVFUZZ_OOM_PAUSES", "0,1,3").split(","))


class Campaign:
    """One target's campaign in this process (see the module docstring). ``known``: signatures of failures
    already reported elsewhere (another worker): they are counted, not shrunk and written again."""

    def __init__(self, target: Target, config: CampaignConfig, listener: Listener | None = None,
                 known: set[tuple[str, str]] | frozenset = frozenset()) -> None:
        self.target = target
        self.config = config
        self.listener = listener or Quiet()
        self.known: set[tuple[str, str]] = set(known)
        #: example_key -> signature of examples that ended a worker (a crash, a hang): counted, not re-run
        self.ended: dict[str, tuple[str, str]] = {}
        self.fault_name = config.fault.name if config.fault else None
        self.db = config.db()
        #: the size tiers the chunks rotate through (campaign_tiers), each with its own config: the small tier's is
        #: ``config`` itself, big-cache's sets ``big_cache``, long's and wide's have their limits (tier_limits)
        self.tiers = campaign_tiers(target, config)
        self._configs = {t: _tier_config(config, t) for t in self.tiers}
        self._strategies: dict = {}
        self._base_key = f"kvfuzz:{target.name}:{self.fault_name}".encode()
        self._use(self.tiers[0])
        self._latest: dict[tuple[str, str], tuple[Example, Finding, Run | None]] = {}
        #: per new failure being shrunk: the structural-first result, when it was found, that pass's seconds
        self._first: dict[tuple[str, str], tuple] = {}
        self._found: list[tuple[str, str]] = []  # distinct failures of the run in progress (_execute)
        #: the unshrunk reproducer of each distinct failure seen here and not yet recorded shrunk (_seen)
        self._early: dict[tuple[str, str], Path] = {}
        self._new: list[FailureRecord] = []
        self._run: Run | None = None
        self._locked = False  # the current example holds the device-memory lock (fuzz/harness/memory.py)
        #: ``time.monotonic()`` past which no example starts (the target's start plus ``--duration``; None: no time
        #: budget). The supervisor sends it with every task (CLOCK_MONOTONIC is the same in every process of a
        #: host); a chunk, a shrink and the structural shrink stop there (:class:`PastDeadline`).
        self.deadline: float | None = None
        #: what the deadline cut short in this process ("shrinking <kind> (<check>)", "generating"), for the summary
        self.cut_short: list[str] = []
        self._sanitize_all = False  # a new memory-safety failure is being shrunk: every example is sanitized
        self._sanitize_spent = 0.0  # seconds spent on sanitized runs (config.sanitize_time_share's budget)
        self._sanitize_since: float | None = None  # when this campaign's first example was checked
        self._sanitizer: sanitizer.SanitizedChild | None = None
        self._sanitized_last: str | None = None  # the example being checked was sanitized: its "sanitize" label

    def _sanitize_due(self, example) -> bool:
        """Whether ``example`` (which passed every other check) runs under memcheck: never off CUDA
        (:func:`~kvfuzz.fuzz.harness.sanitizer.applies`); always while a new memory-safety failure is shrunk; when
        ``config.sanitize`` picks it by hash; or, under ``config.sanitize_time_share`` and for a target that declares
        it (``Target.sanitize_by_default``), when this process has spent less than that share of its time since its
        first example on sanitized runs (examples over 1 GiB of cache excepted: memcheck's copy of a big cache would
        double its device memory). No child is started within :data:`~kvfuzz.fuzz.harness.sanitizer.START_SECONDS`
        of the deadline."""
        config = self.config
        if not (config.sanitize or config.sanitize_time_share or self._sanitize_all) or not sanitizer.applies(
                self.target):
            return False
        if self._sanitize_all:
            return True
        now = time.monotonic()
        if (self.deadline is not None and self.deadline - now < sanitizer.START_SECONDS
                and not (self._sanitizer is not None and self._sanitizer.running)):
            return False  # a child started now would hold this worker past --duration (~15 s to start, H200)
        if config.sanitize and sanitizer.selected(example, config.sanitize):
            return True
        self._sanitize_since = now if self._sanitize_since is None else self._sanitize_since
        return (bool(config.sanitize_time_share) and self.target.sanitize_by_default
                and not memory.is_big(example.batch)
                and self._sanitize_spent <= config.sanitize_time_share * (now - self._sanitize_since))

    def _sanitizer_child(self) -> sanitizer.SanitizedChild:
        self._sanitizer = self._sanitizer or sanitizer.SanitizedChild(spec_of(self.target) or self.target.name)
        return self._sanitizer

    def close(self) -> None:
        """End what this campaign keeps running beside it (the long-lived sanitized child; idempotent)."""
        if self._sanitizer is not None:
            self._sanitizer.close()

    def _use(self, tier: str) -> None:
        """Draw from ``tier`` from now on: its config, its strategy, and its database key (serving, long and wide, whose
        limits change what the same choices draw, keep theirs apart: ``kvfuzz:<target>:<fault>:<tier>``; a
        big-cache example's choices are a small one's, relocated)."""
        self.tier = tier
        self.config = self._configs[tier]
        if tier not in self._strategies:
            self._strategies[tier] = strategy_for(self.target, self.config, tier=tier)
        self.strategy = self._strategies[tier]
        self.key = self._base_key + (f":{tier}".encode() if tier in ("serving", "long", "wide") else b"")

    def _labels(self, example: Example) -> dict[str, str]:
        """Coverage labels of ``example`` (:func:`labels`) and the size tier it was drawn from."""
        return {**labels(self.target, example.batch), "tier": self.tier}

    # ---- one example ----------------------------------------------------------------------------------------
    def _run_example(self, example: Example) -> str | None:
        """Prepare and check one example (the Run is kept in ``self._run``); returns the undeclared outcome
        ("rejected: <error>", "accepted, correct") or None, or raises the Finding. An error outside the kernel
        call (the adapter's build_call, kvfuzz itself) becomes a HarnessError, never the kernel's."""
        config, target = self.config, self.target
        stage = "prepare"
        try:
            try:
                self._run = properties.prepare(target, example, config.fault)
            except LayoutError:
                if not config.undeclared:
                    raise
                reject()  # kvfuzz's layout cannot hold an undeclared configuration: nothing to ask the kernel
            stage = "check"
            if config.undeclared:
                self._run, outcome = properties.check_undeclared(target, example, run=self._run)
                _event(f"undeclared: {outcome.split(':')[0]}")
                return outcome
            properties.check(target, example, config.fault, run=self._run, run_unsafe=config.run_unsafe,
                             on_phase=self.listener.phase)
            if config.fault is None and self._sanitize_due(example):
                stage = "sanitize"
                with sanitizer.gpu_slot(config.out, wait=self._sanitize_all) as slot:
                    if not slot:  # another worker's sanitized run has this GPU: skipped, not charged
                        return None
                    started, child = time.monotonic(), self._sanitizer_child()
                    fresh = not child.running  # its first example pays its start: not charged to the time share
                    try:
                        self._sanitized_last = "memcheck"
                        child.check(target, example, confirm=not self._sanitize_all)
                    except sanitizer.DeviceFull:  # the sanitized run found no device memory: not sanitized
                        self._sanitized_last = "skipped: device full"
                    finally:
                        if not fresh:
                            self._sanitize_spent += time.monotonic() - started
            return None
        except Finding:
            raise
        except KeyboardInterrupt:
            if STOP.is_set():
                raise
            raise HarnessError(f"raised KeyboardInterrupt in {stage}", "KeyboardInterrupt outside the kernel call "
                               "with no stop requested", {"traceback": traceback.format_exc(limit=-6)}) from None
        except OutOfSpace:
            raise
        except BaseException as e:  # the adapter or kvfuzz: name it, shrink it, never blame the kernel
            if type(e).__module__.startswith("hypothesis"):
                raise
            exit_if_device_unusable(e, f"kvfuzz's {stage}")  # a campaign's worker: the supervisor decides
            if memory.is_out_of_memory(e):  # kvfuzz's own memory, whatever the adapter: never a finding
                raise _OutOfMemory() from e
            if disk_full(e):  # a full disk ends the campaign (exit 3); it is nobody's finding
                raise OutOfSpace(getattr(e, "filename", None) or f"a file ({stage})",
                                 e if isinstance(e, OSError) else None) from e
            raise HarnessError(f"raised {type(e).__name__} in {stage}",
                               f"{type(e).__name__} outside the kernel call ({stage}: "
                               f"{'the target built the call' if stage == 'prepare' else 'checking the output'}): {e}",
                               {"stage": stage, "traceback": traceback.format_exc(limit=-6)}) from None

    def past_deadline(self, shrinking: bool = False) -> bool:
        """Whether the campaign's ``--duration`` has run out (:attr:`deadline`); ``shrinking``: for a shrink of a
        failure found before it, which has :data:`SHRINK_GRACE_SECONDS` more."""
        return self.deadline is not None and time.monotonic() > self.deadline + (SHRINK_GRACE_SECONDS if shrinking
                                                                                 else 0.0)

    def _shrinking(self) -> bool:
        """Whether a new failure, seen and not yet recorded, is being shrunk in this run."""
        return any(sig not in self.known and sig not in self._found for sig in self._latest)

    def _body(self, example: Example) -> None:
        if STOP.is_set():
            raise KeyboardInterrupt
        if self.past_deadline():
            shrinking = self._shrinking()
            if not shrinking or self.past_deadline(shrinking=True):
                raise PastDeadline()
            note = "shrinking past --duration (up to KVFUZZ_SHRINK_GRACE, %g s)" % SHRINK_GRACE_SECONDS
            if note not in self.cut_short:
                self.cut_short.append(note)
        lab = self._labels(example)
        for k, v in lab.items():
            _event(f"{k}: {v}")
        if self.ended and example_key(example) in self.ended:  # it crashed or hung a worker: already counted
            _event("skipped: ended a worker before")
            return
        finding = self._attempt(example, lab)
        run = self._run
        if finding is None and run is not None and math.isfinite(run.ratio):
            # guidance: Hypothesis's targeted phase mutates towards a higher agreement error / bound, so a near
            # miss (a ratio close to 1, as a serving-sized batch's partial defect gives) climbs towards a failure
            hypothesis.target(run.ratio, label=TARGET_LABEL)
        if finding is None or finding.signature in self.known:
            return
        if finding.known is not None:  # accepted in the baseline: listed once (unshrunk), counted, not shrunk
            self._record_known(example, finding)
            return
        signature = finding.signature
        first = signature not in self._latest
        self._latest[signature] = (example, finding, self._run)
        if first:
            self._seen(signature)
            found_at = time.monotonic()
            if self._reduces():  # structural first (reduce.py): a serving-sized failure is one sequence in seconds
                self._first[signature] = (self._reduce(signature, self._latest[signature], first=True), found_at,
                                          time.monotonic() - found_at)
            else:
                self._first[signature] = (None, found_at, 0.0)
        raise finding

    def _attempt(self, example: Example, lab: dict | None = None) -> Finding | None:
        """Run one example, reported to the listener (``begin``, its phases, ``end``) and counted; returns its
        Finding or None (the Run stays in ``self._run``). Used by Hypothesis's test body and by the structural
        shrink's candidates alike. KeyboardInterrupt (a stop) propagates and the example is not counted."""
        if STOP.is_set():
            raise KeyboardInterrupt
        lab = self._labels(example) if lab is None else lab
        self.listener.begin(self.target.name, example)  # the example is being prepared
        started = time.perf_counter()
        big = memory.is_big(example.batch)
        try:
            finding, undeclared = self._locked_attempt(example, lab, started, big)
        except _OutOfMemory:  # other workers' memory (fuzz/harness/memory.py): again, alone on the device
            for i, pause in enumerate(OUT_OF_MEMORY_PAUSES):
                self._run = None
                memory.release_device_memory(collect=True)
                time.sleep(pause)  # the other workers' examples end meanwhile (a big one waits for the lock)
                try:
                    finding, undeclared = self._locked_attempt(example, lab, started, True,
                                                               last=i == len(OUT_OF_MEMORY_PAUSES) - 1)
                    break
                except _OutOfMemory:
                    continue
            else:  # kvfuzz cannot fit it: counted as skipped, never the kernel's finding nor a harness error
                self._run = None
                memory.release_device_memory(collect=True)
                _event("skipped: out of device memory")
                self.listener.end(self.target.name, Outcome(lab, 0.0, time.perf_counter() - started,
                                                            skipped=SKIPPED_FOR_MEMORY))
                return None
        return finding

    def _locked_attempt(self, example: Example, lab: dict, started: float, locked: bool,
                        last: bool = False) -> tuple[Finding | None, str | None]:
        """:meth:`_attempt`'s run of the example, holding the campaign's device-memory lock when ``locked``
        (fuzz/harness/memory.py), the memory it left given back then. Raises _OutOfMemory when the device ran out
        of memory outside the kernel call, or in it unless ``last`` (the last re-run: then it is the kernel's
        finding); nothing is counted then."""
        self._run = finding = undeclared = None
        with memory.device_memory_lock(self.config.out) if locked else contextlib.nullcontext():
            self._locked = locked
            if not last:  # a kernel's out-of-memory error comes here, to be re-run (the last try: the kernel's)
                memory.RETRIES_OUT_OF_MEMORY.set()
            try:
                undeclared = self._run_example(example)
            except Finding as f:
                finding = f
                classify(self.config.baseline, self.target, example, finding, self._run)
                if isinstance(finding, MemorySafetyError) and finding.known is None and (
                        finding.signature not in self.known):  # a new one: shrunk on every example (a known one: not)
                    self._sanitize_all = True
            finally:
                self._locked = False
                memory.RETRIES_OUT_OF_MEMORY.clear()
            self._end(example, lab, started, None if finding is None else finding.signature, undeclared)
            if locked:  # give back what the example left (a failing one's Run is kept: _forget_run drops it)
                self._run = self._run if finding is not None else None
                memory.release_device_memory()
        return finding, undeclared

    def _end(self, example: Example, lab: dict, started: float, signature, undeclared: str | None) -> None:
        """Report one answered example to the listener (its Outcome)."""
        run, total = self._run, time.perf_counter() - started
        kernel_s = run.timings.kernel if run is not None else 0.0
        if undeclared is not None:
            lab["undeclared"] = undeclared.split(":")[0]
        elif self.config.undeclared and signature is not None:
            lab["undeclared"] = "silently wrong"
        rejection = undeclared.removeprefix("rejected: ") if undeclared and undeclared.startswith("rejected") \
            else None
        if self._sanitized_last:
            lab["sanitize"], self._sanitized_last = self._sanitized_last, None
        batch = example.batch
        self.listener.end(self.target.name, Outcome(lab, kernel_s, max(0.0, total - kernel_s),
                                                    run.ratio if run is not None else 0.0, signature, rejection,
                                                    kv_tokens=sum(batch.ctx_lens) + sum(batch.query_lens)))

    # ---- pieces -------------------------------------------------------------------------------------------
    def _test(self, phases: list[Phase], chunk_seed: int, max_examples: int, explicit: Example | None = None,
              strategy=None, database: ExampleDatabase | None = None):
        body = self._body

        def property_(example: Example) -> None:
            body(example)

        # How Hypothesis and Tyche name the property (an identifier): kvfuzz_vllm_cpu_attention.
        property_.__name__ = property_.__qualname__ = "kvfuzz_" + re.sub(r"\W", "_", self.target.name)
        if explicit is not None:
            property_ = hypothesis.example(explicit)(property_)
        # settings() outside seed(): @seed replaces the database of the settings it sees with None
        test = settings(database=self.db if database is None else database, max_examples=max_examples, deadline=None,
                        phases=phases,
                        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                        report_multiple_bugs=True, derandomize=False, print_blob=False,
                        )(seed(chunk_seed)(given(self.strategy if strategy is None else strategy)(property_)))
        test._hypothesis_internal_database_key = self.key  # stable across kvfuzz releases (module docstring)
        return test

    def _execute(self, test, record: bool = True) -> list[FailureRecord]:
        """Run ``test``; write each new distinct failure it raises as a reproducer (``record``) or only keep
        its signature in ``self._found`` (a pinned chunk: recorded once widened)."""
        self._new, self._found = [], []
        try:
            test()
        except PastDeadline:
            # --duration ran out mid-run: each failure seen and not yet recorded is recorded as it stands
            pending = [sig for sig in self._latest if sig not in self.known and sig not in self._found]
            self.cut_short.append("shrinking " + ", ".join(f"{k} ({c})" for k, c in pending) if pending
                                  else "generating")
            for sig in pending:
                self._latest[sig][1].details["shrink_stopped"] = "the campaign's --duration ran out"
                self._found.append(sig)
                if record:
                    self._record(sig)
        except (Finding, BaseExceptionGroup) as exc:
            errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
            for e in errors:
                if not isinstance(e, Finding):
                    raise e
                self._found.append(e.signature)
                if record:
                    self._record(e.signature)
        return self._new

    def _seen(self, signature: tuple[str, str], latest=None, stage: str = "unshrunk") -> None:
        """Write a provisional reproducer of a new distinct failure and report it (``stage``: "unshrunk", then
        "structural" after the structural-first pass, "hypothesis" after Hypothesis's): a shrink can reach an
        input that kills the worker (a crash or hang of another kind), and the supervisor then keeps this one
        instead of losing the failure. It replaces an earlier provisional one; :meth:`_record` removes it once the
        final one is written."""
        example, finding, run = latest or self._latest[signature]
        path = write_reproducer(self.config.out, self.target, example, finding, run, fault_name=self.fault_name)
        self._drop_early(signature, keep=path)
        self._early[signature] = path
        self.listener.seen(attrs.evolve(FailureRecord.of(self.target.name, finding, example, self.fault_name, path),
                                        stage=stage))

    def _drop_early(self, signature: tuple[str, str], keep: Path) -> None:
        """Remove the provisional reproducer of ``signature`` unless it is ``keep`` (the same example)."""
        early = self._early.pop(signature, None)
        if early is not None and Path(early) != Path(keep):
            shutil.rmtree(early, ignore_errors=True)

    def _record(self, signature: tuple[str, str], latest=None) -> None:
        self.known.add(signature)
        first, found_at, first_s = self._first.pop(signature, (None, None, 0.0))
        example, finding, run = smaller(first, latest or self._latest[signature])  # shrink order: reduce.py
        recorded_at = time.monotonic()
        if self._reduces():
            example, finding, run = self._reduce(signature, (example, finding, run))
        finding.details["shrink_seconds"] = shrink_seconds(found_at, first_s, recorded_at,
                                                           finding.details.get("structural_shrink"))
        path = write_reproducer(self.config.out, self.target, example, finding, run, fault_name=self.fault_name)
        self._drop_early(signature, keep=path)
        self._forget_run(signature)
        self._sanitize_all &= signature[0] != FailureKind.MEMORY_SAFETY.value  # recorded: back to the time share
        record = FailureRecord.of(self.target.name, finding, example, self.fault_name, path)
        self._new.append(record)
        self.listener.failure(record)

    def _forget_run(self, signature: tuple[str, str]) -> None:
        """Drop the Run a recorded failure kept (its reproducer is written): a big-cache example's Run holds
        caches of several GiB, which every worker that found a failure on one kept on the device for the rest of
        the campaign (an adapter with a big-cache finding filled an H100: other workers' prepare ran out of
        memory). Gives the memory back to the device."""
        latest = self._latest.get(signature)
        if latest is not None and latest[2] is not None:
            big = memory.is_big(latest[0].batch)
            self._latest[signature] = (latest[0], latest[1], None)
            if self._run is latest[2]:
                self._run = None
            if big:
                memory.release_device_memory(collect=True)

    def _record_known(self, example: Example, finding: Finding) -> None:
        """The first hit of a baseline entry here: its reproducer (as found, not shrunk: the baseline already
        knows the bug) and its record; later hits are only counted."""
        self.known.add(finding.signature)
        path = write_reproducer(self.config.out, self.target, example, finding, self._run, fault_name=self.fault_name)
        record = FailureRecord.of(self.target.name, finding, example, self.fault_name, path)
        self._new.append(record)
        self.listener.failure(record)

    def _reduces(self) -> bool:
        """Whether new failures get the structural shrink (not outside the declaration, nor on big caches,
        whose block ids are placed on purpose)."""
        c = self.config
        return (c.structural_shrink > 0 and not c.undeclared and not c.big_cache
                and not self.past_deadline(shrinking=True))

    def _reduce(self, signature: tuple[str, str], start: tuple, first: bool = False) -> tuple:
        """A structural pass over ``start`` (``(example, finding, run)``): the coarse moves on a failure as found
        (``first``), every move after Hypothesis's shrink (:func:`kvfuzz.fuzz.campaign.reduce.structural`)."""
        return structural(self, signature, start, SHRINK_GRACE_SECONDS, first=first)

    def replay_database(self) -> list[FailureRecord]:
        """Replay (and re-shrink) what the database holds for this target, tier by tier (each tier's key);
        returns the new failures."""
        new: list[FailureRecord] = []
        for tier in self.tiers:
            self._use(tier)
            if next(iter(self.db.fetch(self.key)), None) is not None:
                new += self._execute(self._test([Phase.reuse, Phase.shrink], self.config.seed, 1))
        self._use(self.tiers[0])
        return new

    def run_chunk(self, chunk: int, n: int, plan: Plan | None = None) -> list[FailureRecord]:
        """Explore ``n`` examples from chunk ``chunk``'s seed (generate, shrink) inside the chunk's kernel
        configuration (:func:`chunk_config`), widening each new failure across configurations; returns the new
        failures found. It draws from ``plan``'s tier, aimed at its focus (kvfuzz.fuzz.campaign.steering; its
        failures widened as a pinned chunk's), else from :func:`~kvfuzz.strategies.tiers.tier_of_chunk`'s."""
        plan = plan or Plan(tier_of_chunk(self.tiers, chunk))
        self._use(plan.tier)
        chunk_seed, focus = self.config.seed * CHUNK_SEED_STRIDE + chunk, plan.focus
        pin = aim_pin(chunk_config(self.target, self.config, plan.config_chunk(chunk)), focus, self.target.capabilities)
        if pin is None and focus is None:
            return self._execute(self._test([Phase.generate, Phase.shrink], chunk_seed, n))
        pinned = InMemoryExampleDatabase()
        self._execute(self._test([Phase.generate] + ([Phase.shrink] if pin is not None else []), chunk_seed, n,
                                 strategy=strategy_for(self.target, self.config, pin, self.tier, focus),
                                 database=pinned), record=False)
        if not self._found:
            return []
        if self.past_deadline(shrinking=True):  # past --duration and its shrink grace: recorded unwidened
            for sig in self._found:
                if sig not in self.known:
                    self._record(sig)
            return self._new
        return self._widen(pinned, list(self._found))

    def _widen(self, pinned: InMemoryExampleDatabase, found: list[tuple[str, str]]) -> list[FailureRecord]:
        """Shrink the failures a pinned chunk found (``pinned`` holds their choices, ``found`` their signatures)
        across kernel configurations: the choices replay unchanged in the free strategy (strategies/batches.py,
        ``choice``), whose shrinker may then lower the heads, head size, cache dtype or features. They are
        handed over as *secondary* entries (Hypothesis skips shrinking a primary entry that replays exactly,
        taking it for an already shrunk one). The pinned examples wait in the campaign database's secondary
        key meanwhile, so a worker lost while widening loses nothing (a later replay widens them); the
        widened ones go to its primary key. A signature the free strategy does not reproduce keeps its pinned
        example."""
        saved = list(pinned.fetch(self.key))
        secondary = self.key + b".secondary"
        widen_db = InMemoryExampleDatabase()
        for choices in saved:
            self.db.save(secondary, choices)
            widen_db.save(secondary, choices)
        at_pin = {sig: self._latest[sig] for sig in found}
        # max_examples sizes the replayed corpus: Hypothesis replays max(2, max_examples / 10) entries
        self._execute(self._test([Phase.reuse, Phase.shrink], self.config.seed, 10 * len(saved),
                                 database=widen_db))
        for sig in found:
            if sig not in self.known:  # not reproduced in the free strategy (flaky): the pinned example
                self._record(sig, latest=at_pin[sig])
        for choices in widen_db.fetch(self.key):
            self.db.save(self.key, choices)
        for choices in saved:
            self.db.delete(secondary, choices)
        return self._new

    def check_one(self, example: Example) -> list[FailureRecord]:
        """Run one given example (Hypothesis's explicit phase: no generation, no shrinking); returns its failure
        if it is new."""
        deadline, self.deadline = self.deadline, None  # a re-run (a killed worker's example) is owed an answer
        try:
            return self._execute(self._test([Phase.explicit], self.config.seed, 1, explicit=example))
        finally:
            self.deadline = deadline


# ---- the whole budget in this process (library use: the gate, benchmarks, tests) ----------------------------
class _Counting(Quiet):
    def __init__(self, stats: TargetStats, start: float, on_example: Callable[[TargetStats], None],
                 steer: Steering | None = None) -> None:
        self.stats, self.start, self.on_example, self.steer = stats, start, on_example, steer

    def end(self, target, outcome) -> None:
        self.stats.add(outcome, time.monotonic() - self.start)
        if self.steer is not None and outcome.skipped is None:  # what the next chunks steer by
            self.steer.observe(outcome.labels, outcome.ratio, outcome.signature)
        self.on_example(self.stats)

    def failure(self, record) -> None:
        self.stats.add_failure(record)


def fuzz_target(target: Target, config: CampaignConfig,
                on_example: Callable[[TargetStats], None] = lambda s: None,
                stats: TargetStats | None = None) -> TargetStats:
    """Fuzz one target within the config's budget in this process: replay the database, then chunks
    ``0, 1, ...`` of fresh seeds (sized to the time left) until ``max_examples`` or ``duration``; returns the
    counts and distinct failures. A kernel that crashes the process takes this process with it: campaigns that
    must survive that run under the supervisor (``kvfuzz fuzz``). Pass ``stats`` to keep what was counted if
    the run is interrupted (KeyboardInterrupt propagates)."""
    stats = stats if stats is not None else TargetStats(target.name)
    config.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    steer = Steering.of(target, config, campaign_tiers(target, config))  # None: the fixed split (tier_of_chunk)
    campaign = Campaign(target, config, _Counting(stats, start, on_example, steer))
    campaign.deadline = None if config.duration is None else start + config.duration
    campaign.replay_database()
    chunk, tier_times = 0, {}
    while stats.examples < config.max_examples:
        if STOP.is_set():
            raise KeyboardInterrupt
        elapsed = time.monotonic() - start
        if config.duration is not None and elapsed > config.duration:
            break
        before = stats.examples
        plan = steer.plan(chunk) if steer is not None else Plan(tier_of_chunk(campaign.tiers, chunk))
        tier, per_chunk = plan.tier, examples_per_chunk(target, config)
        n = tier_chunk_size(tier, campaign.tiers, per_chunk, tier_times,
                            None if config.duration is None else config.duration - elapsed)
        if n is None:
            n = chunk_size(config, stats.examples, elapsed, per_chunk=per_chunk)
        n = plan.size(min(n, config.max_examples - stats.examples))
        campaign.run_chunk(chunk, n, plan)
        record_tier_time(tier_times, tier, stats.examples - before, time.monotonic() - start - elapsed)
        chunk += 1
        if stats.examples == before:  # nothing ran (e.g. every example rejected): do not spin
            break
        if config.stop_at_first_failure and stats.failures:
            break
    campaign.close()
    stats.elapsed = time.monotonic() - start
    return stats


__all__ = ["DURATION_SLACK_SECONDS", "DURATION_SLACK_SHARE", "SHRINK_GRACE_SECONDS", "TARGET_LABEL", "Campaign",
           "PastDeadline", "duration_allowance", "fuzz_target", "strategy_for"]
