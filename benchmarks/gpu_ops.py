"""What one small GPU example's harness stages cost on the host: per stage (generation, materialization,
caller checks, reference), the torch.profiler counts of CUDA runtime calls (kernel launches, memory copies,
synchronizations) and the operators with the most self CPU time, over examples of one compiled configuration.

    python benchmarks/gpu_ops.py [--target vllm.unified_attention] [--examples 100] [--big] [--out ops.json]

The stage times of benchmarks/gpu_profile.py say how long each stage takes; this says why (its own times are
inflated by the profiler) (on the CPU it
prints the operator counts only: nothing is launched). ``--big``: examples scaled to 1M+ KV elements.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from pathlib import Path

import attrs
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import _grow, draw  # noqa: E402

from kvfuzz.contracts.checks.reference import reference_and_envelope  # noqa: E402
from kvfuzz.contracts.model.poison import Poison  # noqa: E402
from kvfuzz.fuzz.harness import attention  # noqa: E402
from kvfuzz.fuzz.harness.caller import caller_violations  # noqa: E402
from kvfuzz.fuzz.harness.run import generate, reference_device  # noqa: E402
from kvfuzz.fuzz.targets import get_target  # noqa: E402
from kvfuzz.strategies.batches import examples  # noqa: E402
from kvfuzz.strategies.configs import config_for  # noqa: E402
from kvfuzz.strategies.limits import Limits  # noqa: E402

STAGES = ("generate", "materialize", "check_caller", "reference")
RUNTIME = ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
           "cudaMemsetAsync", "cudaHostAlloc", "cudaMalloc", "cudaEventSynchronize")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="vllm.unified_attention")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = get_target(a.target)
    cfg = config_for(target.capabilities, Limits(), 0, 0)
    strategy = examples(target.capabilities, Limits(), (Poison.STALE,), pin=cfg)
    exs = [draw(strategy, i) for i in range(a.examples)]
    if a.big:
        exs = [attrs.evolve(e, batch=_grow(e.batch)) for e in exs[: max(5, a.examples // 10)]]
    runs = [attention.prepare(target, e) for e in exs[:3]]  # warm: compiles, lazy CUDA modules
    for r in runs:
        caller_violations(target, r)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for e in exs:
            with record_function("generate"):
                data = generate(e, reference_device(target, e.batch))[0]
            with record_function("materialize"):
                run = attention.prepare(target, e, data=data)
            with record_function("check_caller"):
                caller_violations(target, run)
            with record_function("reference"):
                reference_and_envelope(e.batch, run.data)
    n = len(exs)
    # each event belongs to the innermost stage range that contains it in time, on its thread
    spans = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events() if ev.name in STAGES]
    spans.sort()
    per = {s: collections.Counter() for s in STAGES}
    self_us = {s: collections.Counter() for s in STAGES}
    wall = collections.Counter()
    for s0, s1, name in spans:
        wall[name] += s1 - s0
    starts = [s[0] for s in spans]
    for ev in prof.events():
        if ev.name in STAGES or ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        i = bisect.bisect_right(starts, ev.time_range.start) - 1
        if i < 0 or ev.time_range.start > spans[i][1]:
            continue
        stage = spans[i][2]
        per[stage][ev.name] += 1
        self_us[stage][ev.name] += ev.self_cpu_time_total
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "target": a.target,
           "config": cfg.summary(), "examples": n, "big": a.big,
           "median_kv_elements": sorted(e.batch.kv_elements for e in exs)[n // 2], "stages": {}}
    for s in STAGES:
        doc["stages"][s] = {
            "ms_per_example": round(wall[s] / n / 1e3, 3),
            "runtime_calls_per_example": {k: round(per[s][k] / n, 1) for k in RUNTIME if per[s][k]},
            "aten_ops_per_example": round(sum(v for k, v in per[s].items() if k.startswith("aten::")) / n, 1),
            "top_self_cpu_us_per_example": {k: round(v / n, 1) for k, v in self_us[s].most_common(12)}}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
