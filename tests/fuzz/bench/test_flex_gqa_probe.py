"""benchmarks/flex_gqa_probe.py: each case through torch.flex_paged with the options named (here on the CPU, eagerly:
what the GPU run prints comes from the same lines)."""

from __future__ import annotations

import pytest
from support import benchmark_script

from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged

pytestmark = pytest.mark.kernel


def test_each_case_runs_through_the_target_with_the_options_named(capsys):
    own = TorchFlexPaged.__dict__["kernel_options"]
    assert benchmark_script("flex_gqa_probe").main(["--options", "target,former"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# torch ") and "eager (cpu)" in lines[0] and "get_kernel_options: vllm" in lines[0]
    cases = lines[1:-1]
    assert len(cases) == 18 and lines[-1] == "# 0 of 18 did not pass"
    assert cases[12] == ("H=64/1 D=16 q=1 page=16 float32, target {'FORCE_USE_FLEX_ATTENTION': True, 'BLOCK_M': 16, "
                        "'BLOCK_N': 16}: passed")
    assert cases[13] == ("H=64/1 D=16 q=1 page=16 float32, former {'BLOCK_M': 32, 'BLOCK_N': 16, 'num_warps': 4, "
                        "'num_stages': 1}: passed")
    assert TorchFlexPaged.__dict__["kernel_options"] is own  # the target's own options put back


def test_a_failing_case_prints_its_error_and_is_counted(capsys, monkeypatch):
    """Planted: options that raise (each case reports the error type and its last lines, and is counted)."""
    probe = benchmark_script("flex_gqa_probe")
    monkeypatch.setitem(probe.OPTIONS, "former", staticmethod(lambda batch: 1 / 0))
    assert probe.main(["--options", "former"]) == 0
    out = capsys.readouterr().out
    assert out.count(": ZeroDivisionError\n") == 9 and out.rstrip().endswith("# 9 of 9 did not pass")


def test_an_unknown_option_is_refused(capsys):
    assert benchmark_script("flex_gqa_probe").main(["--options", "target,fixed"]) == 2
    assert "--options 'target,fixed': each must be one of target, former, defaults" in capsys.readouterr().err
