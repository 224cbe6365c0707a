"""fuzz/harness/sanitizer_warmup.py: a sanitized child prepares a few tiny examples of its target, never calling the
kernel, before it says it is ready: every declared dtype and kv_cache_dtype (at most MAX_PAIRS pairs) and one whose
data is drawn on the device, each batch made exact as a real example's; a preparation that raises is counted, and
the warm-up goes on; through a real child (the planted compute-sanitizer of tests/support/planted_memcheck.py): the
ready marker carries the warm-up, a warm-up that raises leaves the child serving, and what the warm-up printed is no
example's report."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from support import SUPPORT

from kvfuzz.contracts.model.capabilities import Capabilities, Contract
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.harness.run import GPU_REFERENCE_MIN_KV
from kvfuzz.fuzz.harness.sanitizer import SanitizedChild
from kvfuzz.fuzz.harness.sanitizer_warmup import MAX_PAIRS, warm_examples, warm_pairs, warm_up
from kvfuzz.fuzz.targets.registry import get_target, spec_of


def _caps(**kw):
    base = dict(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16", "float32"), head_sizes=(64, 128),
                block_sizes=(16, 32), kv_cache_dtypes=("auto", "fp8"))
    return Capabilities(**(base | kw))


def test_one_example_per_dtype_and_cache_dtype_and_one_drawn_on_the_device():
    examples = warm_examples(_caps())
    pairs = [(e.batch.dtype, e.batch.kv_cache_dtype) for e in examples[:-1]]
    assert pairs == [("float16", "auto"), ("float32", "fp8"), ("float16", "fp8"), ("float32", "auto")]
    assert all(e.batch.k_scale == 0.5 for e in examples[:-1] if e.batch.kv_cache_dtype == "fp8")
    assert examples[-1].batch.kv_elements >= GPU_REFERENCE_MIN_KV > max(e.batch.kv_elements for e in examples[:-1])
    assert {e.batch.head_size for e in examples} == {64} and {e.batch.block_size for e in examples} == {16}


def test_every_declared_dtype_and_cache_dtype_is_warmed_within_the_bound():
    caps = _caps(dtypes=("float16", "bfloat16", "float32"), kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"))
    pairs = warm_pairs(caps)
    assert len(pairs) == MAX_PAIRS == len(set(pairs)) and len(warm_examples(caps)) == MAX_PAIRS + 1
    assert {d for d, _ in pairs} == set(caps.dtypes) and {k for _, k in pairs} == set(caps.kv_cache_dtypes)


class _Target:
    capabilities = _caps(kv_cache_dtypes=("auto",))

    def run(self, call):  # the warm-up must never call the kernel under test
        raise AssertionError("the kernel was called")


def test_the_warm_up_prepares_each_example_and_never_runs_the_kernel():
    prepared = []
    got = warm_up(_Target(), prepare=lambda target, example: prepared.append(example.batch.dtype))
    assert prepared == ["float16", "float32", "float16"]
    assert got["warm_errors"] == 0 and got["warm"] >= 0


def test_each_batch_is_made_exact_before_it_is_prepared():
    made, prepared = [], []
    warm_up(_Target(), prepare=lambda target, example: prepared.append(example.batch),
            exact=lambda batch: made.append(batch) or batch)
    assert made == prepared and len(made) == len(warm_examples(_Target.capabilities))


def test_a_preparation_that_raises_is_counted_and_the_rest_still_run():
    seen = []

    def prepare(target, example):
        seen.append(example.batch.dtype)
        if example.batch.dtype == "float32":
            raise ValueError("a layout that cannot hold it")

    got = warm_up(_Target(), prepare=prepare)
    assert seen == ["float16", "float32", "float16"] and got["warm_errors"] == 1


def test_a_declaration_the_examples_cannot_be_built_from_is_one_error_not_a_raise():
    class Odd(_Target):
        capabilities = None  # no declaration at all: warm_examples raises

    assert warm_up(Odd(), prepare=lambda target, example: None)["warm_errors"] == 1


def test_real_declarations_prepare_every_warm_up_example():
    """A decode-only target gets decodes, a latent (MLA) target latent batches: none of the examples is refused."""
    for name in ("vllm.unified_attention", "vllm.decode_attention_fwd", "vllm.triton_mla_decode"):
        assert warm_up(get_target(name))["warm_errors"] == 0, name


def _child(tmp: Path, monkeypatch, warm: str | None):
    """A SanitizedChild of planted_memcheck.WarmUpWatch under the planted compute-sanitizer (which runs its program),
    recording what it builds in ``tmp/builds``; ``warm``: KVFUZZ_PLANTED_WARM."""
    from support.planted_memcheck import FAKE_SANITIZER

    exe = tmp / "compute-sanitizer"
    exe.write_text(FAKE_SANITIZER.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KVFUZZ_PLANTED_BUILDS", str(tmp / "builds"))
    if warm:
        monkeypatch.setenv("KVFUZZ_PLANTED_WARM", warm)
    target = get_target(f"{SUPPORT / 'planted_memcheck.py'}:WarmUpWatch")
    return target, SanitizedChild(spec_of(target), sanitizer=str(exe), timeout=120)


def _example():
    return Example(small_batch([1], [5], head_size=32, block_size=16), Poison.NAN)  # not the warm-up's head_size


@pytest.mark.parametrize("warm", [None, "raise"])
def test_the_child_warms_up_every_declared_dtype_before_ready_and_serves_even_when_the_warm_up_raises(
        tmp_path, monkeypatch, warm):
    target, child = _child(tmp_path, monkeypatch, warm)
    try:
        child.check(target, _example(), confirm=False)
        child.check(target, _example(), confirm=False)  # still serving: the same child
        assert child.last["child"] == "seen"
    finally:
        child.close()
    builds = [line.split() for line in (tmp_path / "builds").read_text().splitlines()]
    warmed, served = builds[:-2], builds[-2:]
    caps = target.capabilities
    assert len(warmed) == len(warm_examples(caps)) and all(h == str(caps.head_sizes[0]) for _, _, h in warmed)
    assert {d for d, _, _ in warmed} == set(caps.dtypes) and {k for _, k, _ in warmed} == set(caps.kv_cache_dtypes)
    assert served == [[_example().batch.dtype, "auto", "32"]] * 2
    assert child.started["warm"] > 0 and child.started["warm_errors"] == (len(warmed) if warm else 0)


def test_what_the_warm_up_printed_is_not_the_first_examples_report(tmp_path, monkeypatch):
    """The warm-up's batches "read out of bounds" (the planted access): the report comes before the ready marker,
    so the first example's segment, checked without a fresh child to confirm it, is clean."""
    target, child = _child(tmp_path, monkeypatch, "access")
    try:
        child.check(target, _example(), confirm=False)  # raises MemorySafetyError if the warm-up's lines were its
        assert child.last["child"] == "first" and child.started["warm_errors"] == 0
    finally:
        child.close()
