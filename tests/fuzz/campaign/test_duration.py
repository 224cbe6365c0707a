"""--duration holds whatever the findings (issue 40): with no shrink grace (KVFUZZ_SHRINK_GRACE=0), a failure found
early, whose shrinks (Hypothesis's, then the structural one) would take minutes at 0.4 s per call, is recorded as
shrunk so far when the time runs out, and the campaign ends within its allowance (max(10%, 15 s)) past --duration;
with the default grace a shrink goes on past --duration (no new example is drawn) and the summary says so. Measured
against the campaign's own clock (summary.json's elapsed_s, from the target's first task), with the allowance as margin:
not against the machine's speed."""

import json
import os
import time

import pytest
from support import SUPPORT, kvfuzz
from support.planted_targets import SdpaPaged

from kvfuzz import Poison
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.bench.paged_torch import PagedTorch
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import Campaign, duration_allowance

PLANTED = SUPPORT / "planted_endings.py"


def test_duration_holds_through_a_slow_shrink(tmp_path):
    duration = 4.0
    out = tmp_path / "out"
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:SlowWrong", "--poison", "stale", "--out", out, "--workers", "1",
               "--duration", f"{duration:g}s", timeout=600, env=dict(os.environ, KVFUZZ_SHRINK_GRACE="0"))
    assert r.returncode == 1, r.stdout + r.stderr  # the failure is found and reported
    summary = json.loads((out / "summary.json").read_text())
    (target,) = summary["targets"]
    assert target["failures"] and all(f["reproducer"] for f in target["failures"])
    # without the deadline inside the worker this ran the whole Hypothesis shrink and 60 s of structural shrink
    assert target["elapsed_s"] <= duration + duration_allowance(duration), target
    assert not [w for w in summary["warnings"] if "past --duration" in w]


class _Wrong(SdpaPaged):
    name = "planted.wrong_by_one"

    def run(self, call):
        return super().run(call) + 1


def test_a_pinned_chunk_past_its_deadline_records_its_failure_unwidened(tmp_path, monkeypatch):
    """In one process (no timing margin needed: the deadline has passed when the first failure shrinks): with no
    shrink grace the shrink stops, and the failure is recorded in its configuration instead of widened across
    configurations."""
    import kvfuzz.fuzz.campaign.runner as runner

    monkeypatch.setattr(runner, "SHRINK_GRACE_SECONDS", 0.0)
    c = Campaign(_Wrong(), CampaignConfig(out=tmp_path, poisons=(Poison.ZEROS,), seed=1, pin_configs=True))
    c.deadline = time.monotonic()  # already past
    assert c.run_chunk(0, 50) == []  # nothing starts past the deadline
    assert c.cut_short == ["generating"]
    c.deadline = None
    c.runner.body = _then_deadline(c, c.runner.body)
    (record,) = c.run_chunk(1, 50)
    assert record.reproducer and c.cut_short[-1].startswith("shrinking kernel mismatch")
    # a re-run of a killed worker's example is owed its answer, deadline or not
    again = Campaign(_Wrong(), CampaignConfig(out=tmp_path / "again", poisons=(Poison.ZEROS,), seed=1))
    again.deadline = time.monotonic() - 1
    (rerun,) = again.check_one(Example.from_dict(record.example))
    assert (rerun.kind, rerun.check) == (record.kind, record.check)


def _then_deadline(c, body):
    """The campaign's body, with its deadline passing right after the first example that fails."""
    def wrapped(example):
        try:
            body(example)
        except BaseException:
            c.deadline = time.monotonic() - 1
            raise
    return wrapped


def test_a_shrink_goes_on_past_the_deadline_within_its_grace(tmp_path, monkeypatch):
    """With a shrink grace, a failure found before --duration ran out is still shrunk (and widened) after it, no new
    example is drawn, and cut_short names the overrun for the summary."""
    import kvfuzz.fuzz.campaign.runner as runner

    monkeypatch.setattr(runner, "SHRINK_GRACE_SECONDS", 3600.0)
    c = Campaign(_Wrong(), CampaignConfig(out=tmp_path, poisons=(Poison.ZEROS,), seed=1, pin_configs=True))
    c.deadline = time.monotonic()  # already past: nothing new starts
    assert c.run_chunk(0, 50) == [] and c.cut_short == ["generating"]
    c.deadline = None
    c.runner.body = _then_deadline(c, c.runner.body)
    (record,) = c.run_chunk(1, 50)
    assert record.reproducer and record.stage == "final"
    assert any(n.startswith("shrinking past --duration") for n in c.cut_short), c.cut_short
    b = Example.from_dict(record.example).batch
    assert len(b.query_lens) == 1, b  # shrunk to one sequence, not left as drawn


class _SlowPaged(PagedTorch):
    name = "planted.slow_paged"


class _SimClock:
    """``time`` as the engine and the runner read it, with a simulated ``monotonic()`` (the rest is the real one)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_slow_pinned_campaign_gives_each_configuration_its_share_in_rotation_order(tmp_path, monkeypatch):
    """Pinned and steered chunks (as on CUDA), examples of a simulated second each and --duration 60 s: a pinned chunk
    gives way after its share of --duration (PINNED_CHUNK_SHARE, counted after its first example), and the groups of
    FREE_EVERY chunks take the rotation's configurations in order, so the campaign sees the soft cap off and on.
    Before: chunk 0 (1,000 examples) held all 60 s in configuration 0, and a later group would have taken
    configuration 3, skipping 1 and 2 (bug.flashinfer-4401's seeds 0-2 stayed in soft-cap-on modules)."""
    from kvfuzz.fuzz.campaign import engine, runner
    from kvfuzz.fuzz.campaign.chunks import PINNED_CHUNK_SHARE
    from kvfuzz.fuzz.campaign.steering import FREE_EVERY

    clock, chunks, batches = _SimClock(), [], []
    monkeypatch.setattr(engine, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    begin, run_chunk = engine._Counting.begin, engine.Campaign.run_chunk

    def counted(listener, name, example):
        clock.now += 1.0
        batches.append((len(chunks) - 1, example.batch))
        return begin(listener, name, example)

    def chunk(campaign, k, n, plan=None):
        chunks.append((k, plan.config_chunk(k), clock.now))
        return run_chunk(campaign, k, n, plan)

    monkeypatch.setattr(engine._Counting, "begin", counted)
    monkeypatch.setattr(engine.Campaign, "run_chunk", chunk)
    duration = 60.0
    config = CampaignConfig(out=tmp_path, poisons=(Poison.ZEROS,), seed=0, duration=duration, pin_configs=True,
                            tiers=("small",), max_examples=10_000)
    stats = engine.fuzz_target(_SlowPaged(), config)
    assert not stats.failures and stats.examples >= duration - 2
    assert [c for _, c, _ in chunks] == [k // FREE_EVERY for k, _, _ in chunks] and len(chunks) > FREE_EVERY
    for i, (k, _, start) in enumerate(chunks):  # each chunk: its first example, then at most its share
        end = chunks[i + 1][2] if i + 1 < len(chunks) else clock.now
        assert end - start <= 1 + PINNED_CHUNK_SHARE * duration + 1, chunks
    assert {b.softcap is None for _, b in batches} == {True, False}


def test_a_focused_chunk_gives_way_after_its_seconds_and_only_with_a_duration(tmp_path, monkeypatch):
    """Examples of a simulated second each, steered, unpinned: with --duration a chunk aimed at a bin ends
    focus_chunk_seconds() after its first example (it is there to reach its bin; 50 serving examples of FA3 held a
    worker ~22 s per bin), while a free chunk runs its examples; without --duration the campaign is bounded by its
    examples and every focused chunk runs its FOCUS_EXAMPLES (deterministic in the seed). Planted: a focus limit
    that is not applied (the focused chunks ran 25 examples each, the tier's whole chunk). KVFUZZ_FREE_SECONDS, off
    by default, limits the free chunks as well."""
    from kvfuzz.fuzz.campaign import chunks as chunk_module
    from kvfuzz.fuzz.campaign import engine, runner
    from kvfuzz.fuzz.campaign.steering import FOCUS_EXAMPLES

    def run(duration, max_examples, target=None):
        clock, chunks = _SimClock(), []
        monkeypatch.setattr(engine, "time", clock)
        monkeypatch.setattr(runner, "time", clock)
        begin, run_chunk = engine._Counting.begin, engine.Campaign.run_chunk

        def counted(listener, name, example):
            clock.now += 1.0
            chunks[-1][2] += 1
            return begin(listener, name, example)

        def chunk(campaign, k, n, plan=None):
            chunks.append([k, plan is not None and plan.focus is not None, 0])
            return run_chunk(campaign, k, n, plan)

        monkeypatch.setattr(engine._Counting, "begin", counted)
        monkeypatch.setattr(engine.Campaign, "run_chunk", chunk)
        target = target or _SlowPaged()
        out = tmp_path / f"{target.name}-{duration}-{len(list(tmp_path.iterdir()))}"  # a fresh --out each run
        config = CampaignConfig(out=out, poisons=(Poison.ZEROS,), seed=0, duration=duration, pin_configs=False,
                                tiers=("small",), max_examples=max_examples)
        stats = engine.fuzz_target(target, config)
        assert not stats.failures
        return chunks

    monkeypatch.delenv(chunk_module.FOCUS_SECONDS_ENV, raising=False)
    limit = chunk_module.focus_chunk_seconds()
    assert limit == chunk_module.FOCUS_CHUNK_SECONDS > 0
    timed = run(60.0, 10_000)
    focused = [n for _, f, n in timed[:-1] if f]  # the last chunk may end with the campaign
    assert focused and max(focused) <= 1 + limit + 1, timed
    assert max(n for _, f, n in timed[:-1] if not f) > 1 + limit + 1, timed  # free chunks are not limited
    counted = run(None, 200)
    assert [n for _, f, n in counted[:-1] if f] and all(
        n == min(FOCUS_EXAMPLES, 25) for _, f, n in counted[:-1] if f), counted
    monkeypatch.setenv(chunk_module.FOCUS_SECONDS_ENV, "0")  # planted: no focus limit
    assert max(n for _, f, n in run(60.0, 10_000)[:-1] if f) > 1 + limit + 1
    # KVFUZZ_FREE_SECONDS (off by default, above: the free chunks ran longer) limits the steered free chunks too
    monkeypatch.delenv(chunk_module.FOCUS_SECONDS_ENV)
    monkeypatch.setenv(chunk_module.FREE_SECONDS_ENV, "2")
    both = run(60.0, 10_000)
    assert max(n for _, _, n in both[:-1]) <= 1 + max(limit, 2) + 1, both
    assert max(n for _, f, n in both[:-1] if not f) <= 1 + 2 + 1, both
    # a target's own free_chunk_seconds (FlashAttention 3: 5) limits its free chunks without the variable, which
    # overrides it for every target (0: off)
    monkeypatch.delenv(chunk_module.FREE_SECONDS_ENV)

    class OwnFreeLimit(_SlowPaged):
        name = "planted.slow_paged_free_limit"
        free_chunk_seconds = 2.0

    own = run(60.0, 10_000, OwnFreeLimit())
    assert max(n for _, f, n in own[:-1] if not f) <= 1 + 2 + 1, own
    monkeypatch.setenv(chunk_module.FREE_SECONDS_ENV, "0")
    assert max(n for _, f, n in run(60.0, 10_000, OwnFreeLimit())[:-1] if not f) > 1 + limit + 1


def test_a_chunk_limit_on_the_work_clock_leaves_out_the_compiles(monkeypatch):
    """KVFUZZ_CHUNK_CLOCK=work: a chunk's seconds after its first example less the worker's compiles in them (a
    Triton chunk that compiles for 8 s of 10 has spent 2); the wall clock (the default) counts all 10; a bad value
    is refused naming the variable; the runner hands the limit its compile total only on the work clock."""
    import types

    from kvfuzz.fuzz.campaign import chunks
    from kvfuzz.fuzz.campaign.runner import ExampleRunner
    from kvfuzz.fuzz.harness.kernel_clock import COMPILES

    compiled = [3.0]  # compiles before the chunk's clock starts do not count either way
    wall, work = chunks.ChunkLimit(5.0), chunks.ChunkLimit(5.0, lambda: compiled[0])
    for limit in (wall, work):
        assert not limit.up(0.0, True) and not limit.up(1.0, True)  # the first example, then its end: the clock starts
    compiled[0] = 11.0  # 8 s of compiles in the next 10 s
    assert wall.up(11.0, True) and not work.up(11.0, True)
    assert work.up(15.0, True) and not work.up(15.0, False)  # 14 - 8 = 6 > 5, once the chunk may stop
    monkeypatch.delenv(chunks.CHUNK_CLOCK_ENV, raising=False)
    assert chunks.chunk_clock() == "wall"
    runner = types.SimpleNamespace()
    ExampleRunner.limit_chunk(runner, 5.0)
    assert runner.chunk.compiled is None
    monkeypatch.setenv(chunks.CHUNK_CLOCK_ENV, "work")
    ExampleRunner.limit_chunk(runner, 5.0)
    assert runner.chunk.compiled == COMPILES.seconds
    monkeypatch.setenv(chunks.CHUNK_CLOCK_ENV, "cpu")
    with pytest.raises(ValueError, match="KVFUZZ_CHUNK_CLOCK='cpu'"):
        chunks.chunk_clock()
