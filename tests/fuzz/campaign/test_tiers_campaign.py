"""Size tiers in campaigns (kvfuzz.fuzz.campaign.chunks.campaign_tiers, engine.Campaign, `kvfuzz fuzz --tier`):
which tiers a target's chunks draw from, and a planted long-context defect that only the long tier finds and that
shrinks back down to the shortest context that shows it."""

import json

import pytest
from support import kvfuzz
from support.planted_targets import LongContextTruncated

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.chunks import TIER_PROBE_EXAMPLES, campaign_tiers, record_tier_time, tier_chunk_size
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.targets import get_target


def test_campaign_tiers_follow_the_config_and_the_declaration(tmp_path):
    cpu_op, writer = get_target("vllm.cpu_attention"), get_target("vllm.cpu_reshape_and_cache")
    cfg = lambda **kw: CampaignConfig(out=tmp_path, **kw)  # noqa: E731
    assert campaign_tiers(cpu_op, cfg()) == ("small",)  # the default
    assert campaign_tiers(cpu_op, cfg(tiers=("auto",))) == ("small",)  # auto: small on CPU
    assert campaign_tiers(cpu_op, cfg(tiers=("wide", "long"))) == ("long", "wide")  # in TIERS order
    assert campaign_tiers(cpu_op, cfg(big_cache=True)) == ("big-cache",)
    assert campaign_tiers(cpu_op, cfg(tiers=("long",), undeclared=True)) == ("small",)
    assert writer.size_tiers() == ("small",)  # CPU only: nothing declared beyond the default
    with pytest.raises(ValueError, match="vllm.cpu_reshape_and_cache declares the size tiers small, not long"):
        campaign_tiers(writer, cfg(tiers=("long",)))


def test_the_long_tier_finds_a_long_context_defect_the_small_tier_cannot(tmp_path):
    target = LongContextTruncated()
    small = fuzz_target(target, CampaignConfig(out=tmp_path / "small", max_examples=60, poisons=(Poison.ZEROS,),
                                               seed=1))
    assert small.examples == 60 and not small.failures
    long = fuzz_target(target, CampaignConfig(out=tmp_path / "long", max_examples=60, poisons=(Poison.ZEROS,),
                                              seed=1, tiers=("long",), stop_at_first_failure=True))
    assert len(long.failures) == 1
    (case,) = [p for p in (tmp_path / "long").iterdir() if p.name.startswith("planted.long_context_truncated-")]
    batch = json.loads((case / "case.json").read_text())["example"]["batch"]
    # shrunk to one decode sequence just past the 4096 positions the kernel reads
    assert batch["query_lens"] == [1] and batch["ctx_lens"][0] + 1 > target.MAX_KEYS
    assert batch["ctx_lens"][0] <= target.MAX_KEYS + max(target.capabilities.block_sizes)


def test_kvfuzz_fuzz_tier_option(tmp_path):
    r = kvfuzz("fuzz", "--target", "vllm.cpu_reshape_and_cache", "--tier", "long", "--max-examples", "1",
               "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "--tier" in r.stderr and "declares the size tiers small" in r.stderr
    assert "Traceback" not in r.stderr
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--tier", "huge", "--max-examples", "1",
               "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "--tier" in r.stderr and "Traceback" not in r.stderr
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--big-cache", "--tier", "long", "--max-examples", "1",
               "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "--big-cache is --tier big-cache" in r.stderr
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--tier", "wide", "--max-examples", "4", "--poison",
               "zeros", "--baseline", "kvfuzz-baseline.toml", "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "size tiers wide" in r.stdout
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["coverage"]["tier"] == {"wide": t["examples"]}


def test_a_large_tier_chunk_takes_a_small_chunks_time():
    small_only = ("small",)
    mix = ("small", "long", "wide")
    assert tier_chunk_size("small", mix, 1000, {}, None) is None  # chunk_size decides the small tier
    assert tier_chunk_size("long", ("long", "wide"), 1000, {}, None) is None  # no small tier: nothing to balance
    assert tier_chunk_size("small", small_only, 1000, {}, None) is None
    # before the small tier and the long tier have each finished a chunk: a probe
    assert tier_chunk_size("long", mix, 1000, {}, None) == TIER_PROBE_EXAMPLES
    assert tier_chunk_size("long", mix, 1000, {"small": [2, 2000, 40.0]}, None) == TIER_PROBE_EXAMPLES
    assert tier_chunk_size("long", mix, 5, {}, None) == 5  # never more than a chunk
    # small chunks took 20 s on average, a long example 0.5 s: 40 long examples take a small chunk's time
    times = {"small": [2, 2000, 40.0], "long": [1, 8, 4.0], "wide": [1, 8, 0.08]}
    assert tier_chunk_size("long", mix, 1000, times, None) == 40
    assert tier_chunk_size("long", mix, 1000, times, 5.0) == 10  # 10 fit in the 5 s left
    assert tier_chunk_size("long", mix, 1000, times, 0.1) == 1  # at least one
    assert tier_chunk_size("wide", mix, 1000, times, None) == 1000  # a fast tier: capped at a chunk
    record_tier_time(times, "long", 0, 30.0)  # a chunk whose worker died before counting: left out
    assert times["long"] == [1, 8, 4.0]
    record_tier_time(times, "long", 32, 12.0)
    assert times["long"] == [2, 40, 16.0] and tier_chunk_size("long", mix, 1000, times, None) == 50


def test_a_mixed_campaign_probes_a_large_tier_before_sizing_it(tmp_path):
    # one worker, chunks of 25, the fixed split (--steer off): small 0, long 1 (a probe: nothing measured yet),
    # small 2 (the rest)
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--steer", "off", "--tier", "small", "--tier", "long",
               "--max-examples", "40",
               "--chunk-examples", "25", "--workers", "1", "--poison", "zeros", "--baseline", "kvfuzz-baseline.toml",
               "--out", str(tmp_path))
    assert r.returncode in (0, 1), r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "summary.json").read_text())["targets"]
    assert t["examples"] == 40 and t["coverage"]["tier"] == {"small": 40 - TIER_PROBE_EXAMPLES,
                                                             "long": TIER_PROBE_EXAMPLES}


def test_the_serving_tier_finds_a_window_straddle_defect_the_small_tier_cannot(tmp_path, monkeypatch):
    """A kernel wrong only on a prefill chunk whose context runs past a window of >= 256 keys at head size >= 192
    (shaped like vLLM 0.33.0's FA3 failure, issue 38): a serving campaign finds it and shrinks it to one such
    chunk; a small-tier campaign of the same budget draws no context that long."""
    from support.planted_window import WindowStraddledAtLargeHeads

    from kvfuzz.strategies import tiers

    # the serving tier's draws at CPU sizes: contexts to 512 tokens, a 48-token budget, 3 sequences
    monkeypatch.setattr(tiers, "SERVING_CTX_LEN", 512)
    monkeypatch.setattr(tiers, "SERVING_TOKENS", 48)
    monkeypatch.setattr(tiers, "SERVING_NUM_SEQS", 3)
    monkeypatch.setattr(tiers, "SERVING_NUM_HEADS", 4)
    target = WindowStraddledAtLargeHeads()
    assert target.size_tiers() == ("small", "serving")
    cfg = dict(max_examples=100, poisons=(Poison.ZEROS,), seed=1)
    serving = fuzz_target(target, CampaignConfig(out=tmp_path / "serving", tiers=("serving",),
                                                 stop_at_first_failure=True, **cfg))
    assert len(serving.failures) == 1 and serving.first_failure_examples <= 100
    (case,) = [p for p in (tmp_path / "serving").iterdir() if p.name.startswith(target.name + "-")]
    batch = json.loads((case / "case.json").read_text())["example"]["batch"]
    # shrunk to one 2-token chunk just past the smallest window the defect needs
    assert batch["head_size"] == 192 and batch["sliding_window"] == 256 and batch["query_lens"] == [2]
    assert 256 <= batch["ctx_lens"][0] <= 256 + 32
    # the small tier, given the examples the serving tier needed: no context reaches a 256-key window
    budget = dict(cfg, max_examples=serving.first_failure_examples)
    small = fuzz_target(target, CampaignConfig(out=tmp_path / "small", **budget))
    assert small.examples == serving.first_failure_examples and not small.failures
