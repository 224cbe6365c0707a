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


def test_a_device_full_of_other_workers_cache_is_given_back_not_skipped(tmp_path):
    """Issue 49: on an idle GPU a campaign skipped examples for memory (exit 3), the device full of what other
    workers' caching allocators kept. A planted 10-unit device where each worker's first example caches 6 units
    until kvfuzz gives its memory back: the second worker's first example finds no room; it asks every worker of
    the GPU to give its cache back (memory.Releases), runs again, and the campaign finds nothing and exits 0."""
    out, device = tmp_path / "out", tmp_path / "device"
    device.mkdir()
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_endings.py'}:FillsUnlessReleased", "--poison", "stale",
               "--out", out, "--workers", "2", "--max-examples", "40", "--seed", "1",
               env=dict(os.environ, KVFUZZ_OOM_PAUSES="0,0,0", KVFUZZ_PLANTED_DEVICE=str(device)), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    (target,) = summary["targets"]
    assert target["failures"] == [] and target["skipped_for_memory"] == 0, summary
    assert r.returncode == 0, r.stdout + r.stderr
    # the device really filled: both workers ran a 6-unit example, so one of them waited for the other's release
    assert len(list(device.glob("held-*"))) == 2
