"""What each harness stage asks of the device per example, not its wall time: on CUDA the summed duration and number
of the CUDA kernels each stage launches and the peak device memory it allocates above what was allocated when it
began; on the CPU the self time and number of the torch operators each stage runs (issue 51: with 14 workers on one
GPU the per-example wall time of a campaign is mostly queueing behind kvfuzz's own GPU work; this says whose work).

    python benchmarks/harness_gpu_time.py --target vllm.flash_attn_varlen --tier small --tier serving \\
        --examples 100 --serving-examples 30 --out gpu-time.json
    python benchmarks/harness_gpu_time.py --replay harness-speed.json --out gpu-time.json  # another run's examples

The examples are benchmarks/harness_speed.py's (the same draw: each tier's strategy, ``--per-config`` examples inside
each kernel configuration, every poison; or ``--replay`` a harness_speed or harness_gpu_time output's very examples),
run through the harness (``kvfuzz.fuzz.harness.properties``) under ``torch.profiler`` (ProfilerActivity.CUDA on a
CUDA target, the CPU otherwise), ``--group`` examples a profiling session, after one unprofiled warm-up example.

Stages are the fields of ``kvfuzz.fuzz.harness.run.Timings``: ``generate``, ``materialize`` (with the output's NaN
poison, as Timings counts it), ``check_caller``, ``kernel`` (``Target.run``: the kernel under test and its adapter),
``reference``, ``check_output``; ``other`` is whatever ran outside them. A stage is opened and closed where the
harness calls the functions of :data:`MARKS` (kvfuzz.fuzz.harness.attention), each an ``torch.profiler``
``record_function`` range named ``kvfuzz.stage/<stage>``; a CUDA kernel belongs to the stage whose range holds the
operator that launched it (the profiler's correlation of a kernel with its launching operator or range), a CPU
operator to the stage whose range holds its start. Device memory: ``torch.cuda.reset_peak_memory_stats`` when a stage
opens, ``max_memory_allocated`` less the memory allocated then when it closes, the largest of an example's
openings of the stage; the mean and the largest over the examples.

Per target and tier, printed and written (``--out``): per stage and example, ``ms`` (CUDA kernel time; on the CPU,
operator self time), ``count`` (kernels; operators), ``cpu_ms`` (on CUDA: the operators' host self time),
``peak_mib_mean``/``peak_mib_max`` (CUDA only); ``top``: the ``--top`` kernels (operators) by total time in each stage,
names shortened (:func:`short_name`); the sum over stages (``total_ms``), its part outside ``kernel``, and the
ceiling it implies for one device doing only this work: ``1000 / total_ms`` examples/s. The profiler's own overhead
inflates host times (``cpu_ms``), not kernel durations. Results: docs/benchmarks.md ("A harness at the kernel's
pace").
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from harness_speed import STAGES, draw_examples, forget_checked_shapes, one  # noqa: E402

from kvfuzz.contracts.model.example import Example  # noqa: E402
from kvfuzz.contracts.model.poison import Poison  # noqa: E402
from kvfuzz.fuzz.harness import attention  # noqa: E402
from kvfuzz.fuzz.targets import get_target  # noqa: E402

ALL = (*STAGES, "other")
PREFIX = "kvfuzz.stage/"
#: The harness functions (names in kvfuzz.fuzz.harness.attention) that open a stage while they run, and the stage
#: that follows when they return (the boundaries of kvfuzz.fuzz.harness.run.Timings: the output's poison is
#: ``materialize``'s).
MARKS = {"generate": ("generate", "materialize"), "materialize": ("materialize", "materialize"),
         "caller_violations": ("check_caller", "materialize"), "poison_output": ("materialize", "materialize"),
         "run_kernel": ("kernel", "reference"), "reference_and_envelope": ("reference", "check_output")}
#: Marks that also run after the output checks (a failing example's caller checks, on the call prepare builds
#: again): there they return to the stage they interrupted.
LATE = ("generate", "materialize", "caller_violations")
MIB = 1 << 20


class CudaMemory:
    """The CUDA caching allocator's figures on the current device (what :class:`StageMarks` reads)."""

    @staticmethod
    def allocated() -> int:
        return torch.cuda.memory_allocated()

    @staticmethod
    def reset() -> None:
        torch.cuda.reset_peak_memory_stats()

    @staticmethod
    def peak() -> int:
        return torch.cuda.max_memory_allocated()


class StageMarks:
    """The current stage, one ``record_function`` range per stretch of it, and with ``memory`` (an object with
    ``allocated()``, ``reset()``, ``peak()`` in bytes: :class:`CudaMemory`) each stage's peak bytes above its start,
    the largest of the current example's stretches (:attr:`peaks`)."""

    def __init__(self, memory=None) -> None:
        self.stage: str | None = None
        self.memory = memory
        self.peaks: dict[str, int] = {}
        self._range = None
        self._base = 0

    def enter(self, stage: str | None) -> None:
        """Close the current stretch and open one of ``stage`` (None: none)."""
        if stage == self.stage:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.memory is not None and self.stage is not None:
            grown = max(0, self.memory.peak() - self._base)
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), grown)
        self.stage = stage
        if stage is None:
            return
        if self.memory is not None:
            self._base = self.memory.allocated()
            self.memory.reset()
        self._range = record_function(PREFIX + stage)
        self._range.__enter__()

    def wrap(self, name: str, f):
        opens, follows = MARKS[name]

        def wrapped(*a, **k):
            before = self.stage
            self.enter(opens)
            try:
                return f(*a, **k)
            finally:
                late = name in LATE and before in ALL and ALL.index(before) > ALL.index("kernel")
                self.enter(before if late else follows)
        return wrapped

    def __enter__(self):
        self._saved = {name: getattr(attention, name) for name in MARKS}
        for name, f in self._saved.items():
            setattr(attention, name, self.wrap(name, f))
        return self

    def __exit__(self, *exc):
        self.enter(None)
        for name, f in self._saved.items():
            setattr(attention, name, f)


def short_name(name: str, width: int = 80) -> str:
    """A kernel's or operator's name, shortened: a CUDA C++ kernel's unqualified name and, in brackets, what its
    template arguments say it computes (their last ``...Functor``, ``..._functor``, ``..._kernel_cuda``,
    ``..._kernel_impl`` or ``..._kernel`` name, else their first CamelCase name): ``void at::native::
    vectorized_elementwise_kernel<4, at::native::AbsFunctor<double>, ...>(...)`` -> ``vectorized_elementwise_kernel
    [AbsFunctor]``. Operator (``aten::mm``) and Triton kernel names are kept; at most ``width`` characters."""
    s = name[5:] if name.startswith("void ") else name
    cut = min((i for i in (s.find("<"), s.find("(")) if i > 0), default=len(s))
    base, rest = s[:cut], s[cut:]
    base = base.split("::")[-1] if "::" in base and not base.startswith("aten::") else base
    tag = ""
    if rest.startswith("<"):
        words = re.findall(r"[A-Za-z_]\w*", rest)
        ends = ("Functor", "_functor", "_kernel_cuda", "_kernel_impl", "_kernel")
        named = [w for w in words if w.endswith(ends) and w != base and not w.startswith("gpu_kernel")]
        camel = [w for w in words if re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", w) and len(w) >= 6]
        tag = named[-1] if named else camel[0] if camel else ""
    out = f"{base}[{tag}]" if tag else base
    return out[:width]


def _spans(events) -> tuple[list[float], list[tuple[float, float, str]]]:
    """The stage ranges among the profiler's events, by start: their starts, and (start, end, stage)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in events
                   if e.name.startswith(PREFIX) and e.device_type == DeviceType.CPU)
    return [s[0] for s in spans], spans


def attribute(events, acc: dict, cuda: bool) -> None:
    """Add the profiler's ``events`` to ``acc`` (:func:`accumulator`): per stage its kernels (on the CPU, its
    operators), their microseconds by shortened name, and on CUDA the operators' host self time; and every CUDA
    kernel's time, attributed or not (``device_us``). A range's GPU-side copy (the profiler's
    ``gpu_user_annotation``, named as the range: the span of its kernels on the GPU) is no kernel."""
    starts, spans = _spans(events)
    ranges = {e.name for e in events if e.name.startswith(PREFIX) or getattr(e, "is_user_annotation", False)}

    def stage_of(t: float) -> str:
        i = bisect.bisect_right(starts, t) - 1
        return spans[i][2] if i >= 0 and t <= spans[i][1] else "other"

    for e in events:
        if e.device_type != DeviceType.CPU:
            if e.device_type == DeviceType.CUDA and e.name not in ranges:
                acc["device_us"] += e.time_range.elapsed_us()
            continue
        ours = e.name.startswith(PREFIX)  # a stage's range: holds what Triton launched with no operator of its own
        row = acc["stages"][e.name[len(PREFIX):] if ours else stage_of(e.time_range.start)]
        if not ours:
            row["cpu_us"] += e.self_cpu_time_total
        launched = [(short_name(k.name), k.duration) for k in e.kernels if k.name not in ranges] if cuda else \
            [] if ours else [(e.name, e.self_cpu_time_total)]
        for name, us in launched:
            row["us"] += us
            row["count"] += 1
            row["names"][name] += us
            row["calls"][name] += 1


def accumulator() -> dict:
    """Empty per-stage sums for :func:`attribute`."""
    fresh = lambda: {"us": 0.0, "count": 0, "cpu_us": 0.0, "names": Counter(), "calls": Counter()}  # noqa: E731
    return {"stages": defaultdict(fresh), "device_us": 0.0}


def profiled_pass(target, exs: list[Example], group: int) -> tuple[dict, dict, Counter]:
    """Run ``exs`` under the profiler, ``group`` a session: the sums of :func:`attribute`, per stage the peak MiB of
    each example (CUDA), and the verdicts."""
    cuda = target.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    acc, peaks, verdicts = accumulator(), defaultdict(list), Counter()
    forget_checked_shapes()  # every call shape's first caller checks, as in a fresh worker
    for g in range(0, len(exs), group):
        with profile(activities=activities) as prof:
            with StageMarks(CudaMemory() if cuda else None) as marks:
                for e in exs[g : g + group]:
                    marks.peaks = {}
                    marks.enter("generate")
                    verdict, _ = one(target, e, None)
                    if cuda:
                        torch.cuda.synchronize()
                    marks.enter("other")
                    verdicts[verdict["verdict"]] += 1
                    for stage, grown in marks.peaks.items():
                        peaks[stage].append(grown / MIB)
        attribute(prof.events(), acc, cuda)
    return acc, peaks, verdicts


def summarize(acc: dict, peaks: dict, n: int, cuda: bool, top: int) -> dict:
    """Per example: each stage's figures, the sum over stages, its part outside the kernel, the ceiling."""
    m = max(1, n)
    stages, tops = {}, {}
    for stage in ALL:
        row = acc["stages"].get(stage) or accumulator()["stages"][stage]
        stages[stage] = {"ms": round(row["us"] / m / 1e3, 4), "count": round(row["count"] / m, 2)}
        if cuda:
            got = peaks.get(stage, [])
            stages[stage] |= {"cpu_ms": round(row["cpu_us"] / m / 1e3, 4),
                              "peak_mib_mean": round(sum(got) / m, 3), "peak_mib_max": round(max(got, default=0), 3)}
        tops[stage] = [[name, round(us / m / 1e3, 4), round(row["calls"][name] / m, 2)]
                       for name, us in row["names"].most_common(top)]
    total = sum(s["ms"] for s in stages.values())
    out = {"stages": stages, "total_ms": round(total, 4), "harness_ms": round(total - stages["kernel"]["ms"], 4),
           "ceiling_examples_per_s": round(1000 / total, 1) if total > 0 else None, "top": tops}
    if cuda:  # CUDA kernels the profiler saw but could not tie to an operator or range of this thread
        attributed = sum(r["us"] for r in acc["stages"].values())
        out["unattributed_ms"] = round(max(0.0, acc["device_us"] - attributed) / m / 1e3, 4)
    return out


def measure(name: str, tier: str, exs: list[Example], group: int, top: int) -> dict:
    """One target and tier: :func:`summarize`'s figures with what was run."""
    target = get_target(name)
    cuda = target.device.startswith("cuda")
    s = time.perf_counter()
    one(target, exs[0], None)  # warm: lazy modules, first compiles and loads, the profiler not yet on
    acc, peaks, verdicts = profiled_pass(target, exs, group)
    rec = {"target": name, "tier": tier, "device": target.device, "measure": "cuda kernels" if cuda else "cpu ops",
           "examples": len(exs), "verdicts": dict(verdicts),
           "median_kv_tokens": int(statistics.median(sum(e.batch.seq_lens) for e in exs)),
           "median_num_seqs": int(statistics.median(e.batch.num_seqs for e in exs)),
           **summarize(acc, peaks, len(exs), cuda, top)}
    rec["seconds"] = round(time.perf_counter() - s, 1)
    return rec


def report(rec: dict, top: int) -> list[str]:
    """The lines printed for one record: the stage table, the reference's top kernels, the summary line."""
    cuda = rec["measure"] == "cuda kernels"
    what, unit = ("kernel ms", "kernels") if cuda else ("op ms", "ops")
    lines = [f"== {rec['target']} {rec['tier']}: {rec['examples']} examples on {rec['device']} ({rec['measure']}; "
             f"median {rec['median_kv_tokens']} KV tokens, {rec['median_num_seqs']} seqs; verdicts {rec['verdicts']})",
             f"  {'stage':>13}{what:>12}{unit:>10}"
             + (f"{'host ms':>10}{'peak MiB mean':>15}{'max':>10}" if cuda else "")]
    for stage, row in rec["stages"].items():
        cells = f"  {stage:>13}{row['ms']:>12.3f}{row['count']:>10.1f}"
        if cuda:
            cells += f"{row['cpu_ms']:>10.2f}{row['peak_mib_mean']:>15.1f}{row['peak_mib_max']:>10.1f}"
        lines.append(cells)
    lines.append(f"  top {top} {unit} of the reference (ms and calls per example):")
    lines += [f"    {ms:>9.3f} {calls:>7.1f}  {name}" for name, ms, calls in rec["top"]["reference"][:top]] or [
        "    none (a batch under kvfuzz.fuzz.harness.run.GPU_REFERENCE_MIN_KV KV elements: reference on the CPU)"]
    ceiling = rec["ceiling_examples_per_s"]
    device = "GPU" if cuda else "CPU op"
    lines.append(f"  {rec['target']} {rec['tier']}: {rec['total_ms']:.3f} {device} ms per example over the stages "
                 f"({rec['harness_ms']:.3f} outside the kernel, {rec['stages']['kernel']['ms']:.3f} the kernel's); "
                 f"ceiling {ceiling} examples/s on one {'GPU' if cuda else 'core'} doing only this"
                 + (f"; unattributed kernels {rec['unattributed_ms']:.3f} ms" if cuda else ""))
    return lines


def jobs(a) -> list[tuple[str, str, list[Example] | None]]:
    """(target, tier, examples or None to draw) per record to measure: ``--replay``'s, or targets x tiers."""
    if a.replay:
        old = json.loads(Path(a.replay).read_text())
        return [(r["target"], r["tier"], [Example.from_dict(c["example"]) for c in r["cases"]])
                for r in old["records"]]
    return [(name, tier, None) for name in a.target or ["vllm.cpu_attention"] for tier in a.tier or ["small"]]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="repeatable (default vllm.cpu_attention)")
    ap.add_argument("--tier", action="append", choices=("small", "serving"), help="repeatable (default small)")
    ap.add_argument("--examples", type=int, default=50, help="per target and tier (see --serving-examples)")
    ap.add_argument("--serving-examples", type=int, help="per target at the serving tier (default --examples)")
    ap.add_argument("--per-config", type=int, default=25, help="examples per kernel configuration")
    ap.add_argument("--poisons", default=",".join(p.value for p in Poison),
                    help="comma-separated poisons of the drawn examples (default all)")
    ap.add_argument("--replay", help="run the examples recorded in this output of harness_speed.py")
    ap.add_argument("--group", type=int, default=20, help="examples per profiling session")
    ap.add_argument("--top", type=int, default=10, help="kernels (operators) kept per stage by total time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (campaign workers use 1)")
    ap.add_argument("--out", required=True, help="the run's JSON")
    a = ap.parse_args(argv)
    try:
        poisons = tuple(Poison(p) for p in a.poisons.split(","))
    except ValueError as e:
        ap.error(f"--poisons: {e}; choose from {', '.join(p.value for p in Poison)}")
    if min(a.examples, a.serving_examples or 1, a.per_config, a.group) < 1:
        ap.error("--examples, --serving-examples, --per-config and --group: at least 1")
    try:
        todo = jobs(a)
        targets = {name: get_target(name) for name, _, _ in todo}
    except (OSError, ValueError, KeyError) as e:  # an unreadable --replay file, an unknown --target
        ap.error(f"{'--replay' if a.replay else '--target'}: {e}")
    torch.set_num_threads(a.threads)
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "records": []}
    for name, tier, exs in todo:
        target = targets[name]
        if not target.availability().ok:
            print(f"{name}: unavailable: {target.availability().reason}", flush=True)
            continue
        n = a.serving_examples if tier == "serving" and a.serving_examples else a.examples
        exs = exs or draw_examples(target, tier, n, a.per_config, poisons)
        rec = measure(name, tier, exs, a.group, a.top)
        rec["cases"] = [{"example": e.to_dict()} for e in exs]  # --replay reads them as harness_speed's
        doc["records"].append(rec)
        print("\n".join(report(rec, a.top)), flush=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))  # after each record: a run cut short keeps what it measured
    Path(a.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
