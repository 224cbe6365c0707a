"""benchmarks/bug_draws.py: bug.flashinfer-4401's bench campaign replayed on the CPU (the same fuzz_target, pinning and
steering as `kvfuzz bench bugs` on CUDA, on a stand-in; a simulated GPU clock) draws a row that triggers it within
240 s: issue 53. Before chunks gave way after their share of --duration, seed 0's campaign stayed in its first
module, which has a soft cap (benchmarks/results/flashinfer-4401-draws-cpu.txt)."""

from __future__ import annotations

import json

from support import run_benchmark


def test_a_240_s_campaign_of_flashinfer_4401_draws_a_triggering_row(tmp_path):
    out = tmp_path / "draws.json"
    done = run_benchmark("bug_draws", "--seeds", 0, "--duration", 240, "--until-trigger", "--json", out, timeout=900)
    assert done.returncode == 0, done.stderr
    (summary,) = json.loads(out.read_text())["summaries"]
    assert summary["first triggering example"] is not None, summary
    assert summary["first trigger at (simulated s)"] <= 240, summary
    (run,) = json.loads(out.read_text())["runs"]
    first = run["rows"][summary["first triggering example"] - 1]
    assert first["value_range"] == "shifted" and first["softcap"] is None and first["min_row_max_logit"] < -34657
    assert len({r["module"] for r in run["rows"]}) >= 2  # it left its first module, which has a soft cap
    assert run["rows"][0]["softcap"] is not None
