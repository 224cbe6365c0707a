"""benchmarks/harness_gpu_time.py: each harness stage's device work per example (CUDA kernels and peak memory on a
GPU; operators on the CPU), attributed to the stage that launched it."""

from __future__ import annotations

import json

import pytest
import torch
from support import benchmark_script
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from kvfuzz.fuzz.harness import attention


@pytest.fixture(scope="module")
def gt():
    return benchmark_script("harness_gpu_time")


def test_every_stage_is_reported_and_a_planted_operator_lands_in_its_stage(gt, tmp_path, monkeypatch):
    """On vllm.cpu_attention: an FFT planted in the reference and an i0 in the output checks (a stage no function of
    the marks opens: it follows the reference) are each counted once per example, in their stage and nowhere else."""
    reference, check_output = attention.reference_and_envelope, attention.check_output

    def planted_reference(*a, **k):
        torch.fft.rfft(torch.ones(8, dtype=torch.float64))
        return reference(*a, **k)

    def planted_check(*a, **k):
        torch.special.i0(torch.ones(3))
        return check_output(*a, **k)

    monkeypatch.setattr(attention, "reference_and_envelope", planted_reference)
    monkeypatch.setattr(attention, "check_output", planted_check)
    out = tmp_path / "gpu-time.json"
    doc = gt.main(["--target", "vllm.cpu_attention", "--examples", "4", "--per-config", "2", "--poisons", "stale",
                   "--group", "3", "--top", "1000", "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    (rec,) = doc["records"]
    assert rec["measure"] == "cpu ops" and rec["examples"] == 4 and "error" not in rec["verdicts"]
    assert list(rec["stages"]) == list(gt.ALL)
    for stage, row in rec["stages"].items():
        assert set(row) == {"ms", "count"}, stage  # no memory figure on the CPU
        assert row["ms"] >= 0 and row["count"] >= 0, (stage, row)
    for stage in ("generate", "materialize", "kernel", "reference", "check_output"):
        assert rec["stages"][stage]["count"] > 0, stage
    calls = {stage: {name: n for name, _, n in rows} for stage, rows in rec["top"].items()}
    assert calls["reference"]["aten::_fft_r2c"] == 1.0
    assert calls["check_output"]["aten::i0"] == 1.0
    for stage in gt.ALL:
        assert stage == "reference" or "aten::_fft_r2c" not in calls[stage], stage
        assert stage == "check_output" or "aten::i0" not in calls[stage], stage
    # the kernel stage is Target.run alone: vLLM's CPU op, none of the harness's own operators
    assert "aten::fill_" not in calls["kernel"]
    assert rec["total_ms"] == pytest.approx(sum(r["ms"] for r in rec["stages"].values()), abs=1e-3)
    assert rec["ceiling_examples_per_s"] == round(1000 / rec["total_ms"], 1)
    assert attention.reference_and_envelope is planted_reference  # the marks put back what they wrapped
    lines = gt.report(rec, 3)
    assert len(lines) == 2 + len(gt.ALL) + 1 + 3 + 1 and "ceiling" in lines[-1] and "aten::" in lines[-2]


def _event(i, name, start, end, device=DeviceType.CPU):
    return FunctionEvent(id=i, name=name, thread=1, start_us=start, end_us=end, device_type=device)


def test_cuda_kernels_go_to_the_stage_that_launched_them(gt):
    """The CUDA path on synthetic profiler events: a kernel of an operator inside a stage's range, a Triton kernel
    tied to the range itself, the range's GPU-side copy (not a kernel), a kernel outside every range ("other"), and
    a device event tied to nothing (unattributed)."""
    ref = _event(1, gt.PREFIX + "reference", 0, 100)
    ref.append_kernel("kernel_unified_attention_2d", 0, 5)
    ref.append_kernel(gt.PREFIX + "reference", 0, 90)  # the gpu_user_annotation: the span of its kernels
    op = _event(2, "aten::abs", 10, 20)
    op.append_kernel("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<double>, "
                     "std::array<char*, 2ul> >(int, at::native::AbsFunctor<double>, std::array<char*, 2ul>)", 0, 7)
    run = _event(3, gt.PREFIX + "kernel", 100, 150)
    fa = _event(4, "_vllm_fa3_C::fwd", 120, 130)
    fa.append_kernel("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)",
                     0, 3)
    stray = _event(5, "aten::copy_", 200, 210)
    stray.append_kernel("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
                        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(...)", 0, 1)
    device = [_event(10 + i, n, 300, 300 + us, DeviceType.CUDA)
              for i, (n, us) in enumerate([("k", 5), ("k", 7), ("k", 3), ("k", 1), ("lost", 2),
                                           (gt.PREFIX + "reference", 90)])]
    acc = gt.accumulator()
    gt.attribute([ref, op, run, fa, stray, *device], acc, cuda=True)
    got = gt.summarize(acc, {"reference": [2.0, 6.0]}, 2, True, 5)
    s = got["stages"]
    assert (s["reference"]["ms"], s["reference"]["count"]) == (0.006, 1.0)  # per example of 2: (5 + 7) us / 2
    assert (s["kernel"]["ms"], s["kernel"]["count"]) == (0.0015, 0.5)
    assert (s["other"]["ms"], s["check_output"]["ms"]) == (0.0005, 0.0)
    assert got["unattributed_ms"] == 0.001 and got["total_ms"] == 0.008 and got["harness_ms"] == 0.0065
    assert (s["reference"]["peak_mib_mean"], s["reference"]["peak_mib_max"], s["kernel"]["peak_mib_max"]) == (
        4.0, 6.0, 0)
    assert s["reference"]["cpu_ms"] == 0.005  # aten::abs's host time; a range's own time is not an operator's
    assert [n for n, _, _ in got["top"]["reference"]] == ["vectorized_elementwise_kernel[AbsFunctor]",
                                                          "kernel_unified_attention_2d"]
    assert got["top"]["kernel"][0][0] == "device_kernel[FlashAttnFwdSm90]"
    assert got["top"]["other"][0][0] == "elementwise_kernel[direct_copy_kernel_cuda]"


class _Memory:
    """A device whose allocated and peak bytes the test sets."""

    def __init__(self):
        self.now = self.high = 0

    def allocated(self):
        return self.now

    def reset(self):
        self.high = self.now

    def peak(self):
        return self.high


def test_a_stage_peak_is_above_its_start_and_the_largest_of_its_stretches(gt):
    mem = _Memory()
    marks = gt.StageMarks(mem)
    mem.now = 100
    marks.enter("materialize")
    mem.high, mem.now = 400, 150  # grew by 300 at most, kept 50
    marks.enter("check_caller")
    mem.high = 170
    marks.enter("materialize")  # the output's poison: a second stretch of materialize, smaller
    mem.high = 250
    marks.enter(None)
    assert marks.peaks == {"materialize": 300, "check_caller": 20}


def test_a_late_caller_check_returns_to_the_output_checks(gt):
    """The marks' boundaries: a failing example's caller checks after the output checks return there; before the
    kernel they hand over to materialize (the output's poison)."""
    marks = gt.StageMarks()
    seen = []
    check = marks.wrap("caller_violations", lambda: seen.append(marks.stage))
    marks.enter("check_output")
    check()
    assert (seen, marks.stage) == (["check_caller"], "check_output")
    marks.enter("materialize")
    check()
    assert marks.stage == "materialize"
    marks.enter(None)


def test_short_names(gt):
    assert gt.short_name("aten::mm") == "aten::mm"
    assert gt.short_name("kernel_unified_attention_3d") == "kernel_unified_attention_3d"
    assert gt.short_name("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<double, at::native::"
                         "func_wrapper_t<double, at::native::sum_functor<double, double, double>::operator()"
                         "(at::TensorIterator&)::{lambda(double, double)#1}>, unsigned int, double, 4, 4> >"
                         "(at::native::ReduceOp<double>)") == "reduce_kernel[sum_functor]"
    assert len(gt.short_name("x" * 300)) == 80


@pytest.mark.parametrize("argv, named", [(["--target", "nope"], "--target: unknown target 'nope'"),
                                         (["--replay", "/nonexistent/missing.json"], "--replay:"),
                                         (["--poisons", "bogus"], "--poisons:"), (["--group", "0"], "--group")])
def test_bad_usage_exits_2_naming_the_option(gt, tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        gt.main([*argv, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    assert named in capsys.readouterr().err and not (tmp_path / "x.json").exists()
