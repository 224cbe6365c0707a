"""Which task a free worker gets next (:class:`Scheduler`, for the supervisor of
:mod:`kvfuzz.fuzz.campaign.workers.supervisor`), and which targets a campaign left without an example
(:meth:`Scheduler.unserved`).

The targets take the workers in turn. A target's *turn* begins with its first chunk of fresh seeds, and so does its
``--duration`` clock (``TargetState.start``). Before its turn, a target gets its database replay (the target's
other work waits for it), with its warm-up chunks (``CampaignConfig.warmup``: configurations the chunks will visit,
compiled in parallel with the replay), and the examples to run again (their worker was killed from outside, or
ended by another worker's CUDA fault); in its turn, those retries and chunks of fresh seeds
(:mod:`kvfuzz.fuzz.campaign.chunks`), each with the :class:`~kvfuzz.fuzz.campaign.steering.Plan` the target's
steering chooses (its size tier and the bin its draws aim at; without steering, the size tier
:func:`~kvfuzz.fuzz.campaign.chunks.chunk_tier` chooses, every draw free) and sized to the budget left, until
``--max-examples`` or ``--duration`` is spent.

A free worker takes the first of:

1. the work of the targets whose turn has begun, **the latest begun first** (its retries, then its next chunk): a
   target whose turn has begun is never starved by an earlier one, which gets only the workers the later one
   cannot use (its budget all handed out, or spent);
2. the work of the targets whose turn has not begun, in the campaign's order: the replay, the warm-up chunks, the
   retries, then the first chunk, which begins the target's turn.

So a later target begins its turn only on a worker that no begun target could use; an earlier target that could
not use it then (its replay still running) waits, clock stopped, for the later target's turn to end.

Why the clock starts at the first chunk, not at the replay: the replay may run before the target's turn, on a
worker another target left idle, and its length is not the target's to choose (it grows with the database of every
campaign in the same ``--out``); counted, it could eat the whole ``--duration`` and leave no fresh example, as it
already stood outside ``--max-examples`` (its runs are counted apart, ``shrink_runs``). The replay and the warm-up
chunks get a deadline of their own, ``--duration`` from the moment each is handed out (the supervisor's
``_assign``): a replay that no other target's turn overlaps adds its time to the campaign's. A retry, owed an
answer, runs whatever the deadline."""

from __future__ import annotations

import time
from typing import Callable

from kvfuzz.fuzz.campaign.chunks import WARMUP_EXAMPLES, chunk_size, chunk_tier, examples_per_chunk, tier_chunk_size
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.steering import Plan
from kvfuzz.fuzz.campaign.workers.bookkeeping import TargetState, Task


class Scheduler:
    """Hands out the campaign's tasks. ``chunks``: target -> chunks started so far (the campaign's state.json
    keeps it, so a campaign started again goes on with new seeds); ``workers``: how many share the budget;
    ``clock``: ``time.monotonic`` (a test's fake clock)."""

    def __init__(self, config: CampaignConfig, chunks: dict[str, int], workers: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.chunks, self.workers, self.clock = config, chunks, workers, clock
        self._ids = 0
        self.turns: list[TargetState] = []  # the targets whose turn has begun, in the order it began

    def next_task(self, targets: list[TargetState]) -> Task | None:
        """The next task for a free worker (the module docstring's order), or None when no target has work now
        (their replay is in flight, or their budget is spent or handed out)."""
        now = self.clock()
        for t in reversed(self.turns):
            if not t.stats.stopped:
                task = self._retry(t) or self._chunk(t, now)
                if task is not None:
                    return task
        for t in targets:
            if t.stats.stopped or t.start is not None:
                continue
            if not t.replayed and not t.replay_issued:
                t.replay_issued = True
                return self._task("replay", t)
            if t.warm:  # compiles in parallel with the replay: configurations the chunks will visit
                return self._task("chunk", t, n=WARMUP_EXAMPLES, chunk=-1 - t.warm.pop(0))
            if not t.replayed:
                continue  # the others wait for the database replay of this target
            task = self._retry(t) or self._chunk(t, now)
            if task is not None:
                return task
        return None

    def unserved(self, targets: list[TargetState]) -> list[str]:
        """The campaign's problems of ``targets`` that drew no example (none counted, lost or skipped) although the
        budget asked for some (``--max-examples`` is at least 1, so every campaign does): one line each, for the
        summary's ``problems`` (exit 3 when nothing failed). Not a target stopped early (its reason is in the
        summary), nor one ended by its first failure (``stop_at_first_failure``, e.g. found in its replay). The
        caller leaves it out when the campaign itself was stopped (interrupted, a fatal error, a full disk: that
        is the problem)."""
        config, out = self.config, []
        budget = f"--duration {config.duration:g} s" if config.duration is not None else \
            f"--max-examples {config.max_examples}"
        for t in targets:
            s = t.stats
            if s.examples or s.lost or s.skipped_memory or s.stopped or (config.stop_at_first_failure and s.failures):
                continue
            how = ("its turn began, but no worker drew an example before its budget ran out" if t.start is not None
                   else "it never got a worker for a chunk of fresh examples")
            out.append(f"{t.name} drew no example ({budget} asked for some): {how}; it was not fuzzed (what the "
                       f"workers ran is in {config.out}/workers)")
        return out

    def _chunk(self, t: TargetState, now: float) -> Task | None:
        """``t``'s next chunk of fresh seeds, sized to what is left of its budget, or None when it is spent; its
        first begins ``t``'s turn (and its ``--duration`` clock)."""
        config = self.config
        elapsed = now - (t.start or now)
        if config.duration is not None and elapsed > config.duration:
            return None
        if config.stop_at_first_failure and t.stats.new_failures:
            return None
        pending = sum(max(0, x.n - x.counted) for x in t.in_flight if x.kind == "chunk")
        done = t.stats.examples + pending
        if done >= config.max_examples:
            return None
        k = self.chunks.get(t.name, 0)
        plan = t.steer.plan(k) if t.steer is not None else Plan(chunk_tier(t.tiers, k))
        per_chunk = examples_per_chunk(t.target, config)
        time_left = None if config.duration is None else config.duration - elapsed
        n = tier_chunk_size(plan.tier, t.tiers, per_chunk, t.tier_times, time_left)
        if n is None:
            n = chunk_size(config, t.stats.examples, elapsed, self.workers, per_chunk=per_chunk)
        n = plan.size(min(n, config.max_examples - done))
        if t.ended and n == config.max_examples - done:
            # a chunk's first example is its simplest, and one that ended a worker is skipped uncounted:
            # without one more, a last chunk of 1 would count nothing, again and again (a free chunk: a
            # focused one's simplest example is another, counted, and the budget would overshoot by one)
            n, plan = n + 1, Plan(plan.tier)
        self.chunks[t.name] = k + 1
        if t.start is None:
            t.start = now
            self.turns.append(t)
        if t.steer is not None:  # its bins count its examples as coming (parallel workers spread over bins)
            t.steer.started(plan, max(1, n))
        return self._task("chunk", t, n=max(1, n), chunk=k, tier=plan.tier, plan=plan)

    def _retry(self, t: TargetState) -> Task | None:
        """Re-run ``t``'s first example owed one (its worker was killed from outside), or None."""
        return self._task("retry", t, example=t.retries.pop(0)) if t.retries else None

    def _task(self, kind: str, t: TargetState, **kw) -> Task:
        self._ids += 1
        task = Task(self._ids, kind, t.name, sent=self.clock(), **kw)
        t.in_flight.append(task)
        return task


__all__ = ["Scheduler"]
