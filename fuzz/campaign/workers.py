"""Multi-process campaigns: N worker processes, each a single-process ``kvfuzz fuzz`` with its own seed,
sharing the reproducer directory and the example database; the supervisor isolates kernel crashes and hangs.

A worker journals every example to ``<out>/workers/wN/inflight.json`` before its kernel runs and removes it
after. The supervisor polls the workers:

- a worker that exits by a signal or an unexpected code (segfault, abort, CUDA illegal memory access taking
  the process down) leaves its journal behind: the example becomes a "kernel crash" reproducer and the
  worker restarts with a new seed and the remaining budget;
- a worker whose journal is older than ``example_timeout`` is stuck in a kernel: it is killed, the example
  becomes a "kernel hang" reproducer, and the worker restarts.

On CUDA machines each worker is pinned to one GPU with CUDA_VISIBLE_DEVICES (worker i -> GPU i mod count).
SIGINT/SIGTERM to the supervisor are forwarded; workers stop after their current example and write their
summaries, which the supervisor merges (one entry per distinct failure, counts summed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

from kvfuzz.fuzz.campaign.engine import CampaignConfig, FoundFailure, recover_crashed
from kvfuzz.fuzz.campaign.reproducers import write_reproducer
from kvfuzz.fuzz.targets.base import Target


@attrs.define
class Worker:
    index: int
    work_dir: Path
    args: list[str]
    seed: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    crashes: dict = attrs.Factory(dict)  # target -> crashes and hangs in this worker
    skip: list = attrs.Factory(list)
    summaries: list = attrs.Factory(list)  # one per incarnation (a restarted worker starts a new one)

    def collect(self) -> None:
        """Keep what this incarnation counted: its summary, or (killed) its last status file."""
        summary, status = self.work_dir / "summary.json", self.work_dir / "status.json"
        if summary.exists():
            self.summaries.append(json.loads(summary.read_text()))
        elif status.exists():
            st = json.loads(status.read_text())
            self.summaries.append({"targets": st["done"] + ([st["current"]] if st.get("current") else [])})
        summary.unlink(missing_ok=True)
        status.unlink(missing_ok=True)
    started: float = 0.0
    done: bool = False
    returncode: int | None = None


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _env(index: int, gpus: int) -> dict[str, str]:
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(w: Worker, gpus: int, remaining: float | None) -> None:
    args = [sys.executable, "-m", "kvfuzz.fuzz.cli", "fuzz", *w.args, "--seed", str(w.seed),
            "--worker-dir", str(w.work_dir), *[a for t in w.skip for a in ("--skip-target", t)]]
    if remaining is not None:
        args += ["--duration", f"{max(1.0, remaining):.0f}s"]
    w.work_dir.mkdir(parents=True, exist_ok=True)
    log = open(w.work_dir / "worker.log", "a")
    w.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_env(w.index, gpus))
    w.started = time.monotonic()


def run_workers(n: int, worker_args: list[str], out: Path, seed: int, duration: float | None,
                example_timeout: float, targets: dict[str, Target], config: CampaignConfig,
                on_event=lambda msg: None, poll: float = 0.5,
                max_crashes: int = 3) -> tuple[list[dict], list[FoundFailure], bool]:
    """Run ``n`` workers to completion. ``worker_args`` are the ``kvfuzz fuzz`` options every worker gets
    (without --seed/--duration/--worker-dir). A target that crashes or hangs ``max_crashes`` times in a worker
    is skipped by that worker from then on, so one broken kernel cannot starve the others. Each (target,
    kind) is written as one reproducer; repeats are counted. Returns (worker summaries, crashes and hangs
    recovered, interrupted)."""
    gpus = gpu_count()
    start = time.monotonic()
    workers = [Worker(i, out / "workers" / f"w{i}", worker_args, seed * 1000 + i) for i in range(n)]
    for w in workers:
        _start(w, gpus, duration)
    recovered: list[FoundFailure] = []
    stopping = {"flag": False}

    def recover(w: Worker, wcfg: CampaignConfig, hang: bool) -> None:
        journal = w.work_dir / "inflight.json"
        entry = json.loads(journal.read_text()) if journal.exists() else None
        for found in recover_crashed(wcfg, targets, hang=hang, write=False):
            key = (found.target, found.finding.kind.value, found.finding.check)
            seen = next((r for r in recovered if (r.target, r.finding.kind.value, r.finding.check) == key), None)
            if seen is not None:
                seen.count += 1
                continue
            if found.target in targets:
                found.reproducer = write_reproducer(out, targets[found.target], found.example, found.finding,
                                                    None, fault_name=entry.get("fault") if entry else None)
            recovered.append(found)
        if entry is not None:
            name = entry["target"]
            w.crashes[name] = w.crashes.get(name, 0) + 1
            if w.crashes[name] >= max_crashes and name not in w.skip:
                w.skip.append(name)
                on_event(f"worker {w.index}: {name} crashed or hung {w.crashes[name]} times; skipping it")

    def stop(signum, frame):
        stopping["flag"] = True
        for w in workers:
            if w.proc and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not all(w.done for w in workers):
            time.sleep(poll)
            for w in workers:
                if w.done:
                    continue
                rc = w.proc.poll()
                journal = w.work_dir / "inflight.json"
                wcfg = attrs.evolve(config, work_dir=w.work_dir)
                if rc is None:
                    if journal.exists() and time.time() - journal.stat().st_mtime > example_timeout:
                        w.proc.kill()
                        w.proc.wait()
                        w.collect()
                        recover(w, wcfg, hang=True)
                        on_event(f"worker {w.index}: kernel hang (> {example_timeout:.0f}s), restarting")
                        _restart(w, gpus, duration, start, stopping["flag"], set(targets))
                    continue
                w.collect()
                if rc in (0, 1) or stopping["flag"]:
                    w.done, w.returncode = True, rc
                    if journal.exists() and rc not in (0, 1):
                        recover(w, wcfg, hang=False)
                    continue
                # died: a signal (negative rc) or an unexpected exit code
                recover(w, wcfg, hang=False)
                on_event(f"worker {w.index}: died with exit code {rc}, restarting")
                _restart(w, gpus, duration, start, stopping["flag"], set(targets))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    summaries = [s for w in workers for s in w.summaries]
    return summaries, recovered, stopping["flag"]


def _restart(w: Worker, gpus: int, duration: float | None, start: float, stopping: bool,
             names: set[str]) -> None:
    remaining = None if duration is None else duration - (time.monotonic() - start)
    if stopping or (remaining is not None and remaining <= 1) or set(w.skip) >= names:
        w.done = True
        return
    w.restarts += 1
    w.seed += 7919  # new seeds: do not walk straight back into the example that killed it
    _start(w, gpus, remaining)


def merge_summaries(summaries: list[dict], wall: float | None = None) -> list[dict]:
    """Merge per-worker target summaries: sums of examples and times, one failure entry per (target, kind,
    check) with counts summed. ``wall``: the campaign's wall-clock seconds; examples/s is then the aggregate
    rate of all workers (examples / wall), else examples over the longest worker's time."""
    merged: dict[str, dict] = {}
    for s in summaries:
        for t in s["targets"]:
            m = merged.setdefault(t["target"], {"target": t["target"], "examples": 0, "elapsed_s": 0.0,
                                               "kernel_s": 0.0, "harness_s": 0.0, "paths": {}, "coverage": {},
                                               "failures": {}, "workers": 0})
            m["workers"] += 1
            m["examples"] += t["examples"]
            m["elapsed_s"] = max(m["elapsed_s"], t["elapsed_s"])
            m["kernel_s"] += t["kernel_s"]
            m["harness_s"] += t["harness_s"]
            for p, c in t["paths"].items():
                m["paths"][p] = m["paths"].get(p, 0) + c
            for dim, counts in t.get("coverage", {}).items():
                d = m["coverage"].setdefault(dim, {})
                for v, c in counts.items():
                    d[v] = d.get(v, 0) + c
            for f in t["failures"]:
                key = (f["kind"], f["check"])
                if key in m["failures"]:
                    m["failures"][key]["count"] += f["count"]
                else:
                    m["failures"][key] = dict(f)
    out = []
    for m in merged.values():
        m["failures"] = list(m["failures"].values())
        if wall:
            m["elapsed_s"] = round(wall, 3)
        m["examples_per_s"] = round(m["examples"] / m["elapsed_s"], 3) if m["elapsed_s"] else 0.0
        out.append(m)
    return out
