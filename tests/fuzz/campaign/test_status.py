"""A long campaign that is easy to watch (kvfuzz.fuzz.campaign.workers.status, the workers' memory reports):
status.json's elapsed and remaining time, examples per second over the last minutes, distinct failures and the
memory each worker holds, from unit pieces to a running campaign."""

import json
import os
import signal
import time

import attrs
from support import SUPPORT, start_kvfuzz

from kvfuzz.fuzz.campaign.records import FailureRecord, Outcome, TargetStats
from kvfuzz.fuzz.campaign.store.journal import CampaignState
from kvfuzz.fuzz.campaign.workers import worker
from kvfuzz.fuzz.campaign.workers.bookkeeping import Slot, TargetState
from kvfuzz.fuzz.campaign.workers.status import Rates, Snapshots, rss_bytes


def test_the_rates_are_over_the_last_minute_and_the_last_five():
    """From the newest sample at least a window old (the oldest one early on) to the last sample."""
    rates = Rates()
    assert rates.per_second() == {"last_1m": None, "last_5m": None}
    for t, n in [(0, 0), (100, 100), (300, 1100), (340, 1500), (400, 2100)]:
        rates.add(float(t), n)
    # last minute: from t=340 to 400, 600 examples; last five: from t=100 to 400, 2000 examples
    assert rates.per_second() == {"last_1m": 10.0, "last_5m": 6.667}
    early = Rates()
    early.add(0.0, 0)
    early.add(20.0, 50)
    assert early.per_second() == {"last_1m": 2.5, "last_5m": 2.5}  # 20 s in: over what there is


@attrs.define
class _Proc:
    pid: int


def test_status_says_time_rates_failures_and_memory(tmp_path):
    """status.json's fields from the supervisor's view: elapsed since the start, remaining until the last target's
    --duration runs out, the distinct failures, each worker's resident memory (this process stands in for a worker)
    and the CUDA memory a worker reported, with totals."""
    clock = [1000.0]
    snaps = Snapshots(tmp_path, CampaignState(tmp_path / "state.json"), duration=600.0, clock=lambda: clock[0])
    stats = TargetStats("t", examples=1200)
    stats.add_failure(FailureRecord("t", "kernel mismatch", "kernel", "agreement", "m", {}))
    targets = [TargetState(object(), stats, start=1000.0)]
    here, gone = Slot(0, proc=_Proc(os.getpid())), Slot(1)
    gone.gpu_memory = (3 << 30, 1 << 30)
    clock[0] = 1120.0
    snaps.write(targets, [here, gone], force=True)
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["elapsed_s"], status["remaining_s"], status["examples"], status["distinct_failures"]) == (
        120.0, 480.0, 1200, 1)
    assert status["running"] and set(status["examples_per_s"]) == {"last_1m", "last_5m"}
    w0, w1 = status["memory"]["workers"]["0"], status["memory"]["workers"]["1"]
    assert w0["pid"] == os.getpid() and w0["rss_bytes"] == status["memory"]["rss_bytes"] > 0
    assert w0["gpu_reserved_bytes"] is None and w1["rss_bytes"] is None
    assert (w1["gpu_reserved_bytes"], w1["gpu_allocated_bytes"]) == (3 << 30, 1 << 30)
    assert status["memory"]["gpu_reserved_bytes"] == 3 << 30
    assert rss_bytes(None) is None and rss_bytes(2 ** 31 - 1) is None  # no such process
    # at the end: nothing remains, nothing runs
    snaps.write(targets, [here, gone], final=True)
    final = json.loads((tmp_path / "status.json").read_text())
    assert final["remaining_s"] == 0.0 and not final["running"]
    # a second target not yet started: the targets take the workers in turn, so its 600 s come after the first's 480
    targets.append(TargetState(object(), TargetStats("u")))
    snaps.write(targets, [here, gone], force=True)
    assert json.loads((tmp_path / "status.json").read_text())["remaining_s"] == 1080.0


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_a_worker_reports_its_cuda_memory_at_most_every_few_seconds(monkeypatch):
    """After an example the worker says how much CUDA memory its allocator reserves and holds, once per
    MEMORY_SECONDS; off CUDA (this machine) it says nothing."""
    assert worker.gpu_memory() is None  # no CUDA here
    pipe = _Pipe()
    listener = worker.PipeListener(pipe)
    listener.end("t", Outcome({}))  # not CUDA: no memory message
    monkeypatch.setattr(worker, "gpu_memory", lambda: (4 << 30, 2 << 30))
    quiet = worker.PipeListener(_Pipe())
    quiet.end("t", Outcome({}))
    quiet.end("t", Outcome({}))  # within MEMORY_SECONDS of the first
    assert [m[0] for m in pipe.sent] == ["end"]
    assert [m for m in quiet.conn.sent if m[0] == "memory"] == [("memory", 4 << 30, 2 << 30)]


def test_a_running_campaign_says_how_it_is_doing(tmp_path):
    """Mid-run, status.json of a `kvfuzz fuzz --duration` campaign has its elapsed and remaining time, its rates,
    its failures and each worker's resident memory."""
    out = tmp_path / "out"
    p = start_kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_endings.py'}:Slow", "--poison", "stale",
                     "--duration", "600s", "--workers", "2", "--out", out,
                     env=dict(os.environ, KVFUZZ_PLANTED_LOG=str(tmp_path / "calls.log")))
    try:
        deadline, status = time.monotonic() + 300, {}
        while time.monotonic() < deadline:
            try:
                status = json.loads((out / "status.json").read_text())
            except (OSError, ValueError):
                status = {}
            workers = status.get("memory", {}).get("workers", {})
            if status.get("examples", 0) >= 2 and len(workers) == 2 and all(w["rss_bytes"] for w in workers.values()):
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.5)
        else:
            raise AssertionError(f"status.json never showed two workers running examples: {status}")
        assert status["running"] and 0 < status["elapsed_s"] and 0 < status["remaining_s"] <= 600
        assert status["distinct_failures"] == 0 and set(status["examples_per_s"]) == {"last_1m", "last_5m"}
        assert status["memory"]["rss_bytes"] == sum(w["rss_bytes"] for w in workers.values())
        assert status["memory"]["gpu_reserved_bytes"] is None  # the CPU: no CUDA memory
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
