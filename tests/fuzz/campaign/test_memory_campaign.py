"""An example kvfuzz cannot fit in device memory (out of memory in its own prepare, even alone on the device after
the retries) is neither a finding nor a harness error: `kvfuzz fuzz` counts it as skipped, says so, exits 3."""

import json
import os

from support import SUPPORT, kvfuzz


def test_out_of_memory_in_prepare_is_skipped_not_blamed(tmp_path):
    out = tmp_path / "out"
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_endings.py'}:OutOfMemoryInPrepare", "--poison", "stale",
               "--out", out, "--workers", "1", "--max-examples", "12", "--seed", "1",
               env=dict(os.environ, KVFUZZ_OOM_PAUSES="0,0,0"), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    (target,) = summary["targets"]
    assert target["failures"] == [], target["failures"]  # no harness error, no finding
    assert target["skipped_for_memory"] > 0
    assert r.returncode == 3, r.stdout + r.stderr
    assert any("skipped" in p and "out of device memory" in p for p in summary["problems"])
