"""benchmarks/pyspy_top.py: inclusive shares from py-spy's raw stacks (each frame counted once per stack)."""

from __future__ import annotations

from support import benchmark_script


def _module():
    return benchmark_script("pyspy_top")


def test_inclusive_shares_count_a_recursive_frame_once():
    raw = [
        "main (w.py:1);check (fuzz/harness/attention.py:9);reference (contracts/checks/reference.py:5) 6\n",
        "main (w.py:1);check (fuzz/harness/attention.py:12);check (fuzz/harness/attention.py:30) 3\n",
        "main (w.py:1);draw (hypothesis/core.py:2) 1\n",
        "garbage line without a count\n",
    ]
    total, frames = _module().top_frames(raw)
    shares = dict(frames)
    assert total == 10
    assert shares["main (w.py)"] == 10
    assert shares["check (fuzz/harness/attention.py)"] == 9  # the recursive call once, not 12
    assert shares["reference (contracts/checks/reference.py)"] == 6
    _, only = _module().top_frames(raw, under="contracts/")
    assert [k for k, _ in only] == ["reference (contracts/checks/reference.py)"]
