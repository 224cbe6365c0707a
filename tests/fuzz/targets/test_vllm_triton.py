"""vLLM's context_attention_fwd, unified_attention and decode_attention_fwd end to end on CPU (Triton
interpreter): correct calls agree with the fp64 reference, both unified paths are taken exactly when the
target says, caller faults are blamed on the caller, and one real kernel finding is kept as a regression."""

import attrs
import pytest
from support import available

from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelMismatch
from kvfuzz.contracts.checks.invariants import PREFILL, UNIFIED, check_contract
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example, prepare
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.fuzz.targets.vllm_triton import VllmContextAttentionFwd, VllmDecodeAttentionFwd, VllmUnifiedAttention

pytestmark = pytest.mark.kernel


# ---- declarations (no kernel runs) ------------------------------------------------------------------

def test_declarations():
    ctx, uni, dec = VllmContextAttentionFwd(), VllmUnifiedAttention(), VllmDecodeAttentionFwd()
    assert ctx.capabilities.contract is Contract.PREFIX and Contract.PREFIX.passes_new_kv
    assert uni.capabilities.contract is Contract.UNIFIED and not uni.capabilities.decode_only
    assert dec.capabilities.contract is Contract.UNIFIED and dec.capabilities.decode_only
    for t in (ctx, uni, dec):
        assert t.capabilities.devices == ("cpu", "cuda")
        assert "bfloat16" not in t.capabilities.dtypes or not t.interpreted  # interpreter computes bf16 wrongly
    assert 544 in ctx.capabilities.block_sizes and 48 in ctx.capabilities.block_sizes  # non-power-of-2 blocks


def test_prefix_contract_caches_ctx_of_every_sequence_so_the_seeds_fault_changes_nothing(make_batch):
    b = make_batch([(5, 3), (1, 20), (1, 0)])
    assert Contract.PREFIX.cached_lens(b) == (3, 20, 0)  # the decode token is passed as key/value
    assert get_fault("decode-ctx-only").cached_lens(b, Contract.PREFIX.cached_lens(b)) == (3, 20, 0)


# ---- vllm.context_attention_fwd ------------------------------------------------------------------------

CTX_BATCHES = {
    "fp32-D64-bs16-mixed": dict(lens=[(5, 3), (1, 20), (17, 0), (1, 0)], dtype="float32", head_size=64,
                                block_size=16, reverse=True),
    "fp16-D80-bs48-tiles-straddle-blocks": dict(lens=[(1, 47), (9, 40), (1, 0)], dtype="float16",
                                                head_size=80, block_size=48),
    "fp16-D32-bs544-gqa4": dict(lens=[(3, 30), (1, 5)], dtype="float16", head_size=32, block_size=544,
                                num_heads=4, num_kv_heads=1),
}


@pytest.mark.parametrize("case", list(CTX_BATCHES))
def test_context_attention_fwd_computes_decode_sequences_too(make_batch, case):
    t = available(VllmContextAttentionFwd)
    kw = dict(CTX_BATCHES[case])
    b = make_batch(kw.pop("lens"), seed=5, **kw)
    run = check_example(t, Example(b, Poison.NAN))
    assert run.path == "_fwd_kernel(prefill+decode)"
    assert run.call.kwargs["skip_decode"] is False
    assert run.output.isfinite().all()


def test_prefix_invariant_checks_the_decode_rows_of_key_and_value(make_batch):
    """Under the split contract a decode token's key/value rows are not read (it comes from the cache); under
    the prefix contract they are: a wrong decode row is a violation only there."""
    b = make_batch([(3, 2), (1, 6)], seed=1)
    d = make_batch_data(b)
    run = prepare(VllmContextAttentionFwd(), Example(b, Poison.NAN))
    key, value = run.call.key.clone(), run.call.value
    key[3] += 1  # row 3 = the decode token of sequence 1
    split = check_contract(Contract.SPLIT, b, d, run.cache.layout, run.call.key_cache, run.call.value_cache,
                           key, value)
    assert [x.source for x in split] == ["cache"]  # split: the decode token must be in the cache; key row unread
    v = check_contract(Contract.PREFIX, b, d, run.cache.layout, run.call.key_cache, run.call.value_cache, key, value)
    assert [(x.check, x.source, x.seq, x.position) for x in v] == [(PREFILL, "key", 1, 6)]


def test_prefix_invariant_fires_when_key_and_value_are_wrong(make_batch):
    t = available(VllmContextAttentionFwd)
    b = make_batch([(4, 3), (1, 9)], seed=2)
    run = prepare(t, Example(b, Poison.NAN))
    run.call.value[4].zero_()  # the decode sequence's new token, passed separately (same tensor as kwargs["v"])
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, run.example, run=run)
    f = info.value
    assert f.kind.blame == "caller" and f.check == PREFILL.value
    assert [(x["source"], x["seq"], x["position"]) for x in f.details["violations"]] == [("value", 1, 9)]
    assert f.details["kernel"]["outcome"] == "mismatch"  # the kernel used the wrong value row


def test_prefix_invariant_fires_when_a_decode_context_position_is_missing(make_batch):
    t = available(VllmContextAttentionFwd)
    b = make_batch([(1, 9)], seed=3)
    lens = (8,)  # the caller wrote one context position too few
    run = prepare(t, Example(b, Poison.NAN))
    run.cache = materialize(b, run.data, t.layout(b), lens, Poison.NAN)
    run.call = t.build_call(b, run.data, run.cache)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, run.example, run=run)
    v = info.value.details["violations"][0]
    assert (info.value.check, v["source"], v["seq"], v["position"]) == (PREFILL.value, "cache", 0, 8)
    assert info.value.details["kernel"]["outcome"] == "non-finite"


# ---- vllm.unified_attention ---------------------------------------------------------------------------

UNIFIED_BATCHES = {
    # max_query_len 17 > MAX_3D_QUERY_LEN (8): 2-D
    "2d-fp16-D64-bs16-mixed": (dict(lens=[(5, 3), (1, 20), (17, 0), (1, 0)], dtype="float16", head_size=64,
                                    block_size=16, reverse=True), "2d"),
    # decode only: 3-D, 16 segments + reduce_segments
    "3d-fp32-D40-bs32-decodes": (dict(lens=[(1, 33), (1, 0), (1, 14)], dtype="float32", head_size=40,
                                      block_size=32, num_heads=4, num_kv_heads=1), "3d"),
    # short prefills (speculative-decoding sized, <= 8 tokens) also take the 3-D path
    "3d-fp16-D32-bs48-short-prefills": (dict(lens=[(8, 40), (1, 5), (3, 0)], dtype="float16", head_size=32,
                                             block_size=48), "3d"),
}


@pytest.fixture
def kernel_choice(monkeypatch):
    """Which path unified_attention really launched: "3d" if it launched reduce_segments, else "2d"."""
    from kvfuzz.fuzz.targets.vllm_triton import prepare_triton_runtime

    prepare_triton_runtime()
    from vllm.v1.attention.ops import triton_unified_attention as tua

    launched = []

    class Spy:  # stands in for the jitted reduce_segments: records the launch, then launches it
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(tua, "reduce_segments", Spy(tua.reduce_segments))
    return lambda: "3d" if launched else "2d"


@pytest.mark.parametrize("case", list(UNIFIED_BATCHES))
def test_unified_attention_agrees_on_both_paths(make_batch, kernel_choice, case):
    t = available(VllmUnifiedAttention)
    kw, expected = UNIFIED_BATCHES[case]
    kw = dict(kw)
    b = make_batch(kw.pop("lens"), seed=7, **kw)
    run = check_example(t, Example(b, Poison.NAN))
    assert run.path == expected == kernel_choice()  # the target's rule is the kernel's own
    assert run.output.isfinite().all()


# ---- vllm.decode_attention_fwd --------------------------------------------------------------------------

DECODE_BATCHES = {
    # MHA -> _fwd_kernel_stage1 (fp32: see the fp16 finding below); seq_len 1 and 2 leave splits empty
    "normal-fp32-D64-bs16": dict(lens=[(1, 20), (1, 0), (1, 1), (1, 47)], dtype="float32", head_size=64,
                                 block_size=16, num_heads=2, num_kv_heads=2, reverse=True),
    # GQA -> _fwd_grouped_kernel_stage1, page_size 1 (SGLang's default)
    "grouped-fp16-D80-bs1": dict(lens=[(1, 9), (1, 30)], dtype="float16", head_size=80, block_size=1,
                                 num_heads=4, num_kv_heads=1),
    "grouped-fp16-D32-bs48-gqa7": dict(lens=[(1, 47), (1, 3)], dtype="float16", head_size=32, block_size=48,
                                       num_heads=7, num_kv_heads=1),
}


@pytest.mark.parametrize("case", list(DECODE_BATCHES))
def test_decode_attention_fwd_agrees(make_batch, case):
    t = available(VllmDecodeAttentionFwd)
    kw = dict(DECODE_BATCHES[case])
    b = make_batch(kw.pop("lens"), seed=11, **kw)
    run = check_example(t, Example(b, Poison.NAN))
    stage1 = "normal" if b.num_heads == b.num_kv_heads else "grouped"
    assert run.path == f"{stage1},splits=4" and run.call.kwargs["num_kv_splits"] == 4
    assert run.output.isfinite().all()


def test_decode_attention_fwd_vllm_split_rule(make_batch):
    """num_kv_splits=None follows vLLM's Triton MLA rule: next_pow2(max_seq_len // 512), capped by SMs."""
    t = VllmDecodeAttentionFwd(num_kv_splits=None)
    assert t.num_kv_splits(make_batch([(1, 40)])) == 1
    assert t.path(make_batch([(1, 40)])) == "grouped,splits=1"
    if t.interpreted:  # no SMs here: the cap is 1 x 2
        assert t.num_kv_splits(make_batch([(1, 2047)], block_size=512)) == 2


def test_decode_attention_fwd_mha_fp16_precision_finding(make_batch):
    """FINDING (vllm 0.33.0): the MHA stage-1 kernel (``_fwd_kernel_stage1``) computes q.k as
    ``tl.sum(q[None, :] * k, 1)`` on fp16 tensors; Triton's tl.sum keeps fp16, and ``qk *= sm_scale`` runs
    in fp16, so the logits carry fp16 rounding. With "large" values (logits ~16x wider) the output error is
    5.33e-3 against a bound of 1.59e-3 (3.35x) on a decode of two keys (seed 230), while unified_attention and
    context_attention_fwd use 47% of the bound on the same batch (with the data seeds drew before issue 21's
    generator, seed 17: 2.55e-3 against 6.8e-4, 27%; a scan of seeds 0-259 of this batch finds 7 failing now, 14
    then, and an emulation of the fp16 dot over 1000 seeds fails as often with either generator); the grouped
    stage-1 kernel (tl.dot, fp32 accumulation) does not have this. Minimal case found by searching single decode
    sequences (ctx_len 1, 3, 7, 15, 31 x 30 seeds, "large" values: 15 of 150 fail). The earlier pinned case
    (ctx_len 7, seed 41, normal values) exceeded the old per-row bound by 9% and is inside the rounding envelope
    of a correct FlashAttention-family kernel at every element (docs/tolerance.md)."""
    t = available(VllmDecodeAttentionFwd)
    b = attrs.evolve(make_batch([(1, 1)], dtype="float16", head_size=32, block_size=16, num_heads=1,
                                num_kv_heads=1, seed=230), value_range="large")
    with pytest.raises(KernelMismatch) as info:
        check_example(t, Example(b, Poison.NAN))
    assert info.value.kind.blame == "kernel" and info.value.details["path"] == "normal,splits=4"
    assert info.value.details["oracle"]["error"] > 3 * info.value.details["oracle"]["bound"]
    for other in (VllmUnifiedAttention(), VllmContextAttentionFwd()):  # same batch: the other kernels agree
        check_example(other, Example(b, Poison.NAN))


# ---- the seeds' caller fault ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, lens", [(VllmUnifiedAttention, [(5, 3), (1, 20)]),
                                       (VllmDecodeAttentionFwd, [(1, 20), (1, 5)])])
def test_seeds_fault_is_a_caller_violation(make_batch, cls, lens):
    t = available(cls)
    b = make_batch(lens, dtype="float32", head_size=32, block_size=16, seed=3)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, Example(b, Poison.NAN), get_fault("decode-ctx-only"))
    f = info.value
    assert f.kind.blame == "caller" and f.check == UNIFIED.value
    decode = b.decode_seqs[0]
    v = f.details["violations"][0]
    assert (v["seq"], v["position"]) == (decode, b.ctx_lens[decode])
    assert f.details["kernel"]["outcome"] == "non-finite"  # the kernel read the NaN slot
