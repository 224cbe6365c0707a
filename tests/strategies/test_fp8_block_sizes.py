"""``Capabilities.fp8_block_sizes``: a kernel that takes an fp8 cache at some block sizes only (FlashAttention 4's
SM90 fp8-KV-dequant kernel: block size 64 at head size 512, vLLM's ``_get_sm90_fa4_fp8_kv_block_size``). Every
strategy draws inside it, the declaration refuses a batch outside it, and the reductions stay inside it."""

import attrs
from hypothesis import Phase, given, settings

from kvfuzz.contracts.model.batch import contiguous_batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.configs import config_for, round_length
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import reductions
from kvfuzz.strategies.serving import serving_batches
from kvfuzz.strategies.tiers import tier_limits

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16", "bfloat16"),
                    head_sizes=(64, 128, 512), block_sizes=(16, 32, 64, 128), kv_cache_dtypes=("auto", "fp8_e4m3"),
                    fp8_head_sizes=(512,), fp8_block_sizes=(64,))
LIMITS = Limits()


def test_the_declaration_refuses_an_fp8_batch_at_another_block_size():
    fp8 = contiguous_batch([1], [3], block_size=64, head_size=512, kv_cache_dtype="fp8_e4m3", dtype="bfloat16",
                           num_heads=2, num_kv_heads=1)
    assert CAPS.accepts(fp8) and CAPS.outside(fp8) == []
    bad = attrs.evolve(fp8, block_size=32)
    assert not CAPS.accepts(bad)
    assert CAPS.outside(bad) == ["block_size 32 with kv_cache_dtype fp8_e4m3"]
    assert CAPS.accepts(attrs.evolve(bad, kv_cache_dtype="auto"))  # a 16-bit cache takes every block size
    assert CAPS.block_sizes_for("auto") == (16, 32, 64, 128) and CAPS.block_sizes_for("fp8_e4m3") == (64,)
    assert attrs.evolve(CAPS, fp8_block_sizes=None).block_sizes_for("fp8_e4m3") == CAPS.block_sizes


def test_free_and_serving_draws_stay_inside():
    seen = set()

    @settings(max_examples=200, phases=[Phase.generate], database=None, deadline=None, derandomize=True)
    @given(batches(CAPS, LIMITS))
    def free(b):
        assert CAPS.accepts(b), CAPS.outside(b)
        seen.add((b.kv_cache_dtype, b.block_size))

    @settings(max_examples=40, phases=[Phase.generate], database=None, deadline=None)
    @given(serving_batches(CAPS, tier_limits("serving")))
    def serving(b):
        assert CAPS.accepts(b), CAPS.outside(b)

    free()
    serving()
    assert ("fp8_e4m3", 64) in seen and {bs for kv, bs in seen if kv == "auto"} >= {16, 128}


def test_configuration_rounds_stay_inside_and_cover_every_block_size():
    n = round_length(CAPS, LIMITS, seed=5)
    configs = [config_for(CAPS, LIMITS, seed=5, index=k) for k in range(n)]
    assert all(c.block_size in CAPS.block_sizes_for(c.kv_cache_dtype) for c in configs)
    assert all(c.head_size in CAPS.head_sizes_for(c.kv_cache_dtype) for c in configs)
    assert {c.block_size for c in configs} == set(CAPS.block_sizes)
    assert "fp8_e4m3" in {c.kv_cache_dtype for c in configs}


def test_reductions_of_an_fp8_batch_keep_its_block_size():
    fp8 = contiguous_batch([3, 1], [70, 5], block_size=64, head_size=512, kv_cache_dtype="fp8_e4m3",
                           dtype="bfloat16", k_scale=0.5, v_scale=0.5, num_heads=2, num_kv_heads=1)
    smaller = reductions(fp8, CAPS, LIMITS)
    assert smaller and all(CAPS.accepts(b) for b in smaller)
    auto = attrs.evolve(fp8, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    assert any(b.block_size < 64 for b in reductions(auto, CAPS, LIMITS))
