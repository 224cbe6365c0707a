"""FlashInfer's calls inside campaigns, without a GPU (issue 20): every example of a FlashInfer target goes
through the guard's plan()/run() (and append) checks, so a caller fault is reported as the caller's, under the
names the guard itself uses. The kernels are the stand-in of tests/support/flashinfer_standin.py (NOT FlashInfer: its
documented contract computed on the CPU from the page lists it is handed)."""

import pytest
import torch
from support.flashinfer_standin import install_standin

from kvfuzz.contracts.checks.failures import CallerContractViolation
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import flashinfer as fi_guard
from kvfuzz.fuzz.guard.interception import guard
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.caller import call_violations, caller_violations
from kvfuzz.fuzz.harness.faults import FAULTS, get_fault, page_list_names
from kvfuzz.fuzz.targets import get_target
from kvfuzz.fuzz.targets.flashinfer import CHECKED_KERNELS

DECODE, TC, PREFILL, APPEND = ("flashinfer.batch_decode", "flashinfer.batch_decode_tc", "flashinfer.batch_prefill",
                               "flashinfer.append_paged_kv_cache")
TARGETS = (DECODE, TC, PREFILL, APPEND)


@pytest.fixture
def standin(monkeypatch):
    return install_standin(monkeypatch)


def fresh(name):
    """A new instance of the target (a registered one keeps the wrappers it made with an earlier stand-in)."""
    return type(get_target(name))()


def batch_for(make_batch, target, seed=8, **kw):
    """Three sequences over pages of 8 (the first two span several pages; ids handed out in reverse), fp16,
    head size 64; decode-only targets get decodes."""
    t = get_target(target)
    lens = [(1, 13), (1, 20), (1, 9)] if t.capabilities.decode_only else [(5, 8), (1, 20), (4, 0)]
    args = dict(dtype="float16", head_size=64, block_size=8, num_heads=8, num_kv_heads=2, seed=seed, reverse=True)
    return make_batch(lens, **{**args, **kw})


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])  # the four cache forms: NHD/HND x 5-D/(k, v)
def test_a_correct_call_passes_every_check_and_the_model_agrees(make_batch, standin, target, seed):
    t = fresh(target)
    b = batch_for(make_batch, target, seed=seed)
    run = properties.prepare(t, Example(b, Poison.NAN))
    assert t.checked_kernel.name in CHECKED_KERNELS and page_list_names(run.call.kwargs)
    assert caller_violations(t, run) == []
    properties.check(t, Example(b, Poison.NAN), run=run)  # no finding: the stand-in agrees with the reference


def test_the_tensor_core_decode_takes_group_size_7_and_builds_its_wrapper_with_the_flag(make_batch, standin):
    b = batch_for(make_batch, TC, num_heads=7, num_kv_heads=1)
    assert get_target(TC).capabilities.accepts(b) and not get_target(DECODE).capabilities.accepts(b)
    properties.check(fresh(TC), Example(b, Poison.NAN))
    assert "decode.plan(tensor cores)" in standin.calls


#: fault, target, the first check reported (the guard's name for it), what the kernel did with the call
CASES = [
    ("last-page-len-off-by-one", DECODE, "kv_last_page_len", {"not run"}),
    ("last-page-len-off-by-one", PREFILL, "kv_last_page_len", {"not run"}),
    ("last-page-len-off-by-one", APPEND, "kv_last_page_len", {"not run"}),
    ("block-out-of-range", DECODE, "kv_indices range", {"not run"}),
    ("block-out-of-range", TC, "kv_indices range", {"not run"}),
    ("block-out-of-range", PREFILL, "kv_indices range", {"not run"}),
    ("block-out-of-range", APPEND, "kv_indices range", {"not run"}),
    ("kv-indptr-off-by-one", DECODE, "kv_indptr", {"mismatch"}),
    ("kv-indptr-off-by-one", PREFILL, "kv_indptr", {"mismatch", "not run"}),
    ("kv-indptr-off-by-one", APPEND, "kv_indptr", {"not run"}),
    ("decode-ctx-only", DECODE, "unified invariant", {"mismatch"}),
    ("decode-ctx-only", TC, "unified invariant", {"mismatch"}),
    ("query-start-loc-mismatch", PREFILL, "query_start_loc", {"not run"}),
    ("int64-index", APPEND, "index tensor dtype", {"wrote the cache"}),
]
#: faults that leave a page-list call alone (kvfuzz's max_seq_len and a shared block have no FlashInfer form)
#: or break nothing FlashInfer needs: attention's wrappers take all-int64 page lists (the module is compiled
#: for indptr.dtype), the writer's pre-write cache holds ctx_len positions whatever the fault
NOT_A_VIOLATION = [("max-seq-len-too-small", DECODE), ("shared-block", DECODE), ("shared-block", PREFILL),
                   ("int64-index", DECODE), ("int64-index", PREFILL), ("decode-ctx-only", APPEND),
                   ("query-start-loc-mismatch", DECODE), ("query-start-loc-mismatch", APPEND)]


def test_every_fault_has_a_flashinfer_case():
    assert {c[0] for c in CASES} | {c[0] for c in NOT_A_VIOLATION} == set(FAULTS)


@pytest.mark.parametrize("fault, target, check, outcomes", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_faulty_call_is_the_callers_violation_named_as_the_guard_names_it(make_batch, standin, fault, target,
                                                                             check, outcomes):
    t = fresh(target)
    b = batch_for(make_batch, target)
    with pytest.raises(CallerContractViolation) as info:
        properties.check(t, Example(b, Poison.STALE), get_fault(fault))
    f = info.value
    assert f.kind.blame == "caller" and f.check == check, f.message
    assert f.details["kernel"]["outcome"] in outcomes, f.details["kernel"]
    assert all(v["fix"] for v in f.details["violations"])


@pytest.mark.parametrize("fault, target", NOT_A_VIOLATION, ids=[f"{f}-{t}" for f, t in NOT_A_VIOLATION])
def test_a_fault_flashinfer_does_not_mind_passes(make_batch, standin, fault, target):
    t = fresh(target)
    b = batch_for(make_batch, target)
    run = properties.prepare(t, Example(b, Poison.STALE), get_fault(fault))
    properties.check(t, Example(b, Poison.STALE), get_fault(fault), run=run)
    if fault == "int64-index" and t.capabilities.contract.is_attention:
        assert {run.call.kwargs[n].dtype for n in page_list_names(run.call.kwargs)} == {torch.int64}


def test_the_campaign_checks_are_the_guards_own(make_batch, standin):
    """The same faulty decode, once through the harness and once through FlashInfer's (stand-in) wrapper under
    the installed guard: the guard records the checks the harness reports (the harness adds its ground-truth
    comparison with the batch on top)."""
    t = fresh(DECODE)
    b = batch_for(make_batch, DECODE)
    for fault in ("last-page-len-off-by-one", "block-out-of-range", "kv-indptr-off-by-one"):
        run = properties.prepare(t, Example(b, Poison.STALE), get_fault(fault))
        harness = {v.check for v in call_violations(t, run)}
        with guard(mode="record") as g, fi_guard.flashinfer_guard(standin):
            with g.new_kv(*run.data.new_kv(b)):
                try:
                    t.run(run.call)
                except IndexError:  # the stand-in follows the bad page id out of the cache, after the guard
                    assert fault == "block-out-of-range"
        recorded = {c for r in g.records for c in r.checks}
        assert recorded and recorded <= harness, (fault, recorded, harness)


def test_writer_faults_apply_only_to_page_list_writers(make_batch):
    """vLLM's reshape_and_cache takes no page lists: faults' call mutations still leave its calls alone."""
    from support import available

    t = available("vllm.cpu_reshape_and_cache")
    b = make_batch([(5, 3), (1, 20)], dtype="float32", head_size=64, block_size=16)
    properties.check(t, Example(b, Poison.STALE), get_fault("kv-indptr-off-by-one"))
    properties.check(t, Example(b, Poison.STALE), get_fault("last-page-len-off-by-one"))


@pytest.mark.parametrize("target, fault, check", [(DECODE, "last-page-len-off-by-one", "kv_last_page_len"),
                                                  (PREFILL, "kv-indptr-off-by-one", "kv_indptr"),
                                                  (APPEND, "block-out-of-range", "kv_indices range")])
def test_a_campaign_with_a_caller_fault_reports_only_the_callers_violation(tmp_path, standin, target, fault, check):
    """A whole (in-process) campaign on the stand-in: every example draws a FlashInfer configuration, the fault
    breaks its call, and the only finding is the caller's, under the guard's name; without the fault, none."""
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import fuzz_target
    from kvfuzz.strategies import Limits

    limits = Limits(max_num_seqs=2, max_ctx_len=20, max_query_len=6, max_num_heads=4)
    t = fresh(target)
    stats = fuzz_target(t, CampaignConfig(out=tmp_path / "fault", max_examples=8, seed=1, fault=get_fault(fault),
                                          limits=limits, poisons=(Poison.STALE,), structural_shrink=0))
    assert {(f.kind, f.check) for f in stats.failures.values()} == {("caller contract violation", check)}
    clean = fuzz_target(t, CampaignConfig(out=tmp_path / "clean", max_examples=8, seed=1, limits=limits,
                                          poisons=(Poison.STALE,), structural_shrink=0))
    assert not clean.failures and clean.examples == 8
