"""Size tiers in campaigns (kvfuzz.fuzz.campaign.chunks.campaign_tiers, engine.Campaign, `kvfuzz fuzz --tier`):
which tiers a target's chunks draw from, and a planted long-context defect that only the long tier finds and that
shrinks back down to the shortest context that shows it."""

import json

import pytest

from kvfuzz.fuzz.campaign.chunks import campaign_tiers
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.targets import get_target
from kvfuzz.contracts.model.poison import Poison
from support import kvfuzz
from support.planted_targets import LongContextTruncated


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
