"""One example, from Hypothesis's property body to its verdict (:class:`ExampleRunner`).

A :class:`~kvfuzz.fuzz.campaign.engine.Campaign` hands :meth:`ExampleRunner.body` to Hypothesis as its property, and
the structural shrink runs each candidate through :meth:`ExampleRunner.attempt`. For one example the runner:

- stops the run at a stop request, or at ``--duration`` (:class:`PastDeadline`; a shrink of a failure found in time
  gets :data:`SHRINK_GRACE_SECONDS` more); stops a pinned chunk's generation once it has had its share of
  ``--duration`` (:meth:`ExampleRunner.limit_chunk`);
- skips an example that ended a worker before (the supervisor counted it);
- prepares and checks it through the target's property (:mod:`kvfuzz.fuzz.harness.properties`), re-runs it under
  compute-sanitizer when :class:`SanitizerSchedule` says so, and names any error outside the kernel call a harness
  error (never the kernel's finding);
- runs an example that ran out of device memory again, holding the device-memory lock (fuzz/harness/memory.py),
  after each pause of :data:`OUT_OF_MEMORY_PAUSES`, and skips it if it never fits (:data:`SKIPPED_FOR_MEMORY`);
- reports it to the listener (``begin``, its phases, ``end``: its :class:`~kvfuzz.fuzz.campaign.records.Outcome`)
  and keeps its verdict in the :class:`~kvfuzz.fuzz.campaign.failure_ledger.FailureLedger`: a new failure gets a
  provisional reproducer and the structural-first pass (:func:`kvfuzz.fuzz.campaign.reduce.structural`, kept in
  the ledger) and is raised for Hypothesis to shrink; a known one is counted; one the baseline accepts is recorded
  once, unshrunk.

It also says where the time goes (:mod:`kvfuzz.fuzz.campaign.stages`): each example's Outcome carries its seconds
per stage, its draw included (Hypothesis's ``draw_times`` of the test case); the time between examples is
Hypothesis's engine; every second of Hypothesis's shrink phase (read from the runner of the Hypothesis run in
progress), of the widening and of the structural passes (:meth:`ExampleRunner.shrinking`) is ``shrink``; the
rest of a piece of work (:meth:`ExampleRunner.task`) is ``other``. Seconds outside examples are reported with the
listener's ``spent``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

import attrs
import hypothesis
from hypothesis import currently_in_test_context, event, reject
from hypothesis.control import current_build_context

from kvfuzz.contracts.caches.layouts import LayoutError
from kvfuzz.contracts.checks.failures import FailureKind, Finding, HarnessError, MemorySafetyError
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.chunks import ChunkLimit, ChunkTimeUp, chunk_clock
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.failure_ledger import Failing, FailureLedger
from kvfuzz.fuzz.campaign.records import SKIPPED_FOR_MEMORY, FailureRecord, Listener, Outcome
from kvfuzz.fuzz.campaign.reduce import structural
from kvfuzz.fuzz.campaign.stages import TIMED, Clock, conjecture_runner
from kvfuzz.fuzz.campaign.store.baseline import classify
from kvfuzz.fuzz.campaign.store.journal import OutOfSpace, disk_full
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.harness import memory, properties, sanitizer, sanitizer_standby
from kvfuzz.fuzz.harness.coverage import labels
from kvfuzz.fuzz.harness.isolation import STOP, exit_if_device_unusable
from kvfuzz.fuzz.harness.kernel_clock import COMPILES
from kvfuzz.fuzz.harness.run import Run
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.fuzz.targets.registry import spec_of

#: The label of the ``hypothesis.target()`` score every passing example reports: its agreement error's largest
#: ratio to its bound (``Run.ratio``, kvfuzz.contracts.checks.oracles.agreement).
TARGET_LABEL = "error/bound"

#: Seconds past ``--duration`` a shrink of a failure found before it may go on (Hypothesis's shrink, the
#: widening across configurations and the structural shrink): a reproducer shrunk to a few sequences is what a
#: kernel's maintainers can use, an unshrunk serving batch of 19 sequences is not. No new example is drawn past
#: ``--duration``; a shrink that overran says so in the summary's warnings.
#: Environment: KVFUZZ_SHRINK_GRACE (seconds; 0 holds --duration through any shrink).
SHRINK_GRACE_SECONDS = float(os.environ.get("KVFUZZ_SHRINK_GRACE", "120"))

#: Seconds :meth:`ExampleRunner.attempt` waits, holding the device-memory lock, before each re-run of an example
#: that ran out of device memory in kvfuzz's own phases (other workers' examples end and free theirs meanwhile).
#: Environment: KVFUZZ_OOM_PAUSES (comma-separated seconds; the tests' planted out-of-memory wait 0).
OUT_OF_MEMORY_PAUSES = tuple(float(x) for x in os.environ.get("KVFUZZ_OOM_PAUSES", "0,1,3").split(","))

#: Seconds outside examples a runner keeps before it reports them (``spent``), besides at the end of each piece of
#: work: a worker that dies loses at most this much of its accounting.
FLUSH_SECONDS = 5.0


def note(text: str) -> None:
    """``hypothesis.event(text)`` inside Hypothesis's test; nothing outside it (the structural shrink runs its
    candidates outside Hypothesis, where ``event()`` raises InvalidArgument)."""
    if currently_in_test_context():
        event(text)


class PastDeadline(BaseException):
    """The campaign's ``--duration`` ran out (:attr:`ExampleRunner.deadline`): raised from the property body, it ends
    the Hypothesis run at once, generating or shrinking (a BaseException not Exception, SystemExit or GeneratorExit
    gets through: ``hypothesis.core.failure_exceptions_to_catch``); the campaign records each failure found so far as
    it stands."""


_UNSEARCHED = object()


class _OutOfMemory(Exception):
    """The device ran out of memory (kvfuzz.fuzz.harness.memory.is_out_of_memory) outside the kernel call, or in it
    while other processes filled the device: :meth:`ExampleRunner.attempt` runs the example again holding the
    device-memory lock."""


class SanitizerSchedule:
    """Which examples run again under compute-sanitizer memcheck (``--sanitize``), and the long-lived sanitized child
    that runs them (started at the first one; its hits confirmed in a standby: sanitizer_standby.screen)."""

    def __init__(self, target: Target, config: CampaignConfig) -> None:
        self.target, self.config = target, config
        #: a new memory-safety failure is being shrunk: every example is sanitized until it is recorded
        self.every_example = False
        self.spent = 0.0  # seconds of sanitized runs (config.sanitize_time_share's budget)
        self.since: float | None = None  # when this process checked its first example
        self.last: str | None = None  # the "sanitize" label of the example just sanitized
        self.by_time_share = False  # the example just found due was picked by the time share
        self._child: sanitizer.SanitizedChild | None = None
        self._timed: dict | None = None  # the example in progress: its seconds per phase (:meth:`take`)

    def due(self, example: Example, deadline: float | None = None) -> bool:
        """Whether ``example`` (which passed every other check) runs under memcheck: never off CUDA
        (:func:`~kvfuzz.fuzz.harness.sanitizer.applies`); always while a new memory-safety failure is shrunk; when
        ``config.sanitize`` picks it by hash; or, under ``config.sanitize_time_share`` and for a target that declares
        it (``Target.sanitize_by_default``), when this process has spent less than that share of its time since its
        first example on sanitized runs, among examples of at most
        :data:`~kvfuzz.fuzz.harness.sanitizer.TIME_SHARE_MAX_TOKENS` cached tokens (where the share goes furthest;
        examples over 1 GiB of cache never: memcheck's copy of a big cache would double its device memory). No child
        is started within :data:`~kvfuzz.fuzz.harness.sanitizer.START_SECONDS` of ``deadline``
        (``time.monotonic()``; None: no time budget)."""
        config = self.config
        self.by_time_share = False
        if not (config.sanitize or config.sanitize_time_share or self.every_example) or not sanitizer.applies(
                self.target):
            return False
        if self.every_example:
            return True
        now = time.monotonic()
        if (deadline is not None and deadline - now < sanitizer.START_SECONDS
                and not (self._child is not None and self._child.running)):
            return False  # a child started now would hold this worker past --duration
        if config.sanitize and sanitizer.selected(example, config.sanitize):
            return True
        self.since = now if self.since is None else self.since
        self.by_time_share = (bool(config.sanitize_time_share) and self.target.sanitize_by_default
                              and sum(example.batch.seq_lens) <= sanitizer.TIME_SHARE_MAX_TOKENS
                              and not memory.is_big(example.batch)
                              and self.spent <= config.sanitize_time_share * (now - self.since))
        return self.by_time_share

    def run(self, example: Example) -> None:
        """Check ``example`` in the sanitized child (raises its MemorySafetyError), holding this GPU's sanitizer slot;
        skipped, uncharged, when another worker's sanitized run holds it. An example the time share picked is also
        skipped, uncharged, while the child is still starting: it starts in the background
        (:meth:`~kvfuzz.fuzz.harness.sanitizer.SanitizedChild.ready`), so a worker's ~15 s start neither holds the
        GPU's one slot nor stalls the worker. A hash share and a shrink wait for it. A child's first example pays its
        start when it waited: not charged to the time share either. Its seconds per phase: :meth:`take`."""
        began = time.perf_counter()
        self._child = self._child or sanitizer_standby.screen(spec_of(self.target) or self.target.name)
        if self.by_time_share and not self.every_example and not self._child.ready():
            return self._note(None)
        with sanitizer.gpu_slot(self.config.out, wait=self.every_example) as slot:
            if not slot:
                return self._note(None)
            self._note(None, time.perf_counter() - began)
            started, fresh = time.monotonic(), not self._child.running
            self._child.last = None
            try:
                self.last = "memcheck"
                self._child.check(self.target, example, confirm=not self.every_example)
            except sanitizer.DeviceFull:  # the sanitized run found no device memory: not sanitized
                self.last = "skipped: device full"
            finally:
                if not fresh:
                    self.spent += time.monotonic() - started
                self._note(self._child.last)

    def _note(self, last: dict | None, slot: float = 0.0) -> None:
        """Add a run's seconds per phase (``last``: SanitizedChild.last; ``slot``: the slot's wait) to the example's,
        and the child's start if one was seen complete."""
        timed = self._timed = self._timed or {"seconds": {}, "group": "skipped"}
        seconds = timed["seconds"]
        for phase, s in ((last or {}).get("seconds", {}) | ({"slot": slot} if slot else {})).items():
            seconds[phase] = seconds.get(phase, 0.0) + s
        if last is not None:
            timed["group"] = {"first": "first example", "new": "new config", "seen": "seen config"}.get(
                last["child"], "no report")
            timed["confirm"] = last.get("confirm")  # where a confirmation ran (sanitizer_standby.CONFIRMS)
        if self._child is not None and self._child.started is not None:
            timed["start"], self._child.started = self._child.started, None

    def take(self, seconds: float, shrinking: bool) -> dict | None:
        """The example's sanitized runs for its Outcome, then forgotten (None if none): ``{"seconds": {phase: s},
        "group": g, "start": {...}}``, ``other`` the rest of ``seconds`` (the runner's measure: its ``sanitize``
        stage); ``g`` one of kvfuzz.fuzz.campaign.stages.SANITIZE_GROUPS ("shrink" when ``shrinking``)."""
        timed, self._timed = self._timed, None
        if timed is None and not seconds:
            return None
        timed = timed or {"seconds": {}, "group": "skipped"}
        other = seconds - sum(timed["seconds"].values())
        if other > 0:
            timed["seconds"]["other"] = other
        if shrinking:
            timed["group"] = "shrink"
        return timed

    def close(self) -> None:
        """End the sanitized child, if one runs, and its standby (idempotent)."""
        for child in (self._child, self._child and self._child.confirmer):
            if child is not None:
                child.close()


class ExampleRunner:
    """Runs the examples of one target's campaign in this process (see the module docstring). ``ledger``: the
    campaign's failure signatures; ``config`` and ``tier`` follow the chunk in progress (:meth:`use`)."""

    def __init__(self, target: Target, config: CampaignConfig, listener: Listener, ledger: FailureLedger,
                 releases: memory.Releases | None = None) -> None:
        self.target, self.config, self.listener, self.ledger = target, config, listener, ledger
        #: the cached device memory of the workers of this GPU, given back on request (fuzz/harness/memory.py)
        self.releases = releases or memory.Releases(config.out, release=self._release)
        self.tier = "small"
        self.fault_name = config.fault.name if config.fault else None
        self.sanitizer = SanitizerSchedule(target, config)
        self._prepare, self._check = properties.property_of(target)
        #: the Run of the example that ran last (a failing one's is kept in the ledger until it is recorded)
        self.run: Run | None = None
        #: ``time.monotonic()`` past which no example starts (the target's start plus ``--duration``; None: no time
        #: budget). The supervisor sends it with every task (CLOCK_MONOTONIC is the same in every process of a host).
        self.deadline: float | None = None
        #: what the deadline cut short in this process ("shrinking <kind> (<check>)", "generating"), for the summary
        self.cut_short: list[str] = []
        self.chunk = ChunkLimit()  # how long the chunk in progress may generate (:meth:`limit_chunk`)
        self.clock = Clock()  # the time outside examples, per stage (kvfuzz.fuzz.campaign.stages), from now on
        COMPILES.listen()  # a kernel call's compiles are told apart from its time (kvfuzz.fuzz.harness.kernel_clock)
        self._tasks = 0  # pieces of work begun (the first one's time includes the campaign's set-up)
        self._shrinks = 0  # depth of shrinking() contexts
        self._hypothesis = _UNSEARCHED  # the ConjectureRunner of the Hypothesis run in progress (found on demand)
        self._phase: str | None = None  # its phase at the last example
        self._draw = self._waited = self._sanitized = 0.0  # the example in progress: its draw, waits, sanitized run
        #: ``time.perf_counter()`` when the example in progress entered the body (None: run outside it) and when the
        #: last one left it (None: accounted since)
        self._entered: float | None = None
        self._left: float | None = None

    def use(self, tier: str, config: CampaignConfig) -> None:
        """Run the examples of size tier ``tier``, drawn with ``config`` (the tier's limits), from now on."""
        self.tier, self.config = tier, config

    def past_deadline(self, shrinking: bool = False) -> bool:
        """Whether the campaign's ``--duration`` has run out (:attr:`deadline`); ``shrinking``: for a shrink of a
        failure found before it, which has :data:`SHRINK_GRACE_SECONDS` more."""
        return self.deadline is not None and time.monotonic() > self.deadline + (SHRINK_GRACE_SECONDS if shrinking
                                                                                 else 0.0)

    def limit_chunk(self, seconds: float | None) -> None:
        """A chunk starts: it generates for at most ``seconds`` after its first example ends (None: no limit); then
        the body raises ChunkTimeUp before the next example, unless Hypothesis is not generating or a new failure is
        being shrunk (kvfuzz.fuzz.campaign.chunks ``ChunkLimit``), the worker's compiles not counted with
        ``KVFUZZ_CHUNK_CLOCK=work`` (``chunk_clock``)."""
        self.chunk = ChunkLimit(seconds, COMPILES.seconds if seconds is not None and chunk_clock() == "work" else None)

    def reduces(self) -> bool:
        """Whether new failures get the structural shrink (not outside the declaration, nor on big caches, whose
        block ids are placed on purpose, nor past ``--duration``'s shrink grace)."""
        c = self.config
        return (c.structural_shrink > 0 and not c.undeclared and not c.big_cache
                and not self.past_deadline(shrinking=True))

    def shrink_first(self, signature: tuple[str, ...]) -> None:
        """The structural-first pass (kvfuzz.fuzz.campaign.reduce) on a new failure as found, before Hypothesis shrinks
        it: a serving-sized failure is one or two sequences in seconds. Its result, when the failure was found and the
        pass's seconds are kept in the ledger for the engine to record the smaller of it and Hypothesis's."""
        found_at, first = time.monotonic(), None
        if self.reduces():
            with self.shrinking():
                first = structural(self, signature, self.ledger.latest(signature), first=True)
        self.ledger.keep_first(signature, first, found_at, time.monotonic() - found_at)

    def shrink_seconds_left(self, budget: float) -> float:
        """``budget`` seconds of shrinking, cut to what ``--duration`` and its shrink grace leave."""
        if self.deadline is None:
            return budget
        return max(0.0, min(budget, self.deadline + SHRINK_GRACE_SECONDS - time.monotonic()))

    # ---- Hypothesis's property body ------------------------------------------------------------------------
    def body(self, example: Example) -> None:
        """Run ``example`` and give Hypothesis its verdict: return (it passed, its failure is known or accepted by
        the baseline, or it ended a worker before) or raise its new Finding (shrunk by Hypothesis). Raises
        :class:`PastDeadline` past ``--duration`` (and its shrink grace while a new failure is shrunk), and
        KeyboardInterrupt on a stop request."""
        self._entered = time.perf_counter()  # the time accounting: when, what Hypothesis is doing, how long it drew
        if self._hypothesis is _UNSEARCHED:
            self._hypothesis = conjecture_runner()
        self._phase = getattr(self._hypothesis, "_current_phase", None)
        try:
            self._draw = math.fsum(current_build_context().data.draw_times.values())
        except Exception:  # no build context: an example run outside Hypothesis
            self._draw = 0.0
        try:
            if STOP.is_set():
                raise KeyboardInterrupt
            if self.past_deadline():
                if not self.ledger.pending() or self.past_deadline(shrinking=True):
                    raise PastDeadline()
                grace = "shrinking past --duration (up to KVFUZZ_SHRINK_GRACE, %g s)" % SHRINK_GRACE_SECONDS
                if grace not in self.cut_short:
                    self.cut_short.append(grace)
            if self.chunk.up(time.monotonic(), self._phase == "generate" and not self._shrinks
                             and not self.ledger.pending()):
                raise ChunkTimeUp()
            lab = {**labels(self.target, example.batch), "tier": self.tier}
            for k, v in lab.items():
                note(f"{k}: {v}")
            if self.ledger.ended_a_worker(example):  # it crashed or hung a worker: already counted
                note("skipped: ended a worker before")
                return
            finding = self.attempt(example, lab)
            run = self.run
            if finding is None and run is not None and math.isfinite(run.ratio):
                # guidance: Hypothesis's targeted phase mutates towards a higher agreement error / bound, so a near
                # miss (a ratio close to 1, as a serving-sized batch's partial defect gives) climbs towards a failure
                hypothesis.target(run.ratio, label=TARGET_LABEL)
            if finding is None or self.ledger.is_known(finding.signature):
                return
            if finding.known is not None:  # accepted in the baseline: listed once (unshrunk), counted, not shrunk
                self.record_known(example, finding)
                return
            if self.ledger.saw(finding.signature, (example, finding, self.run)):
                self.seen(finding.signature)
                self.shrink_first(finding.signature)
            raise finding
        finally:
            self._left = time.perf_counter()  # what follows the example's report (its verdict) is "other"

    # ---- one example, retried when the device's memory runs out ------------------------------------------
    def attempt(self, example: Example, lab: dict | None = None) -> Finding | None:
        """Run one example, reported to the listener (``begin``, its phases, ``end``) and counted; returns its
        Finding or None (its Run stays in :attr:`run`). KeyboardInterrupt (a stop) propagates and the example is
        not counted. An example that runs out of device memory in kvfuzz's phases runs again alone on the device
        (holding the lock) after each of :data:`OUT_OF_MEMORY_PAUSES`; skipped if it never fits."""
        if STOP.is_set():
            raise KeyboardInterrupt
        lab = {**labels(self.target, example.batch), "tier": self.tier} if lab is None else lab
        self.listener.begin(self.target.name, example)  # the example is being prepared
        started = time.perf_counter()
        self._waited = self._sanitized = 0.0
        self.sanitizer.take(0.0, False)  # a sanitized run of an example cut short before its report: forgotten
        try:
            return self._once(example, lab, started, memory.is_big(example.batch))
        except _OutOfMemory:  # other workers' memory (fuzz/harness/memory.py): again, alone on the device
            pass
        finally:
            self.releases.poll()  # another worker asked for room: give back what this one keeps cached
            self.releases.trim()
        for i, pause in enumerate(OUT_OF_MEMORY_PAUSES):
            self.run = None
            asked = time.perf_counter()
            gc.collect()
            time.sleep(pause)  # the other workers' examples end meanwhile (a big one waits for the lock)
            self.releases.request()  # every worker of the GPU gives its cached memory back first
            self._waited += time.perf_counter() - asked
            try:
                return self._once(example, lab, started, True, last=i == len(OUT_OF_MEMORY_PAUSES) - 1)
            except _OutOfMemory:
                continue
        # kvfuzz cannot fit it: counted as skipped, never the kernel's finding nor a harness error
        self.run = None
        memory.release_device_memory(collect=True)
        print(f"kvfuzz: {self.target.name}: an example skipped for device memory after {len(OUT_OF_MEMORY_PAUSES)} "
              f"re-runs: {memory.footprint(example.batch)}", file=sys.stderr)
        note("skipped: out of device memory")
        self._report(example, lab, started, None, None, skipped=SKIPPED_FOR_MEMORY)
        return None

    def _once(self, example: Example, lab: dict, started: float, locked: bool, last: bool = False) -> Finding | None:
        """One run of the example for :meth:`attempt`, holding the device-memory lock when ``locked`` (the memory it
        left given back then), classified against the baseline and reported (``end``). Raises _OutOfMemory, counting
        nothing, when the device ran out of memory outside the kernel call, or in it unless ``last`` (the last re-run:
        then it is the kernel's finding)."""
        self.run = finding = undeclared = None
        asked = time.perf_counter()
        if locked:
            self.releases.idle()  # holding nothing while it waits for the lock
        with memory.device_memory_lock(self.config.out) if locked else contextlib.nullcontext():
            if locked:  # the other workers' cached memory back, for this example, not waited for (a re-run waited)
                self.releases.request(wait=False)
            self._waited += time.perf_counter() - asked if locked else 0.0
            if not last:  # a kernel's out-of-memory error comes here, to be re-run (the last try: the kernel's)
                memory.RETRIES_OUT_OF_MEMORY.set()
            try:
                undeclared = self.check(example)
            except Finding as f:
                finding = f
                if self.config.baseline is not None:
                    classify(self.config.baseline, self.target, example, finding, self.run)
                if isinstance(finding, MemorySafetyError) and finding.known is None and not self.ledger.is_known(
                        finding.signature):  # a new one: shrunk on every example (a known one: not)
                    self.sanitizer.every_example = True
            finally:
                memory.RETRIES_OUT_OF_MEMORY.clear()
            self._report(example, lab, started, None if finding is None else finding.signature, undeclared)
            if locked:  # give back what the example left (a failing one's Run is kept: the ledger drops it)
                self.run = self.run if finding is not None else None
                memory.release_device_memory()
        return finding

    def check(self, example: Example) -> str | None:
        """Prepare and check one example (its Run kept in :attr:`run`); returns the undeclared outcome ("rejected:
        <error>", "accepted, correct") or None, or raises the Finding. An error outside the kernel call (the
        adapter's build_call, kvfuzz itself) becomes a HarnessError, never the kernel's."""
        config, target = self.config, self.target
        stage = "prepare"
        try:
            try:
                self.run = self._prepare(target, example, config.fault)
            except LayoutError:
                if not config.undeclared:
                    raise
                reject()  # kvfuzz's layout cannot hold an undeclared configuration: nothing to ask the kernel
            stage = "check"
            if config.undeclared:
                self.run, outcome = properties.check_undeclared(target, example, run=self.run)
                note(f"undeclared: {outcome.split(':')[0]}")
                return outcome
            self._check(target, example, config.fault, run=self.run, run_unsafe=config.run_unsafe,
                        on_phase=self.listener.phase)
            if config.fault is None and self.sanitizer.due(example, self.deadline):
                stage, began = "sanitize", time.perf_counter()
                try:
                    self.sanitizer.run(example)
                finally:
                    self._sanitized += time.perf_counter() - began
            return None
        except (Finding, OutOfSpace):
            raise
        except KeyboardInterrupt:
            if STOP.is_set():
                raise
            raise HarnessError(f"raised KeyboardInterrupt in {stage}", "KeyboardInterrupt outside the kernel call "
                               "with no stop requested", {"traceback": traceback.format_exc(limit=-6)}) from None
        except BaseException as e:  # the adapter or kvfuzz: name it, shrink it, never blame the kernel
            if type(e).__module__.startswith("hypothesis"):
                raise
            error = self._harness_error(e, stage)
            raise error from (None if isinstance(error, HarnessError) else e)

    @staticmethod
    def _harness_error(e: BaseException, stage: str) -> BaseException:
        """What an error outside the kernel call in ``stage`` becomes: _OutOfMemory (kvfuzz's own memory, whatever
        the adapter: never a finding), OutOfSpace (a full disk ends the campaign, exit 3; nobody's finding), or a
        HarnessError; a device left unusable ends this worker (the supervisor decides)."""
        exit_if_device_unusable(e, f"kvfuzz's {stage}")
        if memory.is_out_of_memory(e):
            return _OutOfMemory()
        if disk_full(e):
            return OutOfSpace(getattr(e, "filename", None) or f"a file ({stage})",
                              e if isinstance(e, OSError) else None)
        return HarnessError(f"raised {type(e).__name__} in {stage}",
                            f"{type(e).__name__} outside the kernel call ({stage}: "
                            f"{'the target built the call' if stage == 'prepare' else 'checking the output'}): {e}",
                            {"stage": stage, "traceback": traceback.format_exc(limit=-6)})

    def _report(self, example: Example, lab: dict, started: float, signature, undeclared: str | None,
                skipped: str | None = None) -> None:
        """Report one answered (or ``skipped``) example to the listener: its Outcome, with its seconds since the last
        charge per stage (its Run's Timings, its draw, sanitized run and waits; Hypothesis's engine before its draw,
        ``hypothesis``; the rest, the last example's verdict among it, ``other``; all ``shrink`` while shrinking).
        The clock moves past them."""
        run, total = self.run, time.perf_counter() - started
        kernel_s = run.timings.kernel if run is not None else 0.0
        span = self.clock.skip_to(time.perf_counter())
        since, entered, left = self.clock.mark - span, self._entered, self._left
        self._entered = self._left = None
        stages = {"draw": self._draw, "sanitize": self._sanitized, "memory_wait": self._waited}
        if run is not None:
            stages.update((k, getattr(run.timings, k)) for k in TIMED)
        if entered is not None:
            since = max(since, left or since)
            stages["draw"] = min(self._draw, max(0.0, entered - since))
            stages["hypothesis"] = entered - stages["draw"] - since
        stages["other"] = max(0.0, span - sum(stages.values()))
        self._draw = 0.0
        if undeclared is not None:
            lab["undeclared"] = undeclared.split(":")[0]
        elif self.config.undeclared and signature is not None:
            lab["undeclared"] = "silently wrong"
        rejection = undeclared.removeprefix("rejected: ") if undeclared and undeclared.startswith("rejected") \
            else None
        if self.sanitizer.last:
            lab["sanitize"], self.sanitizer.last = self.sanitizer.last, None
        batch, shrinking = example.batch, self._shrinking()
        self.listener.end(self.target.name, Outcome(
            lab, kernel_s, max(0.0, total - kernel_s), run.ratio if run is not None else 0.0, signature, rejection,
            skipped, 0 if skipped else sum(batch.ctx_lens) + sum(batch.query_lens),
            {"shrink": span} if shrinking else stages, self.sanitizer.take(self._sanitized, shrinking)))

    # ---- where the time goes (kvfuzz.fuzz.campaign.stages) ----------------------------------------------------
    @contextlib.contextmanager
    def task(self):
        """One piece of the campaign's work (a replay, a chunk, a re-run): its time starts now (the first one's at the
        runner's creation: the campaign's set-up, its strategies, is its own); at its end what no example or charge
        took is ``other``, and every pending second is reported."""
        if self._tasks:
            self.clock.mark = time.perf_counter()
        self._tasks += 1
        try:
            yield
        finally:
            self.charge("other")
            self.flush()

    @contextlib.contextmanager
    def shrinking(self):
        """Every second inside (the widening, the structural passes), its examples included, is ``shrink``."""
        self.charge("other")
        self._shrinks += 1
        try:
            yield
        finally:
            self.charge("shrink")
            self._shrinks -= 1

    def new_run(self) -> None:
        """A Hypothesis run starts: the time before it is the engine's own (``other``)."""
        self.charge("other")
        self._hypothesis, self._phase = _UNSEARCHED, None

    def end_run(self) -> None:
        """The Hypothesis run ended: the time since its last example is Hypothesis's (its shrink's, when it ended
        shrinking)."""
        self.charge("hypothesis")
        self._phase = None

    def charge(self, stage: str) -> None:
        """Charge the time since the last charge to ``stage`` (to ``shrink`` while shrinking; what followed the last
        example's report to ``other``); report what is pending once it passes :data:`FLUSH_SECONDS`."""
        shrinking, self._entered = self._shrinking(), None
        if self._left is not None:
            self.clock.charge(self.tier, "shrink" if shrinking else "other", until=self._left)
            self._left = None
        self.clock.charge(self.tier, "shrink" if shrinking else stage)
        if self.clock.pending_seconds > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Report the pending seconds outside examples (``spent``)."""
        for tier, seconds in self.clock.take().items():
            self.listener.spent(self.target.name, tier, seconds)

    def _shrinking(self) -> bool:
        return self._shrinks > 0 or self._phase == "shrink"

    # ---- reproducers of a verdict --------------------------------------------------------------------------
    def write(self, failing: Failing, stage: str = "final") -> Path:
        """Write ``failing``'s reproducer directory in ``--out`` (``stage``: how far it was shrunk, case.json's
        ``stage``); returns its path."""
        example, finding, run = failing
        return write_reproducer(self.config.out, self.target, example, finding, run, fault_name=self.fault_name,
                                stage=stage)

    def record_of(self, failing: Failing, path: Path | None) -> FailureRecord:
        return FailureRecord.of(self.target.name, failing[1], failing[0], self.fault_name, path)

    def seen(self, signature: tuple[str, ...], failing: Failing | None = None, stage: str = "unshrunk") -> None:
        """Write a provisional reproducer of a new distinct failure and report it (``stage``: "unshrunk", then
        "structural" after the structural-first pass, "hypothesis" after Hypothesis's shrink, before the structural
        shrink): a shrink can reach an input that kills the worker (a crash or hang of another kind), and the
        supervisor then keeps this one instead of losing the failure. It replaces an earlier provisional one;
        recording the final one removes it."""
        failing = failing or self.ledger.latest(signature)
        path = self.write(failing, stage)
        self.ledger.keep_provisional(signature, path)
        self.listener.seen(attrs.evolve(self.record_of(failing, path), stage=stage))

    def record_known(self, example: Example, finding: Finding) -> None:
        """The first hit of a baseline entry here: its reproducer (as found, not shrunk: the baseline already
        knows the bug) and its record; later hits are only counted."""
        self.ledger.mark_known(finding.signature)
        failing = (example, finding, self.run)
        self.recorded(self.record_of(failing, self.write(failing)))

    def recorded(self, record: FailureRecord) -> None:
        """A distinct failure's reproducer is written: keep it and report it."""
        self.ledger.recorded(record)
        self.listener.failure(record)
        if record.kind == FailureKind.MEMORY_SAFETY.value and record.known is None:
            self.sanitizer.every_example = False  # recorded: back to the time share

    def drop(self, run: Run | None) -> None:
        """Let go of ``run`` (a recorded failure's, :meth:`FailureLedger.forget_run`): a big example's memory goes
        back to the device."""
        if run is None:
            return
        big = memory.is_big(run.example.batch)
        if self.run is run:
            self.run = None
        del run
        if big:
            memory.release_device_memory(collect=True)

    def _release(self) -> None:
        """Give back the device memory this process keeps cached, the target's kernel library's pools included
        (``Target.release_memory``)."""
        memory.release_device_memory()
        self.target.release_memory()

    def close(self) -> None:
        """End what the runner keeps running beside it (the long-lived sanitized child; idempotent)."""
        self.sanitizer.close()



__all__ = ["OUT_OF_MEMORY_PAUSES", "SHRINK_GRACE_SECONDS", "TARGET_LABEL", "ExampleRunner", "PastDeadline",
           "SanitizerSchedule", "note"]
