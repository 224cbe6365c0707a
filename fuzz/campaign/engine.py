"""The campaign engine: one target's Hypothesis campaign, run in pieces a scheduler chooses.

A :class:`Campaign` holds what stays fixed for one target in one process: the strategy (drawn inside the
target's declaration, or outside it with ``undeclared``), the property body, the database key and the
signatures of failures already known. A scheduler runs it piece by piece:

- :meth:`Campaign.replay_database` replays the failures the example database holds for this target
  (Hypothesis's reuse phase), so a new campaign tries them first;
- :meth:`Campaign.run_chunk` explores ``n`` examples from chunk ``k``'s seed (``seed * 100_003 + k``), with the size
  tier and the bin its draws aim at that its :class:`~kvfuzz.fuzz.campaign.steering.Plan` gives, all inside
  the kernel configuration the Plan names (:func:`kvfuzz.strategies.configs.config_for`: dtype, heads, head size,
  kv_cache_dtype, block size, features; what a compiled kernel specializes on, so a chunk compiles once and
  then runs at the kernel's speed; with ``--duration``, for at most a share of it past its first example,
  :data:`~kvfuzz.fuzz.campaign.chunks.PINNED_CHUNK_SHARE`): a failure with a new signature (failure kind and
  check) is shrunk inside the configuration (no recompiles), then *widened*: its choices replay unchanged in the
  free strategy, which shrinks it across configurations (fewer heads, a smaller head size, no fp8, ...; compiling
  what it needs), and the result is written as a reproducer; a failure whose signature is known is counted and
  exploration goes on;
- :meth:`Campaign.check_one` re-runs one given example (one a killed worker had in flight).

Each example runs through the campaign's :class:`~kvfuzz.fuzz.campaign.runner.ExampleRunner` (Hypothesis's property
body: the deadline, the out-of-memory re-run, the sanitizer, the verdict) and its failure signatures are kept in a
:class:`~kvfuzz.fuzz.campaign.failure_ledger.FailureLedger`; the engine keeps the campaign's flow: the database
replay, chunks and tiers, widening, and recording a failure once shrunk (the smaller of the structural-first result and
Hypothesis's, then the structural shrink, its reproducer; the shrink order is :mod:`kvfuzz.fuzz.campaign.reduce`'s).
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

import re
import time
from typing import Callable

import attrs
import hypothesis
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.campaign.chunks import (
    CHUNK_SEED_STRIDE,
    ChunkTimeUp,
    campaign_tiers,
    chunk_config,
    chunk_size,
    chunk_tier,
    chunk_time_limit,
    examples_per_chunk,
    record_tier_time,
    tier_chunk_size,
)
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.failure_ledger import Failing, FailureLedger
from kvfuzz.fuzz.campaign.records import FailureRecord, Listener, Quiet, TargetStats
from kvfuzz.fuzz.campaign.reduce import shrink_seconds, smaller, structural
from kvfuzz.fuzz.campaign.runner import ExampleRunner, PastDeadline
from kvfuzz.fuzz.campaign.steering import Plan, Steering
from kvfuzz.fuzz.harness import memory
from kvfuzz.fuzz.harness.isolation import STOP
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.batches import big_cache_examples, examples, undeclared_examples
from kvfuzz.strategies.configs import KernelConfig
from kvfuzz.strategies.focus import Focus, aim_pin
from kvfuzz.strategies.seeding import seed_only
from kvfuzz.strategies.serving import serving_examples
from kvfuzz.strategies.tiers import tier_limits


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


class SortKeys:
    """Hypothesis's ``sort_key(nodes)`` (hypothesis.internal.conjecture.shrinker) remembered for the last ``size``
    choice sequences it was asked about, by identity (each kept alive while remembered, so an id is never another
    sequence's). Hypothesis keeps a Pareto front of a run's examples whenever it has a database and the examples
    report ``hypothesis.target()`` (every campaign: kvfuzz.fuzz.campaign.runner.TARGET_LABEL), and each example
    added to it recomputes the sort key (one ``choice_to_index`` per choice) of itself and of the members it is
    compared with, ~10-20 times: ~2 ms of the ~3 ms Hypothesis spent between two small examples on a 2-core CPU
    (benchmarks/campaign_speed.py). The key of a sequence never changes, so remembering it changes nothing the front
    keeps or evicts, nor a draw (the front's random choices are the same)."""

    def __init__(self, sort_key: Callable, size: int = 128) -> None:
        self.sort_key, self.size = sort_key, size
        self._memo: dict[int, tuple] = {}

    def __call__(self, nodes):
        hit = self._memo.get(id(nodes))
        if hit is not None and hit[0] is nodes:
            return hit[1]
        key = self.sort_key(nodes)
        if type(nodes) is tuple:  # a finished example's (ConjectureResult.nodes): never changes
            self._memo[id(nodes)] = (nodes, key)
            if len(self._memo) > self.size:
                del self._memo[next(iter(self._memo))]  # the oldest
        return key


def remember_sort_keys() -> None:
    """Make the Pareto front of Hypothesis runs in this process use :class:`SortKeys` (once; nothing where
    Hypothesis's internals moved: the front then costs what it did)."""
    from hypothesis.internal.conjecture import pareto

    if callable(getattr(pareto, "sort_key", None)) and not isinstance(pareto.sort_key, SortKeys):
        pareto.sort_key = SortKeys(pareto.sort_key)


def mutator_groups(spans) -> list[set[tuple[int, int]]]:
    """Hypothesis's ``Spans.mutator_groups`` (hypothesis.internal.conjecture.data), in one pass over the span trail:
    per span label, the ``(start, end)`` choice indices of its spans (none inside a unique collection), groups of
    two or more, in the order their labels first start. Hypothesis's mutator draws a group from these after every
    example it keeps as a base (generate_mutations_from), and computed them with two visitor passes, ~6 method calls
    and a Span object per span: 0.31 ms a small example's spans on a 2-core CPU, 0.63 a serving one's; this pass,
    0.04 and 0.09. The same groups in the same order (tests/fuzz/campaign/test_engine_speedups.py compares them), so
    the mutator's random choices pick the same spans: the same draws."""
    from hypothesis.internal.conjecture.data import UNIQUE_COLLECTION_LABEL

    unique = {i for i, label in enumerate(spans.labels) if label == UNIQUE_COLLECTION_LABEL}
    starts: list[int] = []
    ends: list[int] = []
    order: list[tuple[int, int]] = []
    stack: list[int] = []
    unique_open: list[int] = []
    choices = 0
    for record in spans.trail:  # 1, 2: a span stops (discarded or not); 3: a choice; 4 + k: a span of label k starts
        if record <= 2:
            i = stack.pop()
            ends[i] = choices
            if unique_open and unique_open[-1] == i:
                unique_open.pop()
        elif record == 3:
            choices += 1
        else:
            i = len(starts)
            starts.append(choices)
            ends.append(choices)
            if not unique_open:
                order.append((record - 4, i))
            if record - 4 in unique:
                unique_open.append(i)
            stack.append(i)
    groups: dict[int, set[tuple[int, int]]] = {}
    for label_index, i in order:
        groups.setdefault(label_index, set()).add((starts[i], ends[i]))
    return [g for g in groups.values() if len(g) >= 2]


def fast_mutator_groups() -> None:
    """Make Hypothesis's ``Spans.mutator_groups`` :func:`mutator_groups` in this process (once; nothing where its
    internals moved: the trail's encoding, the property, the unique-collection label)."""
    import functools

    from hypothesis.internal.conjecture import data

    current = getattr(data.Spans, "mutator_groups", None)
    trail = getattr(data, "TrailType", None)
    if not isinstance(current, functools.cached_property) or current.func is mutator_groups or trail is None \
            or (trail.STOP_SPAN_DISCARD, trail.STOP_SPAN_NO_DISCARD, trail.CHOICE) != (1, 2, 3) \
            or not hasattr(data, "UNIQUE_COLLECTION_LABEL") or current.func.__name__ != "mutator_groups":
        return
    fast = functools.cached_property(mutator_groups)
    fast.__set_name__(data.Spans, "mutator_groups")
    data.Spans.mutator_groups = fast


class Campaign:
    """One target's campaign in this process (see the module docstring). ``known``: signatures of failures
    already reported elsewhere (another worker): they are counted, not shrunk and written again. Its examples run
    through :attr:`runner` (:class:`~kvfuzz.fuzz.campaign.runner.ExampleRunner`); its failure signatures are in
    :attr:`ledger` (:class:`~kvfuzz.fuzz.campaign.failure_ledger.FailureLedger`)."""

    def __init__(self, target: Target, config: CampaignConfig, listener: Listener | None = None,
                 known: set[tuple[str, str]] | frozenset = frozenset(),
                 releases: memory.Releases | None = None) -> None:
        remember_sort_keys()
        fast_mutator_groups()
        self.target = target
        self.config = config
        self.listener = listener or Quiet()
        self.ledger = FailureLedger(known)
        # its clock starts: the set-up counts
        self.runner = ExampleRunner(target, config, self.listener, self.ledger, releases)
        self.db = config.db()
        #: the size tiers the chunks rotate through (campaign_tiers), each with its own config: the small tier's is
        #: ``config`` itself, big-cache's sets ``big_cache``, long's and wide's have their limits (tier_limits)
        self.tiers = campaign_tiers(target, config)
        self._configs = {t: _tier_config(config, t) for t in self.tiers}
        self._strategies: dict = {}
        self._base_key = f"kvfuzz:{target.name}:{self.runner.fault_name}".encode()
        self._use(self.tiers[0])

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` past which no example starts (:attr:`ExampleRunner.deadline`); None: no time budget.
        A chunk, a shrink and the structural shrink stop there (:class:`~kvfuzz.fuzz.campaign.runner.PastDeadline`)."""
        return self.runner.deadline

    @deadline.setter
    def deadline(self, value: float | None) -> None:
        self.runner.deadline = value

    @property
    def cut_short(self) -> list[str]:
        """What the deadline cut short in this process (:attr:`ExampleRunner.cut_short`), for the summary."""
        return self.runner.cut_short

    def past_deadline(self, shrinking: bool = False) -> bool:
        return self.runner.past_deadline(shrinking)

    def close(self) -> None:
        """End what this campaign keeps running beside it (the long-lived sanitized child; idempotent)."""
        self.runner.close()

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
        self.runner.use(tier, self.config)

    # ---- a Hypothesis run -----------------------------------------------------------------------------------
    def _test(self, phases: list[Phase], chunk_seed: int, max_examples: int, explicit: Example | None = None,
              strategy=None, database: ExampleDatabase | None = None):
        body = self.runner.body

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
        its signature in the ledger's run (a pinned chunk: recorded once widened)."""
        self.ledger.start_run()
        self.runner.new_run()
        try:
            try:
                with seed_only():  # the chunk's draws depend on its seed, not on what this process imported
                    test()
            finally:
                self.runner.end_run()
        except ChunkTimeUp:
            pass  # a pinned chunk's share of --duration is spent (no new failure pending): the next chunk goes on
        except PastDeadline:
            # --duration ran out mid-run: each failure seen and not yet recorded is recorded as it stands
            pending = self.ledger.pending()
            self.cut_short.append("shrinking " + ", ".join(f"{k} ({c})" for k, c, *_ in pending) if pending
                                  else "generating")
            for sig in pending:
                self.ledger.latest(sig)[1].details["shrink_stopped"] = "the campaign's --duration ran out"
                self.ledger.found(sig)
                if record:
                    self._record(sig)
        except (Finding, BaseExceptionGroup) as exc:
            errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
            for e in errors:
                if not isinstance(e, Finding):
                    raise e
                self.ledger.found(e.signature)
                if record:
                    self._record(e.signature)
        return self.ledger.records()

    # ---- recording a distinct failure -----------------------------------------------------------------------
    def _record(self, signature: tuple[str, ...], latest: Failing | None = None) -> None:
        """Take the smaller of the failure's structural-first result and Hypothesis's (``latest``, else the ledger's),
        shrink it structurally (:meth:`_reduce`), write its final reproducer, saying how long each shrink took
        (``details.shrink_seconds``), and report it; its provisional reproducer and its Run are let go."""
        self.ledger.mark_known(signature)
        first, found_at, first_s = self.ledger.take_first(signature)
        failing = smaller(first, latest or self.ledger.latest(signature))  # the shrink order: reduce.py
        del first
        recorded_at = time.monotonic()
        if self.runner.reduces():
            failing = self._reduce(signature, failing)
        details = failing[1].details
        details["shrink_seconds"] = shrink_seconds(found_at, first_s, recorded_at, details.get("structural_shrink"))
        path = self.runner.write(failing)
        self.ledger.drop_provisional(signature, keep=path)
        record = self.runner.record_of(failing, path)
        del failing, latest
        self.runner.drop(self.ledger.forget_run(signature))
        self.runner.recorded(record)

    def _reduce(self, signature: tuple[str, ...], failing: Failing) -> Failing:
        """The structural shrink after Hypothesis's (:func:`kvfuzz.fuzz.campaign.reduce.structural`, every move): before
        its first candidate runs, the Hypothesis-shrunk reproducer is written (and reported ``seen``), so a candidate
        that kills the worker leaves it behind. Returns the smallest ``(example, finding, run)`` that fails the same
        way, the finding's details saying what the shrink did (``structural_shrink``: the case it started from, the
        candidates tried and taken, seconds)."""
        with self.runner.shrinking():
            return structural(self.runner, signature, failing)

    # ---- the pieces a scheduler runs ------------------------------------------------------------------------
    def replay_database(self) -> list[FailureRecord]:
        """Replay (and re-shrink) what the database holds for this target, tier by tier (each tier's key);
        returns the new failures."""
        new: list[FailureRecord] = []
        with self.runner.task():
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
        failures widened as a pinned chunk's are), else from :func:`chunk_tier`'s, free."""
        plan = plan or Plan(chunk_tier(self.tiers, chunk))
        with self.runner.task():
            self._use(plan.tier)
            return self._chunk(chunk, n, plan)

    def _chunk(self, chunk: int, n: int, plan: Plan) -> list[FailureRecord]:
        chunk_seed, focus = self.config.seed * CHUNK_SEED_STRIDE + chunk, plan.focus
        pin = aim_pin(chunk_config(self.target, self.config, plan.config_chunk(chunk)), focus, self.target.capabilities)
        # a pinned chunk gives way to the next configuration after its share of --duration
        # (chunks.PINNED_CHUNK_SHARE), a focused one after FOCUS_CHUNK_SECONDS (it is there to reach its bin), a
        # steered free one after its target's free_chunk_seconds (0: off)
        self.runner.limit_chunk(chunk_time_limit(self.config, pin is not None, focus is not None, plan.free,
                                                 self.target.free_chunk_seconds))
        try:
            if pin is None and focus is None:
                return self._execute(self._test([Phase.generate, Phase.shrink], chunk_seed, n))
            pinned = InMemoryExampleDatabase()  # a focused draw is shrunk in the free strategy (widened), not its focus
            self._execute(self._test([Phase.generate] + ([Phase.shrink] if pin is not None else []), chunk_seed, n,
                                     strategy=strategy_for(self.target, self.config, pin, self.tier, focus),
                                     database=pinned), record=False)
        finally:
            self.runner.limit_chunk(None)
        found = self.ledger.found_in_run()
        if not found:
            return []
        if self.past_deadline(shrinking=True):  # past --duration and its shrink grace: recorded unwidened
            for sig in found:
                if not self.ledger.is_known(sig):
                    self._record(sig)
            return self.ledger.records()
        return self._widen(pinned, found)

    def _widen(self, pinned: InMemoryExampleDatabase, found: list[tuple[str, ...]]) -> list[FailureRecord]:
        """Shrink the failures a pinned or focused chunk found (``pinned`` holds their choices, ``found`` their
        signatures) across kernel configurations and out of the focus: the choices replay unchanged in the free
        strategy (strategies/batches.py ``choice``, strategies/focus.py), whose shrinker may then lower the heads,
        head size, cache dtype or features, and leave the focused bin. They are
        handed over as *secondary* entries (Hypothesis skips shrinking a primary entry that replays exactly,
        taking it for an already shrunk one). The pinned examples wait in the campaign database's secondary
        key meanwhile, so a worker lost while widening loses nothing (a later replay widens them); the
        widened ones go to its primary key. A signature the free strategy does not reproduce keeps its pinned
        example."""
        with self.runner.shrinking():
            return self._widened(pinned, found)

    def _widened(self, pinned: InMemoryExampleDatabase, found: list[tuple[str, ...]]) -> list[FailureRecord]:
        saved = list(pinned.fetch(self.key))
        secondary = self.key + b".secondary"
        widen_db = InMemoryExampleDatabase()
        for choices in saved:
            self.db.save(secondary, choices)
            widen_db.save(secondary, choices)
        at_pin = {sig: self.ledger.latest(sig) for sig in found}
        # max_examples sizes the replayed corpus: Hypothesis replays max(2, max_examples / 10) entries
        self._execute(self._test([Phase.reuse, Phase.shrink], self.config.seed, 10 * len(saved),
                                 database=widen_db))
        for sig in found:
            if not self.ledger.is_known(sig):  # not reproduced in the free strategy (flaky): the pinned example
                self._record(sig, latest=at_pin[sig])
        for choices in widen_db.fetch(self.key):
            self.db.save(self.key, choices)
        for choices in saved:
            self.db.delete(secondary, choices)
        return self.ledger.records()

    def check_one(self, example: Example) -> list[FailureRecord]:
        """Run one given example (Hypothesis's explicit phase: no generation, no shrinking); returns its failure
        if it is new."""
        deadline, self.deadline = self.deadline, None  # a re-run (a killed worker's example) is owed an answer
        try:
            with self.runner.task():
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
        if self.steer is not None and outcome.skipped is None and "shrink" not in outcome.stages:
            self.steer.observe(outcome.labels, outcome.ratio, outcome.signature)  # what the next chunks steer by
        self.on_example(self.stats)

    def failure(self, record) -> None:
        self.stats.add_failure(record)

    def spent(self, target, tier, seconds) -> None:
        self.stats.add_spent(tier, seconds)


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
    steer = Steering.of(target, config, campaign_tiers(target, config))  # None: the fixed split (chunk_tier)
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
        plan = steer.plan(chunk) if steer is not None else Plan(chunk_tier(campaign.tiers, chunk))
        tier, per_chunk = plan.tier, examples_per_chunk(target, config)
        n = tier_chunk_size(tier, campaign.tiers, per_chunk, tier_times,
                            None if config.duration is None else config.duration - elapsed)
        if n is None:
            n = chunk_size(config, stats.examples, elapsed, per_chunk=per_chunk)
        n = plan.size(min(n, config.max_examples - stats.examples))
        campaign.run_chunk(chunk, n, plan)
        ran, spent = stats.examples - before, time.monotonic() - start - elapsed
        record_tier_time(tier_times, tier, ran, spent)
        stats.add_chunk(plan.focus is not None, ran, spent)
        chunk += 1
        if stats.examples == before:  # nothing ran (e.g. every example rejected): do not spin
            break
        if config.stop_at_first_failure and stats.new_failures:  # a baseline's known failures do not stop it
            break
    campaign.close()
    stats.elapsed = time.monotonic() - start
    return stats


__all__ = ["DURATION_SLACK_SECONDS", "DURATION_SLACK_SHARE", "Campaign", "SortKeys", "duration_allowance",
           "fast_mutator_groups", "fuzz_target", "mutator_groups", "remember_sort_keys", "strategy_for"]
