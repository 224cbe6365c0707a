"""FlashInfer's targets on a GPU, cold and warm: examples/s of a campaign with an empty JIT cache and of a second
campaign with the cache the first one left, the compile time of every JIT module the campaigns built, and what
they drew (the summary's ``declared`` table, GQA groups, paths); then, if time is left, the replay of the
group-size-7 regression case. Writes OUT/flashinfer-speed.json and OUT/flashinfer-speed.md after every phase, so
a run cut short keeps what it measured.

Each phase is one ``kvfuzz fuzz`` (kvfuzz.fuzz.bench.curve.run_campaign: its own process group, sampled every
few seconds, SIGTERM at its wall and SIGKILL of the group 30 s later; nvcc left behind is killed) with pinned
configurations (each chunk one JIT module; heads, page size and window size free inside it), no structural
shrink (a failure is still shrunk by Hypothesis and listed) and the target's own JIT cache
(``--jit-cache ROOT/<target>/jit``):

- cold: an empty cache; ``--duration`` = wall - 30 s (kvfuzz's start-up, ~12 s, and the compile a chunk handed
  out last still runs; one in flight at the wall is cut: SIGTERM, then the workers' 20 s grace);
- warm: the same seed, workers and chunks over the cache the cold phase left, ``--max-examples`` = what the cold
  phase ran (at least 60), so it revisits the same configurations; ``--duration`` = wall - 15 s; modules it
  still builds are listed.

How the campaign options meet a 20-90 s compile per module on a 16-core machine: with FlashInfer's run-time
fields free, chunks 0 .. workers-1 are already (mostly) different modules, compiled in parallel by the workers,
so ``--warmup`` (2-example chunks of the first configurations) would only visit them twice; small chunks
(``--chunk-examples`` 20-25) move each worker to its next module soon after a compile, which is what spreads a
cold phase over the declared values (a round of 3 configurations draws every one); more workers than the
cores a module's nvcc jobs need only slow every compile down, hence PLAN's worker counts and MAX_JOBS.

JIT modules (flashinfer/jit/core.py ``JitSpecNvcc.build``): ``<cache>/.cache/flashinfer/<version>/<arch>/
cached_ops/<name>/`` holds ``build.ninja`` (written right before ninja runs, rewritten only when it changes)
and ``<name>.so``; a module's compile time is the .so's mtime minus build.ninja's (under the campaign's
contention: several workers compile at once). Names (flashinfer/jit/attention/modules.py
``get_batch_decode_uri``/``get_batch_prefill_uri``, jit/page.py: ``page``) give its compile key.

Time: ``--budget`` seconds for everything (default 400), shared among the phases in proportion to PLAN and
re-shared as phases end early or late (a compile in flight at a phase's wall may run 30 s past it); a phase
that would get under 30 s is skipped (said in the JSON). Expect --budget seconds, at most about 60 s more.

Usage (after ``source benchmarks/gpu_env.sh``; benchmarks/gpu_flashinfer.sh does it):
    python3 benchmarks/flashinfer_speed.py --out "$OUT" [--budget 400] [--root /tmp/fi-speed]
        [--target NAME ...] [--seed 1] [--workers N] [--no-replay]     (default budget: 400)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvfuzz.fuzz.bench.curve import run_campaign

#: Per target: (cold wall s, warm wall s, workers, examples per chunk). Workers: 8 for the decode module (one
#: heavy .cu file, 21 s alone on an H100), 2 where a module is many heavy files (the prefill modules, fa3's
#: 86 s alone with 16 nvcc jobs, and fa2's, which the tensor-core decode builds: several at once only share the
#: cores). Each phase runs with MAX_JOBS (ninja's -j in flashinfer/jit/cpp_ext.py run_ninja) = CPUs / workers.
PLAN = {
    "flashinfer.append_paged_kv_cache": (45, 20, 4, 25),
    "flashinfer.batch_decode": (80, 25, 8, 20),
    "flashinfer.batch_prefill": (120, 30, 2, 20),
    "flashinfer.batch_decode_tc": (70, 20, 2, 20),
}
MIN_WALL = 30.0
#: Set by SIGTERM (e.g. from `timeout`): the campaign in flight is stopped as at its wall, nothing else starts.
STOP: list[bool] = []
#: Seconds kept back for the replay of the regression case (a decode module compile and a child process).
REPLAY_RESERVE = 60.0
REPLAY_CASE = (Path(__file__).resolve().parents[1] / "regressions"
               / "flashinfer.batch_decode-config-rejected-Unsupported-group_size--7-548595e908")

_MODULE = re.compile(
    r"^(?P<kind>batch_decode|batch_prefill)_with_kv_cache_dtype_q_(?P<q>[a-z0-9]+)_dtype_kv_(?P<kv>[a-z0-9]+)_"
    r"dtype_o_(?P<o>[a-z0-9]+)_dtype_idx_(?P<idx>[a-z0-9]+)_head_dim_qk_(?P<head_dim>\d+)_head_dim_vo_\d+_"
    r"posenc_\d+_use_swa_(?P<window>True|False)_use_logits_cap_(?P<softcap>True|False)"
    r"(?:_f16qk_(?:True|False))?(?P<sm90>_sm90)?$")


def parse_module(name: str) -> dict:
    """A JIT module's compile key from its name: kind (batch_decode, batch_prefill, page, or the name),
    dtypes, head_dim, window and soft cap on or off, backend (prefill: "fa3" for the _sm90 modules, else "fa2")."""
    m = _MODULE.match(name)
    if m is None:
        return {"kind": name}
    d = m.groupdict()
    out = {"kind": d["kind"], "q": d["q"], "kv": d["kv"], "o": d["o"], "idx": d["idx"],
           "head_dim": int(d["head_dim"]), "window": d["window"] == "True", "softcap": d["softcap"] == "True"}
    if d["kind"] == "batch_prefill":
        out["backend"] = "fa3" if d["sm90"] else "fa2"
    return out


def jit_modules(cache: Path) -> list[dict]:
    """Every module under ``cache``'s ``cached_ops`` folders: name, compile key, built (its .so exists),
    compile_s (.so mtime - build.ninja mtime, None when either is missing), built_at (the .so's mtime)."""
    out = []
    for d in sorted(cache.rglob("cached_ops/*")) if cache.exists() else []:
        if not d.is_dir():
            continue
        so, ninja = d / f"{d.name}.so", d / "build.ninja"
        built = so.exists()
        t_so = so.stat().st_mtime if built else None
        t_ninja = ninja.stat().st_mtime if ninja.exists() else None
        out.append({"name": d.name, **parse_module(d.name), "built": built,
                    "compile_s": round(t_so - t_ninja, 1) if built and t_ninja is not None else None,
                    "built_at": t_so})
    return out


def count_modules(cache: Path) -> int:
    """Built JIT modules under ``cache`` (the curve's compile count)."""
    return sum(1 for m in jit_modules(cache) if m["built"])


def share(plan: dict[str, tuple], remaining: float, phases_left: list[tuple[str, str]]) -> float:
    """The wall of the next phase in ``phases_left`` ((target, "cold"/"warm") pairs): ``remaining`` seconds
    shared among the phases left in proportion to their planned walls."""
    walls = [plan[t][0 if m == "cold" else 1] for t, m in phases_left]
    return remaining * walls[0] / sum(walls) if walls and sum(walls) > 0 else 0.0


def campaign_limits(mode: str, wall: float) -> tuple[float, float]:
    """``(--duration, SIGTERM time)`` of a phase of ``wall`` seconds (module docstring)."""
    return max(5.0, wall - (30.0 if mode == "cold" else 15.0)), wall


def phase_record(run: dict, modules_before: list[dict], modules_after: list[dict], started: float) -> dict:
    """What one phase reports: run_campaign's result (samples dropped, the last kept), the modules this phase
    built (with their compile time and when, from the phase start), the first sample that counted an example."""
    before = {m["name"] for m in modules_before if m["built"]}
    new = [dict(m, built_s=round(m["built_at"] - started, 1) if m["built_at"] else None)
           for m in modules_after if m["built"] and m["name"] not in before]
    for m in new:
        m.pop("built_at", None)
    first = next((s["t"] for s in run.get("samples", []) if s.get("examples")), None)
    rec = {k: v for k, v in run.items() if k != "samples"}
    ex, el = rec.get("examples"), rec.get("elapsed_s")
    rec["examples_per_wall_s"] = round(ex / rec["seconds"], 2) if ex and rec.get("seconds") else None
    if rec.get("examples_per_s") is None and ex and el:
        rec["examples_per_s"] = round(ex / el, 3)
    gqa = rec.get("coverage", {}).get("gqa", {})
    rec.update(modules_built=new, first_example_s=first, group_sizes=sorted(gqa), last_sample=(run.get("samples")
                                                                                              or [None])[-1])
    rec["incomplete_modules"] = [m["name"] for m in modules_after if not m["built"]]
    return rec


def _fmt(x, unit="") -> str:
    return "-" if x is None else (f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}")


def markdown(doc: dict) -> str:
    """The short table of a (possibly partial) document."""
    s = doc["settings"]
    lines = [f"# FlashInfer targets, cold and warm ({s.get('device', '?')}, {s.get('cpus')} CPUs, flashinfer "
             f"{s.get('flashinfer', '?')}, budget {s.get('budget_s')} s, seed {s.get('seed')})", "",
             "| target | workers | cold: examples, ex/s | JIT modules built cold (compile s: median, max) | first "
             "example | warm: examples, ex/s | built warm | declared never drawn | GQA groups drawn | failures |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in doc["targets"].items():
        cold, warm = t.get("cold") or {}, t.get("warm") or {}
        secs = [m["compile_s"] for m in cold.get("modules_built", []) if m.get("compile_s") is not None]
        comp = (f"{len(cold.get('modules_built', []))} ({statistics.median(secs):.0f}, {max(secs):.0f})" if secs
                else str(len(cold.get("modules_built", []))))
        never = sorted(set(cold.get("declared_never_drawn", [])) & set(warm.get("declared_never_drawn",
                                                                                 cold.get("declared_never_drawn", []))))
        fails = {f"{k} ({c})" for r in (cold, warm) for k, c, _ in r.get("failures", [])}
        skipped = t.get("skipped")
        lines.append(
            f"| {name} | {cold.get('workers', '-')} | "
            + (f"skipped: {skipped} |" if skipped and not cold else
               f"{_fmt(cold.get('examples'))}, {_fmt(cold.get('examples_per_s'))} |")
            + f" {comp} | {_fmt(cold.get('first_example_s'), ' s')} | "
            + (f"{_fmt(warm.get('examples'))}, {_fmt(warm.get('examples_per_s'))} | "
               f"{len(warm.get('modules_built', []))}"
               if warm else f"{t.get('warm_skipped', '-')} | -")
            + f" | {', '.join(never) or 'none'} | "
            + f"{', '.join(sorted(set(cold.get('group_sizes', [])) | set(warm.get('group_sizes', [])))) or '-'}"
            + f" | {', '.join(sorted(fails)) or 'none'} |")
    r = doc.get("replay")
    if r:
        said = (r.get("output") or "").strip().splitlines()
        lines += ["", f"Replay of `{Path(r['case']).name}`: exit {r.get('exit_status')}, {r.get('seconds')} s: "
                      f"{said[0] if said else '-'}"]
    lines += ["", f"Finished: {doc.get('finished')}; {doc.get('elapsed_s')} s. Modules per phase, compile times, "
                  "declared tables and samples: flashinfer-speed.json."]
    return "\n".join(lines) + "\n"


def write(doc: dict, out: Path) -> None:
    """flashinfer-speed.json and .md under ``out``, each written whole (temporary file, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("flashinfer-speed.json", json.dumps(doc, indent=1, default=str)),
                       ("flashinfer-speed.md", markdown(doc))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def _probe(code: str) -> str:
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return r.stdout.strip() or r.stderr.strip().splitlines()[-1]
    except Exception as e:  # a probe must not stop the benchmark
        return f"? ({type(e).__name__})"


def replay_case(case: Path, jit: Path, timeout: float) -> dict:
    """``kvfuzz replay`` of the regression case with ``jit`` as FlashInfer's cache: exit status, seconds, output."""
    start = time.monotonic()
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(jit), COLUMNS="200")
    try:
        r = subprocess.run([sys.executable, "-m", "kvfuzz.fuzz.cli", "replay", str(case), "--timeout",
                            str(int(timeout))], capture_output=True, text=True, timeout=timeout + 30, env=env)
        status, output = r.returncode, (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        status, output = "timeout", str(e.stdout or "")[-3000:]
    return {"case": str(case), "exit_status": status, "seconds": round(time.monotonic() - start, 1),
            "output": output}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fi-out")))
    ap.add_argument("--root", type=Path, default=Path("/tmp/fi-speed"), help="campaigns and JIT caches")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for everything")
    ap.add_argument("--target", action="append", dest="targets", help=f"default: {', '.join(PLAN)}")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=None, help="workers of every phase (default: PLAN's)")
    ap.add_argument("--no-replay", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.append(True))  # `timeout`: stop the campaign in flight
    targets = a.targets or list(PLAN)
    plan = {t: PLAN.get(t, (60, 20, 4, 20)) for t in targets}
    start = time.monotonic()
    deadline = start + a.budget
    shutil.rmtree(a.root, ignore_errors=True)
    doc = {"settings": {"budget_s": a.budget, "seed": a.seed, "cpus": os.cpu_count(), "plan": plan,
                        "device": _probe("import torch; print(torch.cuda.get_device_name())"),
                        "flashinfer": _probe("import flashinfer; print(flashinfer.__version__)"),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")},
           "targets": {t: {} for t in targets}, "finished": False}
    write(doc, a.out)
    phases = [(t, m) for t in targets for m in ("cold", "warm")]
    reserve = 0.0 if a.no_replay else REPLAY_RESERVE
    try:
        _phases(a, plan, phases, doc, deadline - reserve, start)
    finally:  # a SIGTERM (sys.exit) or an error: what was measured stays written
        doc["elapsed_s"] = round(time.monotonic() - start, 1)
        write(doc, a.out)
    case = REPLAY_CASE
    left = deadline - time.monotonic()
    if STOP:
        doc["stopped"] = "SIGTERM: the phase in flight was stopped and recorded, nothing after it ran"
    elif not a.no_replay and case.exists() and left > 20:
        jit = a.root / "flashinfer.batch_decode" / "jit"
        doc["replay"] = replay_case(case, jit, max(15.0, left - 5))
    doc["finished"] = not STOP
    doc["elapsed_s"] = round(time.monotonic() - start, 1)
    write(doc, a.out)
    print(markdown(doc))
    return 143 if STOP else 0


def _phases(a: argparse.Namespace, plan: dict, phases: list, doc: dict, deadline: float, start: float) -> None:
    """Run the cold and warm phases in order, each in its share of the time left before ``deadline``."""
    while phases and not STOP:
        target, mode = phases[0]
        wall = share(plan, deadline - time.monotonic(), phases)
        entry = doc["targets"][target]
        if wall < MIN_WALL or (mode == "warm" and not entry.get("cold")):
            entry["skipped" if mode == "cold" else "warm_skipped"] = (
                "no cold phase" if mode == "warm" and not entry.get("cold")
                else f"out of time ({wall:.0f} s left for it)")
            phases.pop(0)
            write(doc, a.out)
            continue
        _, _, workers, chunk = plan[target]
        workers = a.workers or workers
        jit = a.root / target / "jit"
        extra = ["--configs", "pinned", "--chunk-examples", str(chunk), "--structural-shrink", "0"]
        if mode == "warm":
            extra += ["--max-examples", str(max(60, entry["cold"].get("examples") or 0))]
        before, started = jit_modules(jit), time.time()
        duration, term = campaign_limits(mode, wall)
        os.environ["MAX_JOBS"] = str(max(2, (os.cpu_count() or 16) // workers))
        run = run_campaign(target, duration, workers, jit, a.root / target / mode, seed=a.seed,
                           interval=a.interval, extra=tuple(extra), cache_option="--jit-cache", count=count_modules,
                           wall=term, stop=lambda: bool(STOP))
        entry[mode] = phase_record(run, before, jit_modules(jit), started)
        entry[mode].update(wall_planned_s=round(wall, 1), max_jobs=int(os.environ["MAX_JOBS"]))
        log = a.root / target / f"{mode}.log"
        entry[mode]["log_tail"] = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
        phases.pop(0)
        doc["elapsed_s"] = round(time.monotonic() - start, 1)
        write(doc, a.out)


if __name__ == "__main__":
    sys.exit(main())
