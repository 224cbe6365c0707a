"""Each real target end to end on CPU: correct calls pass, the seeds' caller fault is blamed on the caller."""


import pytest
from support import ROOT, available, kvfuzz

from kvfuzz.contracts.checks.failures import CallerContractViolation
from kvfuzz.contracts.checks.invariants import DECODE, UNIFIED
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.harness.faults import get_fault
from kvfuzz.strategies import Limits

pytestmark = pytest.mark.kernel




@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_chunked_prefill_paged_decode_mixed_batch_agrees(make_batch, dtype):
    t = available("vllm.chunked_prefill_paged_decode")
    b = make_batch([(5, 3), (1, 20), (17, 0), (1, 0)], dtype=dtype, head_size=64, reverse=True, seed=2)
    run = check_example(t, Example(b, Poison.NAN))
    assert run.path == "context_attention_fwd+kernel_paged_attention_2d"
    assert run.output.isfinite().all()


@pytest.mark.parametrize("name, invariant", [("vllm.chunked_prefill_paged_decode", DECODE),
                                             ("vllm.cpu_attention", UNIFIED)])
def test_seeds_fault_is_a_caller_violation_and_shows_the_kernel_outcome(make_batch, name, invariant):
    t = available(name)
    b = make_batch([(5, 3), (1, 20)], dtype="float32", head_size=64, block_size=16, seed=3)
    with pytest.raises(CallerContractViolation) as info:
        check_example(t, Example(b, Poison.NAN), get_fault("decode-ctx-only"))
    f = info.value
    assert f.kind.blame == "caller" and f.check == invariant.value
    v = f.details["violations"][0]
    assert (v["seq"], v["position"]) == (1, 20)
    assert f.details["kernel"]["outcome"] == "non-finite"  # what the kernel computed from that cache
    assert "Kernel computed from this call: non-finite" in f.message


@pytest.mark.parametrize("name", ["vllm.chunked_prefill_paged_decode", "vllm.cpu_attention"])
def test_short_campaign_on_each_real_target(tmp_path, name):
    """A few generated examples with finite poison (the NaN tail defect of vllm.cpu_attention, Finding 1, is tested in
    test_cpu_layout.py) at the value ranges the gate draws (Findings 11 and 15 at "extreme"/"shifted" values are
    tested in test_attention_params.py): no finding, every example counted, paths recorded."""
    t = available(name)
    ranges = t.gate_value_ranges or Limits().value_ranges
    cfg = CampaignConfig(out=tmp_path, max_examples=6, seed=1, poisons=(Poison.STALE, Poison.ZEROS),
                         limits=Limits(max_num_seqs=3, max_ctx_len=40, max_query_len=12, value_ranges=ranges))
    stats = fuzz_target(t, cfg)
    assert stats.failures == {}, [f.message for f in stats.failures.values()]
    assert stats.examples == 6 and sum(stats.paths.values()) == 6


def test_a_subclass_that_does_not_set_its_own_name_is_rejected(tmp_path):
    """Issue 15 §3: sharing the parent's name would share its reproducer directories and database key."""
    from kvfuzz.fuzz.targets.registry import load_spec

    adapter = tmp_path / "nameless.py"
    adapter.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
                       "from sdpa_paged_target import SdpaPaged\n\nclass Faster(SdpaPaged):\n    pass\n")
    with pytest.raises(ValueError, match=r"Faster does not set its own `name`: it would share SdpaPaged's name "
                                         r"'example.sdpa_paged'"):
        load_spec(f"{adapter}:Faster")
    r = kvfuzz("fuzz", "--target", f"{adapter}:Faster", "--max-examples", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "does not set its own `name`" in r.stderr and "nameless.py" in r.stderr, r.stderr


def test_a_failed_import_is_an_availability_that_says_what_failed():
    from kvfuzz.fuzz.targets.base import Availability, try_import

    module, why = try_import("json")
    assert why is None and module.__name__ == "json"
    assert try_import("kvfuzz_no_such_module")[1] == Availability(
        False, "importing kvfuzz_no_such_module failed: ModuleNotFoundError: No module named 'kvfuzz_no_such_module'")

    def broken():
        raise RuntimeError("libcudart.so.13: cannot open shared object file")

    assert try_import("the extension", broken, fix="install CUDA 13") == (None, Availability(
        False, "importing the extension failed: RuntimeError: libcudart.so.13: cannot open shared object file "
               "(install CUDA 13)"))
