"""Examples per second of a CPU campaign by worker count: the same ``kvfuzz fuzz`` run with ``--workers N`` for
each N asked (``0``: no ``--workers``, the default), one after another, each from a fresh output folder.

    python benchmarks/cpu_workers.py [--target vllm.cpu_attention] [--duration 30s] [--workers 1 0]
                                     [--repeat 2] [--json benchmarks/results/cpu-workers.json]

Each run is ``kvfuzz fuzz --target T --duration D --baseline kvfuzz-baseline.toml --out TMP [--workers N]``
(the shipped baseline: README Finding 1 is known, counted, not shrunk). Recorded per run: the workers the
campaign used, its examples and examples/s (summary.json), how busy the machine's CPUs were in the two seconds
before it started (``/proc/stat``; other processes share the cores, so examples/s taken on a busy machine says
little) and the CPU seconds the campaign's processes used, all of them (supervisor, workers; startup included),
per example: less sensitive to the others. No timing is asserted anywhere; the numbers go in README's
"Measured speed".
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Percent of all CPUs busy over ``seconds`` (``/proc/stat``), or None where there is none."""

    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(100.0 * (1 - (i1 - i0) / max(1, t1 - t0)), 1)


def run(target: str, duration: str, workers: int) -> dict:
    """One campaign; its workers, examples and examples/s, and the machine's CPU load just before it."""
    busy = cpu_busy()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["fuzz", "--target", target, "--duration", duration, "--baseline", "kvfuzz-baseline.toml",
                *(["--workers", str(workers)] if workers else [])]
        cmd = [sys.executable, "-m", "kvfuzz.fuzz.cli", *args, "--out", str(Path(tmp) / "out")]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "out" / "summary.json").read_text())
    (t,) = summary["targets"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": " ".join(["kvfuzz", *args]), "workers": summary["workers"],
            "examples": t["examples"], "examples_per_s": t["examples_per_s"], "cpu_busy_before_pct": busy,
            "cpu_s": round(cpu, 1), "cpu_ms_per_example": round(1000 * cpu / max(1, t["examples"]), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="vllm.cpu_attention")
    ap.add_argument("--duration", default="30s")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 0], help="worker counts; 0: the default")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the runs here")
    a = ap.parse_args()
    runs = []
    for _ in range(a.repeat):
        for n in a.workers:
            runs.append(run(a.target, a.duration, n))
            print(json.dumps(runs[-1]), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"target": a.target, "duration": a.duration, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
