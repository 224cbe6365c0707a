"""Every caller fault is reported as the caller's violation, named and located, with what the kernel did."""

import pytest

from kvfuzz.contracts.example import Example
from kvfuzz.contracts.failures import CallerContractViolation
from kvfuzz.contracts.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.harness.faults import FAULTS, get_fault
from kvfuzz.fuzz.targets import get_target

pytestmark = pytest.mark.kernel

CASES = [
    # fault, target, expected first check, kernel outcomes allowed
    ("decode-ctx-only", "vllm.chunked_prefill_paged_decode", "decode invariant", {"mismatch"}),  # stale poison
    ("int64-index", "vllm.cpu_attention", "index tensor dtype", {"crashed"}),
    ("int64-index", "vllm.chunked_prefill_paged_decode", "index tensor dtype", {"agrees with reference"}),
    ("max-seq-len-too-small", "vllm.chunked_prefill_paged_decode", "max_seq_len", {"agrees with reference"}),
    ("block-out-of-range", "vllm.cpu_attention", "block id range", {"not run"}),
    ("shared-block", "vllm.cpu_attention", "unified invariant", {"mismatch", "non-finite"}),
    ("query-start-loc-mismatch", "vllm.cpu_attention", "query_start_loc", {"not run"}),
    ("query-start-loc-mismatch", "vllm.chunked_prefill_paged_decode", "query_start_loc", {"not run"}),
]


def test_every_fault_has_a_case():
    assert {c[0] for c in CASES} == set(FAULTS)


@pytest.mark.parametrize("fault, target, check, outcomes", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_fault_is_blamed_on_the_caller(make_batch, fault, target, check, outcomes):
    t = get_target(target)
    if not t.availability().ok:
        pytest.skip(t.availability().reason)
    b = make_batch([(5, 3), (1, 20), (4, 9)], dtype="float16", head_size=64, block_size=16, seed=8)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, Example(b, Poison.STALE), get_fault(fault))
    f = info.value
    assert f.kind.blame == "caller" and f.check == check, f.message
    assert f.details["kernel"]["outcome"] in outcomes, f.details["kernel"]
    assert "Fix the caller" in f.message or "fix" in f.details["violations"][0]


def test_without_a_fault_the_same_batch_is_clean(make_batch):
    for name in ("vllm.cpu_attention", "vllm.chunked_prefill_paged_decode"):
        t = get_target(name)
        if t.availability().ok:
            b = make_batch([(5, 3), (1, 20), (4, 9)], dtype="float16", head_size=64, block_size=16, seed=8)
            check_example(t, Example(b, Poison.STALE))


def test_a_fault_that_cannot_apply_leaves_the_example_alone(make_batch):
    b = make_batch([(5, 3)], dtype="float16", head_size=64)
    assert not get_fault("shared-block").applies(b)
    assert not get_fault("decode-ctx-only").applies(b)
    assert not get_fault("max-seq-len-too-small").applies(b, {"query": None})
    with pytest.raises(KeyError, match="known: decode-ctx-only"):
        get_fault("nope")
