"""benchmarks/sanitize_phases.py: the sanitize stage by phase printed from a summary's ``time.sanitize``, a row per
phase and a column per group of examples, each cell seconds/examples."""

from __future__ import annotations

from support import benchmark_script

from kvfuzz.fuzz.campaign.stages import StageTable, time_table


def _module():
    return benchmark_script("sanitize_phases")


def test_the_breakdown_prints_a_row_per_phase_and_a_column_per_group():
    table = StageTable()
    table.add("small", {"sanitize": 16.0}, examples=1, sanitize={
        "group": "first example", "seconds": {"start": 14.0, "compile": 1.5, "kernel": 0.5},
        "start": {"seconds": 14.5, "target": 6.0, "cuda": 1.0, "warm": 5.5, "warm_errors": 1}})
    table.add("small", {"sanitize": 0.5}, examples=1, sanitize={"group": "seen config", "seconds": {"kernel": 0.5}})
    table.add("small", {"sanitize": 0.01}, examples=1, sanitize={"group": "skipped", "seconds": {"other": 0.01}})
    summary = {"time": time_table([("t", table)], wall=100.0, startup=0.0, workers=2),
               "targets": [{"target": "t", "examples": 3, "first_failure_s": None}]}
    lines = _module().lines_of(summary, "seed-1")
    text = "\n".join(lines)
    assert lines[0] == "seed-1: wall 100 s of worker time (2 workers), sanitize stage 16.5 s (16.5%)"
    assert "due for the sanitizer 3 (sanitized 2, skipped 1)" in text and "14.5 s spawn to ready" in text
    assert "CUDA context 1.0 s, warm-up 5.5 s with 1 example(s) refused" in text
    header = next(line for line in lines if line.strip().startswith("phase"))
    assert header.split()[1:] == ["all", "first", "example", "seen", "config", "skipped"]
    kernel = next(line for line in lines if line.strip().startswith("kernel"))
    assert kernel.split()[1:] == ["1.00/2", "0.50/1", "0.50/1", "-"]
    assert [line.split()[0] for line in lines[4:]] == ["start", "compile", "kernel", "other", "examples", "seconds",
                                                       "s/example"]
    assert _module().lines_of({"time": {"wall_s": 1.0}}, "x")[-1] == "  no sanitized run"
