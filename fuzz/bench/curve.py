"""``kvfuzz bench throughput --curve``: examples/s over a real campaign, minute by minute, for each target,
from a cold Triton cache and a warm one, with one worker and with the default number of workers.

Each run is a real ``kvfuzz fuzz`` (a subprocess: supervised workers, shrinking, reproducers) of one target for
``duration`` seconds with its own ``--triton-cache``. The curve samples the campaign's ``status.json`` (examples
counted so far) and the Triton cache (``__grp__*.json`` files: one per compiled specialization) every
``interval`` seconds. Modes:

- ``cold``: an empty Triton cache (every specialization is compiled in the run);
- ``warm``: the cache the cold run with the same seed and workers left (the configurations the cold run
  visited are compiled; what remains is loading them from disk once per worker; being faster, it goes on to
  configurations the cold run never reached and compiles those);
- ``warm-capped`` (``--mode``): the same, capped at the cold run's example count, so it stays within what the
  cold run compiled.

Reported per run: the samples, examples/s per minute, the mean over the run, compiled specializations per
minute, the campaign's exit status and failures, and whether every declared dtype, kv_cache_dtype, head size,
block size and feature was drawn (the summary's ``declared`` table).

:func:`run_campaign` serves other compile caches too (``cache_option``, ``count``: FlashInfer's JIT modules,
benchmarks/flashinfer_speed.py) and can stop a campaign at a wall-clock limit (``wall``) and still read what it
counted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

MODES = ("cold", "warm")
#: Every mode :func:`curve` runs: ``warm-capped`` is a warm run that draws as many examples as the cold one did,
#: so it visits the configurations the cold run compiled (an uncapped warm run, faster, goes on to new ones and
#: compiles them): the rate of a warm cache without compiles.
ALL_MODES = ("cold", "warm", "warm-capped")
#: Seconds between the SIGTERM of a campaign past its ``wall`` and the SIGKILL of its process group: the
#: supervisor gives its workers 20 s (kvfuzz.fuzz.campaign.workers.supervisor.STOP_GRACE_SECONDS), then writes the
#: summary.
KILL_AFTER = 30.0


def _status_examples(out: Path, target: str) -> int | None:
    try:
        doc = json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return None
    for t in doc.get("targets", []):
        if t.get("target") == target:
            return int(t.get("examples", 0))
    return None


def compiled_kernels(cache: Path) -> int:
    """Specializations in a Triton cache directory (one ``__grp__<name>.json`` per compiled kernel)."""
    return sum(1 for _ in cache.rglob("__grp__*.json")) if cache.exists() else 0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the campaign's process group (its workers and what they started: nvcc, ninja), if any is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_campaign(target: str, duration: float, workers: int | None, cache: Path, out: Path, seed: int = 0,
                 interval: float = 5.0, extra: tuple[str, ...] = (),
                 on_sample: Callable[[dict], None] = lambda s: None, cache_option: str = "--triton-cache",
                 count: Callable[[Path], int] = None, wall: float | None = None,
                 stop: Callable[[], bool] = lambda: False) -> dict:
    """One ``kvfuzz fuzz`` of ``target`` for ``duration`` s with compile cache ``cache`` (passed as
    ``cache_option``, counted by ``count``: Triton's by default); returns its curve. The campaign runs in its own
    process group. ``wall``: seconds after which it is sent SIGTERM (it stops, finishes or abandons the examples
    in flight and writes its summary) and, :data:`KILL_AFTER` s later, its whole group SIGKILL (then the counts
    come from its last status.json); ``stopped_at_wall`` says whether that happened. ``stop()`` true (asked at
    every sample) stops it the same way before its wall. Whatever happens, no process of the group is left
    running."""
    count = count or compiled_kernels
    cmd = [sys.executable, "-m", "kvfuzz.fuzz.cli", "fuzz", "--target", target, "--duration", f"{duration}s",
           "--seed", str(seed), "--out", str(out), cache_option, str(cache), *extra]
    if workers:
        cmd += ["--workers", str(workers)]
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log = open(out.parent / f"{out.name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, COLUMNS="200"),
                            start_new_session=True)
    samples, termed = [], None
    try:
        while proc.poll() is None:
            to_wall = None if wall is None or termed is not None else wall - (time.monotonic() - start)
            time.sleep(interval if to_wall is None else max(0.1, min(interval, to_wall)))
            now = time.monotonic() - start
            if termed is None and (wall is not None and now >= wall or stop()):
                termed = now
                proc.terminate()
            if termed is not None and now >= termed + KILL_AFTER:
                _kill_group(proc)
            s = {"t": round(now, 2), "examples": _status_examples(out, target), "compiled": count(cache)}
            samples.append(s)
            on_sample(s)
    finally:
        _kill_group(proc)  # nvcc/ninja a killed worker left behind
        proc.wait()
        log.close()
    elapsed = time.monotonic() - start
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    t = next((x for x in summary.get("targets", []) if x.get("target") == target), {})
    if not t:  # killed before its summary: what its last status snapshot counted
        try:
            status = json.loads((out / "status.json").read_text())
            t = next((x for x in status.get("targets", []) if x.get("target") == target), {})
        except (OSError, ValueError):
            t = {}
    never = [f"{dim} {v}" for dim, counts in t.get("declared", {}).items() for v, n in counts.items() if n == 0]
    return {"target": target, "workers": summary.get("workers", workers), "seconds": round(elapsed, 1),
            "pid": proc.pid, "exit_status": proc.returncode, "stopped_at_wall": termed is not None,
            "summary": bool(summary), "examples": t.get("examples"), "elapsed_s": t.get("elapsed_s"),
            "examples_per_s": t.get("examples_per_s"), "kernel_s": t.get("kernel_s"),
            "harness_s": t.get("harness_s"), "compiled": count(cache),
            "failures": [(f["kind"], f["check"], f["count"]) for f in t.get("failures", [])],
            "declared": t.get("declared", {}), "coverage": t.get("coverage", {}),
            "rejections": t.get("rejections", {}), "declared_never_drawn": never,
            "per_minute": per_minute(samples), "samples": samples}


def per_minute(samples: list[dict]) -> list[dict]:
    """Examples/s and new compiled kernels in each whole minute of the samples."""
    out, prev = [], {"t": 0.0, "examples": 0, "compiled": 0}
    minute = 1
    for s in samples:
        if s["examples"] is None:
            continue
        if s["t"] >= 60 * minute:
            dt = s["t"] - prev["t"]
            out.append({"minute": minute, "examples_per_s": round((s["examples"] - prev["examples"]) / dt, 2),
                        "compiled": s["compiled"] - prev["compiled"]})
            prev, minute = s, minute + 1
    return out


def curve(targets: list[str], duration: float, worker_counts: list[int | None], seed: int = 0,
          interval: float = 5.0, root: Path | None = None, extra: tuple[str, ...] = (),
          on_run: Callable[[dict], None] = lambda r: None,
          on_doc: Callable[[dict], None] = lambda d: None, modes: tuple[str, ...] = MODES) -> dict:
    """For each target and worker count (None: kvfuzz's default), the runs of ``modes`` in order (a cold run
    first: the others use the cache it left); returns the JSON document, also handed to ``on_doc`` after every
    run (a benchmark cut short keeps what it measured). Raises ValueError for a mode not in :data:`ALL_MODES`
    or modes that do not start with "cold"."""
    if not modes or modes[0] != "cold" or any(m not in ALL_MODES for m in modes):
        raise ValueError(f"modes must start with 'cold' and be among {', '.join(ALL_MODES)}: {modes}")
    import torch

    root = Path(root or tempfile.mkdtemp(prefix="kvfuzz-curve-"))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"settings": {"duration_s": duration, "seed": seed, "interval_s": interval, "device": device,
                        "cpus": os.cpu_count(), "extra": list(extra)}, "runs": []}
    for target in targets:
        for workers in worker_counts:
            tag = f"{target}-w{workers or 'default'}"
            cache = root / f"triton-{tag}"
            shutil.rmtree(cache, ignore_errors=True)
            cold_examples = None
            for mode in modes:
                out = root / f"{tag}-{mode}"
                shutil.rmtree(out, ignore_errors=True)
                cap = ("--max-examples", str(max(1, cold_examples or 1))) if mode == "warm-capped" else ()
                r = run_campaign(target, duration, workers, cache, out, seed, interval, (*extra, *cap))
                if mode == "cold":
                    cold_examples = r.get("examples")
                r.update(mode=mode, workers_asked=workers or "default")
                doc["runs"].append(r)
                on_run(r)
                on_doc(doc)
    return doc


def plot(doc: dict, path: Path) -> Path:
    """Examples/s per minute, one line per target, mode and workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in doc["runs"]:
        pm = r["per_minute"]
        if pm:
            ax.plot([p["minute"] for p in pm], [p["examples_per_s"] for p in pm], marker="o",
                    linestyle="-" if r["mode"] == "warm" else "--",
                    label=f"{r['target']} {r['mode']} w={r['workers']}")
    ax.set_xlabel("minute of the campaign")
    ax.set_ylabel("examples/s")
    ax.set_yscale("log")
    ax.set_title(f"kvfuzz fuzz on {doc['settings']['device']}")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["ALL_MODES", "MODES", "compiled_kernels", "curve", "per_minute", "plot", "run_campaign"]
