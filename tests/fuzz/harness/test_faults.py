"""Every caller fault is reported as the caller's violation, named and located, with what the kernel did."""

import pytest
from support import available

from kvfuzz.contracts.checks.failures import CallerContractViolation
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.harness.faults import FAULTS, get_fault
from kvfuzz.fuzz.targets import get_target

pytestmark = pytest.mark.kernel

CASES = [
    # fault, target, expected first check, kernel outcomes allowed
    ("decode-ctx-only", "vllm.chunked_prefill_paged_decode", "decode invariant", {"mismatch"}),  # stale poison
    ("int64-index", "vllm.cpu_attention", "index tensor dtype", {"crashed"}),
    ("block-out-of-range", "vllm.cpu_attention", "block id range", {"not run"}),
    ("shared-block", "vllm.cpu_attention", "unified invariant", {"mismatch", "non-finite"}),
    ("query-start-loc-mismatch", "vllm.cpu_attention", "query_start_loc", {"not run"}),
    ("query-start-loc-mismatch", "vllm.chunked_prefill_paged_decode", "query_start_loc", {"not run"}),
]


# CSR callers (SGLang's kernels): the same faults break kv_indices/kv_indptr instead of a block table
CSR_CASES = [
    ("decode-ctx-only", "sglang.decode_attention_fwd", "unified invariant", {"mismatch"}),
    ("block-out-of-range", "sglang.extend_attention_fwd", "kv_indices range", {"not run"}),
    ("block-out-of-range", "sglang.decode_attention_fwd", "kv_indices range", {"not run"}),
    ("kv-indptr-off-by-one", "sglang.extend_attention_fwd", "kv_indptr", {"mismatch"}),
    ("kv-indptr-off-by-one", "sglang.decode_attention_fwd", "kv_indptr", {"mismatch"}),
    ("shared-block", "sglang.decode_attention_fwd", "unified invariant", {"mismatch"}),
    ("query-start-loc-mismatch", "sglang.extend_attention_fwd", "query_start_loc", {"not run"}),
]
#: the faults that mean nothing for a CSR call (int32/int64 both work there; no max_seq_len argument; no
#: kv_last_page_len)
CSR_NOT_APPLICABLE = {"int64-index", "max-seq-len-too-small", "last-page-len-off-by-one"}
#: faults of FlashInfer's page lists alone (tests/fuzz/harness/test_flashinfer_campaign.py has their cases)
PAGE_LISTS_ONLY = {"last-page-len-off-by-one"}


#: faults that break only what a path on another platform needs: vLLM's ROCm custom kernel reads int32 indices
#: and sizes its partitions from max_seq_len; the Triton path this CPU (and CUDA) takes reads neither. The
#: kernel agrees with the reference, and the guard's checks give a portability warning, not an error.
PORTABILITY_CASES = [
    ("int64-index", "vllm.chunked_prefill_paged_decode", "index tensor dtype"),
    ("max-seq-len-too-small", "vllm.chunked_prefill_paged_decode", "max_seq_len"),
]


def test_every_fault_has_a_case():
    assert {c[0] for c in CASES} | {c[0] for c in CSR_CASES} | {c[0] for c in PORTABILITY_CASES} | PAGE_LISTS_ONLY \
        == set(FAULTS)
    assert {c[0] for c in CSR_CASES} | CSR_NOT_APPLICABLE == set(FAULTS)


@pytest.mark.parametrize("fault, target, check, outcomes", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_fault_is_blamed_on_the_caller(make_batch, fault, target, check, outcomes):
    t = available(target)
    b = make_batch([(5, 3), (1, 20), (4, 9)], dtype="float16", head_size=64, block_size=16, seed=8)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, Example(b, Poison.STALE), get_fault(fault))
    f = info.value
    assert f.kind.blame == "caller" and f.check == check, f.message
    assert f.details["kernel"]["outcome"] in outcomes, f.details["kernel"]
    assert "Fix the caller" in f.message or "fix" in f.details["violations"][0]


@pytest.mark.parametrize("fault, target, check", PORTABILITY_CASES, ids=[f"{c[0]}-{c[1]}" for c in PORTABILITY_CASES])
def test_a_fault_only_another_platform_misreads_is_a_portability_warning(make_batch, fault, target, check):
    from kvfuzz.contracts.checks.violations import Category
    from kvfuzz.fuzz.guard.signatures import check_kernel_call
    from kvfuzz.fuzz.harness.attention import prepare

    t = available(target)
    b = make_batch([(5, 3), (1, 20), (4, 9)], dtype="float16", head_size=64, block_size=16, seed=8)
    check_example(t, Example(b, Poison.STALE), get_fault(fault))  # the kernel agrees: no finding
    run = prepare(t, Example(b, Poison.STALE), get_fault(fault))
    vs = check_kernel_call(t.checked_kernel, run.call.kwargs, vacuity=False)
    assert {(v.check.value, v.category) for v in vs} == {(check, Category.PORTABILITY)}, [v.message for v in vs]
    assert "ROCm gfx90a, gfx942, gfx950" in vs[0].message
    assert [v.check.value for v in check_kernel_call(t.checked_kernel, run.call.kwargs, vacuity=False,
                                                     rocm_arch="gfx942") if v.is_error] == [check] * len(vs)


def _csr_batch(make_batch, target):
    lens = [(1, 3), (1, 20), (1, 9)] if target.capabilities.decode_only else [(5, 3), (1, 20), (4, 9)]
    return make_batch(lens, dtype="float16", head_size=64, block_size=4, seed=8)


@pytest.mark.parametrize("fault, target, check, outcomes", CSR_CASES, ids=[f"{c[0]}-{c[1]}" for c in CSR_CASES])
def test_csr_fault_is_blamed_on_the_caller(make_batch, fault, target, check, outcomes):
    t = available(target)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, Example(_csr_batch(make_batch, t), Poison.STALE), get_fault(fault))
    f = info.value
    assert f.kind.blame == "caller" and f.check == check, f.message
    assert f.details["kernel"]["outcome"] in outcomes, f.details["kernel"]


@pytest.mark.parametrize("target", ["sglang.extend_attention_fwd", "sglang.decode_attention_fwd"])
def test_csr_faults_shrink_to_the_fewest_sequences_they_need(target):
    """Without running the kernel: the caller checks alone flag every fault, and Hypothesis shrinks an example
    to one sequence (kv-indptr-off-by-one: two, a boundary between sequences)."""
    from hypothesis import find, settings

    from kvfuzz.fuzz.harness.attention import caller_violations, prepare
    from kvfuzz.strategies.batches import examples
    from kvfuzz.strategies.limits import Limits

    t = get_target(target)
    applicable = sorted({c[0] for c in CSR_CASES if c[1] == target})
    for name in applicable:
        fault = get_fault(name)

        def flagged(e, fault=fault):
            run = prepare(t, e, fault)
            return fault.applies(e.batch, run.call.kwargs) and bool(caller_violations(t, run))

        e = find(examples(t.capabilities, Limits(max_num_seqs=3, max_ctx_len=40, max_query_len=8, max_num_heads=4)),
                 flagged, settings=settings(max_examples=300, deadline=None, database=None))
        assert e.batch.num_seqs == fault.needs_seqs, (name, e.batch.summary())


@pytest.mark.parametrize("name", ["vllm.cpu_attention", "vllm.chunked_prefill_paged_decode"])
def test_without_a_fault_the_same_batch_is_clean(make_batch, name):
    t = available(name)
    b = make_batch([(5, 3), (1, 20), (4, 9)], dtype="float16", head_size=64, block_size=16, seed=8)
    check_example(t, Example(b, Poison.STALE))


def test_a_fault_that_cannot_apply_leaves_the_example_alone(make_batch):
    b = make_batch([(5, 3)], dtype="float16", head_size=64)
    assert not get_fault("shared-block").applies(b)
    assert not get_fault("decode-ctx-only").applies(b)
    assert not get_fault("max-seq-len-too-small").applies(b, {"query": None})
    assert not get_fault("last-page-len-off-by-one").applies(b, {"query": None, "block_table": None})
    assert not get_fault("last-page-len-off-by-one").applies(b, {"kv_indptr": None, "kv_indices": None})
    with pytest.raises(KeyError, match="known: decode-ctx-only"):
        get_fault("nope")
