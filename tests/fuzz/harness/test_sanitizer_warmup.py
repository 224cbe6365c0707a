"""fuzz/harness/sanitizer_warmup.py: a sanitized child prepares a few tiny examples of its target, never calling the
kernel, before it says it is ready; one per declared dtype x kv_cache_dtype (up to two of each) and one whose data
is drawn on the device; a preparation that raises is counted, and the warm-up goes on."""

from __future__ import annotations

from kvfuzz.contracts.model.capabilities import Capabilities, Contract
from kvfuzz.fuzz.harness.run import GPU_REFERENCE_MIN_KV
from kvfuzz.fuzz.harness.sanitizer_warmup import warm_examples, warm_up


def _caps(**kw):
    base = dict(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16", "float32"), head_sizes=(64, 128),
                block_sizes=(16, 32), kv_cache_dtypes=("auto", "fp8"))
    return Capabilities(**(base | kw))


def test_one_example_per_dtype_and_cache_dtype_and_one_drawn_on_the_device():
    examples = warm_examples(_caps())
    pairs = [(e.batch.dtype, e.batch.kv_cache_dtype) for e in examples[:-1]]
    assert pairs == [("float16", "auto"), ("float16", "fp8"), ("float32", "auto"), ("float32", "fp8")]
    assert all(e.batch.k_scale == 0.5 for e in examples[:-1] if e.batch.kv_cache_dtype == "fp8")
    assert examples[-1].batch.kv_elements >= GPU_REFERENCE_MIN_KV > max(e.batch.kv_elements for e in examples[:-1])
    assert {e.batch.head_size for e in examples} == {64} and {e.batch.block_size for e in examples} == {16}


class _Target:
    capabilities = _caps(kv_cache_dtypes=("auto",))

    def run(self, call):  # the warm-up must never call the kernel under test
        raise AssertionError("the kernel was called")


def test_the_warm_up_prepares_each_example_and_never_runs_the_kernel():
    prepared = []
    got = warm_up(_Target(), prepare=lambda target, example: prepared.append(example.batch.dtype))
    assert prepared == ["float16", "float32", "float16"]
    assert got["warm_errors"] == 0 and got["warm"] >= 0


def test_a_preparation_that_raises_is_counted_and_the_rest_still_run():
    seen = []

    def prepare(target, example):
        seen.append(example.batch.dtype)
        if example.batch.dtype == "float32":
            raise ValueError("a layout that cannot hold it")

    got = warm_up(_Target(), prepare=prepare)
    assert seen == ["float16", "float32", "float16"] and got["warm_errors"] == 1


def test_real_declarations_prepare_every_warm_up_example():
    """A decode-only target gets decodes, a latent (MLA) target latent batches: none of the examples is refused."""
    from kvfuzz.fuzz.targets.registry import get_target

    for name in ("vllm.unified_attention", "vllm.decode_attention_fwd", "vllm.triton_mla_decode"):
        assert warm_up(get_target(name))["warm_errors"] == 0, name
