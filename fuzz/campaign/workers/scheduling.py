"""Which task a free worker gets next (:class:`Scheduler`, for the supervisor of
:mod:`kvfuzz.fuzz.campaign.workers.supervisor`).

Each target's database replay comes first (the other targets' chunks wait for it), with its warm-up chunks
(``CampaignConfig.warmup``: configurations the chunks will visit, compiled in parallel with the replay); then the
examples to run again (their worker was killed from outside, or ended by another worker's CUDA fault); then chunks
of fresh seeds (:mod:`kvfuzz.fuzz.campaign.chunks`), each with the :class:`~kvfuzz.fuzz.campaign.steering.Plan` the
target's steering chooses (its size tier and the bin its draws aim at; without steering, the size tier
:func:`~kvfuzz.fuzz.campaign.chunks.chunk_tier` chooses, every draw free) and sized to the budget left, until
``--max-examples`` or ``--duration`` is spent."""

from __future__ import annotations

import time

from kvfuzz.fuzz.campaign.chunks import WARMUP_EXAMPLES, chunk_size, chunk_tier, examples_per_chunk, tier_chunk_size
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.steering import Plan
from kvfuzz.fuzz.campaign.workers.bookkeeping import TargetState, Task


class Scheduler:
    """Hands out the campaign's tasks. ``chunks``: target -> chunks started so far (the campaign's state.json
    keeps it, so a campaign started again goes on with new seeds); ``workers``: how many share the budget."""

    def __init__(self, config: CampaignConfig, chunks: dict[str, int], workers: int) -> None:
        self.config, self.chunks, self.workers = config, chunks, workers
        self._ids = 0

    def next_task(self, targets: list[TargetState]) -> Task | None:
        """The next task for a free worker, or None when no target has work now (their replay is in flight, or
        their budget is spent or handed out)."""
        now = time.monotonic()
        for t in targets:
            if t.stats.stopped:
                continue
            if not t.replayed and not t.replay_issued:
                t.replay_issued = True
                t.start = t.start or now
                return self._task("replay", t)
            if t.warm:  # compiles in parallel with the replay: configurations the chunks will visit
                return self._task("chunk", t, n=WARMUP_EXAMPLES, chunk=-1 - t.warm.pop(0))
            if not t.replayed:
                continue  # the others wait for the database replay of this target
            if t.retries:
                return self._task("retry", t, example=t.retries.pop(0))
            task = self._chunk(t, now)
            if task is not None:
                return task
        return None

    def _chunk(self, t: TargetState, now: float) -> Task | None:
        """``t``'s next chunk of fresh seeds, sized to what is left of its budget, or None when it is spent."""
        config = self.config
        elapsed = now - (t.start or now)
        if config.duration is not None and elapsed > config.duration:
            return None
        if config.stop_at_first_failure and t.stats.failures:
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
        if t.steer is not None:  # its bins count its examples as coming (parallel workers spread over bins)
            t.steer.started(plan, max(1, n))
        return self._task("chunk", t, n=max(1, n), chunk=k, tier=plan.tier, plan=plan)

    def _task(self, kind: str, t: TargetState, **kw) -> Task:
        self._ids += 1
        task = Task(self._ids, kind, t.name, sent=time.monotonic(), **kw)
        t.start = t.start or time.monotonic()
        t.in_flight.append(task)
        return task


__all__ = ["Scheduler"]
