"""The supervisor (kvfuzz.fuzz.campaign.workers.supervisor, endings, worker): every way a kernel or a worker can end,
run through `kvfuzz fuzz` as a user would (planted adapters in tests/support/planted_endings.py misbehave on head size
64): each test checks the exit status, the reproducer's kind, the counts (examples = kernel calls, every call logged by
the planted kernel) and that no process is left."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import SUPPORT, kvfuzz, start_kvfuzz

HERE = Path(__file__).resolve().parent
PLANTED = SUPPORT / "planted_endings.py"


def fuzz_planted(cls, tmp_path, *extra, timeout=300):
    log = tmp_path / "calls.log"
    env = dict(os.environ, KVFUZZ_PLANTED_LOG=str(log))
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:{cls}", "--poison", "stale", "--out", str(tmp_path / "out"),
               "--max-crashes", "2", "--example-timeout", "4", *extra, env=env, timeout=timeout)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    calls = log.read_text().split() if log.exists() else []
    return r, summary, calls


def assert_no_process_left(calls):
    time.sleep(0.5)
    alive = [p for p in set(calls) if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
    assert alive == [], f"worker processes left behind: {alive}"


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


ENDINGS = [
    ("Segfaults", "kernel crash", "SIGSEGV"),
    ("Aborts", "kernel crash", "SIGABRT"),
    ("Exits0", "kernel crash", "exit status 0"),
    ("Exits1", "kernel crash", "exit status 1"),
    ("Exits3", "kernel crash", "exit status 3"),
    ("RaisesSystemExit", "kernel crash", "raised SystemExit"),
    ("RaisesRuntimeError", "kernel crash", "raised RuntimeError"),
    ("BreaksDevice", "kernel crash", "CUDA error"),
    ("RaisesMemoryError", "kernel crash", "raised MemoryError"),
    ("Hangs", "kernel hang", "timeout"),
    ("BuildCallRaises", "harness error", "raised ValueError in prepare"),
]


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("cls, kind, check", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_every_ending_is_classified_counted_and_saved(tmp_path, cls, kind, check, workers):
    if workers == "2" and cls not in ("Segfaults", "Exits0", "RaisesSystemExit", "Hangs"):
        pytest.skip("two workers: one of each family of endings is enough")
    r, summary, calls = fuzz_planted(cls, tmp_path, "--max-examples", "24", "--workers", workers)
    assert r.returncode == 1, r.stdout + r.stderr
    (t,) = summary["targets"]
    assert [(f["kind"], f["check"]) for f in t["failures"]] == [(kind, check)], r.stdout
    f = t["failures"][0]
    assert f["blame"] == ("harness" if kind == "harness error" else "kernel")
    repro = Path(f["reproducer"])
    case = json.loads((repro / "case.json").read_text())
    assert case["kind"] == kind and case["check"] == check and case["example"]["batch"]["head_size"] == 64
    if kind == "harness error":
        assert "not written" in case["tensors"] and not (repro / "tensors.safetensors").exists()
    else:
        assert (repro / "tensors.safetensors").exists()
    # exact counts: every example whose call was built ran the kernel once, and was counted once, as an example of
    # the budget or as a run that shrank the failure (counted apart: --max-examples bounds the examples)
    assert t["examples"] <= 24
    if kind != "harness error":
        assert t["examples"] + t["shrink_runs"] == len(calls), (t["examples"], t["shrink_runs"], len(calls))
    assert summary["exit_status"] == 1 and summary["lost"] == 0 and summary["problems"] == []
    # a process death costs a worker, which is replaced; an exception does not
    dies = kind == "kernel hang" or check.startswith(("SIG", "exit status", "CUDA error"))
    assert (summary["worker_restarts"] > 0) == dies, summary["worker_restarts"]
    assert_no_process_left(calls)


def test_the_budget_is_global_and_the_counts_add_up(tmp_path):
    """Two workers share --max-examples (a restarted worker does not get the budget again). Slow (0.3 s a call)
    in chunks of 5: with the fast Correct kernel in chunks of 25, one worker could run all 40 before the other
    had started on a loaded machine (one failure in a fresh-clone run)."""
    r, summary, calls = fuzz_planted("Slow", tmp_path, "--max-examples", "40", "--workers", "2",
                                     "--chunk-examples", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = summary["targets"]
    assert t["examples"] == 40 == len(calls)
    assert len(set(calls)) == 2  # both workers ran examples
    assert_no_process_left(calls)


def test_crashing_worker_restarts_with_the_rest_of_the_global_budget(tmp_path):
    r, summary, calls = fuzz_planted("Exits1", tmp_path, "--max-examples", "40", "--workers", "2",
                                     "--max-crashes", "50")
    (t,) = summary["targets"]
    assert r.returncode == 1 and t["examples"] + t["shrink_runs"] == len(calls)
    assert 40 <= t["examples"] <= 40 + 2  # each death ends a chunk early: the budget is re-planned, not reset
    assert summary["worker_restarts"] == t["failures"][0]["count"]


def _start(cls, tmp_path, *extra):
    log = tmp_path / "calls.log"
    env = dict(os.environ, KVFUZZ_PLANTED_LOG=str(log))
    p = start_kvfuzz("fuzz", "--target", f"{PLANTED}:{cls}", "--poison", "stale", "--out", str(tmp_path / "out"),
                     *extra, env=env, stderr=subprocess.STDOUT)
    return p, log


def _wait_calls(log: Path, n: int, timeout: float = 120) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and len(log.read_text().split()) >= n:
            return log.read_text().split()
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} kernel calls after {timeout} s")


def _wait_state(path: Path, ready, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = json.loads(path.read_text())
            if ready(state):
                return state
        except (OSError, ValueError):  # not written yet (it is replaced atomically, never half-written)
            pass
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach the expected state in {timeout} s")


def test_sigkill_of_the_supervisor_takes_its_workers_and_the_next_run_resumes(tmp_path):
    p, log = _start("Slow", tmp_path, "--max-examples", "500", "--workers", "2")
    calls = _wait_calls(log, 6)
    # let a snapshot (every 2 s) record a chunk and what is in flight: a fixed sleep was not always enough on
    # a loaded 2-core machine
    _wait_state(tmp_path / "out" / "state.json",
                lambda st: st.get("chunks", {}).get("planted.slow", 0) >= 1 and st.get("in_flight"))
    p.kill()
    p.wait(30)
    assert_no_process_left(log.read_text().split())  # the workers died with their supervisor
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert state["running"] is True and state["chunks"]["planted.slow"] >= 1
    # the next campaign with the same --out: the lock is free, the killed example is retried, nothing is blamed
    log.unlink()
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--target", f"{PLANTED}:Slow", "--poison", "stale",
               "--max-examples", "3", "--out", str(tmp_path / "out"),
               env=dict(os.environ, KVFUZZ_PLANTED_LOG=str(log)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "retrying the" in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(summary["targets"]) == 2 and all(not t["failures"] for t in summary["targets"])
    assert not [d for d in (tmp_path / "out").iterdir() if "kernel-crash" in d.name]
    assert calls  # (the first run did run)


def test_a_worker_killed_from_outside_is_not_a_kernel_bug_and_its_example_is_retried(tmp_path):
    p, log = _start("Slow", tmp_path, "--max-examples", "12", "--workers", "1")
    calls = _wait_calls(log, 3)
    os.kill(int(calls[-1]), signal.SIGKILL)  # the worker, in (or right around) its kernel call
    out, _ = p.communicate(timeout=180)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert p.returncode == 0, out
    assert t["failures"] == [] and t["lost"] == 0 and "killed from outside" in out
    assert t["examples"] == 12
    assert_no_process_left(log.read_text().split())


def test_sigterm_stops_the_campaign_even_when_the_kernel_swallows_the_interrupt(tmp_path):
    p, log = _start("SwallowsInterrupts", tmp_path, "--max-examples", "500")
    _wait_calls(log, 3)
    time.sleep(0.2)  # inside the next example's 0.5 s kernel
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] is True and p.returncode == 3, out
    assert summary["targets"][0]["examples"] < 500 and summary["targets"][0]["failures"] == []
    assert_no_process_left(log.read_text().split())


@pytest.mark.cli_text
def test_a_second_campaign_on_the_same_out_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    p, log = _start("Slow", tmp_path, "--max-examples", "30")
    _wait_calls(log, 2)
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "2", "--out", str(tmp_path / "out"))
    assert r.returncode == 3 and "in use by another kvfuzz campaign" in r.stdout and f"pid {p.pid}" in r.stdout
    p.terminate()
    p.wait(60)
    # the lock file stays behind; the process that held it is gone: a new campaign takes it over
    assert (tmp_path / "out" / ".kvfuzz.lock").exists()
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "2", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout


@pytest.mark.cli_text
def test_torn_state_files_are_set_aside_with_a_warning(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "state.json").write_text('{"seed": 0, "chunks": {"planted.corr')
    (out / "status.json").write_text("[1, 2")
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "3", "--poison", "stale",
               "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "state.json was unreadable" in r.stdout and (out / "state.json.corrupt").exists()
    assert json.loads((out / "state.json").read_text())["chunks"] == {"planted.correct": 1}


@pytest.mark.cli_text
def test_an_in_flight_example_state_json_cannot_read_is_named_and_not_retried(tmp_path):
    """A state.json of a killed campaign whose in-flight example does not read (edited, or from another kvfuzz): the
    worker that retried it died ("TypeError: Batch.__init__() missing ...") and the campaign exited 3, each run."""
    out = tmp_path / "out"
    out.mkdir()
    bad = {"batch": {"query_lens": "one"}, "poison": "nan"}
    (out / "state.json").write_text(json.dumps({"seed": 0, "chunks": {}, "running": True, "in_flight": {
        "0": {"target": "planted.correct", "example": bad, "phase": "kernel"}, "1": 5}}))
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "3", "--poison", "stale",
               "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "field 'in_flight.0.example.batch.query_lens': is 'one'" in r.stdout and "it is not retried" in r.stdout
    assert "field 'in_flight.1.example': is NoneType" in r.stdout and "problem" not in r.stdout


def test_a_worker_lost_in_the_structural_shrink_leaves_the_hypothesis_shrunk_reproducer(tmp_path):
    """The structural shrink's candidate (a smaller head size, block ids scaled) exits the process: the failure
    keeps the reproducer Hypothesis shrank, and says so."""
    r, summary, calls = fuzz_planted("CrashesWhenReshaped", tmp_path, "--max-examples", "150", "--workers", "1",
                                     "--max-crashes", "100", "--configs", "free", timeout=600)
    assert r.returncode == 1, r.stdout
    (t,) = summary["targets"]
    (raised,) = [f for f in t["failures"] if f["check"] == "raised SystemExit"]
    assert "shrunk by Hypothesis; the worker exited during the structural shrink" in raised["message"], raised
    case = json.loads((Path(raised["reproducer"]) / "case.json").read_text())
    assert case["example"]["batch"]["head_size"] == 128
    assert t["examples"] + t["shrink_runs"] == len(calls) and summary["lost"] == 0
    assert_no_process_left(calls)


def test_a_worker_lost_in_hypothesis_shrink_leaves_the_structurally_shrunk_reproducer(tmp_path):
    """A failure as found is shrunk structurally first (fewer sequences, shorter lengths), reported ``seen`` so;
    Hypothesis's shrink then steps into an input that exits the process: the failure keeps the structurally shrunk
    reproducer, and says so."""
    r, summary, calls = fuzz_planted("ExitsWhileHypothesisShrinks", tmp_path, "--max-examples", "150", "--workers",
                                     "1", "--max-crashes", "100", "--configs", "free", timeout=600)
    assert r.returncode == 1, r.stdout
    (t,) = summary["targets"]
    (raised,) = [f for f in t["failures"] if f["check"] == "raised SystemExit"]
    assert "shrunk structurally first; the worker exited while Hypothesis shrank it" in raised["message"], raised
    case = json.loads((Path(raised["reproducer"]) / "case.json").read_text())
    assert case["example"]["batch"]["head_size"] == 128 and case["details"]["structural_first"]["taken"] >= 1
    assert t["examples"] + t["shrink_runs"] == len(calls) and summary["lost"] == 0  # shrink runs counted apart
    assert_no_process_left(calls)


def test_the_mixed_adapter_gives_one_reproducer_per_distinct_ending(tmp_path):
    """The issue's acceptance campaign, short: every distinct ending once, counts exact, no process left."""
    r, summary, calls = fuzz_planted("Mixed", tmp_path, "--max-examples", "80", "--workers", "2",
                                     "--max-crashes", "40", timeout=600)
    assert r.returncode == 1, r.stdout
    (t,) = summary["targets"]
    sigs = {(f["kind"], f["check"]) for f in t["failures"]}
    assert {("kernel crash", "SIGSEGV"), ("kernel crash", "SIGABRT"), ("kernel hang", "timeout")} <= sigs, sigs
    # SystemExit (head size 128, two or more sequences) is a failing example whose shrink reaches one sequence,
    # where Mixed exits: the worker dies shrinking it, and the failure keeps its unshrunk reproducer
    assert ("kernel crash", "raised SystemExit") in sigs, sigs
    dirs = [d for d in (tmp_path / "out").iterdir() if d.name.startswith("planted.mixed-")]
    assert len(dirs) == len(sigs)  # one reproducer per distinct ending
    assert t["examples"] + t["shrink_runs"] == len(calls) and summary["lost"] == 0
    assert_no_process_left(calls)


MALLOC_PROBE = """
import ctypes, resource, sys
from kvfuzz.fuzz.campaign.workers.worker import tune_malloc
if sys.argv[1] == "tuned" and not tune_malloc():
    print("not glibc"); sys.exit(0)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
faults = []
for _ in range(2):  # what an example does with a 16 MiB cache: allocate, fill, free; then the next example
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(16 << 20)
    ctypes.memset(p, 1, 16 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""


def test_a_worker_keeps_freed_memory_so_the_next_example_does_not_fault_its_pages_in_again():
    """worker.tune_malloc: with glibc's defaults the second 16 MiB block is faulted in page by page again
    (~4096 faults); tuned, it reuses the freed one."""
    import sys

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", MALLOC_PROBE, mode], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    tuned = faults("tuned")
    if tuned == "not glibc":
        pytest.skip("the C library is not glibc")
    assert int(tuned) < 100 and int(faults("default")) > 1000


def test_the_supervisor_reads_its_workers_in_batches_not_once_per_message(tmp_path, monkeypatch):
    """A worker says begin, kernel, check and end per example; the supervisor looks at the pipes at most every
    POLL_SECONDS (0.2 s here, so the count does not depend on this machine's speed) and reads what has
    arrived, so it wakes far fewer times than it gets messages (it took the workers' cores for each one), and
    still counts every example."""
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.workers import supervisor as sup
    from kvfuzz.fuzz.targets import get_target

    waits, messages = [], []
    monkeypatch.setattr(sup, "POLL_SECONDS", 0.2)
    monkeypatch.setattr(sup, "wait", lambda *a, real=sup.wait, **k: waits.append(1) or real(*a, **k))
    monkeypatch.setattr(sup.Supervisor, "_message",
                        lambda self, s, msg, real=sup.Supervisor._message:
                            messages.append(msg[0]) or real(self, s, msg))
    spec = f"{PLANTED}:Correct"
    monkeypatch.setenv("KVFUZZ_PLANTED_LOG", str(tmp_path / "calls.log"))
    config = CampaignConfig(out=tmp_path / "out", max_examples=300, structural_shrink=0)
    result = sup.Supervisor([get_target(spec)], [spec], config, resume=False).run()
    examples = result.targets[0].examples
    assert examples == 300 and messages.count("end") == 300 and "phase" in messages
    assert messages.count("phase") == 2 * examples  # kernel and check; begin says "prepare"
    assert len(waits) < examples / 4, (len(waits), len(messages))


def test_a_campaign_stopped_while_shrinking_keeps_the_failure_unshrunk(tmp_path):
    """SIGTERM while a worker shrinks a failure (its provisional reproducer written): the worker finishes its
    example and says goodbye, and the failure is still in the summary, said to be unshrunk; the campaign exits 1 (a
    failure found outranks interrupted). Before, a goodbye dropped it: an interrupted H200 campaign's summary
    listed no failure beside a first_failure_s."""
    p, log = _start("SlowWrong", tmp_path, "--max-examples", "500", "--workers", "1")
    out = tmp_path / "out"
    deadline = time.monotonic() + 240
    while not [d for d in out.iterdir() if (d / "case.json").exists()] if out.exists() else True:
        assert time.monotonic() < deadline and p.poll() is None, "no provisional reproducer"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    (failure,) = summary["targets"][0]["failures"]
    assert failure["kind"] == "kernel mismatch" and "campaign was stopped while shrinking" in failure["message"]
    assert summary["interrupted"] is True and p.returncode == 1, stdout
    assert_no_process_left(log.read_text().split())


def test_an_example_compiling_past_its_timeout_is_given_more_time_not_called_a_hang(tmp_path):
    """A first call that runs a compiler (here a 6 s 'ninja' against --example-timeout 4; FlashInfer's JIT on a
    busy H200 host took over 300 s) is not a kernel hang: the timeout starts again and the summary says why."""
    r, summary, calls = fuzz_planted("CompilesSlowly", tmp_path, "--max-examples", "24", "--workers", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["targets"][0]["failures"] == [] and summary["worker_restarts"] == 0
    assert any("while its worker was compiling (ninja)" in w for w in summary["warnings"]), summary["warnings"]


def test_a_compile_past_every_wait_is_a_compile_timeout(tmp_path, monkeypatch):
    """The waits are bounded (endings.MAX_COMPILE_WAITS): a compile that never ends is a kernel hang with check
    "compile timeout", apart from the kernel's own hangs."""
    monkeypatch.setenv("KVFUZZ_PLANTED_COMPILE_S", "600")
    r, summary, calls = fuzz_planted("CompilesSlowly", tmp_path, "--max-examples", "24", "--workers", "1",
                                     "--example-timeout", "1", "--max-crashes", "1")
    (f,) = summary["targets"][0]["failures"]
    assert (f["kind"], f["check"]) == ("kernel hang", "compile timeout") and "ninja" in f["message"], f
    assert r.returncode == 1


def test_compiler_running_finds_a_compiler_among_the_descendants(tmp_path):
    from kvfuzz.fuzz.campaign.workers.endings import compiler_running

    def proc(pid, comm, ppid):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")

    proc(10, "python3", 1)
    proc(11, "sh (x)", 10)  # a comm with a space and parentheses
    proc(12, "ninja", 11)
    proc(20, "python3", 1)
    proc(21, "nvcc", 1)  # not a descendant of 20
    (tmp_path / "self").mkdir()
    assert compiler_running(10, tmp_path) == "ninja"
    assert compiler_running(20, tmp_path) is None
    assert compiler_running(10, tmp_path / "missing") is None


def test_the_summary_says_where_the_chunks_went(tmp_path):
    """summary.json's ``chunks`` (free, and aimed at a bin) under the supervisor, two workers: every example
    counted in one chunk of one kind, each kind's seconds measured, and report.md's table of them."""
    r, summary, calls = fuzz_planted("Correct", tmp_path, "--max-examples", "80", "--workers", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    (t,) = summary["targets"]
    kinds = t["chunks"]
    assert set(kinds) == {"free", "focused"} and all(k["chunks"] > 0 and k["seconds"] > 0 for k in kinds.values())
    assert sum(k["examples"] for k in kinds.values()) == t["examples"] == 80
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| focused | %d | %d |" % (kinds["focused"]["chunks"], kinds["focused"]["examples"]) in report
