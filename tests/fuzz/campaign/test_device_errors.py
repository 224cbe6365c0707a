"""A kernel that leaves the device unusable (one of CUDA's sticky errors: an illegal memory access, a launch
failure, a device-side assert) ends its worker: the example is a kernel crash ("CUDA error"), and no later
example of that process is blamed on kvfuzz's prepare (harness.run.run_kernel, campaign.workers.endings).
On this CPU the sticky error is planted (tests/support/planted_endings.py BreaksDevice: after its kernel fails,
every later call of the process fails too, as a dead CUDA context does)."""

import json

import pytest
import torch
from support import SUPPORT, kvfuzz

from kvfuzz.fuzz.campaign.workers.endings import DEVICE_ERROR, EndingKind, classify, finding_for
from kvfuzz.fuzz.harness import isolation
from kvfuzz.fuzz.harness.isolation import DEVICE_ERROR_EXIT, leaves_device_unusable
from kvfuzz.fuzz.harness.run import run_kernel

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
    assert not isolation.ISOLATED.is_set()
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


def test_a_bystander_of_another_workers_device_fault_is_re_run_not_blamed(tmp_path):
    """Found on an H100 (2026-11-25): a re-injected int32-offset bug faulted one worker's big-cache example, and
    under CUDA MPS the fault ended three other workers too; the first of them to be reported, a one-block batch
    that cannot overflow anything, was listed as the kernel crash. Now an example whose worker a CUDA error ended,
    while other workers share the GPU, is re-run by a new worker first: here the fault does not come back, so
    there is no finding and nothing is lost."""
    import os

    env = {**os.environ, "KVFUZZ_PLANTED_MARK": str(tmp_path / "faulted")}
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:FaultsOnce", "--poison", "zeros", "--max-examples", "20",
               "--example-timeout", "20", "--workers", "2", "--out", str(tmp_path / "out"), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "faulted").exists() and "re-run by a new worker before anyone is blamed" in r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["failures"] == [] and summary["lost"] == 0 and summary["worker_restarts"] >= 1
    assert t["examples"] >= 20


def test_a_bystander_ended_in_prepare_again_and_again_is_never_blamed(tmp_path):
    """Found on an H100 (issue 40): under MPS, another worker's kernel fault (shrunk, so faulting again and again)
    ended a worker in kvfuzz's prepare twice on the same example, and its re-run was reported as a harness error
    ("a CUDA error left its device unusable ... in prepare"). A CUDA error in kvfuzz's own phases while other
    workers share the GPU is re-run by a new worker every time (up to MAX_BYSTANDER_RERUNS), never reported."""
    import os

    env = {**os.environ, "KVFUZZ_PLANTED_MARK": str(tmp_path / "faulted")}
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:PrepareFaultsTwice", "--poison", "zeros", "--max-examples", "6",
               "--example-timeout", "20", "--workers", "2", "--out", str(tmp_path / "out"), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len((tmp_path / "faulted").read_text().splitlines()) == 2  # the same example, twice
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["failures"] == [] and summary["lost"] == 0 and summary["worker_restarts"] >= 2
    assert t["examples"] >= 6


def test_a_campaign_whose_simplest_example_crashed_still_ends(tmp_path):
    """The crash is the first kernel call (the simplest example of the first chunk), so every later chunk skips it
    uncounted; the last example of the budget used to be handed out as a chunk of 1 that counted nothing, forever."""
    import os

    env = {**os.environ, "KVFUZZ_PLANTED_MARK": str(tmp_path / "faulted")}
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:FaultsOnce", "--poison", "zeros", "--max-examples", "20",
               "--example-timeout", "20", "--workers", "1", "--out", str(tmp_path / "out"), env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    (t,) = json.loads((tmp_path / "out" / "summary.json").read_text())["targets"]
    assert t["examples"] == 20 and [f["check"] for f in t["failures"]] == ["CUDA error"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_example_that_found_the_mps_server_not_ready_runs_again(tmp_path, workers):
    """After one MPS client's fault the server refuses new clients for a while (CUDA error 807; seen on an H100,
    where it ended the campaign as a worker's fatal error). A worker that meets it ends itself (exit status 87);
    its example is run again by a new worker: no finding, nothing lost, exit 0."""
    import os

    env = {**os.environ, "KVFUZZ_PLANTED_MARK": str(tmp_path / "busy")}
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:MpsBusyOnce", "--poison", "zeros", "--max-examples", "12",
               "--example-timeout", "20", "--workers", workers, "--out", str(tmp_path / "out"), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "busy").exists() and "MPS server not ready" in r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["failures"] == [] and summary["lost"] == 0 and t["examples"] >= 12


def test_the_mps_busy_exit_is_killed_in_effect():
    from kvfuzz.fuzz.campaign.workers.endings import MPS_BUSY
    from kvfuzz.fuzz.harness.isolation import MPS_BUSY_EXIT

    ending = classify(MPS_BUSY_EXIT, said_goodbye=False)
    assert (ending.kind, ending.detail) == (EndingKind.KILLED, MPS_BUSY) and finding_for(ending, "kernel") is None
    assert classify(MPS_BUSY_EXIT, said_goodbye=True).kind is EndingKind.EXITED
