"""A kernel that leaves the device unusable (one of CUDA's sticky errors: an illegal memory access, a launch
failure, a device-side assert) ends its worker: the example is a kernel crash ("CUDA error"), and no later
example of that process is blamed on kvfuzz's prepare (harness.run.run_kernel, campaign.workers.endings).
On this CPU the sticky error is planted (tests/support/planted_endings.py BreaksDevice: after its kernel fails,
every later call of the process fails too, as a dead CUDA context does)."""

import json

import pytest
import torch

from kvfuzz.fuzz.campaign.workers.endings import DEVICE_ERROR, EndingKind, classify, finding_for
from kvfuzz.fuzz.harness import run as harness_run
from kvfuzz.fuzz.harness.run import DEVICE_ERROR_EXIT, leaves_device_unusable, run_kernel

from support import SUPPORT, kvfuzz

PLANTED = SUPPORT / "planted_endings.py"


@pytest.mark.parametrize("text", ["CUDA error: an illegal memory access was encountered",
                                  "CUDA error: unspecified launch failure", "CUDA error: device-side assert triggered",
                                  "CUDA error: misaligned address"])
def test_sticky_errors_leave_the_device_unusable(text):
    assert leaves_device_unusable(RuntimeError(text))


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: out of memory"),
                                   RuntimeError("CUDA error: too many resources requested for launch"),
                                   RuntimeError("CUDA error: invalid argument"), ValueError("illegal memory access")])
def test_errors_that_leave_the_context_usable_stay_findings_of_the_example(error):
    assert not leaves_device_unusable(error)


def test_the_exit_status_is_a_kernel_crash_in_the_kernel_phase_and_a_harness_error_elsewhere():
    ending = classify(DEVICE_ERROR_EXIT, said_goodbye=False)
    assert (ending.kind, ending.detail) == (EndingKind.CRASHED, DEVICE_ERROR)
    f = finding_for(ending, "kernel")
    assert (f.kind.value, f.check, f.kind.blame) == ("kernel crash", "CUDA error", "kernel")
    assert "unusable" in f.message
    assert finding_for(ending, "prepare").kind.value == "harness error"
    # the same status after a goodbye is an ordinary exit, not a device error
    assert classify(DEVICE_ERROR_EXIT, said_goodbye=True).kind is EndingKind.EXITED


class _Sticky:
    def run(self, call):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_outside_an_isolated_process_the_error_is_returned_not_fatal():
    """In a user's own process (kvfuzz.check_example, a pytest run) nothing ends the process: the kernel's
    error comes back as the example's crash, as every other kernel error does."""
    assert not harness_run.ISOLATED.is_set()
    call = type("Call", (), {"key_cache": torch.zeros(1)})()
    out, crash = run_kernel(_Sticky(), call)
    assert out is None and crash.startswith("RuntimeError: CUDA error: an illegal memory access")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_campaign_blames_the_kernel_and_nothing_after_it(tmp_path, workers):
    """Without the worker ending itself, the examples after the first failure fail in prepare (the dead
    context) and the campaign reports a harness error: kvfuzz blamed for the kernel's bug."""
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:BreaksDevice", "--poison", "stale", "--max-examples", "30",
               "--max-crashes", "2", "--example-timeout", "20", "--workers", workers, "--out", str(tmp_path / "out"))
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert [(f["kind"], f["check"], f["blame"]) for f in t["failures"]] == [("kernel crash", "CUDA error", "kernel")]
    assert summary["worker_restarts"] > 0 and summary["lost"] == 0
    repro = t["failures"][0]["reproducer"]
    case = json.loads((tmp_path / "out" / repro.split("/")[-1] / "case.json").read_text())
    assert case["example"]["batch"]["head_size"] == 64
    rep = kvfuzz("replay", repro, "--target", f"{PLANTED}:BreaksDevice")
    assert rep.returncode == 1 and "reproduced" in rep.stdout and "kernel crash (CUDA error)" in rep.stdout, rep.stdout
