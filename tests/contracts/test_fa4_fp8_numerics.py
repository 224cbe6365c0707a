"""``Numerics.compute_dtype``: FlashAttention 4's SM90 fp8-KV kernel computes in fp16 whatever the query's dtype
(vllm/vllm_flash_attn/cute/flash_fwd_sm90.py ``fp8_kv_dequant``: "compute is always fp16"): a bf16 query is narrowed
to fp16, K/V widen from e4m3 exactly, P is rounded to fp16 before P@V and the fp32 accumulator is cast to the
output's dtype. A bf16 batch's probabilities below fp16's smallest normal (2**-14) then flush towards zero where the
FlashAttention family's envelope allows bf16's 2**-126: on an H200 a two-token prefill gave 0 where the reference is
-3.2e-24 and the envelope 5.9e-25 (the false alarm this knob ends; docs/tolerance.md, "Declared numerics"). This
arithmetic stays inside the knob's envelope on drawn batches and fails the family's, and P rounded to e4m3 instead,
or an error just above the envelope, fails it."""

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from support import batch_of

from kvfuzz.contracts.checks.oracles import over_envelope
from kvfuzz.contracts.checks.reference import (
    FLASH_ATTENTION,
    Numerics,
    _sequence,
    _softmax_parts,
    reference_and_envelope,
)
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.strategies.batches import Limits, batches

FA4_FP8 = Numerics(compute_dtype="float16")
CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16", "bfloat16"),
                    head_sizes=(64, 512), block_sizes=(64,), kv_cache_dtypes=("fp8", "fp8_e4m3"),
                    features=("sliding_window", "softcap", "sinks"))


def fa4_fp8_model(batch, data, p_dtype=torch.float16, q_dtype=torch.float16):
    """The SM90 fp8-KV kernel's arithmetic on kvfuzz's exact inputs: the query narrowed to ``q_dtype``, fp32 scores
    and softmax, ``exp(s - m)`` rounded to ``p_dtype`` before an fp32 P@V, divided by the fp32 row sum, the output
    rounded to the batch's dtype once. fp64 ``[T, H, Dv]``."""
    narrowed = attrs.evolve(data, query=data.query.to(q_dtype).to(torch.float32))
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size_v), dtype=batch.torch_dtype)
    qsl = batch.query_start_loc
    for i in range(batch.num_seqs):
        _, _, v, s, sink = _sequence(batch, narrowed, i, torch.float32)
        _, e, _, total = _softmax_parts(s, sink)
        acc = torch.einsum("hqk,khd->qhd", e.to(p_dtype).to(torch.float32), v)
        out[qsl[i] : qsl[i + 1]] = (acc / total.transpose(0, 1)).to(batch.torch_dtype)
    return out.to(torch.float64)


def ratio(b, numerics=FA4_FP8, data=None, out=None, **kw):
    d = make_batch_data(b) if data is None else data
    ref, env = reference_and_envelope(b, d, numerics)
    return float(over_envelope(fa4_fp8_model(b, d, **kw) if out is None else out(ref, env), ref, env))


def fixed(**kw):
    kw = dict(dict(num_heads=4, num_kv_heads=4, head_size=512, block_size=64, dtype="bfloat16", kv_cache_dtype="fp8",
                   value_range="large", seed=1), **kw)
    return batch_of([(4, 8), (1, 40)], **kw)


@settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batches(CAPS, Limits(max_num_seqs=3, max_ctx_len=150, max_query_len=8, max_num_heads=8)))
def test_fa4s_fp8_arithmetic_stays_inside_its_envelope(b):
    assert b.fp8_dtype is not None
    assert ratio(b) <= 1.0


def test_the_h200_false_alarm_is_inside_and_was_outside():
    """The shrunk H200 example (2 tokens, 6 heads over 2, head size 512, e4m3 cache, k_scale 0.5, "large")."""
    b = batch_of([(2, 0)], num_heads=6, num_kv_heads=2, head_size=512, block_size=64, dtype="bfloat16",
                 kv_cache_dtype="fp8_e4m3", k_scale=0.5, value_range="large", seed=16777217,
                 sm_scale=0.044194173824159216)
    assert ratio(b) < 0.6
    assert ratio(b, FLASH_ATTENTION) > 10  # fp16's flushed probabilities, far outside bf16's envelope


@pytest.mark.parametrize("seed", [1, 2])
def test_the_knob_is_needed(seed):
    assert ratio(fixed(seed=seed)) < 0.6
    assert ratio(fixed(seed=seed), FLASH_ATTENTION) > 10


def test_queries_below_fp16s_smallest_normal_stay_inside():
    """Every query element below 2**-14 (narrowed to fp16 subnormals, off by up to 2**-25 each), keys "large" and a
    scale that makes the logits count."""
    for seed in range(3):
        b = fixed(seed=seed, sm_scale=2.0**12)
        d = make_batch_data(b)
        d = attrs.evolve(d, query=(d.query * 2.0**-16).to(d.query.dtype))
        assert ratio(b, data=d) < 0.1


def test_p_rounded_to_e4m3_fails():
    assert ratio(fixed(), p_dtype=torch.float8_e4m3fn) > 5


def test_an_error_just_above_the_envelope_fails():
    b = fixed()
    assert ratio(b, out=lambda ref, env: ref + 0.99 * env) <= 1.0
    assert ratio(b, out=lambda ref, env: ref + 1.01 * env) > 1.0
