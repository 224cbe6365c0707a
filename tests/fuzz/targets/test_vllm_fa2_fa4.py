"""FlashAttention 2 and 4 as vLLM's FLASH_ATTN backend calls them (``vllm.flash_attn_varlen_fa2``,
``vllm.flash_attn_varlen_fa4``): on a CPU, through vLLM's real ``flash_attn_interface.py`` into torch stand-ins for
``_vllm_fa2_C::varlen_fwd`` and FA4's ``cute.interface._flash_attn_fwd`` (tests/support/hopper_standins.py), which
check what the kernels check and compute paged attention from exactly the arguments they receive. The calls are
the backend's (ALiBi on FA2, fp32 sinks on FA4, no scheduler metadata, FA2's split counts), what each rejects is
rejected, a planted FA2 defect (ALiBi dropped on its decode path) is found by a campaign and shrunk, and Finding 16
(FA2 reads the freed window blocks: 0 x NaN) is known to the shipped baseline while nothing else on FA2 is."""

import sys
import tempfile
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.database import InMemoryExampleDatabase
from support import ROOT, batch_of, hopper_standins
from support.hopper_standins import StandInFA2, StandInFA4
from support.planted_fa import SinksDroppedOnDecodeFA4

from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import TargetStats
from kvfuzz.fuzz.campaign.store.baseline import classify, load_baseline
from kvfuzz.fuzz.campaign.store.cases import load_case
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
    assert fa2.kv_cache_dtypes == ("auto",)  # flash_attn_supports_kv_cache_dtype: no fp8 on FA2
    # FA4's SM90 fp8-KV-dequant path: e4m3 at head size 512, block size 64 (_get_sm90_fa4_fp8_kv_block_size)
    assert fa4.kv_cache_dtypes == ("auto", "fp8", "fp8_e4m3")
    assert fa4.head_sizes_for("fp8") == (512,) and fa4.block_sizes_for("fp8_e4m3") == (64,)
    assert fa4.block_sizes_for("auto") == fa4.block_sizes
    assert fa2.cuda_graph_padding == fa4.cuda_graph_padding == "vllm"


@no_cuda
@pytest.mark.parametrize("target", [StandInFA2, StandInFA4])
def test_drawn_examples_agree_through_vllms_wrapper(fa, target):
    t = target()

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(examples(t.capabilities, LIMITS))
    def prop(example):
        check_example(t, example)

    prop()
    calls = hopper_standins.SEEN["fa2" if target is StandInFA2 else "fa4"]
    assert calls and hopper_standins.SEEN["fwd"] == [] and hopper_standins.SEEN["sched"] == {}
    if target is StandInFA4:  # fp8 caches drawn (head size 512, block size 64) and run through fp8_kv_dequant
        assert any(c["fp8_kv_dequant"] for c in calls)


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


def fp8_batch(lens=((1, 70), (5, 60), (1, 0)), **kw):
    kw = dict(dict(head_size=512, block_size=64, kv_cache_dtype="fp8_e4m3", dtype="bfloat16", k_scale=0.5,
                   v_scale=2.0), **kw)
    return batch(lens, **kw)


def test_fa4s_fp8_path_declares_its_fp16_arithmetic():
    """SM90's fp8-KV kernel computes in fp16 (flash_fwd_sm90.py fp8_kv_dequant): the envelope of its calls takes
    fp16's P rounding (tests/contracts/test_fa4_fp8_numerics.py); 16-bit caches and FA3 keep their own."""
    fa4 = StandInFA4()
    assert fa4.numerics_for(fp8_batch()).compute_dtype == "float16"
    assert fa4.numerics_for(fp8_batch()).tanh_approx  # the family's softcap knob kept
    assert fa4.numerics_for(batch(((1, 70),), head_size=512, block_size=64)).compute_dtype is None


@no_cuda
def test_fa4s_fp16_arithmetic_passes_only_with_its_declaration(fa, monkeypatch):
    """The stand-in computes FA4's fp8-KV path in fp16 as the kernel does (P and the query rounded to fp16). The
    H200 example whose probability (~1e-24) fp16 flushes passes through the target; with the FlashAttention family's
    envelope instead of the fp16 declaration it is the false alarm the H200 run reported (0 against -3.2e-24)."""
    b = batch(((2, 0),), num_heads=6, num_kv_heads=2, head_size=512, block_size=64, dtype="bfloat16",
              kv_cache_dtype="fp8_e4m3", k_scale=0.5, value_range="large", seed=16777217)
    check_example(StandInFA4(), Example(b, Poison.STALE))
    monkeypatch.setattr(StandInFA4, "numerics_for", lambda self, batch: self.numerics)
    with pytest.raises(KernelMismatch):
        check_example(StandInFA4(), Example(b, Poison.STALE))


@no_cuda
def test_fa4_gets_an_fp8_cache_as_vllms_backend_hands_it_over(fa):
    """FlashAttentionImpl.forward on SM90 with kv_cache_dtype fp8: the caches viewed as e4m3, k/v descales
    ``layer._k_scale/_v_scale.expand((num_seqs, num_kv_heads))`` fp32, no q_descale (the query stays bf16:
    uses_sm90_fa4_fp8_kv_dequant); the wrapper then calls FA4 with fp8_kv_dequant."""
    b = fp8_batch()
    assert StandInFA4().capabilities.accepts(b)
    check_example(StandInFA4(), Example(b, Poison.NAN))
    call = hopper_standins.SEEN["fa4"][-1]
    assert call["fp8_kv_dequant"] is True and call["q"].dtype == torch.bfloat16 and call["q_descale"] is None
    assert call["k"].dtype == call["v"].dtype == torch.float8_e4m3fn and call["k"].shape[1:] == (64, 2, 512)
    for name, value in (("k_descale", 0.5), ("v_descale", 2.0)):
        t = call[name]
        assert t.dtype == torch.float32 and tuple(t.shape) == (3, 2) and bool((t == value).all()), name
    for kvd in ("fp8", "fp8_e4m3"):  # and outside it: the stand-in asserts FA4's block size
        assert not StandInFA4().capabilities.accepts(fp8_batch(kv_cache_dtype=kvd, block_size=32))
    with pytest.raises(KernelCrash, match="page_size"):
        check_example(StandInFA4(), Example(fp8_batch(block_size=32), Poison.NAN))


def fa4_descale_swap(**kw):
    """FA4 that applies ``k_descale`` to V too (a defect in the descale plumbing)."""
    return hopper_standins.fa4_flash_attn_fwd(**dict(kw, v_descale=kw["k_descale"]))


def fa4_no_v_descale(**kw):
    """FA4 that ignores ``v_descale`` (an fp8 V read as if its scale were 1)."""
    v = kw["v_descale"]
    return hopper_standins.fa4_flash_attn_fwd(**dict(kw, v_descale=None if v is None else torch.ones_like(v)))


@no_cuda
@pytest.mark.parametrize("planted", [fa4_descale_swap, fa4_no_v_descale])
def test_a_planted_fa4_descale_defect_is_caught(fa, planted):
    import vllm.vllm_flash_attn.cute.interface as cute

    def wrapped(q, k, v, **kw):
        return planted(q=q, k=k, v=v, **kw)

    cute._flash_attn_fwd = wrapped
    with pytest.raises(KernelMismatch):
        check_example(StandInFA4(), Example(fp8_batch(), Poison.NAN))
    check_example(StandInFA4(), Example(fp8_batch(k_scale=1.0, v_scale=1.0), Poison.NAN))  # unit scales: no trace


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


#: Finding 16's reproducer (an H200 campaign's shrunk case) and the shipped baseline that holds it.
FINDING_16 = ROOT / "docs" / "findings" / "16-vllm-fa2-freed-window-blocks-nan"
SHIPPED = ROOT / "kvfuzz-baseline.toml"
#: The keys one tile of the planted FA2 loads (FA2's split-KV kernel tiles 64 to 256 keys by head size).
TILE = 64


def fa2_reads_freed_window_blocks(*args, tail=False):
    """FA2 as Finding 16 reads it: the stand-in's output plus 0 x V of every key the window masks in the tile that
    holds the window's first key (a freed block's NaN there makes the row NaN, as on the H200). ``tail``: a
    different planted fault on top, 0 x V of the unwritten slots past ``seq_len`` in the sequence's last block."""
    out = hopper_standins.fa2_varlen_fwd(*args)[0]
    v, cu_seqlens_q, seqused_k, block_table, max_seqlen_k, left = (args[2], args[4], args[6], args[8], args[11],
                                                                    args[16])
    left = -1 if left >= max_seqlen_k else left  # mha_varlen_fwd's rewrite: a window past the keys is none
    g, bs = out.shape[1] // v.shape[2], v.shape[1]
    qsl = cu_seqlens_q.tolist()
    for i, n in enumerate(seqused_k.tolist()):
        rows = hopper_standins._rows(v, block_table[i], -(-n // bs) * bs)  # [whole blocks, Hkv, D]
        for r in range(qsl[i], qsl[i + 1]):
            pos = n - (qsl[i + 1] - qsl[i]) + (r - qsl[i])
            first = max(0, pos - left) if left >= 0 else 0
            masked = list(range(first // TILE * TILE, first)) + (list(range(n, len(rows))) if tail else [])
            if masked:
                zero_v = (0 * rows[masked].double()).sum(0).repeat_interleave(g, dim=0)
                out[r] = (out[r].double() + zero_v).to(out.dtype)
    return [out, None]


class PlantedFA2(StandInFA2):
    """The FA2 stand-in under FA2's own name, so that the shipped baseline's entries for it apply."""

    name = "vllm.flash_attn_varlen_fa2"


def non_finite(target, example):
    with pytest.raises(NonFiniteOutput) as info:
        check_example(target, example)
    return info.value


@no_cuda
def test_the_shipped_baseline_knows_finding_16_on_fa2(fa, monkeypatch):
    """Finding 16's shrunk case (one decode after 16 cached tokens, window 1, the block before the window freed to
    the null block, NaN there): FA2 as it should be passes it; FA2 reading the freed block gives the H200's 32 NaN
    elements, which the shipped ``finding-16`` takes (zeros in the null block make it pass), with NaN or inf."""
    case = load_case(FINDING_16)
    example, target = case.example, PlantedFA2()
    assert case.target == target.name and example.batch.freed_window_blocks and example.poison == Poison.NAN
    check_example(target, example)
    monkeypatch.setattr(torch.ops._vllm_fa2_C, "varlen_fwd", fa2_reads_freed_window_blocks, raising=False)
    f = non_finite(target, example)
    assert f.details["oracle"]["bad_elements"] == case.raw["details"]["oracle"]["bad_elements"] == 32
    assert f.details["path"] == case.raw["details"]["path"]
    shipped = load_baseline(SHIPPED)
    assert classify(shipped, target, example, f) == "finding-16" == f.known
    inf = attrs.evolve(example, poison=Poison.INF)
    assert classify(shipped, target, inf, non_finite(target, inf)) == "finding-16"
    # the same NaN on another FlashAttention target is not FA2's known bug: the entry is keyed by target
    other = type("OnFA3Name", (PlantedFA2,), {"name": "vllm.flash_attn_varlen"})()
    g = non_finite(other, example)
    assert classify(shipped, other, example, g) is None and g.known is None


@no_cuda
def test_the_shipped_baseline_keeps_every_other_fa2_failure_new(fa, monkeypatch):
    """finding-16 takes only the freed window blocks' NaN: a NaN that also comes from the unwritten slots past
    seq_len (on Finding 16's case, or on a batch with no window and no freed block), or a wrong finite output
    (ALiBi dropped on decode), stays new, so an FA2 ``--baseline`` campaign still exits 1 on it."""
    shipped, target = load_baseline(SHIPPED), PlantedFA2()
    example = load_case(FINDING_16).example
    monkeypatch.setattr(torch.ops._vllm_fa2_C, "varlen_fwd",
                        lambda *a: fa2_reads_freed_window_blocks(*a, tail=True), raising=False)
    f = non_finite(target, example)
    assert classify(shipped, target, example, f) is None and f.known is None
    assert "finding-16: the example still fails with zeros in its freed slots" in f.message
    plain = Example(batch(((1, 20),), num_heads=2, num_kv_heads=1, head_size=32, block_size=16), Poison.NAN)
    assert plain.batch.sliding_window is None and not plain.batch.freed_window_blocks
    g = non_finite(target, plain)
    assert classify(shipped, target, plain, g) is None and g.known is None
    monkeypatch.setattr(torch.ops._vllm_fa2_C, "varlen_fwd", fa2_alibi_dropped_on_decode, raising=False)
    alibi = Example(batch(((1, 5),), alibi=True), Poison.NAN)
    with pytest.raises(KernelMismatch) as info:
        check_example(target, alibi)
    assert classify(shipped, target, alibi, info.value) is None and info.value.known is None


def fa4_reads_the_last_page(*args, spare=False, **kw):
    """FA4 as Finding 17 reads it: the stand-in's output plus 0 x V of the slots past ``seq_len`` in the sequence's
    last page when pages are 128 tokens (a NaN there makes the row NaN, as on the H200). ``spare``: a different
    planted fault on top, 0 x V of every block no sequence's table names."""
    out = hopper_standins.fa4_flash_attn_fwd(*args, **kw)[0]
    v, cu_seqlens_q, seqused_k, page_table = args[2], kw["cu_seqlens_q"], kw["seqused_k"], kw["page_table"]
    g, bs = out.shape[1] // v.shape[2], v.shape[1]
    qsl = cu_seqlens_q.tolist()
    owned = set(page_table.flatten().tolist())
    for i, n in enumerate(seqused_k.tolist()):
        rows = hopper_standins._rows(v, page_table[i], -(-n // bs) * bs)  # [whole pages, Hkv, D]
        read = [rows[n:]] if bs == 128 else []
        if spare:
            read += [v[b] for b in range(v.shape[0]) if b not in owned]
        if read:
            zero_v = (0 * torch.cat(read).double()).sum(0).repeat_interleave(g, dim=0)
            out[qsl[i]:qsl[i + 1]] = (out[qsl[i]:qsl[i + 1]].double() + zero_v).to(out.dtype)
    return out, None, None, None


class PlantedFA4(StandInFA4):
    """The FA4 stand-in under FA4's own name, so that the shipped baseline's entries for it apply."""

    name = "vllm.flash_attn_varlen_fa4"


def plant_fa4(monkeypatch, kernel):
    """Put ``kernel`` where vLLM's wrapper imports FA4 from (the stand-in module ``install_fa2_fa4`` registered)."""
    monkeypatch.setattr(sys.modules["vllm.vllm_flash_attn.cute.interface"], "_flash_attn_fwd", kernel)


@no_cuda
def test_the_shipped_baseline_knows_finding_17_on_fa4(fa, monkeypatch):
    """Finding 17's shrunk case (one decode, seq_len 1, head size 64, a page of 128, NaN in the slots past seq_len):
    FA4 as it should be passes it; FA4 reading the last page past seq_len turns it NaN, which the shipped
    ``finding-17`` takes (zeros in the tail make it pass), with NaN or inf; pages of 64 are right."""
    example = Example(batch(((1, 0),), num_heads=1, num_kv_heads=1, head_size=64, block_size=128), Poison.NAN)
    target, shipped = PlantedFA4(), load_baseline(SHIPPED)
    check_example(target, example)
    plant_fa4(monkeypatch, fa4_reads_the_last_page)
    f = non_finite(target, example)
    assert classify(shipped, target, example, f) == "finding-17" == f.known
    inf = attrs.evolve(example, poison=Poison.INF)
    assert classify(shipped, target, inf, non_finite(target, inf)) == "finding-17"
    longer = Example(batch(((1, 99), (3, 30)), block_size=128), Poison.NAN)  # 100 and 33 tokens, both tails read
    assert classify(shipped, target, longer, non_finite(target, longer)) == "finding-17"
    check_example(target, Example(batch(((1, 0),), head_size=64, block_size=64), Poison.NAN))
    other = type("OnFA2Name", (PlantedFA4,), {"name": "vllm.flash_attn_varlen_fa2"})()
    g = non_finite(other, example)
    assert classify(shipped, other, example, g) is None and g.known is None


@no_cuda
def test_the_shipped_baseline_keeps_every_other_fa4_failure_new(fa, monkeypatch):
    """finding-17 takes only the NaN of the last page's tail: a NaN that also comes from blocks no sequence owns, or
    a wrong finite output (sinks dropped on decode), stays new, so an FA4 ``--baseline`` campaign still exits 1."""
    shipped, target = load_baseline(SHIPPED), PlantedFA4()
    example = Example(batch(((1, 0),), num_heads=1, num_kv_heads=1, head_size=64, block_size=128, spare=1),
                      Poison.NAN)
    plant_fa4(monkeypatch, lambda *a, **k: fa4_reads_the_last_page(*a, spare=True, **k))
    f = non_finite(target, example)
    assert classify(shipped, target, example, f) is None and f.known is None
    assert "finding-17: the example still fails with zeros in its tail slots" in f.message

    class Planted(SinksDroppedOnDecodeFA4, PlantedFA4):
        name = PlantedFA4.name

    plant_fa4(monkeypatch, hopper_standins.fa4_flash_attn_fwd)
    sinks = Example(batch(((1, 30), (1, 7)), sinks=True), Poison.NAN)
    with pytest.raises(KernelMismatch) as info:
        check_example(Planted(), sinks)
    assert classify(shipped, Planted(), sinks, info.value) is None and info.value.known is None
