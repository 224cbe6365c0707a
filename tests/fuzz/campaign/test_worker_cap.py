"""--workers is capped where more workers cannot help (issue 40: `--workers 500 --max-examples 2` on 2 cores ran 0
examples in 120 s): at the example budget, at MAX_WORKERS_PER_CORE per core and MAX_WORKERS_PER_GPU_CAP per GPU."""

import json

from support import SUPPORT, kvfuzz

from kvfuzz.fuzz.campaign.config import MAX_WORKERS_PER_CORE, MAX_WORKERS_PER_GPU_CAP, cap_workers


def test_cap_at_the_example_budget_cores_and_gpus():
    n, why = cap_workers(500, 2, cpus=2)
    assert n == 2 and len(why) == 1 and "2 example(s)" in why[0]
    n, why = cap_workers(500, None, cpus=2)
    assert n == 2 * MAX_WORKERS_PER_CORE and "CPU core" in why[0]
    n, why = cap_workers(1000, None, cpus=1000, gpus=2)
    assert n == 2 * MAX_WORKERS_PER_GPU_CAP and "GPU" in why[0]
    assert cap_workers(3, 30, cpus=2) == (3, [])  # within every cap: as asked


def test_cli_caps_and_says_so(tmp_path):
    out = tmp_path / "out"
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_endings.py'}:Correct", "--poison", "stale", "--out", out,
               "--workers", "500", "--max-examples", "1", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--workers 500 capped at 1" in " ".join(r.stdout.split())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["examples"] == 1
    assert "more cannot help" in " ".join(kvfuzz("fuzz", "--help").stdout.split())
