"""Every ending of the kvfuzz commands gives a clean message and the documented exit status (issue 48): a gate that
never passes by accident (an interrupted `kvfuzz check` exits 3 and its JUnit file says error), a repeated --target
that runs once, a --db that is neither a directory nor a Redis URL, tracebacks turned into exit 2 or 3 (a malformed
summary.json, a read-only or full folder, the pytest plugin's report path), limits that cannot be met, and the
messages (a corrupt case.json's innermost field, a missing default corpus). Planted adapters
(tests/support/planted_endings.py) keep the campaigns short; docs/cli.md lists the exit statuses."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import ROOT, SUPPORT, available, kvfuzz, start_kvfuzz

from kvfuzz.fuzz.cli import main

PLANTED = SUPPORT / "planted_endings.py"


def _junit(path: Path) -> dict[str, str]:
    """{testcase name: "pass" | "failure" | "error" | "skipped"} of a JUnit file."""
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        kinds = [k for k in ("failure", "error", "skipped") if tc.find(k) is not None]
        out[tc.get("name")] = kinds[0] if kinds else "pass"
    return out


def _wait_for(predicate, what: str, p: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert p.poll() is None, f"kvfuzz ended before {what}: " + "".join(p.communicate())
        assert time.monotonic() < deadline, f"no {what} in {limit} s"
        time.sleep(0.1)


def _examples(out: Path) -> int:
    try:
        return json.loads((out / "status.json").read_text())["targets"][0]["examples"]
    except (OSError, ValueError, KeyError, IndexError):
        return 0


# ---- a gate that never passes by accident ---------------------------------------------------------------------
@pytest.mark.cli_text
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_an_interrupted_check_exits_3_and_its_junit_file_says_error(tmp_path, sig):
    """The repro of issue 48: SIGTERM (a CI job cancelled or timed out), Ctrl-C or a closed terminal mid-gate. It
    printed "N passed" and exited 0, and the JUnit file marked a target that ran 0 examples passed; a corpus case
    not replayed is an error too. Before anything ran, the JUnit file already said error: a gate killed outright
    (SIGKILL) fails."""
    corpus = tmp_path / "corpus"
    case = next((ROOT / "regressions").glob("vllm.cpu_attention-*"))
    (corpus / case.name).mkdir(parents=True)
    (corpus / case.name / "case.json").write_text((case / "case.json").read_text())
    junit, out = tmp_path / "j.xml", tmp_path / "out"
    p = start_kvfuzz("check", "--target", f"{PLANTED}:Slow", "--max-examples", "1000", "--corpus", corpus,
                     "--junit-xml", junit, "--out", out, cwd=tmp_path, stderr=subprocess.STDOUT)
    _wait_for(junit.exists, "JUnit file", p)
    assert _junit(junit) == {"planted.slow": "error", case.name: "error"}  # what SIGKILL would leave
    _wait_for(lambda: _examples(out) > 0, "example counted", p)
    p.send_signal(sig)
    stdout, _ = p.communicate(timeout=300)
    assert p.returncode == 3, stdout
    assert "interrupted" in stdout and "Traceback" not in stdout
    assert _junit(junit) == {"planted.slow": "error", case.name: "error"}, junit.read_text()
    root = ET.parse(junit).getroot()
    assert "interrupted after" in next(root.iter("error")).get("message")
    assert sum(int(s.get("failures")) for s in root.iter("testsuite")) == 0


def test_a_gate_stopped_while_replaying_its_corpus_marks_the_rest_not_replayed(tmp_path, monkeypatch):
    from kvfuzz.fuzz.campaign import gate

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "case.json").write_text("{}")
    calls = []

    def replay(d, **kw):
        calls.append(d.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        raise gate.TargetUnavailable("not here")

    monkeypatch.setattr(gate, "replay", replay)
    with pytest.raises(gate.GateInterrupted) as info:
        gate.check_corpus(tmp_path)
    assert [(r.name, r.skipped is not None, r.error) for r in info.value.results] == [
        ("a", True, None), ("b", False, "not replayed: the gate was interrupted"),
        ("c", False, "not replayed: the gate was interrupted")]


def test_a_target_that_ran_no_example_is_an_error_never_a_pass(tmp_path):
    from kvfuzz.fuzz.campaign.gate import CheckResult, write_junit

    write_junit([CheckResult("property", "t", 0.0, error="no example ran"), CheckResult("regression", "c", 1.0)],
                tmp_path / "j.xml")
    assert _junit(tmp_path / "j.xml") == {"t": "error", "c": "pass"}
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "j.xml").getroot().iter("testsuite")}
    assert suites["kvfuzz.property"].get("errors") == "1" and suites["kvfuzz.regression"].get("errors") == "0"


# ---- a repeated --target ----------------------------------------------------------------------------------------
@pytest.mark.cli_text
def test_a_repeated_target_runs_once_with_a_warning(tmp_path):
    """fuzz --target X --target X reprinted "3 examples" forever (two TargetStats, one target); with --duration it
    ended in a TypeError; check hung. Each now runs X once, says so, and exits 0."""
    spec = f"{PLANTED}:Correct"
    for extra in (["--max-examples", "3"], ["--duration", "3s"]):
        r = kvfuzz("fuzz", "--target", spec, "--target", spec, *extra, "--out", tmp_path / "o", cwd=tmp_path,
                   timeout=300)
        assert r.returncode == 0 and "given more than once" in r.stdout, r.stdout + r.stderr
        assert "Traceback" not in r.stdout + r.stderr
        (t,) = json.loads((tmp_path / "o" / "summary.json").read_text())["targets"]
        assert t["target"] == "planted.correct"
    assert t["examples"] > 0
    r = kvfuzz("check", "--target", spec, "--target", spec, "--max-examples", "2", "--out", tmp_path / "c",
               cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "1 passed, 0 failed" in r.stdout, r.stdout + r.stderr


@pytest.mark.cli_text
def test_two_specs_of_one_target_are_refused(tmp_path):
    examples = ROOT / "examples"
    r = kvfuzz("fuzz", "--target", f"{examples / 'sdpa_paged_target.py'}:SdpaPaged", "--target",
               "sdpa_paged_target:SdpaPaged", "--out", tmp_path / "o", env={**os.environ, "PYTHONPATH": str(examples)})
    assert r.returncode == 2 and "--target" in r.stderr and "name it once" in r.stderr, r.stdout + r.stderr


def test_the_supervisor_refuses_a_target_named_twice(tmp_path):
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.workers.supervisor import Supervisor
    from kvfuzz.fuzz.targets.registry import load_spec

    t = load_spec(f"{PLANTED}:Correct")
    with pytest.raises(ValueError, match="named twice"):
        Supervisor([t, t], ["x", "x"], CampaignConfig(out=tmp_path))


@pytest.mark.cli_text
def test_conflicting_replay_options_exit_2_naming_both(tmp_path):
    case = next((ROOT / "regressions").glob("vllm.cpu_attention-*"))
    r = CliRunner().invoke(main, ["replay", str(case), "--target", "vllm.cpu_attention", "--trust-target"])
    assert r.exit_code == 2 and "--target" in r.output and "--trust-target" in r.output, r.output


# ---- --db: a directory or a Redis URL, nothing else ---------------------------------------------------------------
@pytest.mark.cli_text
@pytest.mark.parametrize("command", ["fuzz", "check"])
@pytest.mark.parametrize("db", ["http://127.0.0.1:1/", "reddis://localhost:6379/0", "redis:localhost"])
def test_a_db_that_looks_like_another_url_is_refused_and_creates_nothing(tmp_path, command, db):
    """`--db http://127.0.0.1:1/` created ./http:/127.0.0.1:1 and exited 0: the shared database silently was not."""
    r = CliRunner().invoke(main, [command, "--target", f"{PLANTED}:Correct", "--db", db, "--out",
                                  str(tmp_path / "o")])
    assert r.exit_code == 2 and "--db" in r.output and "redis://host:port/N" in r.output, r.output
    assert not isinstance(r.exception, (TypeError, ValueError)), r.exception
    assert not any(p.name.startswith(db.split(":")[0]) for p in Path.cwd().iterdir())


@pytest.mark.cli_text
def test_check_and_fuzz_exit_3_alike_on_an_unreachable_redis(tmp_path):
    pytest.importorskip("redis")
    for command in ("fuzz", "check"):
        r = kvfuzz(command, "--target", f"{PLANTED}:Correct", "--db", "redis://127.0.0.1:1/0", "--out",
                   tmp_path / command, cwd=tmp_path)
        assert r.returncode == 3 and "does not answer" in r.stdout, (command, r.stdout + r.stderr)
        assert "FAIL" not in r.stdout and "Traceback" not in r.stdout + r.stderr


# ---- tracebacks where exit 2 or 3 is promised ---------------------------------------------------------------------
@pytest.mark.cli_text
@pytest.mark.parametrize("text, says", [
    ('{"x": 1}', "field 'targets': is missing"),
    ('{"targets": [{"target": "t", "examples": 3', "is not valid JSON"),
    ('{"targets": [{"target": "t"}]}', "field 'targets[0].examples': is missing"),
    ('{"targets": [{"target": "t", "examples": "3", "examples_per_s": 1, "kernel_s": 0, "harness_s": 0, '
     '"failures": []}]}', "field 'targets[0].examples': is str"),
    ('[1, 2]', "holds a JSON list"),
])
def test_report_on_a_malformed_summary_exits_2_naming_the_field(tmp_path, text, says):
    (tmp_path / "summary.json").write_text(text)
    r = kvfuzz("report", tmp_path)
    assert r.returncode == 2 and says in r.stdout and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "report.md").exists()


SUMMARY = {"targets": [{"target": "t", "examples": 3, "examples_per_s": 1.0, "kernel_s": 0.1, "harness_s": 0.2,
                        "failures": [], "paths": {"a": 3}, "coverage": {"path": {"a": 3}}}], "seed": 0}


def _refuse(errno_code, inside: Path):
    real = os.replace

    def replace(src, dst, *a, **k):
        if Path(os.path.abspath(dst)).is_relative_to(inside.resolve()):
            raise OSError(errno_code, os.strerror(errno_code), str(dst))
        return real(src, dst, *a, **k)

    return replace


@pytest.mark.cli_text
@pytest.mark.parametrize("code, status", [(errno.EROFS, 2), (errno.EACCES, 2), (errno.ENOSPC, 3)])
def test_report_that_cannot_be_written_keeps_the_old_one_whole(tmp_path, monkeypatch, code, status):
    """A read-only folder exits 2, a full disk 3 (docs/cli.md); either way the previous report.md and PNGs stay
    whole (each is written beside, then replaced) and no temporary file is left."""
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    assert CliRunner().invoke(main, ["report", str(tmp_path)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(os, "replace", _refuse(code, tmp_path))
    r = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert r.exit_code == status and "cannot write" in r.output and os.strerror(code) in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.cli_text
def test_report_on_a_disk_that_fills_exits_3_with_no_truncated_png(tmp_path):
    """The planted full disk (tests/support/planted_disk.py) in a `kvfuzz report` of its own: exit 3, one line."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(SUMMARY))
    flag = tmp_path / "full"
    flag.touch()
    env = dict(os.environ, KVFUZZ_PLANTED_FULL=str(flag), KVFUZZ_PLANTED_OUT=str(out))
    code = (f"import sys; sys.path.insert(0, {str(SUPPORT)!r}); import planted_disk; "
            f"from kvfuzz.fuzz.cli import main; main(['report', {str(out)!r}])")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and "No space left on device" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


@pytest.mark.cli_text
@pytest.mark.parametrize("command", [["check", "--target", f"{PLANTED}:Correct"], ["fuzz"]])
def test_a_read_only_out_is_refused_before_anything_runs(tmp_path, monkeypatch, command):
    """`kvfuzz check --out` on a read-only folder ended in an OSError traceback (supervisor.py) after the gate."""
    real = Path.write_text

    def write_text(self, *a, **k):
        if self.name.startswith(".kvfuzz-write-test"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)
    r = CliRunner().invoke(main, [*command, "--out", str(tmp_path / "ro")])
    assert r.exit_code == 2 and "--out" in r.output and "Read-only file system" in r.output, r.output


@pytest.mark.cli_text
def test_report_issue_into_a_read_only_reproducer_exits_2(tmp_path, monkeypatch):
    case = next((ROOT / "regressions").glob("vllm.cpu_attention-*"))
    d = tmp_path / case.name
    d.mkdir()
    (d / "case.json").write_text((case / "case.json").read_text())
    monkeypatch.setattr(os, "replace", _refuse(errno.EROFS, d))
    r = CliRunner().invoke(main, ["report", "--issue", str(d)])
    assert r.exit_code == 2 and "cannot write" in r.output and "ISSUE.md" in r.output, r.output
    assert sorted(p.name for p in d.iterdir()) == ["case.json"]


def _pytest_with_guard(tmp_path, *args, conftest: str = ""):
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "conftest.py").write_text(conftest)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "kvfuzz.fuzz.guard.plugin", "--kvfuzz-guard", *map(str, args), "test_ok.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.cli_text
def test_the_guard_report_path_is_checked_before_the_tests_and_written_atomically(tmp_path):
    """--kvfuzz-guard-report to a missing folder: created, as kvfuzz's own outputs are (a traceback after the tests,
    exit 1, before); to a path that cannot be written: pytest's usage error (exit 4) before any test runs; a disk
    that fills when it is written: the tests' result stands, the report is not half-written, and the session
    exits 3 saying so."""
    report = tmp_path / "missing" / "dir" / "r.json"
    r = _pytest_with_guard(tmp_path, "--kvfuzz-guard-report", report)
    assert r.returncode == 0 and json.loads(report.read_text())["mode"] == "fail", r.stdout + r.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _pytest_with_guard(tmp_path, "--kvfuzz-guard-report", blocker / "r.json")
    assert r.returncode == 4 and "--kvfuzz-guard-report" in r.stderr and "Traceback" not in r.stdout + r.stderr
    assert "passed" not in r.stdout
    full = ("import errno, os\nreal = os.replace\n"
            "def replace(src, dst, *a, **k):\n"
            "    if str(dst).endswith('r.json'):\n"
            "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))\n"
            "    return real(src, dst, *a, **k)\n"
            "os.replace = replace\n")
    old = report.read_text()
    r = _pytest_with_guard(tmp_path, "--kvfuzz-guard-report", report, conftest=full)
    assert r.returncode == 3 and "1 passed" in r.stdout, r.stdout + r.stderr
    assert "the report was not written: No space left on device" in r.stdout and "Traceback" not in r.stdout
    assert report.read_text() == old and not list(report.parent.glob("*.tmp"))


# ---- limits that cannot be met ----------------------------------------------------------------------------------
@pytest.mark.cli_text
@pytest.mark.parametrize("args, says", [
    (["--max-ctx-len", "99999999999999999999"], "0<=x<=1048576"),
    (["--max-query-len", "99999999999999999999"], "2<=x<=131072"),
    (["--max-num-seqs", "5000"], "1<=x<=1024"),
    (["--max-num-seqs", "1024", "--max-ctx-len", "1048576"], "at most 4,194,304"),
    (["--threads", "99999999999999999999"], "--threads"),
    (["--warmup", "99999999999999999999"], "--warmup"),
    (["--max-examples", "99999999999999999999"], "1<=x<=1000000000000"),
    (["--example-timeout", "nan"], "'nan' is not a finite number"),
    (["--structural-shrink", "inf"], "'inf' is not a finite number"),
    (["--duration", "99999999999999999999h"], "at most 8784h"),
])
def test_a_limit_that_cannot_be_met_is_refused_at_parse_time_with_its_bound(tmp_path, args, says):
    """--max-ctx-len 99999999999999999999 was accepted; ~50 s later a worker died of MemoryError (and --warmup of
    the same size ended in an OverflowError traceback)."""
    r = CliRunner().invoke(main, ["fuzz", "--target", f"{PLANTED}:Correct", "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2 and says in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


@pytest.mark.cli_text
def test_max_examples_bounds_the_examples_and_shrinking_is_counted_apart(tmp_path):
    """--max-examples 5 counted 12 examples when a failure was found: the runs that shrank it were examples. Now at
    most 5 are drawn and counted; the shrink's runs are summary.json's shrink_runs (docs/cli.md). The end says
    what to do next."""
    available("vllm.cpu_attention")
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "5", "--poison", "nan", "--workers", "1",
               "--out", tmp_path / "o", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["examples"] == 5 and t["shrink_runs"] > 0 and summary["shrink_runs"] == t["shrink_runs"]
    repro = t["failures"][0]["reproducer"]
    for step in ("next steps:", f"kvfuzz replay {repro}", f"kvfuzz report {repro} --issue",
                 f"kvfuzz baseline add {repro} --id ID"):
        assert step in r.stdout, step


# ---- messages -----------------------------------------------------------------------------------------------------
@pytest.mark.cli_text
@pytest.mark.parametrize("path, value, field", [
    (("batch", "query_lens"), "one", "example.batch.query_lens"),
    (("batch", "num_heads"), "4", "example.batch.num_heads"),
    (("batch", "dtype"), "float8", "example.batch.dtype"),
    (("batch", "block_table"), [["x"]], "example.batch.block_table"),
    (("batch", "heads"), 4, "example.batch.heads"),
    (("poison",), "mud", "example.poison"),
])
def test_a_corrupt_case_names_its_innermost_field(tmp_path, path, value, field):
    """The message said "field 'example': ... invalid literal for int() ... 'o'" when query_lens was "one"."""
    case = next((ROOT / "regressions").glob("vllm.cpu_attention-*"))
    d = tmp_path / "case"
    d.mkdir()
    raw = json.loads((case / "case.json").read_text())
    node = raw["example"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (d / "case.json").write_text(json.dumps(raw))
    r = kvfuzz("replay", d)
    assert r.returncode == 2 and f"field '{field}'" in r.stdout, r.stdout + r.stderr


@pytest.mark.cli_text
def test_a_missing_default_corpus_is_said_in_one_line(tmp_path):
    r = kvfuzz("check", "--target", f"{PLANTED}:Correct", "--max-examples", "2", "--out", tmp_path / "o",
               cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if "regression corpus" in x]
    assert "./regressions/ does not exist here" in line and "--corpus DIR" in line


def test_a_second_sigterm_never_raises_in_an_atexit_callback(tmp_path):
    """Worker logs carried "Exception ignored in atexit callback ... KeyboardInterrupt": the process group's SIGTERM
    and then the supervisor's own reached a worker that was already stopping, or exiting. The worker's handler
    raises once; its second signal, here sent from an atexit callback, only sets the stop flag."""
    code = ("import atexit, os, signal, threading\n"
            "from kvfuzz.fuzz.campaign.workers.worker import stop_on_term\n"
            "stop = threading.Event()\n"
            "signal.signal(signal.SIGTERM, stop_on_term(stop))\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM)\nexcept KeyboardInterrupt:\n    print('stopped once')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "stopped once\n", r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr


@pytest.mark.cli_text
def test_baseline_add_on_a_full_disk_exits_3_and_keeps_the_baseline_whole(tmp_path, monkeypatch):
    from kvfuzz.fuzz.campaign.store import journal

    case = next((ROOT / "regressions").glob("vllm.cpu_attention-*"))
    baseline = tmp_path / "b.toml"
    args = ["baseline", "add", str(case), "--baseline", str(baseline), "--reason", "r", "--reference", "vllm#1"]
    assert CliRunner().invoke(main, [*args, "--id", "one"]).exit_code == 0
    before = baseline.read_text()
    monkeypatch.setattr(journal.os, "replace", _refuse(errno.ENOSPC, tmp_path))
    r = CliRunner().invoke(main, [*args, "--id", "two"])
    assert r.exit_code == 3 and "No space left on device" in r.output, r.output
    assert baseline.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["b.toml"]


@pytest.mark.cli_text
def test_ctrl_c_of_a_replay_exits_3_without_a_traceback(tmp_path):
    """Ctrl-C reaches the whole process group. kvfuzz replay ended in click's "Aborted!" with exit status 1, as
    every command did; now one line and 3 (interrupted). The replay's child leaves the signal to its parent, which
    kills it (here mid-kernel), so no KeyboardInterrupt traceback of the child's can reach the output."""
    from support import batch_of

    from kvfuzz.contracts.checks.failures import KernelHang
    from kvfuzz.contracts.model.example import Example
    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
    from kvfuzz.fuzz.targets.registry import load_spec

    spec = f"{PLANTED}:Hangs"
    t = load_spec(spec)
    example = Example(batch_of([(1, 4)], head_size=64, num_heads=2, num_kv_heads=2, dtype="float32"), Poison.NAN)
    d = write_reproducer(tmp_path / "out", t, example, KernelHang("timeout", "hung"), None)
    log = tmp_path / "calls.log"
    p = start_kvfuzz("replay", d, "--target", spec, "--timeout", "600", cwd=tmp_path, stderr=subprocess.STDOUT,
                     env=dict(os.environ, KVFUZZ_PLANTED_LOG=str(log)), new_session=True)
    _wait_for(log.exists, "the kernel call", p)  # the child is inside the hanging kernel
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3 and "interrupted (SIGINT)" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    child = int(log.read_text().split()[0])
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()


@pytest.mark.cli_text
def test_a_stdout_whose_reader_went_away_exits_3_not_1(tmp_path):
    """`kvfuzz fuzz ... | head -2`: rich's console ended the process with exit 1 ("a failure was found") at its next
    line, silently. It stops as interrupted (3), workers stopped and state saved, with nothing on stderr."""
    p = start_kvfuzz("fuzz", "--target", f"{PLANTED}:Slow", "--max-examples", "400", "--out", tmp_path / "o",
                     cwd=tmp_path)
    first = [p.stdout.readline() for _ in range(2)]
    assert first[0].startswith("fuzzing planted.slow"), first
    p.stdout.close()  # as head does after its lines
    assert p.wait(timeout=600) == 3
    assert p.stderr.read() == ""
    assert json.loads((tmp_path / "o" / "state.json").read_text())["running"] is False


@pytest.mark.cli_text
def test_a_signal_while_the_report_is_drawn_keeps_the_campaigns_verdict(tmp_path, monkeypatch):
    """SIGTERM (a `timeout` past --duration) arriving once summary.json is written, while report.md is drawn: the
    campaign is over and its verdict is in summary.json, so the command exits with it (0 here), says the report was
    not written and how to draw it; before, it exited 3 ("interrupted") while summary.json said 0."""
    from kvfuzz.fuzz.campaign.store import report
    from kvfuzz.fuzz.cli.common import Interrupted

    def interrupted(out):
        raise Interrupted("SIGTERM")

    monkeypatch.setattr(report, "write_report", interrupted)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "4", "--workers", "1",
                                  "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert r.exit_code == summary["exit_status"] == 0, r.output
    assert "report not written" in r.output and "SIGTERM" in r.output and "kvfuzz report" in r.output, r.output
    assert not (out / "report.md").exists()
