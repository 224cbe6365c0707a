"""A campaign started again on the same --out (issue 49: "kill the campaign with SIGKILL halfway and start it again
with the same --out: nothing is lost, and the findings are not reported again as new"): the failures an earlier
campaign there recorded are reported found before, with the reproducer already there, none written again, and the
exit status stays 1 (fuzz/campaign/workers/bookkeeping.py FoundBefore, store/cases.py earlier_cases). Run through
`kvfuzz fuzz` as a user would, on a planted adapter that is wrong on every call (tests/support/planted_endings.py)."""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from support import SUPPORT, kvfuzz, start_kvfuzz

from kvfuzz.contracts.checks.oracles import Oracle, check_label
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.campaign.records import TargetStats
from kvfuzz.fuzz.campaign.store.cases import CASE_FORMAT
from kvfuzz.fuzz.campaign.workers.bookkeeping import FoundBefore

WRONG = f"{SUPPORT / 'planted_endings.py'}:AlwaysWrong"
ARGS = ("--target", WRONG, "--poison", "stale", "--workers", "1")


def reproducers(out: Path) -> set[str]:
    return {d.name for d in out.iterdir() if (d / "case.json").exists()}


def fuzz(out: Path, *extra):
    r = kvfuzz("fuzz", *ARGS, "--out", out, *extra, timeout=600)
    return r, json.loads((out / "summary.json").read_text())


def assert_found_before(r, summary, out: Path, first: set[str]) -> None:
    """The second run: exit 1, no new reproducer, its one failure listed as found before with the first run's."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert reproducers(out) == first, "a reproducer was written again for a failure already in --out"
    (failure,) = summary["targets"][0]["failures"]
    assert failure["found_before"] is True and Path(failure["reproducer"]).name in first
    assert failure["kind"] == "kernel mismatch" and failure["known"] is None and failure["count"] >= 1
    assert summary["new_failures"] == 0 and summary["found_before_failures"] == 1 and summary["exit_status"] == 1
    assert "found before: kernel mismatch" in r.stdout and failure["reproducer"] in r.stdout
    assert "not new, and still failing" in r.stdout
    assert "found before" in (out / "report.md").read_text()


def test_a_campaign_run_again_on_its_out_reports_its_failure_found_before_not_new(tmp_path):
    out = tmp_path / "out"
    r1, s1 = fuzz(out, "--max-examples", "10")
    assert r1.returncode == 1, r1.stdout + r1.stderr
    (f1,) = s1["targets"][0]["failures"]
    assert f1["found_before"] is False and s1["new_failures"] == 1 and s1["found_before_failures"] == 0
    first = reproducers(out)
    assert first == {Path(f1["reproducer"]).name}
    # an earlier reproducer that cannot be read: named in a warning, the start goes on
    (out / "torn-case").mkdir()
    (out / "torn-case" / "case.json").write_text('{"format": 1, "target": ')
    r2, s2 = fuzz(out, "--max-examples", "10")
    assert str(out / "torn-case" / "case.json") in r2.stdout and "not valid JSON" in r2.stdout
    assert_found_before(r2, s2, out, first | {"torn-case"})


def test_a_campaign_killed_with_sigkill_and_started_again_loses_nothing_and_reports_nothing_new(tmp_path):
    """SIGKILL once the first reproducer is on disk, the campaign still running (its budget is 100,000 examples):
    waited for by the file, not by time. The run after it exits 1 with the same reproducers, none new."""
    out, log = tmp_path / "out", tmp_path / "calls.log"
    p = start_kvfuzz("fuzz", *ARGS, "--out", out, "--max-examples", "100000",
                     env=dict(os.environ, KVFUZZ_PLANTED_LOG=str(log)))
    deadline = time.monotonic() + 300
    while not (out.exists() and reproducers(out)):
        assert p.poll() is None and time.monotonic() < deadline, "no reproducer before the campaign ended"
        time.sleep(0.1)
    p.kill()
    p.communicate(timeout=60)
    workers = set(log.read_text().split())
    deadline = time.monotonic() + 30  # its workers die with it (PR_SET_PDEATHSIG, the parent-pid watchdog)
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "the killed campaign's workers are still running"
        time.sleep(0.1)
    assert not (out / "summary.json").exists()
    first = reproducers(out)  # one, or two if it was killed between a final reproducer and its provisional's removal
    r, summary = fuzz(out, "--max-examples", "10")
    assert_found_before(r, summary, out, first)
    assert summary["lost"] == 0 and summary["problems"] == []


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


# ---- reading the earlier reproducers back ----------------------------------------------------------------------
EXAMPLE = Example(small_batch([1], [5]), Poison.STALE)


def _case(d: Path, target: str = "t", fault=None, stage: str = "final", known: str | None = None) -> Path:
    d.mkdir(parents=True)
    details = {"baseline": {"known": known}} if known else {}
    (d / "case.json").write_text(json.dumps({
        "format": CASE_FORMAT, "target": target, "kind": "kernel mismatch", "check": Oracle.AGREEMENT.value,
        "message": "off by one", "details": details, "caller_fault": fault, "example": EXAMPLE.to_dict(),
        "stage": stage}))
    return d


def _read(out: Path, targets=("t",), fault=None) -> tuple[FoundBefore, list[str]]:
    said: list[str] = []
    config = SimpleNamespace(out=out, fault=None if fault is None else SimpleNamespace(name=fault))
    return FoundBefore.read(config, set(targets), said.append), said


def test_a_corrupt_or_unreadable_earlier_case_is_named_in_a_warning_and_the_start_goes_on(tmp_path):
    good = _case(tmp_path / "t-kernel-mismatch-good")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "case.json").write_text("{not json")
    (tmp_path / "wrong-field").mkdir()
    (tmp_path / "wrong-field" / "case.json").write_text(json.dumps({"format": CASE_FORMAT, "target": "t",
                                                                    "kind": "no such kind"}))
    (tmp_path / "workers").mkdir()  # a folder without case.json is not a reproducer: nothing said
    (tmp_path / "status.json").write_text("{}")
    before, said = _read(tmp_path)
    assert list(before.cases.values())[0].directory == good
    warnings = [m for m in said if "cannot be read" in m]
    assert len(warnings) == 2
    assert str(tmp_path / "torn" / "case.json") in warnings[0] and "not valid JSON" in warnings[0]
    assert str(tmp_path / "wrong-field" / "case.json") in warnings[1] and "'kind'" in warnings[1]
    assert any("1 failure(s) already have a reproducer" in m for m in said)


def test_only_this_campaigns_targets_and_caller_fault_count_and_the_furthest_shrunk_stands(tmp_path):
    _case(tmp_path / "a-unshrunk", stage="unshrunk")
    final = _case(tmp_path / "b-final")
    _case(tmp_path / "other-target", target="u")
    _case(tmp_path / "under-a-fault", fault="int64-index")
    known = _case(tmp_path / "known", known="entry-1")
    before, _ = _read(tmp_path)
    sig = ("kernel mismatch", Oracle.AGREEMENT.value)
    assert before.cases.keys() == {("t", sig), ("t", (*sig, "entry-1"))}
    assert before.cases[("t", sig)].directory == final and before.cases[("t", (*sig, "entry-1"))].directory == known
    assert before.signatures("t", {}) == [list(sig), [*sig, "entry-1"]] and before.signatures("u", {}) == []
    assert _read(tmp_path / "nowhere")[0].cases == {}  # no --out yet


def test_the_first_hit_of_a_failure_found_before_lists_it_with_the_reproducer_there(tmp_path):
    d = _case(tmp_path / "t-kernel-mismatch-x", known="entry-1")
    before, said = _read(tmp_path)
    stats = TargetStats("t")
    sig = ("kernel mismatch", Oracle.AGREEMENT.value)
    before.hit(stats, None)
    before.hit(stats, list(sig))  # not found before: a new failure, recorded by its worker
    assert stats.failures == {}
    before.hit(stats, [*sig, "entry-1"])
    before.hit(stats, [*sig, "entry-1"])
    (record,) = stats.failures.values()
    assert record.found_before and record.reproducer == str(d) and record.known == "entry-1" and record.count == 1
    assert record.to_dict()["found_before"] is True and record.example == EXAMPLE.to_dict()
    assert [m for m in said if m.startswith("found before")] == [
        f"found before: kernel mismatch ({check_label(sig[1])}) in t -> {d} (its reproducer from an "
        "earlier campaign in this --out; none written again)"]
