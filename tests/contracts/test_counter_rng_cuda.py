"""CUDA only (skipped without a GPU): a seed draws the same bits on the GPU as on the CPU (issue 21's
counter-based generator, contracts/model/counter_rng.py), a large batch of a CUDA target is drawn, checked and
stored from the GPU, and its reproducer loads back and replays equal.

    source benchmarks/gpu_env.sh && python -m pytest -q tests/contracts/test_counter_rng_cuda.py
"""

import attrs
import pytest
import torch
from support import available, batch_of

from kvfuzz.contracts.model import counter_rng
from kvfuzz.contracts.model.data import BatchData, make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the GPU half of CPU/GPU equality")


def assert_same(cpu: BatchData, gpu: BatchData) -> None:
    for f in attrs.fields(BatchData):
        a, b = getattr(cpu, f.name), getattr(gpu, f.name)
        assert (a is None) == (b is None), f.name
        if a is not None:
            assert b.device.type == "cuda" and a.device.type == "cpu", f.name
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), f.name


def shared_batch(**kw):
    """Sequence 1 shares sequence 0's first two blocks; sequence 2 shares one (as tests/contracts/test_csr.py)."""
    from kvfuzz.contracts.model.batch import Batch

    return Batch(**{**dict(query_lens=[3, 1, 2], ctx_lens=[40, 33, 20], num_heads=2, num_kv_heads=1, head_size=32,
                           block_size=16, num_blocks=12, block_table=[[0, 1, 2, 0], [0, 1, 3, 0], [0, 4, 0, 0]],
                           seed=5), **kw})


def test_the_generator_is_the_same_bits_on_the_gpu():
    counts = [(counter_rng.QUERY, 1000), (counter_rng.KEYS, 300_000), (counter_rng.VALUES, 300_000),
              (counter_rng.SINKS, 7)]
    for seed in (0, 1, 2**31 - 1, -3, 2**64 + 5):
        cpu, gpu = counter_rng.normal(seed, counts), counter_rng.normal(seed, counts, "cuda")
        assert gpu.device.type == "cuda" and torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32)), seed
    bounds = torch.arange(1, 5000, dtype=torch.int64)
    assert torch.equal(counter_rng.below(9, counter_rng.DOMINANT, bounds),
                       counter_rng.below(9, counter_rng.DOMINANT, bounds.cuda()).cpu())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("value_range", ["normal", "large", "equal", "dominant", "extreme"])
def test_make_batch_data_on_the_gpu_equals_the_cpu_bitwise(dtype, kv, value_range):
    scales = {} if kv == "auto" else dict(k_scale=3 / 64, v_scale=0.375)
    for sinks in (False, True):
        b = shared_batch(dtype=dtype, kv_cache_dtype=kv, value_range=value_range, sinks=sinks, seed=17, **scales)
        assert b.shared_prefix_rows() is not None
        assert_same(make_batch_data(b, "cpu"), make_batch_data(b, "cuda"))


def big_batch(**kw):
    """About 2.6M KV elements (fp16, H=8, Hkv=2, D=128): over GPU_REFERENCE_MIN_KV and over the CPU's chunk."""
    return batch_of([(8, 4088), (1, 4095), (24, 2000)], num_heads=8, num_kv_heads=2, head_size=128,
                    dtype="float16", **kw)


def test_a_big_batch_is_the_same_bits_on_the_gpu():
    for kw in (dict(seed=3), dict(seed=4, sinks=True, value_range="dominant", kv_cache_dtype="fp8", k_scale=0.5,
                                  v_scale=2.0)):
        b = big_batch(**kw)
        assert b.kv_elements * 2 > counter_rng.CHUNK
        assert_same(make_batch_data(b), make_batch_data(b, "cuda"))


@pytest.mark.parametrize("name", ["vllm.unified_attention", "torch.flex_paged"])
def test_a_big_batch_of_a_cuda_target_is_drawn_checked_and_stored_from_the_gpu(name, tmp_path):
    from safetensors.torch import load_file

    from kvfuzz.contracts.checks.failures import KernelMismatch
    from kvfuzz.fuzz.campaign.store.cases import load_case
    from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
    from kvfuzz.fuzz.campaign.workers.replay import replay_here
    from kvfuzz.fuzz.harness import properties
    from kvfuzz.fuzz.harness.run import GPU_REFERENCE_MIN_KV, reference_device

    t = available(name)
    if t.device == "cpu":
        pytest.skip(f"{name} runs on the CPU here")
    b = big_batch(seed=11)
    if not t.capabilities.accepts(b):
        pytest.skip(f"{name} does not declare {t.capabilities.outside(b)}")
    assert b.kv_elements >= GPU_REFERENCE_MIN_KV and reference_device(t, b) == t.device
    # vllm.cpu_attention and torch.flex_paged leak NaN from unused slots (docs/findings.md, Finding 1, 2): finite poison
    example = Example(b, t.gate_poisons[0] if t.gate_poisons else Poison.NAN)
    run = properties.prepare(t, example)
    assert run.data.keys.device.type == "cuda" and run.data.query.device.type == "cuda"
    assert run.timings.generate > 0
    assert_same(make_batch_data(b), run.data)
    run = properties.check(t, example, run=run)  # raises a Finding if the kernel or the caller is wrong
    assert run.reference is not None and run.ratio < 1
    # a reproducer of this run (a planted finding: the run passed) stores CPU tensors equal to the GPU's
    d = write_reproducer(tmp_path, t, example, KernelMismatch("agreement", "planted for the test"), run)
    stored = load_file(str(d / "tensors.safetensors"))
    for key, value in (("query", run.data.query), ("keys_ground_truth", run.data.keys),
                       ("values_ground_truth", run.data.values), ("output", run.output)):
        assert stored[key].device.type == "cpu" and torch.equal(stored[key], value.cpu()), key
    r = replay_here(load_case(d), t)
    assert r.inputs_match is True and r.got is None, r.message
