"""Coverage that steers (kvfuzz.fuzz.campaign.steering, issue 52): the bins a target declares, the policy that picks
each chunk's tier and focus from what is not yet covered, near misses and failures, a planted kernel wrong in one
mid-range bin that the steered campaign finds and the fixed split misses, and the structural-first shrink of a
serving-sized failure inside a campaign."""

import json
from pathlib import Path

import attrs
import pytest
from hypothesis.database import InMemoryExampleDatabase
from support.planted_bins import WrongInOneBin, WrongPastLongContext

from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import Quiet, TargetStats
from kvfuzz.fuzz.campaign.steering import (
    FOCUS_EXAMPLES,
    FREE_EVERY,
    STATE_DIMENSION,
    Plan,
    Steering,
    bin_counts,
    declared_bins,
)
from kvfuzz.fuzz.harness.coverage import SHAPE_DIMENSIONS
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies import tiers
from kvfuzz.strategies.limits import Limits

SHAPE, HEADS = SHAPE_DIMENSIONS


@pytest.fixture
def cpu_serving(monkeypatch):
    """The serving tier at CPU sizes: contexts to 1024 tokens, a 64-token budget, 4 sequences, 2 heads."""
    for name, value in (("SERVING_CTX_LEN", 1024), ("SERVING_TOKENS", 64), ("SERVING_NUM_SEQS", 4),
                        ("SERVING_NUM_HEADS", 2)):
        monkeypatch.setattr(tiers, name, value)


def test_a_target_declares_the_bins_its_tiers_draw(cpu_serving):
    target = WrongInOneBin()
    small = declared_bins(target, ("small",))
    # the small tier: contexts 0..96 (bins 0, 2^0..2^6) by queries 1..40 (2^0..2^5); one head size, no window
    assert len(small[SHAPE]) == 8 * 6 and small[SHAPE][0] == "0 x 2^0" and small[SHAPE][-1] == "2^6 x 2^5"
    assert small[HEADS] == ("32 x none",) and STATE_DIMENSION not in small
    mixed = declared_bins(target, ("small", "serving"))
    assert set(small[SHAPE]) < set(mixed[SHAPE]) and len(mixed[SHAPE]) == 12 * 7  # to 1024 x 64
    windows = declared_bins(get_target("vllm.cpu_attention"), ("small",))
    heads = get_target("vllm.cpu_attention").capabilities.head_sizes
    assert {b.split(" x ")[1] for b in windows[HEADS]} == {"none", *(f"2^{k}" for k in range(8))}  # to 136 keys
    assert len(windows[HEADS]) == len(heads) * 9
    class Decode(WrongInOneBin):
        name = "planted.decode_in_one_bin"
        capabilities = attrs.evolve(WrongInOneBin.capabilities, decode_only=True)

    assert {b.split(" x ")[1] for b in declared_bins(Decode(), ("small",))[SHAPE]} == {"2^0"}
    states = declared_bins(get_target("vllm.unified_attention"), ("small",))[STATE_DIMENSION]
    assert "freed-window" in states
    counts = bin_counts(mixed, {SHAPE: {"0 x 2^0": 3, "2^12 x 2^0": 1}, STATE_DIMENSION: {}})
    assert counts[SHAPE]["0 x 2^0"] == 3 and counts[SHAPE]["2^8 x 2^6"] == 0 and "2^12 x 2^0" not in counts[SHAPE]


def _steering(**kw) -> Steering:
    bins = {SHAPE: ("0 x 2^0", "2^3 x 2^2", "2^8 x 2^6", "2^9 x 2^6"), HEADS: ("32 x none", "32 x 2^8")}
    return Steering(bins, ("small", "serving"), Limits(), **kw)


def test_the_policy_aims_at_what_is_not_covered_and_spreads_parallel_chunks():
    s = _steering()
    assert all(s.plan(k).focus is None and s.plan(k).tier == "small" for k in (0, 2 * FREE_EVERY))
    assert s.plan(0).free and Plan.from_dict(s.plan(0).to_dict()).free and not Plan("small").free  # a steered free one
    assert s.plan(FREE_EVERY).tier == "serving"  # every other free chunk: the other tiers in turn
    for label in ("0 x 2^0", "2^3 x 2^2", "2^9 x 2^6"):
        s.observe({SHAPE: label, HEADS: "32 x none"})
    plan = s.plan(1)
    assert plan.bins[0] == (SHAPE, "2^8 x 2^6") and plan.tier == "serving"  # the empty bin, by the tier reaching it
    assert plan.focus.ctx_len == (256, 511) and plan.focus.query_len == (64, 127)
    assert plan.bins[1] == (HEADS, "32 x 2^8") and plan.focus.window == (256, 511)  # the window nearest the context
    assert plan == s.plan(1) and Plan.from_dict(plan.to_dict()) == plan and not plan.free  # and over a pipe
    assert plan.config_chunk(1) == 0 and Plan("small").config_chunk(5) == 5  # the free chunk's configuration
    # a group of FREE_EVERY chunks shares one configuration, and the groups take the rotation in order (not the group's
    # first chunk's number: that skipped two configurations of every three)
    assert [s.plan(k).config_chunk(k) for k in range(2 * FREE_EVERY + 1)] == [0, 0, 0, 1, 1, 1, 2]
    assert plan.size(1000) == FOCUS_EXAMPLES and Plan("small").size(1000) == 1000
    s.started(plan, 40)  # handed to a worker: the next chunk aims elsewhere meanwhile
    assert s.plan(2).bins[0] != (SHAPE, "2^8 x 2^6")
    s.finished(plan, 40)
    assert s.plan(2).bins[0] == (SHAPE, "2^8 x 2^6")
    # every bin covered a few times: free chunks
    for _ in range(5):
        for label in s.bins[SHAPE]:
            s.observe({SHAPE: label, HEADS: "32 x 2^8"})
            s.observe({SHAPE: label, HEADS: "32 x none"})
    assert s.plan(1).focus is None and s.empty() == {SHAPE: [], HEADS: []}


def test_near_misses_and_failures_pull_chunks_back():
    s = _steering()
    for label in s.bins[SHAPE]:
        for _ in range(10):
            s.observe({SHAPE: label, HEADS: "32 x none"}, ratio=0.1)
            s.observe({SHAPE: label, HEADS: "32 x 2^8"}, ratio=0.1)
    assert s.plan(1).focus is None  # covered, nothing close to its bound: free
    s.observe({SHAPE: "2^3 x 2^2", HEADS: "32 x none"}, ratio=0.95)  # a near miss
    assert s.plan(1).bins == ((SHAPE, "2^3 x 2^2"), (HEADS, "32 x none")) and s.plan(1).tier == "small"
    for _ in range(4 * 200):  # a near miss's pull fades as its bin fills
        s.observe({SHAPE: "2^3 x 2^2", HEADS: "32 x none"}, ratio=0.1)
    assert s.plan(1).focus is None
    # a failure doubles the need of its bin and its neighbours (a defect's region holds more)
    t = _steering()
    t.observe({SHAPE: "2^8 x 2^6", HEADS: "32 x none"}, signature=("kernel mismatch", "agreement"))
    t.observe({SHAPE: "0 x 2^0", HEADS: "32 x none"})
    assert t.score(SHAPE, "2^9 x 2^6") == 2 * t.score(SHAPE, "2^3 x 2^2")
    assert t.score(SHAPE, "2^8 x 2^6") == t.score(SHAPE, "0 x 2^0") * 2


def test_steering_is_off_in_the_gate_and_where_asked(tmp_path):
    target = WrongInOneBin()
    assert Steering.of(target, CampaignConfig(out=tmp_path), ("small",)) is not None
    for off in (dict(steer=False), dict(gate=True), dict(undeclared=True), dict(big_cache=True)):
        assert Steering.of(target, CampaignConfig(out=tmp_path, **off), ("small",)) is None


def _fuzz(target, out, steer: bool, budget: int, seed: int = 2):
    config = CampaignConfig(out=out, max_examples=budget, poisons=(Poison.ZEROS,), seed=seed, tiers=("serving",),
                            chunk_examples=4, steer=steer, database=InMemoryExampleDatabase(),
                            stop_at_first_failure=True, limits=Limits(max_num_heads=2), structural_shrink=0)
    return engine.fuzz_target(target, config)


def test_the_steered_campaign_finds_a_defect_in_one_mid_range_bin_the_fixed_split_misses(tmp_path, cpu_serving):
    """A kernel wrong only when the batch's longest context is 256-511 and its longest query 64 (the bin
    "2^8 x 2^6": the free serving draws leave it empty, as FA3's window bug sat in bins the serving tier's draws
    left nearly empty): the steered campaign aims a chunk at it once it is the emptiest; the fixed split, given as
    many examples, never draws it. Seeds and budgets fixed: deterministic."""
    target = WrongInOneBin()
    steered = _fuzz(target, tmp_path / "steered", True, 600)
    assert len(steered.failures) == 1, steered.coverage.to_dict()[SHAPE]
    (record,) = steered.failures.values()
    batch = Example.from_dict(record.example).batch
    assert 256 <= max(batch.ctx_lens) <= 511 and max(batch.query_lens) == 64
    fixed = _fuzz(target, tmp_path / "fixed", False, steered.first_failure_examples)
    assert fixed.examples == steered.first_failure_examples and not fixed.failures
    assert "2^8 x 2^6" not in fixed.coverage.to_dict()[SHAPE]
    # and the steered campaign reached more of the declared bins on the way
    assert len(steered.coverage.to_dict()[SHAPE]) > len(fixed.coverage.to_dict()[SHAPE])
    # summary.json's chunks: where each campaign's chunks went, every example counted in one
    kinds = steered.to_dict()["chunks"]
    assert set(kinds) == {"free", "focused"} and all(k["chunks"] > 0 and k["seconds"] > 0 for k in kinds.values())
    assert sum(k["examples"] for k in kinds.values()) == steered.examples
    fixed_kinds = fixed.to_dict()["chunks"]
    assert set(fixed_kinds) == {"free"} and fixed_kinds["free"]["examples"] == fixed.examples


class _GraceEndsAfterTheFirstPass(Quiet):
    """A listener that ends a campaign's shrink grace right after the structural-first pass of its first failure:
    Hypothesis's shrink gets not one example (what a serving-sized failure found late in a campaign gets)."""

    def __init__(self, stats):
        self.stats, self.campaign = stats, None

    def begin(self, target, example):
        if self.campaign.ledger.first_passes():  # the structural-first pass is done: no more time
            self.campaign.deadline = -1e9

    def end(self, target, outcome):
        self.stats.add(outcome, 0.0)


def test_a_serving_failure_is_at_most_two_sequences_when_its_grace_ends(tmp_path, cpu_serving, monkeypatch):
    """Shrinking at serving sizes finishes: a kernel wrong on a prefill chunk after >= 384 cached keys, found in a
    serving batch of several sequences; the grace ends before Hypothesis's shrink runs one example, and the
    reproducer is the structural-first pass's: one sequence, its context halved and snapped toward the trigger's
    edge. The reproducer says how long each shrink took."""
    monkeypatch.setattr(tiers, "SERVING_NUM_SEQS", 24)  # serving-sized: up to 24 decodes and 3 chunks
    target = WrongPastLongContext()
    config = CampaignConfig(out=tmp_path, max_examples=400, poisons=(Poison.ZEROS,), seed=0, tiers=("serving",),
                            steer=False, database=InMemoryExampleDatabase(), limits=Limits(max_num_heads=2))
    stats = TargetStats(target.name)
    listener = _GraceEndsAfterTheFirstPass(stats)
    campaign = listener.campaign = engine.Campaign(target, config, listener)
    campaign.deadline = float("inf")
    chunk = 0
    while not campaign.ledger.records() and chunk < 40:
        campaign.run_chunk(chunk, 10)
        chunk += 1
    (record,) = campaign.ledger.records()
    case = json.loads((Path(record.reproducer) / "case.json").read_text())
    first = case["details"]["structural_first"]
    batch = Example.from_dict(record.example).batch
    assert int(first["from"].split(" seqs")[0]) >= 3  # found in a batch of several sequences
    assert batch.num_seqs <= 2 and first["taken"] >= 1
    assert any(q >= 4 and c >= 384 for q, c in zip(batch.query_lens, batch.ctx_lens))
    assert case["details"]["shrink_stopped"] and "structural_shrink" not in case["details"]
    seconds = case["details"]["shrink_seconds"]
    assert set(seconds) == {"structural_first", "hypothesis", "structural"} and seconds["structural"] == 0
    assert record.shrink == seconds  # and summary.json (FailureRecord.to_dict) says it too
