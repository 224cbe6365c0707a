"""benchmarks/draw_speed.py: Hypothesis's and the strategies' time per example without the harness (issue 51), and
whether two runs drew the same examples."""

from __future__ import annotations

import json
import subprocess

from support import run_benchmark


def _run(*args) -> subprocess.CompletedProcess:
    return run_benchmark("draw_speed", *args)


def test_a_run_splits_draw_and_engine_and_compare_tells_a_changed_example(tmp_path):
    out = tmp_path / "a.json"
    done = _run("--target", "vllm.cpu_attention", "--device", "cpu", "--examples", 8, "--repeat", 2, "--out", out)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    assert rec["examples"] == len(rec["digests"]) == 8 and rec["tier"] == "small" and len(rec["runs_ms"]) == 2
    assert rec["draw_ms"] > 0 and rec["hypothesis_ms"] > 0
    same = _run("--compare", out, out)
    assert same.returncode == 0 and "examples identical in all 2 runs (8 examples)" in same.stdout
    rec["digests"][3] = "0" * 64
    changed = tmp_path / "b.json"
    changed.write_text(json.dumps(rec))
    differs = _run("--compare", out, changed)
    assert differs.returncode == 1 and "examples differ" in differs.stdout


def test_a_count_under_one_exits_2():
    done = _run("--examples", 0)
    assert done.returncode == 2 and "must be at least 1" in done.stderr
