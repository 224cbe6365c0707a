"""Where a CUDA target's example draws its data and computes its fp64 reference (fuzz/harness/run.py,
reference_device): the GPU for a batch of many KV elements, or, with KVFUZZ_GPU_REFERENCE_MIN_WORK set, of much
reference arithmetic; the CPU otherwise, and always for a CPU target."""

import attrs

from kvfuzz.fuzz.harness import run


class OnCuda:
    device = "cuda"


class OnCpu:
    device = "cpu"


def test_the_work_counts_query_heads_and_query_rows_that_kv_elements_leave_out(make_batch):
    b = make_batch([(3, 4), (1, 9)], num_heads=16, num_kv_heads=2, head_size=64)
    assert run.reference_work(b) == 16 * (64 + 64) * (3 * 7 + 1 * 10)
    latent = attrs.evolve(make_batch([(2, 5)], num_heads=4, num_kv_heads=1, head_size=576), value_head_size=512)
    assert run.reference_work(latent) == 4 * (576 + 512) * (2 * 7)
    # sixteen query heads per kv head: 16x the work of one, the same KV elements
    one = make_batch([(3, 4), (1, 9)], num_heads=2, num_kv_heads=2, head_size=64)
    assert one.kv_elements == b.kv_elements and run.reference_work(b) == 8 * run.reference_work(one)


def test_a_batch_of_much_work_and_few_kv_elements_goes_to_the_gpu_only_when_asked(make_batch, monkeypatch):
    heavy = make_batch([(40, 56)], num_heads=32, num_kv_heads=1, head_size=128)
    light = make_batch([(1, 3)], num_heads=1, num_kv_heads=1, head_size=32)
    assert heavy.kv_elements < run.GPU_REFERENCE_MIN_KV and run.reference_work(heavy) >= 1 << 22
    monkeypatch.setattr(run, "GPU_REFERENCE_MIN_WORK", 0)  # the default: off
    assert run.reference_device(OnCuda(), heavy) == "cpu"
    monkeypatch.setattr(run, "GPU_REFERENCE_MIN_WORK", 1 << 22)
    assert run.reference_device(OnCuda(), heavy) == "cuda" and run.reference_device(OnCuda(), light) == "cpu"
    assert run.reference_device(OnCpu(), heavy) == "cpu"  # a CPU target's reference never leaves the CPU
