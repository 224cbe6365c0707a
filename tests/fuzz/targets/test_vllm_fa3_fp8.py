"""FlashAttention 3 with an fp8 KV cache, as vLLM 0.33.0 runs it: the attention layer quantizes the query to e4m3
(``Attention.query_quant`` with ``_q_scale``: a checkpoint's calibrated ``q_scale``, ``Batch.q_scale``), the backend
views the cache as e4m3 and passes the layer's descales ``[N, Hkv]``, and FA3's fp8 forward rounds P to e4m3 before
P@V and writes bf16. Through vLLM's real wrapper over the stand-in op (tests/support/hopper_standins.py), which checks
the extension's fp8 rules (bf16 output, head size a multiple of 16) and computes with the descales and FA3's P
rounding; the real kernel runs on an H100/H200 (benchmarks/results/fa3-fp8-h200.txt)."""

import attrs
import pytest
import torch
from hypothesis import given, settings
from support import batch_of, hopper_standins
from support.hopper_standins import StandInFA3
from support.planted_fa import QDescaleIgnoredFA3

from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelCrash, KernelMismatch
from kvfuzz.contracts.checks.reference import FLASH_ATTENTION
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example, prepare
from kvfuzz.fuzz.targets.registry import get_target
from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttn4Varlen, VllmFlashAttnVarlen
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.configs import config_for
from kvfuzz.strategies.limits import Limits

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-ins replace the compiled ops on a CPU only")
FA3 = get_target("vllm.flash_attn_varlen")


@pytest.fixture
def fa3(monkeypatch):
    return hopper_standins.install_fa3(monkeypatch)


def fp8_batch(lens, *, seed=0, **kw):
    kw = dict(dict(num_heads=4, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=16,
                   kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.75), **kw)
    return batch_of(lens, seed=seed, **kw)


# ---- the declaration -----------------------------------------------------------------------------------------

def test_fp8_caches_are_declared_with_bf16_and_head_sizes_of_16():
    c = FA3.capabilities
    assert c.kv_cache_dtypes == ("auto", "fp8", "fp8_e4m3")          # FlashAttentionBackend: no e5m2
    assert c.dtypes_for("fp8") == ("bfloat16",) and c.dtypes_for("auto") == ("float16", "bfloat16")
    assert c.head_sizes_for("fp8") == tuple(h for h in c.head_sizes if h % 16 == 0)  # e4m3 alignment 16
    b = fp8_batch([(1, 20)])
    assert c.accepts(b)
    assert c.outside(attrs.evolve(b, dtype="float16")) == ["dtype float16 with kv_cache_dtype fp8_e4m3"]
    assert c.outside(attrs.evolve(b, head_size=72)) == ["head_size 72 with kv_cache_dtype fp8_e4m3"]
    # FA2 takes no fp8; FA4's SM90 fp8 path takes either dtype (its query stays 16-bit)
    assert get_target("vllm.flash_attn_varlen_fa2").capabilities.kv_cache_dtypes == ("auto",)
    assert VllmFlashAttn4Varlen.capabilities.fp8_dtypes is None


@settings(max_examples=150, database=None, deadline=None)
@given(batches(FA3.capabilities, Limits(max_ctx_len=64, max_query_len=16)))
def test_the_strategies_draw_fp8_only_where_it_is_declared(b):
    assert FA3.capabilities.accepts(b)
    if b.kv_cache_dtype != "auto":
        assert b.dtype == "bfloat16" and b.head_size % 16 == 0


def test_pinned_configurations_keep_fp8_with_bf16():
    configs = [config_for(FA3.capabilities, Limits(), 3, i) for i in range(60)]
    assert any(c.kv_cache_dtype != "auto" for c in configs)
    assert all(c.dtype == "bfloat16" for c in configs if c.kv_cache_dtype != "auto")
    assert {c.dtype for c in configs} == {"float16", "bfloat16"}


# ---- the query as the layer quantizes it ----------------------------------------------------------------------

def test_the_query_is_quantized_to_e4m3_for_fp8_caches_only_and_idempotently():
    b = fp8_batch([(5, 3), (1, 20)], seed=4)
    d = make_batch_data(b)
    q = FA3.call_data(b, d).query
    assert q.dtype == torch.bfloat16 and not torch.equal(q, d.query)
    assert torch.equal(q, d.query.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16))
    assert torch.equal(FA3.call_data(b, FA3.call_data(b, d)).query, q)  # a replay hands it back rounded
    assert FA3.call_data(b, d).keys is d.keys  # only the query changes
    plain = attrs.evolve(b, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    dp = make_batch_data(plain)
    assert FA3.call_data(plain, dp) is dp  # a 16-bit cache: the query as drawn
    # FA4's SM90 fp8-KV path takes the 16-bit query: nothing rounded
    b4 = fp8_batch([(1, 20)], head_size=512, block_size=64)
    d4 = make_batch_data(b4)
    assert VllmFlashAttn4Varlen().call_data(b4, d4) is d4


def test_a_calibrated_q_scale_divides_the_query_before_e4m3_and_the_reference_gets_it_back():
    """vLLM quantizes the query with ``layer._q_scale`` (a checkpoint's ``q_scale``, 1.0 without one): the kernel
    gets round_e4m3(q / q_scale) and ``q_descale = q_scale``; the reference their product, exactly. A scale of
    3/64 (amax 21 over e4m3's 448) saturates "extreme" queries at 448 * 3/64, as vLLM's QuantFP8 does."""
    for q_scale, value_range in ((0.375, "normal"), (3 / 64, "extreme"), (2.0, "normal")):
        b = fp8_batch([(5, 3), (1, 20)], seed=4, q_scale=q_scale, value_range=value_range)
        d = make_batch_data(b)
        q = FA3.call_data(b, d).query
        codes = (d.query.float() / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.float(), codes.float() * q_scale), q_scale
        assert torch.equal(FA3.call_data(b, FA3.call_data(b, d)).query, q)  # idempotent at any scale
        if value_range == "extreme":
            assert q.float().abs().max().item() == 448 * q_scale  # saturated, as the kernel's query is
    assert "q_scale=0.375" in fp8_batch([(1, 20)], q_scale=0.375).summary()
    assert "q_scale" not in fp8_batch([(1, 20)]).summary()


def test_q_scale_is_drawn_for_the_targets_that_take_an_fp8_query_only():
    from hypothesis import HealthCheck, find

    limits = Limits(max_ctx_len=64, max_query_len=16)
    found = find(batches(FA3.capabilities, limits), lambda b: b.q_scale != 1.0,
                 settings=settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck)))
    assert found.kv_cache_dtype != "auto" and FA3.capabilities.accepts(found)
    for name in ("vllm.unified_attention", "vllm.flash_attn_varlen_fa2"):
        caps = get_target(name).capabilities
        assert not caps.quant_query

        @settings(max_examples=60, database=None, deadline=None)
        @given(batches(caps, limits))
        def never(b):
            assert b.q_scale == 1.0

        never()
    assert not VllmFlashAttn4Varlen.capabilities.quant_query and FA3.capabilities.quant_query
    assert FA3.fp8_query and not VllmFlashAttn4Varlen.fp8_query  # the declaration says what the call does


def test_p_rounded_to_e4m3_is_declared_for_the_fp8_forward_only():
    b = fp8_batch([(1, 20)])
    assert FA3.numerics_for(b).p_fp8_e4m3 and FA3.numerics_for(b).tanh_approx
    plain = attrs.evolve(b, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    assert not FA3.numerics_for(plain).p_fp8_e4m3
    # FA4's SM90 fp8-KV path: P not in e4m3, but computed in fp16 (Numerics.compute_dtype)
    assert VllmFlashAttn4Varlen().numerics_for(fp8_batch([(1, 20)], head_size=512, block_size=64)) == \
        attrs.evolve(VllmFlashAttn4Varlen.numerics, compute_dtype="float16")


# ---- the call and end to end ---------------------------------------------------------------------------------

@no_cuda
def test_the_fp8_call_is_built_as_the_backend_builds_it(fa3):
    b = fp8_batch([(5, 3), (1, 20)], seed=5)  # seed 5: aot schedule
    run = prepare(StandInFA3(), Example(b, Poison.NAN))
    kw = run.call.kwargs
    assert kw["q"].dtype == kw["k"].dtype == kw["v"].dtype == torch.float8_e4m3fn
    assert torch.equal(kw["q"].to(torch.bfloat16), run.data.query)  # the reference's query, bit for bit
    assert kw["out"].dtype == torch.bfloat16
    for name, scale in (("q_descale", 1.0), ("k_descale", 0.5), ("v_descale", 0.75)):
        assert kw[name].shape == (2, 2) and bool((kw[name] == scale).all())
    calibrated = prepare(StandInFA3(), Example(fp8_batch([(5, 3), (1, 20)], seed=5, q_scale=3 / 64), Poison.NAN))
    ckw = calibrated.call.kwargs
    assert bool((ckw["q_descale"] == 3 / 64).all()) and ckw["q_descale"].shape == (2, 2)
    assert torch.equal(ckw["q"].float() * (3 / 64), calibrated.data.query.float())  # codes times q_descale
    made = hopper_standins.SEEN["sched"][kw["scheduler_metadata"].data_ptr()]
    assert made["qkv_dtype"] == torch.float8_e4m3fn  # fp8_dtype() for a quantized cache (the builder)
    assert StandInFA3().path(b).endswith(",fp8")


@no_cuda
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 12])
@pytest.mark.parametrize("features", [{}, dict(sliding_window=5), dict(softcap=3.0), dict(value_range="dominant"),
                                      dict(kv_cache_dtype="fp8", k_scale=1.0, v_scale=1.0, head_size=80),
                                      dict(q_scale=3 / 64), dict(q_scale=2.0, value_range="extreme")])
def test_fa3s_fp8_forward_through_the_real_wrapper_agrees_with_the_reference(fa3, seed, features):
    b = fp8_batch([(1, 30), (7, 12), (1, 0), (16, 0)], seed=seed, **features)
    run = check_example(StandInFA3(), Example(b, Poison.NAN))
    assert run.output.dtype == torch.bfloat16 and hopper_standins.SEEN["fwd"][-1]["q"].dtype == torch.float8_e4m3fn


class UnquantizedReference(StandInFA3):
    """A target that hands FA3 the e4m3 query but leaves the reference the 16-bit one (call_data not overridden):
    the reference then computes with another query than the kernel's."""

    name = "test.fa3_fp8_unquantized_reference"

    def call_data(self, batch, data):
        return data

    def build_call(self, batch, data, cache):
        return super().build_call(batch, VllmFlashAttnVarlen.call_data(self, batch, data), cache)


class NoPRounding(StandInFA3):
    """FA3's fp8 forward judged without its P rounding declared: the envelope of a 16-bit forward."""

    name = "test.fa3_fp8_no_p_rounding"

    def numerics_for(self, batch):
        return self.numerics


class DroppedVDescale(StandInFA3):
    """A caller that passes ``v_descale`` 1.0: the output is off by the cache's v_scale."""

    name = "test.fa3_fp8_dropped_v_descale"

    def descales(self, batch, num_seqs, dev):
        d = super().descales(batch, num_seqs, dev)
        return dict(d, v_descale=torch.ones_like(d["v_descale"]))


class IgnoredQDescale(QDescaleIgnoredFA3, StandInFA3):
    """A kernel that does not apply ``q_descale`` (the call hands it 1.0): right while every query scale is 1.0,
    as the target drew them before ``Batch.q_scale``. The defect is the one a GPU campaign hunts on the real FA3
    (tests/support/planted_fa.py), here over the stand-in."""

    name = "test.fa3_fp8_ignored_q_descale"


@no_cuda
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_kernel_that_ignores_q_descale_is_found_once_q_scale_is_calibrated(fa3, seed):
    uncalibrated = Example(fp8_batch([(16, 40), (1, 30)], seed=seed), Poison.NAN)
    check_example(IgnoredQDescale(), uncalibrated)  # q_scale 1.0: nothing to see
    calibrated = Example(fp8_batch([(16, 40), (1, 30)], seed=seed, q_scale=0.375), Poison.NAN)
    check_example(StandInFA3(), calibrated)
    with pytest.raises(KernelMismatch):
        check_example(IgnoredQDescale(), calibrated)


@no_cuda
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_part_of_the_fp8_model_is_needed(fa3, seed):
    """The correct stand-in passes where each model part left out fails: the query's e4m3 rounding (2**-4 relative)
    moves large logits ("large" values) past the envelope; P's e4m3 rounding is past a 16-bit forward's envelope
    for ordinary values; a dropped v_descale is the caller's."""
    for value_range, wrong, finding in (("large", UnquantizedReference, KernelMismatch),
                                        ("normal", NoPRounding, KernelMismatch),
                                        # the call's v_descale is the cache's scale to the caller checks: the
                                        # cached new tokens no longer match it, so it is the caller's fault
                                        ("normal", DroppedVDescale, CallerContractViolation)):
        example = Example(fp8_batch([(16, 40), (1, 30)], seed=seed, value_range=value_range), Poison.NAN)
        check_example(StandInFA3(), example)
        with pytest.raises(finding):
            check_example(wrong(), example)


@no_cuda
def test_an_fp16_model_with_an_fp8_cache_is_fa3s_own_error(fa3):
    """FA3 writes an fp8 forward's output in bf16 only: the call vLLM makes for an fp16 model with an fp8 cache
    fails in the extension (undeclared: the strategies never draw it; an explicit call says why)."""
    b = fp8_batch([(1, 20)], dtype="float16")
    assert not FA3.capabilities.accepts(b)
    with pytest.raises(KernelCrash, match="output must have dtype BF16"):
        check_example(StandInFA3(), Example(b, Poison.NAN))
    assert FLASH_ATTENTION.p_fp8_e4m3 is False


def test_kvfuzz_targets_says_what_an_fp8_cache_narrows():
    from kvfuzz.fuzz.cli.targets import _kv_cell

    assert _kv_cell(FA3.capabilities) == "auto,fp8,fp8_e4m3 (fp8: bfloat16; head sizes 32,64,80,96,128,192,256)"
    assert _kv_cell(VllmFlashAttn4Varlen.capabilities) in (
        "auto,fp8,fp8_e4m3 (fp8: head sizes 512; block sizes 64)", "auto")  # "auto" on a GPU other than SM90
    assert _kv_cell(get_target("vllm.flash_attn_varlen_fa2").capabilities) == "auto"
