"""vLLM's ``merge_attn_states`` family (kvfuzz.fuzz.targets.vllm_merge): the Triton kernel under the interpreter,
vLLM's torch merge (its CPU path), the CUDA op through vLLM's real ``_custom_ops`` wrapper over a stand-in
(tests/support/merge_standins.py), each against the exact merge of its inputs (kvfuzz.fuzz.harness.merge); every
call variant and edge (an empty part, FlashAttention 2's +inf, in place, transposed log-sum-exps, padded parts,
``prefill_tokens_with_context``, parts of very different magnitude, both parts empty); the caller checks; planted
defects found by the property, one found and shrunk by a campaign, and its standalone.py run without kvfuzz."""

import json
import shutil
import subprocess
import sys
import sysconfig

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from support import SUPPORT, available, batch_of, kvfuzz
from support.merge_standins import SEEN, Bf16Weights, ExpDirect, PlusInfKept, StandInCudaMerge, install_cuda_merge

from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.checks.merge import exact_merge
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.merge import MergeInputs
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.properties import check_example
from kvfuzz.fuzz.targets.vllm_merge import VllmTorchMerge, merge_path
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits

pytestmark = pytest.mark.kernel

LIMITS = Limits(max_num_seqs=3, max_ctx_len=40, max_query_len=8, max_num_heads=8)


def batch(seed=0, dtype="float32", value_range="normal", lens=((1, 20), (5, 9), (3, 0))):
    return batch_of(list(lens), num_heads=4, num_kv_heads=2, head_size=40, dtype=dtype, seed=seed,
                    value_range=value_range)


@pytest.mark.parametrize("name,n", [("vllm.merge_attn_states", 12), ("vllm.merge_attn_states_cpu", 60)])
def test_the_real_merges_agree_with_the_exact_merge_on_drawn_examples(name, n):
    t = available(name)

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(examples(t.capabilities, LIMITS))
    def prop(example):
        run = check_example(t, example)
        assert run.ratio <= 1.0 and run.reference.shape == run.output.shape

    prop()


@pytest.mark.parametrize("seed", [0, 1, 6, 15, 23, 31, 54, 63])  # every variant, alone and together
@pytest.mark.parametrize("name", ["vllm.merge_attn_states", "vllm.merge_attn_states_cpu"])
def test_every_call_variant_and_empty_parts(name, seed):
    """Seeds cover both empty-part conventions, output_lse, in place, transposed log-sum-exps, padded parts and
    prefill_tokens_with_context; the third sequence has no context (an empty prefix)."""
    t = available(name)
    b = batch(seed, dtype="float16")
    run = check_example(t, Example(b, Poison.NAN))
    p = merge_path(b)
    kw = run.call.kwargs
    assert (kw["output"] is kw["prefix_output"]) == p.in_place and (kw["output_lse"] is not None) == p.output_lse
    assert kw["prefix_lse"].is_contiguous() != p.lse_transposed
    assert (kw["prefix_output"].stride(1) == 48) == p.padded  # head size 40 in a 48-wide buffer
    assert kw["prefill_tokens_with_context"] == (1 if p.first_seq_only else None)
    assert bool((kw["prefix_lse"][:, 6:] == p.empty_lse).all())  # restored after an in-place merge
    place, empty = "in-place" if p.in_place else "out-of-place", "+inf" if p.empty_lse > 0 else "-inf"
    assert run.path == f"{place},empty_lse={empty}"


@pytest.mark.parametrize("value_range", ["extreme", "shifted", "dominant", "large"])
def test_parts_of_very_different_magnitude(value_range):
    """Log-sum-exps thousands apart ("extreme"), both ~-40,000 ("shifted"), one dominant key: the Triton merge
    stays within its bound (the weights 0 and 1 exactly where the gap passes fp32's exp range)."""
    t = available("vllm.merge_attn_states")
    for seed in (2, 3):
        run = check_example(t, Example(batch(seed, value_range=value_range), Poison.NAN))
        assert run.ratio <= 1.0


def test_both_parts_empty_merge_to_zero_and_minus_inf():
    """Both log-sum-exps infinite (FlashAttention 2's +inf and 3's -inf): output 0, merged log-sum-exp -inf, as the
    kernel's comments and the exact merge say."""
    t = available("vllm.merge_attn_states")
    from kvfuzz.fuzz.targets.triton_runtime import prepare_triton_runtime

    prepare_triton_runtime()
    from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

    out, lse = torch.full((2, 3, 32), float("nan")), torch.full((3, 2), float("nan"))
    parts = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    p_lse = torch.tensor([[float("-inf"), 1.0]] * 3)
    s_lse = torch.tensor([[float("inf"), 2.0]] * 3)
    merge_attn_states(out, parts[0], p_lse, parts[1], s_lse, output_lse=lse)
    exact, exact_lse = exact_merge(MergeInputs(parts[0], p_lse, parts[1], s_lse))
    assert bool((out[0] == 0).all()) and bool((lse[:, 0] == float("-inf")).all()) and t.name
    assert torch.allclose(out.double(), exact, atol=1e-6) and bool((exact_lse[:, 0] == float("-inf")).all())


def test_the_cuda_op_through_vllms_wrapper_on_a_stand_in(monkeypatch):
    install_cuda_merge(monkeypatch)
    for seed in (0, 1, 54, 63):
        check_example(StandInCudaMerge(), Example(batch(seed, dtype="bfloat16"), Poison.NAN))
    assert SEEN and SEEN[-1]["prefill_tokens_with_context"] == 1  # seed 63: the first sequence only


class HalfHeadWrongUnderLoad(StandInCudaMerge):
    """Planted: a merge that is right alone and, in place with other work on the GPU, gets half of each head wrong
    (Finding 19's shape: one warp's share weighted with the wrong log-sum-exp; here the merged output's second half
    halved). ``loaded`` says whether the side stream's work ran before this call."""

    name = "test.merge_half_head_wrong_under_load"
    loaded = False

    def run(self, call):
        type(self).loaded = False  # set by the side stream's work, which super().run queues first when concurrent
        out = super().run(call)
        if type(self).loaded and call.kwargs["output_lse"] is call.kwargs["prefix_lse"]:
            out[..., out.shape[-1] // 2:] *= 0.5
        return out


def test_a_concurrent_call_queues_the_side_streams_work_first_and_only_it(monkeypatch):
    """Seed bit 6 draws MergePath.concurrent; the call carries it (MergeCall) and each merge target runs the side
    stream's work (vllm_merge.side_load) right before the kernel when it is set, and not otherwise. Off CUDA the real
    side_load queues nothing, and the path names no load."""
    from kvfuzz.fuzz.targets import vllm_merge

    assert vllm_merge.side_load(torch.device("cpu")) is False and not vllm_merge._SIDE
    install_cuda_merge(monkeypatch)
    queued = []
    monkeypatch.setattr(vllm_merge, "side_load", lambda device: queued.append(device) or True)
    for target in (available("vllm.merge_attn_states"), StandInCudaMerge()):
        for seed, concurrent in ((6, False), (70, True), (64, True), (63, False)):
            queued.clear()
            b = batch(seed, dtype="float16")
            assert merge_path(b).concurrent == concurrent and merge_path(b).describe().endswith(",concurrent") == \
                concurrent
            run = check_example(target, Example(b, Poison.NAN))
            assert run.call.concurrent == concurrent and queued == ([torch.device("cpu")] if concurrent else [])
            assert ",concurrent" not in run.path  # on a CPU no work shares the call


def test_a_defect_that_shows_only_under_load_is_found_through_the_concurrent_path(monkeypatch):
    """Planted (HalfHeadWrongUnderLoad): the same in-place batch passes without the side stream's work and fails the
    exact merge with it; an out-of-place call passes either way."""
    from kvfuzz.fuzz.targets import vllm_merge

    install_cuda_merge(monkeypatch)

    def side_load(device):
        HalfHeadWrongUnderLoad.loaded = True
        return True

    monkeypatch.setattr(vllm_merge, "side_load", side_load)
    monkeypatch.setattr(HalfHeadWrongUnderLoad, "loaded", False)
    check_example(HalfHeadWrongUnderLoad(), Example(batch(6, dtype="bfloat16"), Poison.NAN))  # in place, alone
    check_example(HalfHeadWrongUnderLoad(), Example(batch(64, dtype="bfloat16"), Poison.NAN))  # loaded, out of place
    assert HalfHeadWrongUnderLoad.loaded  # the load ran, and out of place nothing went wrong
    check_example(HalfHeadWrongUnderLoad(), Example(batch(6, dtype="bfloat16"), Poison.NAN))  # in place, alone again
    with pytest.raises(KernelMismatch):
        check_example(HalfHeadWrongUnderLoad(), Example(batch(70, dtype="bfloat16"), Poison.NAN))


# ---- the caller's side ----------------------------------------------------------------------------------------

class WrongLseShape(VllmTorchMerge):
    """A caller handing the log-sum-exps as [num_tokens, num_heads] (a backend's layout, not transposed)."""

    name = "test.merge_wrong_lse_shape"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["prefix_lse"] = call.kwargs["prefix_lse"].t().contiguous()
        return call


class SwappedLse(VllmTorchMerge):
    """A caller handing each part the other's log-sum-exp."""

    name = "test.merge_swapped_lse"

    def build_call(self, batch, data, cache):
        return super().build_call(batch, data, attrs.evolve(cache, prefix_lse=cache.suffix_lse,
                                                            suffix_lse=cache.prefix_lse))


def test_a_malformed_or_wrong_call_is_the_callers_fault():
    b = batch(0)
    with pytest.raises(CallerContractViolation) as e:
        check_example(WrongLseShape(), Example(b, Poison.NAN))
    assert e.value.check == Check.MERGE_INPUTS.value and "not run" in e.value.message
    with pytest.raises(CallerContractViolation) as e:
        check_example(SwappedLse(), Example(b, Poison.NAN))
    assert e.value.check == Check.MERGE_PARTS.value


# ---- planted defects ------------------------------------------------------------------------------------------

def test_planted_defects_fail_where_they_should_and_pass_elsewhere():
    assert check_example(ExpDirect(), Example(batch(0), Poison.NAN))  # normal logits: exp(lse) is finite
    with pytest.raises(NonFiniteOutput):  # both log-sum-exps ~-40,000: 0 / 0
        check_example(ExpDirect(), Example(batch(0, value_range="shifted"), Poison.NAN))
    check_example(PlusInfKept(), Example(batch(0), Poison.NAN))  # FlashAttention 3's -inf: right
    with pytest.raises(NonFiniteOutput):  # seed 1: FlashAttention 2's +inf for the empty prefix
        check_example(PlusInfKept(), Example(batch(1), Poison.NAN))
    with pytest.raises(KernelMismatch) as e:
        check_example(Bf16Weights(), Example(batch(0), Poison.NAN))
    assert e.value.check == "agreement with the exact merge"


def _without_kvfuzz(d, tmp_path):
    copy = tmp_path / "elsewhere" / d.name
    shutil.copytree(d, copy)
    env = {"PYTHONPATH": f"{sysconfig.get_paths()['purelib']}:{SUPPORT}", "PATH": "/usr/bin:/bin"}
    probe = subprocess.run([sys.executable, "-S", "-c", "import kvfuzz"], cwd=copy, env=env, capture_output=True)
    assert probe.returncode == 1
    return subprocess.run([sys.executable, "-S", str(copy / "standalone.py")], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_campaign_finds_and_shrinks_a_planted_merge_and_its_standalone_reproduces(tmp_path):
    """ExpDirect's NaN (inf / inf at "extreme" log-sum-exps, 0 / 0 at "shifted" ones) shrinks to one token of one
    sequence, one head; the reproducer's
    standalone.py (planted_merges.py on its path, no kvfuzz) exits 1, and with vLLM's merge in its place 0."""
    out = tmp_path / "out"
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'merge_standins.py'}:ExpDirect", "--max-examples", "400",
               "--duration", "240s", "--out", out, "--workers", "1", "--seed", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    (d,) = [p for p in out.iterdir() if p.name.startswith("test.merge_exp_direct")]
    case = json.loads((d / "case.json").read_text())
    b = case["example"]["batch"]
    assert case["kind"] == "non-finite output" and b["value_range"] in ("extreme", "shifted")
    assert len(b["query_lens"]) == 1 and sum(b["query_lens"]) == 1 and b["num_heads"] == 1
    p = _without_kvfuzz(d, tmp_path)
    assert p.returncode == 1 and "REPRODUCED" in p.stdout, p.stdout + p.stderr
    script = (d / "standalone.py").read_text().replace("planted_merges", "vllm.v1.attention.ops.merge_attn_states")
    (d / "standalone.py").write_text(script.replace('"exp_direct"', '"_merge_attn_states_torch"'))
    p = _without_kvfuzz(d, tmp_path / "fixed")
    assert p.returncode == 0 and "not reproduced" in p.stdout, p.stdout + p.stderr
