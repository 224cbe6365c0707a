"""Several hosts, one search (docs/campaigns.md, "Several hosts"): one campaign per host, sharing the example
database (`--db redis://...`, or a shared directory) and a baseline. Two campaigns on this machine, with their own
--out, stand in for two hosts: the second replays what the first saved, finds the same failure and lists it as a
known duplicate of the first's reproducer, not as a new failure (exit 0, not 1)."""

import json
import shutil

import pytest
from support import SUPPORT, kvfuzz

from kvfuzz.fuzz.campaign.store import ledger

PLANTED = SUPPORT / "planted_endings.py"


def _campaign(out, db, seed):
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:RaisesRuntimeError", "--poison", "stale", "--out", out,
               "--workers", "1", "--max-examples", "40", "--seed", str(seed), "--structural-shrink", "0",
               "--db", db, timeout=600)
    return r, json.loads((out / "summary.json").read_text())


def _two_hosts(tmp_path, db):
    r1, s1 = _campaign(tmp_path / "host1", db, seed=1)
    assert r1.returncode == 1, r1.stdout + r1.stderr  # host 1: a new failure
    (f1,) = s1["targets"][0]["failures"]
    assert f1["known"] is None and f1["check"] == "raised RuntimeError"
    r2, s2 = _campaign(tmp_path / "host2", db, seed=2)
    (f2,) = s2["targets"][0]["failures"]
    assert (f2["kind"], f2["check"]) == (f1["kind"], f1["check"])
    assert f2["known"] and str((tmp_path / "host1").resolve()) in f2["known"] and f1["reproducer"] in f2["known"]
    assert r2.returncode == 0 and s2["new_failures"] == 0, r2.stdout + r2.stderr


def test_two_hosts_sharing_a_directory_database_report_a_failure_once(tmp_path):
    _two_hosts(tmp_path, str(tmp_path / "shared-db"))


def test_two_hosts_sharing_redis_report_a_failure_once(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run installs it)")
    from test_database import _redis

    proc, client, url = _redis(tmp_path)
    try:
        _two_hosts(tmp_path, url)
        assert client.keys(b"*" + ledger.LEDGER_PREFIX + b"planted.raises_runtime_error*")  # the claims, in Redis
    finally:
        proc.terminate()
        proc.wait()


def test_a_resumed_campaign_is_not_its_own_duplicate(tmp_path):
    from hypothesis.database import InMemoryExampleDatabase

    db = InMemoryExampleDatabase()
    assert ledger.claim(db, tmp_path / "a", "t", "kernel crash", "SIGSEGV", "a/r1") is None
    assert ledger.claim(db, tmp_path / "a", "t", "kernel crash", "SIGSEGV", "a/r2") is None  # the same campaign
    other = ledger.claim(db, tmp_path / "b", "t", "kernel crash", "SIGSEGV", "b/r1")
    assert other["reproducer"] == "a/r1" and "a/r1" in ledger.duplicate_note(other)
    assert ledger.claim(db, tmp_path / "b", "t", "kernel crash", "SIGABRT", "b/r2") is None  # another failure
