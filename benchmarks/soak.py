"""A soak: one `kvfuzz fuzz` campaign for hours, sampled every few minutes, killed with SIGKILL halfway and started
again on the same ``--out`` (issue 49, "A soak benchmark").

    python benchmarks/soak.py --out DIR --hours 2 [--sample 300] [--kill-at 0.5] [--warmup 1800] -- --target T ...

Everything after ``--`` goes to ``kvfuzz fuzz`` (``--out`` and ``--duration`` are the soak's own). Each sample (JSON
lines, ``DIR/samples.jsonl``) holds, for the running campaign: each worker's RSS (MiB; of it, anonymous and
file-backed, ``/proc/PID/smaps_rollup``: file-backed pages are shared libraries paged in as first used) and open
files, GPU memory per process (``nvidia-smi --query-compute-apps``, where there is one), the size of ``--out`` and
of its ``hypothesis-db``, the examples so far and examples/s since the last sample (status.json), restarts, lost
examples, skipped examples, distinct failures and reproducer directories. Halfway (``--kill-at``) the campaign's whole
process group is killed with SIGKILL and the same command is started again on the same ``--out`` for the time left:
the second part must lose nothing and report no finding of the first part as new. Each ``--target`` named gets an
equal share of the soak as its ``--duration`` (which is per target: the targets take the workers in turn; with the
whole length each, a 2x H200 soak of twelve targets ran only the first). At ``--hours`` the campaign gets SIGTERM (a
clean stop, its summary written), so a campaign that names no target, or runs past its budgets, still ends with the
soak.

``DIR/soak.json`` (written at the end, and after every sample) sums it up against the goals: RSS and GPU memory
within 10% of their first sample after ``--warmup`` (30 minutes: a worker's memory rises to the high-water marks of
the largest examples it meets, which the CPU Triton-interpreter targets reached within 25 minutes in every run
measured; the growth since the second sample is reported beside it), examples/s not falling more than 10% (the last
hour's mean against the first's, from the second sample), ``--out`` growth per hour, reproducer directories per
distinct failure, lost examples (0), restarts (each explained in the summary's problems), and the findings the
restarted part reported as new. ``DIR/soak.png`` plots the samples (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

MIB = 1 << 20


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def gpu_memory() -> dict[int, int]:
    """MiB of GPU memory per process id (nvidia-smi), empty without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return {}
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    out = {}
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1])
    return out


def workers(proc: psutil.Process) -> list[psutil.Process]:
    """The campaign's worker processes: the supervisor's children named kvfuzz-worker-*, or all its children."""
    try:
        kids = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    named = []
    for k in kids:
        try:
            if "kvfuzz-worker" in " ".join(k.cmdline()) or k.name().startswith("kvfuzz-worker"):
                named.append(k)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return named or kids


def rss_split(pid: int) -> tuple[float | None, float | None]:
    """MiB of ``pid``'s resident set that is anonymous (heap, mapped blocks: what the process allocated, freed or
    not) and file-backed (shared libraries and other mapped files, paged in as they are first used), from
    ``/proc/PID/smaps_rollup``; (None, None) where it cannot be read."""
    kib = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                kib[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return None, None
    if "Rss" not in kib or "Anonymous" not in kib:
        return None, None
    return round(kib["Anonymous"] / 1024, 1), round((kib["Rss"] - kib["Anonymous"]) / 1024, 1)


def status(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def sample(campaign: Path, proc: psutil.Process, started: float, last: dict | None) -> dict:
    """One sample of the running campaign (see the module docstring)."""
    gpu = gpu_memory()
    rows = []
    for w in workers(proc):
        try:
            anon, file = rss_split(w.pid)
            rows.append({"pid": w.pid, "rss_mib": round(w.memory_info().rss / MIB, 1), "anon_mib": anon,
                         "file_mib": file, "open_files": w.num_fds(), "gpu_mib": gpu.get(w.pid)})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    st = status(campaign)
    targets = st.get("targets", [])
    examples = sum(t.get("examples", 0) for t in targets)
    now = time.monotonic()
    rate = None
    if last is not None and now > last["_t"]:
        rate = round((examples - last["examples"]) / (now - last["_t"]), 2) if examples >= last["examples"] else None
    reproducers = [d for d in campaign.iterdir() if d.is_dir() and (d / "case.json").exists()] \
        if campaign.exists() else []
    return {"_t": now, "t_s": round(now - started, 1), "workers": rows,
            "rss_mib": round(sum(r["rss_mib"] for r in rows), 1),
            "anon_mib": round(sum(r["anon_mib"] or 0 for r in rows), 1),
            "file_mib": round(sum(r["file_mib"] or 0 for r in rows), 1),
            "gpu_mib": sum(r["gpu_mib"] or 0 for r in rows) if gpu else None,
            "open_files": sum(r["open_files"] for r in rows),
            "out_mib": round(tree_bytes(campaign) / MIB, 2),
            "db_mib": round(tree_bytes(campaign / "hypothesis-db") / MIB, 2),
            "examples": examples, "examples_per_s": rate,
            "lost": sum(t.get("lost", 0) for t in targets),
            "skipped_for_memory": sum(t.get("skipped_for_memory", 0) for t in targets),
            "distinct_failures": sum(len(t.get("failures", [])) for t in targets),
            "reproducers": len(reproducers)}


def per_target(seconds: float, args: list[str]) -> float:
    """The ``--duration`` that gives each of the campaign's named targets its share of ``seconds``: ``--duration``
    is per target and the targets take the workers in turn, so the whole length would leave every target but the
    first unrun (a campaign naming no target gets the whole length, whatever it runs)."""
    return seconds / max(1, sum(1 for x in args if x == "--target" or x.startswith("--target=")))


def start(kvfuzz: list[str], campaign: Path, seconds: float, log) -> psutil.Process:
    duration = max(1, int(per_target(seconds, ARGS)))
    cmd = kvfuzz + ["fuzz", *ARGS, "--out", str(campaign), "--duration", f"{duration}s"]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return psutil.Process(p.pid)


def verdict(samples: list[dict], parts: list[dict], hours: float, warmup_s: float = 0.0) -> dict:
    """The soak's figures against issue 49's goals. Memory is held to its first sample at or after ``warmup_s``
    (``memory_from_s``; the second sample where none is that late); ``rss_early_mib`` and ``rss_max_over_early_pct``
    keep the growth since the second sample in view."""
    live = [s for s in samples if s["workers"]]
    warm = live[1:] if len(live) > 2 else live
    out: dict = {"samples": len(samples)}
    if warm:
        settled = [s for s in warm if s["t_s"] >= warmup_s] or warm
        first = settled[0]
        out["memory_from_s"] = first["t_s"]
        out["rss_first_mib"], out["rss_max_mib"] = first["rss_mib"], max(s["rss_mib"] for s in settled)
        out["rss_within_10pct"] = out["rss_max_mib"] <= 1.1 * first["rss_mib"]
        out["rss_early_mib"] = warm[0]["rss_mib"]
        out["rss_max_over_early_pct"] = round(100 * (max(s["rss_mib"] for s in warm) / warm[0]["rss_mib"] - 1), 1) \
            if warm[0]["rss_mib"] else None
        for part in ("anon", "file"):  # older samples lack the split
            if first.get(f"{part}_mib") is not None:
                out[f"{part}_first_mib"] = first[f"{part}_mib"]
                out[f"{part}_max_mib"] = max(s.get(f"{part}_mib") or 0 for s in settled)
        if first["gpu_mib"] is not None:
            out["gpu_first_mib"], out["gpu_max_mib"] = first["gpu_mib"], max(s["gpu_mib"] or 0 for s in settled)
            out["gpu_within_10pct"] = out["gpu_max_mib"] <= 1.1 * first["gpu_mib"]
        rates = [s["examples_per_s"] for s in warm if s["examples_per_s"] is not None]
        if len(rates) >= 4:
            k = max(1, len(rates) // max(1, round(hours)))  # samples per hour
            early, late = sum(rates[:k]) / k, sum(rates[-k:]) / k
            out["rate_first_hour"], out["rate_last_hour"] = round(early, 2), round(late, 2)
            out["rate_fell_at_most_10pct"] = late >= 0.9 * early
    last = samples[-1] if samples else {}
    out["out_mib"], out["db_mib"] = last.get("out_mib"), last.get("db_mib")
    out["out_mib_per_hour"] = round(last.get("out_mib", 0) / hours, 2) if hours else None
    out["distinct_failures"], out["reproducers"] = last.get("distinct_failures"), last.get("reproducers")
    out["lost"] = sum(p.get("lost", 0) for p in parts)
    out["restarts"] = sum(p.get("restarts", 0) for p in parts)
    out["parts"] = parts
    return out


def part_summary(campaign: Path, rc: int | None) -> dict:
    try:
        summary = json.loads((campaign / "summary.json").read_text())
    except (OSError, ValueError):
        return {"exit": rc, "summary": None}
    targets = summary.get("targets", [])
    return {"exit": rc, "lost": sum(t.get("lost", 0) for t in targets),
            "restarts": summary.get("restarts", summary.get("worker_restarts", 0)),
            "problems": summary.get("problems", []),
            "new_failures": [[f.get("kind"), f.get("check")] for t in targets for f in t.get("failures", [])
                             if not f.get("known") and not f.get("found_before")],
            "found_before": [[f.get("kind"), f.get("check"), f.get("reproducer")] for t in targets
                             for f in t.get("failures", []) if f.get("found_before")]}


def plot(samples: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [s["t_s"] / 3600 for s in samples]
    fig, ax = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for a, key, title in ((ax[0][0], "rss_mib", "workers' RSS (MiB)"), (ax[0][1], "examples_per_s", "examples/s"),
                          (ax[1][0], "out_mib", "--out (MiB)"), (ax[1][1], "gpu_mib", "GPU memory (MiB)")):
        a.plot(t, [s[key] if s[key] is not None else float("nan") for s in samples], marker=".")
        a.set_title(title)
    if any(s.get("anon_mib") is not None for s in samples):  # the RSS's anonymous part, beside it
        ax[0][0].lines[0].set_label("all")
        ax[0][0].plot(t, [s.get("anon_mib") or float("nan") for s in samples], marker=".", label="anonymous")
        ax[0][0].legend()
    for a in ax[1]:
        a.set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


ARGS: list[str] = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--hours", type=float, required=True)
    ap.add_argument("--sample", type=float, default=300.0, help="seconds between samples")
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the time at which to SIGKILL and restart "
                    "(0: never)")
    ap.add_argument("--warmup", type=float, default=1800.0, help="seconds before the sample memory is held to "
                    "(the workers' high-water marks: docs/campaigns.md, \"A worker's memory\")")
    ap.add_argument("--kvfuzz", default=f"{sys.executable} -m kvfuzz.fuzz.cli", help="how to run kvfuzz")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    ARGS[:] = [x for x in a.args if x != "--"]
    a.out.mkdir(parents=True, exist_ok=True)
    campaign, total = a.out / "campaign", a.hours * 3600
    kvfuzz = a.kvfuzz.split()
    started = time.monotonic()
    samples: list[dict] = []
    parts: list[dict] = []
    killed, stopping = a.kill_at <= 0, False
    with open(a.out / "campaign.log", "a") as log, open(a.out / "samples.jsonl", "a") as jl:
        proc = start(kvfuzz, campaign, total, log)
        last = None
        next_sample = started + min(a.sample, 60.0)  # a first sample after warm-up's first minute
        while True:
            now = time.monotonic()
            if now - started >= total and not stopping:  # --duration is per target: the targets take turns
                os.killpg(proc.pid, signal.SIGTERM)  # a clean stop: the summary is written, exit 3 (interrupted)
                stopping = True
            if not killed and now - started >= a.kill_at * total:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                parts.append({"exit": "SIGKILL", "at_s": round(now - started, 1),
                              "reproducers": len([d for d in campaign.iterdir() if (d / "case.json").exists()])})
                killed = True
                proc = start(kvfuzz, campaign, total - (now - started), log)
                continue
            if now >= next_sample:
                last = sample(campaign, proc, started, last)
                samples.append(last)
                jl.write(json.dumps({k: v for k, v in last.items() if k != "_t"}) + "\n")
                jl.flush()
                next_sample += a.sample
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                rc = proc.wait()
                parts.append(part_summary(campaign, rc))
                break
            time.sleep(1.0)
    doc = verdict(samples, parts, a.hours, a.warmup)
    (a.out / "soak.json").write_text(json.dumps({"command": ARGS, "hours": a.hours, **doc,
                                                 "samples_detail": [{k: v for k, v in s.items() if k != "_t"}
                                                                    for s in samples]}, indent=1))
    plot(samples, a.out / "soak.png")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
