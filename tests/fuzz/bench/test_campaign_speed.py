"""benchmarks/campaign_speed.py: a campaign worker's time per example by stage, on the engine's path, and whether two
runs ran the same examples to the same verdicts; benchmarks/reference_placement.py: the small tier's CPU reference
time split by its arithmetic."""

from __future__ import annotations

import json
import subprocess

from support import run_benchmark


def _run(*args) -> subprocess.CompletedProcess:
    return run_benchmark("campaign_speed", *args)


def test_a_run_reports_every_stage_and_compare_tells_a_changed_outcome(tmp_path):
    out = tmp_path / "a.json"
    done = _run("--target", "vllm.cpu_attention", "--examples", 12, "--warmup", 2, "--chunk", 6, "--poison", "zeros",
                "--clock", "wall", "--out", out)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    assert rec["examples"] == len(rec["outcomes"]) == 12 and rec["tier"] == "small"
    assert set(rec["stages_ms"]) == {"draw", "generate", "materialize", "check_caller", "kernel", "reference",
                                     "check_output", "hypothesis", "other"}
    for stage in ("draw", "generate", "materialize", "kernel", "reference", "hypothesis"):
        assert rec["stages_ms"][stage] > 0, stage
    assert all(o["signature"] is None and float(o["ratio"]) < 1.0 for o in rec["outcomes"])  # zeros: all pass
    same = _run("--compare", out, out)
    assert same.returncode == 0 and "outcomes identical in all 2 runs (12 examples" in same.stdout
    changed = tmp_path / "b.json"
    rec["outcomes"][5]["signature"] = ["kernel mismatch", "agreement"]
    changed.write_text(json.dumps(rec))
    differs = _run("--compare", out, changed)
    assert differs.returncode == 1 and "outcomes differ" in differs.stdout and "examples [5]" in differs.stdout


def test_a_count_under_one_exits_2_naming_the_option():
    done = _run("--examples", 0)
    assert done.returncode == 2 and done.stderr.strip() == "campaign_speed.py: --examples 0: must be at least 1"


def test_messages_times_the_workers_listener_alone():
    done = _run("--target", "vllm.cpu_attention", "--messages", 3, "--clock", "wall")
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout)
    assert rec["examples"] == 3 and rec["tier"] == "small" and rec["listener_ms_per_example"] > 0
    assert 0 < rec["begin_bytes_median"] <= rec["begin_bytes_max"]


def test_reference_placement_splits_the_reference_time_by_its_work():
    from support import benchmark_script

    lines = benchmark_script("reference_placement").main(["--target", "vllm.unified_attention", "--examples", "4"])
    assert len(lines) == 5 and lines[0].startswith("vllm.unified_attention: 4 small examples, ")
    assert all("% of the reference time" in line for line in lines[1:])
