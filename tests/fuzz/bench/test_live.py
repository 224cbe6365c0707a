"""The live upstream bugs (kvfuzz.fuzz.bench.bugs.live, docs/bugs.md "Live upstream bugs"): open upstream in the
pinned versions, so the unpatched kernel must still show each one's smallest trigger, the shipped baseline must know
what `make fuzz` would hit, and `kvfuzz bench bugs --live` must say which it cannot run here and why."""

import pytest
from support import ROOT, available, kvfuzz

from kvfuzz.contracts.checks.failures import NonFiniteOutput
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.bugs.live import LIVE, bench_live
from kvfuzz.fuzz.campaign.store.baseline import classify, load_baseline
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets import BUILTIN, get_target


def test_every_live_bug_names_a_builtin_target_that_accepts_its_trigger_and_is_in_the_docs():
    live = (ROOT / "docs" / "bugs.md").read_text().split("## Live upstream bugs")[1]
    for name, bug in LIVE.items():
        assert name == f"live.{bug.slug}" and bug.target in BUILTIN
        assert get_target(bug.target).capabilities.accepts(bug.smallest()), name
        assert bug.slug.replace("vllm-", "vllm#") in live and bug.fixed_in is None  # pinned: still open


@pytest.mark.parametrize("slug, known", [("vllm-53628", "vllm-53628-chunked"), ("vllm-57017", "vllm-57017-mla")])
def test_the_unpatched_kernel_still_shows_the_smallest_trigger_and_the_baseline_knows_it(slug, known):
    """Pin, do not drop: when an upgrade fixes one, this fails, and the bug becomes a re-injection."""
    bug = LIVE[f"live.{slug}"]
    available(bug.target)
    target = get_target(bug.target)
    example = Example(bug.smallest(), Poison.NAN)
    with pytest.raises(NonFiniteOutput) as info:
        properties.check(target, example)
    assert classify(load_baseline(ROOT / "kvfuzz-baseline.toml"), target, example, info.value) == known


def test_a_bug_this_machine_cannot_show_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    doc = bench_live(["live.vllm-56862"], seeds=1, duration=1)
    (e,) = doc["bugs"]
    assert doc["skipped"] == ["live.vllm-56862"] and e["skipped"].startswith("not shown on a CPU")
    assert e["skipped"] and e["summary"] is None and e["runs"] == []


def test_an_unknown_live_bug_exits_2_naming_the_option():
    r = kvfuzz("bench", "bugs", "--live", "--bug", "vllm-1")
    assert r.returncode == 2 and "--bug" in r.stderr and "live.vllm-53628" in r.stderr
    with pytest.raises(KeyError, match="unknown live bug"):
        bench_live(["live.vllm-1"])

