"""A full disk is an ending like any other (issue 22, section 4): the writes clean up after themselves, and a
campaign whose --out fills stops with exit status 3 and one message naming what could not be written and what
was kept — no traceback, no temporary file, nothing blamed on the kernel — and a rerun with space resumes.
The disk is filled by injection (tests/support/planted_disk.py patches os.replace and os.statvfs), never by mounting."""

import errno
import json
import os
from pathlib import Path

import pytest
from support import SUPPORT, kvfuzz

from kvfuzz.contracts.checks.failures import KernelMismatch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store import journal, reproducers
from kvfuzz.fuzz.campaign.store.journal import OutLock, OutOfSpace, disk_full, stop_when_full, write_json
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer

#: the CI reruns these with a 100-character TMPDIR and COLUMNS=40 (.ci/run)
pytestmark = pytest.mark.cli_text

HERE = Path(__file__).resolve().parent
PLANTED = SUPPORT / "planted_disk.py"


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---- the writes ---------------------------------------------------------------------------------------------------
def test_disk_full_tells_a_full_disk_or_quota_from_other_errors():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(RuntimeError("os error 280"))
    with pytest.raises(OutOfSpace, match="could not write /x/case.json"):
        with stop_when_full("/x/case.json"):
            _enospc()
    with pytest.raises(PermissionError):  # anything else passes unchanged
        with stop_when_full("/x"):
            raise PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.parametrize("where", ["replace", "write"])
def test_write_json_on_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, where):
    path = tmp_path / "state.json"
    write_json(path, {"v": 1})
    if where == "replace":
        monkeypatch.setattr(journal.os, "replace", _enospc)
    else:  # the data itself does not fit: the flush fails inside write_json
        monkeypatch.setattr(journal.json, "dumps", lambda *a, **k: "x" * 10)
        real_open = open

        class Full:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text)

            def flush(self):
                _enospc()

        monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **k: Full(real_open(p, mode, *a, **k)))
    with pytest.raises(OSError) as info:
        write_json(path, {"v": 2})
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert json.loads(path.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_reproducer_that_does_not_fit_is_not_left_half_written(tmp_path, monkeypatch):
    from kvfuzz.contracts.model.batch import Batch
    from kvfuzz.fuzz.bench.mutants import PagedTorch

    t = PagedTorch()
    batch = Batch(query_lens=[1], ctx_lens=[3], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                  num_blocks=2, block_table=[[1]], dtype="float32", seed=0)
    example, finding = Example(batch, Poison.NAN), KernelMismatch("tolerance", "planted")
    monkeypatch.setattr(journal, "write_json", _enospc)  # case.json does not fit
    with pytest.raises(OutOfSpace, match="could not write"):
        write_reproducer(tmp_path, t, example, finding, None)
    assert list(tmp_path.iterdir()) == []  # the directory it created is gone
    monkeypatch.undo()
    d = write_reproducer(tmp_path, t, example, finding, None)
    whole = {p.name: p.read_bytes() for p in d.iterdir()}
    monkeypatch.setattr(reproducers, "_tensors", lambda run: _enospc())  # rewriting the same example fails
    with pytest.raises(OutOfSpace):
        write_reproducer(tmp_path, t, example, finding, None)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == whole  # the earlier one stands, whole


def test_a_lock_that_cannot_be_written_is_released(tmp_path, monkeypatch):
    monkeypatch.setattr(journal.os, "write", _enospc)
    with pytest.raises(OutOfSpace, match=r"\.kvfuzz\.lock"):
        OutLock(tmp_path).acquire()
    monkeypatch.undo()
    OutLock(tmp_path).acquire().release()  # not held by the failed attempt


# ---- a campaign whose --out fills -----------------------------------------------------------------------------
def _fuzz(cls, tmp_path, *extra, full=True, only_statvfs=False):
    out = tmp_path / "out"
    env = dict(os.environ, KVFUZZ_PLANTED_OUT=str(out), COLUMNS="40")
    for k in ("KVFUZZ_PLANTED_FULL", "KVFUZZ_PLANTED_ONLY_STATVFS"):
        env.pop(k, None)
    if full:
        env["KVFUZZ_PLANTED_FULL"] = str(tmp_path / "disk-is-full")
    if only_statvfs:
        env["KVFUZZ_PLANTED_ONLY_STATVFS"] = "1"
    workers = () if "--workers" in extra else ("--workers", "1")  # the scenarios count one worker's examples
    return kvfuzz("fuzz", "--target", f"{PLANTED}:{cls}", "--poison", "stale", "--out", str(out), "--max-examples",
                  "40", "--example-timeout", "20", *workers, *extra, env=env)


def _assert_stopped_cleanly(r, out: Path):
    text = r.stdout + r.stderr
    assert r.returncode == 3, text
    assert "Traceback" not in text, text
    problems = [line for line in r.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1, text
    assert problems[0].startswith("problem: no space left on device") and str(out) in problems[0], problems
    assert "Kept in" in problems[0] and "run the same command again" in problems[0], problems
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], sorted(map(str, out.rglob("*")))
    assert "kernel crash" not in text
    json.loads((out / "state.json").read_text())  # whole: the last snapshot stands


def test_a_campaign_whose_disk_fills_as_it_finds_a_failure_exits_3_and_resumes(tmp_path):
    out = tmp_path / "out"
    r = _fuzz("FillsOnFailure", tmp_path)
    _assert_stopped_cleanly(r, out)
    assert not [d for d in out.iterdir() if d.name.startswith("planted.")]  # no half-written reproducer
    assert not (out / "summary.json").exists() and "summary not written" in r.stdout
    chunks = json.loads((out / "state.json").read_text())["chunks"].get("planted.fills_on_failure", 0)
    (tmp_path / "disk-is-full").unlink()  # space again
    r2 = _fuzz("FillsOnFailure", tmp_path, full=False)
    assert r2.returncode == 1, r2.stdout + r2.stderr
    summary = json.loads((out / "summary.json").read_text())
    (t,) = summary["targets"]
    assert [f["kind"] for f in t["failures"]] == ["kernel mismatch"] and summary["exit_status"] == 1
    assert Path(t["failures"][0]["reproducer"]).joinpath("case.json").is_file()
    assert json.loads((out / "state.json").read_text())["chunks"]["planted.fills_on_failure"] > chunks


def test_a_worker_that_dies_of_the_full_disk_is_not_blamed_on_the_kernel(tmp_path):
    out = tmp_path / "out"
    r = _fuzz("DiesOfFullLog", tmp_path)
    _assert_stopped_cleanly(r, out)
    assert "retries the" not in r.stdout  # state.json could not take the example in flight: not promised
    assert json.loads((out / "state.json").read_text())["running"] is True  # the last snapshot stands
    (tmp_path / "disk-is-full").unlink()
    r2 = _fuzz("DiesOfFullLog", tmp_path, full=False)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"][0]["failures"] == [] and summary["targets"][0]["examples"] == 40


def test_a_full_disk_that_state_json_still_fits_keeps_the_examples_in_flight(tmp_path, monkeypatch):
    """Only reproducers do not fit (a worker died with the disk nearly full, state.json still writes): the
    example in flight goes to state.json, and the rerun retries it."""
    out = tmp_path / "out"
    r = _fuzz("DiesOfFullLog", tmp_path, full=True, only_statvfs=True)
    assert r.returncode == 3 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "retries the 1 example(s) that were in flight" in r.stdout, r.stdout
    state = json.loads((out / "state.json").read_text())
    assert state["running"] is True and len(state["in_flight"]) == 1
    (tmp_path / "disk-is-full").unlink()
    r2 = _fuzz("DiesOfFullLog", tmp_path, full=False)
    assert r2.returncode == 0 and "retrying the 1 example(s)" in r2.stdout, r2.stdout + r2.stderr


def test_a_full_disk_inside_an_example_is_nobodys_finding(tmp_path):
    """ENOSPC while an example is prepared (an adapter writing a file) stops the campaign: not a harness error,
    not the kernel's."""
    from kvfuzz.contracts.model.batch import Batch
    from kvfuzz.fuzz.bench.mutants import PagedTorch
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.engine import Campaign

    class FullInPrepare(PagedTorch):
        name = "planted.full_in_prepare"

        def build_call(self, *args, **kwargs):
            _enospc()

    batch = Batch(query_lens=[1], ctx_lens=[3], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                  num_blocks=2, block_table=[[1]], dtype="float32", seed=0)
    c = Campaign(FullInPrepare(), CampaignConfig(out=tmp_path, database=None, db_spec=str(tmp_path / "db")))
    with pytest.raises(OutOfSpace, match="no space left on device"):
        c.runner.check(Example(batch, Poison.NAN))
