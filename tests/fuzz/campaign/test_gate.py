"""kvfuzz check, the pre-merge gate (kvfuzz.fuzz.campaign.gate): green on the real targets, red on a planted
kernel regression and on a corpus case that fails again; JUnit XML either way."""

import shutil
import xml.etree.ElementTree as ET

import pytest
from support import SUPPORT, kvfuzz

pytestmark = pytest.mark.kernel


def test_green_on_the_real_targets_with_the_committed_corpus(tmp_path):
    junit = tmp_path / "junit.xml"
    r = kvfuzz("check", "--junit-xml", str(junit), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    root = ET.parse(junit).getroot()
    cases = {(tc.get("classname"), tc.get("name")) for tc in root.iter("testcase")}
    assert ("kvfuzz.property", "vllm.chunked_prefill_paged_decode") in cases
    assert any(c == "kvfuzz.regression" for c, _ in cases)
    assert not list(root.iter("failure"))


@pytest.mark.cli_text
def test_red_on_a_planted_kernel_regression(tmp_path):
    junit = tmp_path / "junit.xml"
    r = kvfuzz("check", "--target", f"{SUPPORT / 'planted_targets.py'}:DecodeMissesOwnToken", "--corpus",
               str(tmp_path / "empty-corpus-does-not-exist-is-an-error"), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "no such directory" in r.stderr
    (tmp_path / "corpus").mkdir()
    r = kvfuzz("check", "--target", f"{SUPPORT / 'planted_targets.py'}:DecodeMissesOwnToken", "--corpus",
               str(tmp_path / "corpus"), "--junit-xml", str(junit), "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "kernel mismatch" in r.stdout
    (failure,) = list(ET.parse(junit).getroot().iter("failure"))
    assert "kernel mismatch" in failure.get("message")


def test_red_on_a_corpus_case_that_fails_again(tmp_path):
    out = tmp_path / "fuzz"
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--caller-fault", "decode-ctx-only", "--max-examples",
               "10", "--poison", "stale", "--out", str(out))
    assert r.returncode == 1
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (case,) = [p for p in out.iterdir() if "caller-violation" in p.name]
    shutil.copytree(case, corpus / case.name)
    junit = tmp_path / "junit.xml"
    r = kvfuzz("check", "--target", "vllm.cpu_attention", "--corpus", str(corpus), "--junit-xml", str(junit),
               "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "1 failed" in r.stdout
    failures = [tc.get("name") for tc in ET.parse(junit).getroot().iter("testcase") if tc.find("failure") is not None]
    assert failures == [case.name]


def test_the_gate_draws_only_a_targets_gate_value_ranges(tmp_path):
    """sglang.decode_attention_fwd's gate leaves out the wide-logit ranges of its documented Finding 9;
    `kvfuzz fuzz` (no gate) still draws them."""
    from hypothesis import find, settings
    from hypothesis.errors import NoSuchExample

    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import strategy_for
    from kvfuzz.fuzz.targets import get_target

    t = get_target("sglang.decode_attention_fwd")
    wide = lambda e: e.batch.value_range in ("large", "dominant")  # noqa: E731
    assert set(t.gate_value_ranges) == {"normal", "equal"}
    assert wide(find(strategy_for(t, CampaignConfig(out=tmp_path)), wide, settings=settings(max_examples=500)))
    with pytest.raises(NoSuchExample):
        find(strategy_for(t, CampaignConfig(out=tmp_path, gate=True)), wide, settings=settings(max_examples=300))


@pytest.mark.parametrize("name, state", [("vllm.chunked_prefill_paged_decode", "freed_window_blocks"),
                                         ("vllm.triton_mla_decode", "cuda_graph_padding")])
def test_the_gate_leaves_a_live_bugs_state_undrawn(tmp_path, name, state):
    """Live vllm#53628 and vllm#57017 (docs/bugs.md) need the freed-window state and CUDA-graph pads: the gate
    draws neither on those targets (it stays green on known live bugs), `kvfuzz fuzz` draws both."""
    from hypothesis import find, settings
    from hypothesis.errors import NoSuchExample

    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import strategy_for
    from kvfuzz.fuzz.targets import get_target

    t = get_target(name)
    has = lambda e: bool(e.batch.freed_window_blocks or e.batch.num_pad_seqs)  # noqa: E731
    assert t.gate_states_off == (state,)
    assert has(find(strategy_for(t, CampaignConfig(out=tmp_path)), has, settings=settings(max_examples=500)))
    with pytest.raises(NoSuchExample):
        find(strategy_for(t, CampaignConfig(out=tmp_path, gate=True)), has, settings=settings(max_examples=200))
