"""benchmarks/fa4_backend_guard.py --standin: vLLM's own FLASH_ATTN backend code (FlashAttentionImpl.forward and
do_kv_cache_update, executed from the installed flash_attn.py) picks FA4 for head size 512 on a stand-in SM90,
calls vLLM's flash_attn_varlen_func wrapper over the FA4 stand-in, and the guard records nothing on the correct
calls and the unwritten decode token on the planted one; with the fault removed the planted check fails."""

import pytest
import torch
from support import benchmark_script, run_benchmark

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-ins replace CUDA ops")


@no_cuda
def test_the_standin_run_passes_the_backends_calls_and_catches_the_planted_fault():
    r = run_benchmark("fa4_backend_guard", "--standin", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.split()}
    for case in ("bf16", "fp16-block64", "window64", "sinks", "fp8-e4m3"):
        assert lines[case][1:4] == ["4", "1", "0"], r.stdout  # fa_version 4, one checked call, no record
        assert float(lines[case][4]) < 0.05, r.stdout
    assert lines["planted"][1:4] == ["4", "1", "1"], r.stdout
    assert "unified invariant violated in flash_attn_varlen_func at sequence 0, position 300" in r.stdout
    assert "all expectations held" in r.stdout


@no_cuda
def test_the_planted_check_fails_when_the_fault_is_not_planted(monkeypatch, capsys):
    mod = benchmark_script("fa4_backend_guard")
    monkeypatch.setattr(mod, "plant", lambda slots: None)  # the token written: nothing to record
    assert mod.main(["--standin", "--cases", "planted"]) == 1
    out = capsys.readouterr().out
    assert "FAILED planted: the guard recorded the unwritten token" in out
