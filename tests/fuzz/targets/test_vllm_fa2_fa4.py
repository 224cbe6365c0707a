"""FlashAttention 2 and 4 as vLLM's FLASH_ATTN backend calls them (``vllm.flash_attn_varlen_fa2``,
``vllm.flash_attn_varlen_fa4``): on a CPU, through vLLM's real ``flash_attn_interface.py`` into torch stand-ins for
``_vllm_fa2_C::varlen_fwd`` and FA4's ``cute.interface._flash_attn_fwd`` (tests/support/hopper_standins.py), which
check what the kernels check and compute paged attention from exactly the arguments they receive. The calls are
the backend's (ALiBi on FA2, fp32 sinks on FA4, no scheduler metadata, FA2's split counts), what each rejects is
rejected, and a planted FA2 defect (ALiBi dropped on its decode path) is found by a campaign and shrunk."""

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.database import InMemoryExampleDatabase
from support import batch_of, hopper_standins
from support.hopper_standins import StandInFA2, StandInFA4
from support.planted_fa import SinksDroppedOnDecodeFA4

from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import TargetStats
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets.registry import get_target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-ins replace CUDA ops")
LIMITS = Limits(max_num_seqs=3, max_ctx_len=48, max_query_len=8, max_num_heads=8)


@pytest.fixture
def fa(monkeypatch):
    return hopper_standins.install_fa2_fa4(monkeypatch)


def batch(lens=((1, 30), (7, 12), (1, 0)), **kw):
    kw = dict(dict(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", seed=0), **kw)
    return batch_of(list(lens), **kw)


def test_the_declarations_are_read_off_the_kernels():
    fa2 = get_target("vllm.flash_attn_varlen_fa2").capabilities
    fa4 = get_target("vllm.flash_attn_varlen_fa4").capabilities
    assert "alibi" in fa2.features and "sinks" not in fa2.features and max(fa2.head_sizes) == 256
    assert all(d % 8 == 0 for d in fa2.head_sizes) and all(b % 16 == 0 for b in fa2.block_sizes)
    assert "sinks" in fa4.features and "alibi" not in fa4.features and 512 in fa4.head_sizes
    assert 320 not in fa4.head_sizes  # Finding 18: FA4 does not compile it on SM90
    assert fa2.kv_cache_dtypes == fa4.kv_cache_dtypes == ("auto",)
    assert fa2.cuda_graph_padding == fa4.cuda_graph_padding == "vllm"


@no_cuda
@pytest.mark.parametrize("target", [StandInFA2, StandInFA4])
def test_drawn_examples_agree_through_vllms_wrapper(fa, target):
    t = target()

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(examples(t.capabilities, LIMITS))
    def prop(example):
        check_example(t, example)

    prop()
    calls = hopper_standins.SEEN["fa2" if target is StandInFA2 else "fa4"]
    assert calls and hopper_standins.SEEN["fwd"] == [] and hopper_standins.SEEN["sched"] == {}


@no_cuda
def test_fa2_gets_the_backends_call_with_alibi(fa):
    b = batch(alibi=True, sliding_window=9, softcap=30.0, seed=3)
    check_example(StandInFA2(), Example(b, Poison.NAN))
    call = hopper_standins.SEEN["fa2"][-1]
    assert call["alibi_slopes"].dtype == torch.float32 and call["alibi_slopes"].shape == (4,)
    assert call["num_splits"] == 1 and call["window_size_left"] == 8  # seed 3: VLLM_BATCH_INVARIANT's 1
    assert StandInFA2().path(batch(((1, 30), (1, 5)))) == "fa2,splits=0,ngroups_swapped"
    assert StandInFA2().path(batch(((1, 30), (1, 5)), alibi=True)) == "fa2,splits=0,varlen"


@no_cuda
def test_fa4_gets_fp32_sinks_and_its_window_and_no_descales(fa):
    b = batch(sinks=True, sliding_window=5, head_size=320, dtype="bfloat16")
    check_example(StandInFA4(), Example(b, Poison.NAN))
    call = hopper_standins.SEEN["fa4"][-1]
    assert call["learnable_sink"].dtype == torch.float32 and (call["window_size_left"], call["window_size_right"]) \
        == (4, 0)
    assert call["q_descale"] is None and call["k_descale"] is None and call["page_table"].dtype == torch.int32


@no_cuda
def test_what_each_rejects(fa):
    with pytest.raises(KernelCrash, match="s_aux"):  # FA2 has no sinks: its wrapper raises, a clear error
        check_example(StandInFA2(), Example(batch(sinks=True), Poison.NAN))
    with pytest.raises(ValueError, match="ALiBi"):  # FA4 has none: vLLM runs FA2 for an ALiBi model
        StandInFA4().build_call(batch(alibi=True), None, None)
    with pytest.raises(KernelCrash, match="divisible by 16"):  # outside FA2's declaration: its check fires
        check_example(StandInFA2(), Example(batch(block_size=8), Poison.NAN))


def fa2_alibi_dropped_on_decode(*args):
    """FA2 with a planted defect: ALiBi left out when the call's longest query is one token."""
    args = list(args)
    if args[10] == 1:  # max_seqlen_q
        args[9] = None  # alibi_slopes
    return hopper_standins.fa2_varlen_fwd(*args)


@no_cuda
def test_a_campaign_finds_and_shrinks_a_planted_fa2_defect(fa, monkeypatch):
    monkeypatch.setattr(torch.ops._vllm_fa2_C, "varlen_fwd", fa2_alibi_dropped_on_decode, raising=False)
    t = StandInFA2()
    with pytest.raises(KernelMismatch):
        check_example(t, Example(batch(((1, 5),), alibi=True), Poison.NAN))
    check_example(t, Example(batch(((3, 5),), alibi=True), Poison.NAN))  # a prefill keeps its ALiBi
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=600, duration=120, seed=1,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True, pin_configs=False,
                            limits=LIMITS, structural_shrink=60.0)
    stats = TargetStats(t.name)
    campaign = engine.Campaign(t, config, engine._Counting(stats, 0.0, lambda s: None))
    chunk = 0
    while not campaign.ledger.records() and chunk < 40:
        campaign.run_chunk(chunk, 25)
        chunk += 1
    record = campaign.ledger.records()[-1]
    b = Example.from_dict(record.example).batch
    assert record.kind == "kernel mismatch" and b.alibi and b.query_lens == (1,)
    assert b.num_heads <= 2 and b.ctx_lens[0] <= 2  # one decode, one or two heads, a key or two before it


@no_cuda
def test_the_planted_fa4_defect_the_gpu_run_hunts_is_caught(fa):
    """benchmarks/gpu_fa.sh planted SinksDroppedOnDecodeFA4 on an H200 asks a campaign to find this class; here over
    FA4's stand-in: a decode with sinks fails, a prefill (which keeps its ``s_aux``) passes."""

    class Planted(SinksDroppedOnDecodeFA4, StandInFA4):
        name = "test.fa4_sinks_dropped_on_decode_standin"

    with pytest.raises(KernelMismatch):
        check_example(Planted(), Example(batch(((1, 30), (1, 7)), sinks=True), Poison.NAN))
    check_example(Planted(), Example(batch(((3, 30), (1, 7)), sinks=True), Poison.NAN))
    assert hopper_standins.SEEN["fa4"][-1]["learnable_sink"] is not None
