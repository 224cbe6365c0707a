"""What kvfuzz's own harness costs per example, stage by stage, on any device: milliseconds, torch operator calls
and host reads (a host<->device sync each where the tensor lives on a GPU) per example per stage, and the verdict
of every example, so two trees can be compared side by side (issue 51, "a harness at the kernel's pace").

    python benchmarks/harness_speed.py --target vllm.cpu_attention --tier small --examples 100 --out after.json
    python benchmarks/harness_speed.py --replay before.json --out after.json    # the very examples of another run
    python benchmarks/harness_speed.py --compare before.json after.json         # verdicts equal? stage table

Examples are drawn from the campaign's strategies (``--tier small``: ``kvfuzz.strategies.batches.examples``;
``--tier serving``: ``kvfuzz.strategies.serving.serving_examples`` with ``tier_limits("serving")``), ``--per-config``
examples inside each kernel configuration (``config_for(capabilities, limits, 0, k)``, as a campaign's chunks pin
one), every poison. Each example is written to the output with its verdict (``pass`` and the agreement ratio, or
the finding's kind, check and message), so ``--replay`` runs exactly the same examples in another tree (whatever
its strategies draw) and ``--compare`` checks the verdicts are identical. ``--plant`` makes some examples fail on
purpose (a NaN or a wrong element in the kernel's output, every third example), ``--fault`` runs a caller fault
(``kvfuzz.fuzz.harness.faults``), so the failure paths are compared too.

Two passes over the examples, after one warm-up example: the timed pass reads each run's own
``kvfuzz.fuzz.harness.run.Timings`` (``--clock``: wall-clock, or on a CPU target by default this thread's CPU
time, which other processes on a shared machine do not inflate); the counted pass (``--count N``: the first N
examples; slower, its times are not used) counts, per stage, the torch operators dispatched (``TorchDispatchMode``:
every aten call but views; each is a kernel launch on a GPU unless its tensors are on the CPU), the host reads
(``item``, ``bool``, ``tolist``, ``nonzero``, ``equal``, boolean indexing, ``unique``, ``repeat_interleave`` without
a size and copies to the CPU: a sync each when the tensor is on a GPU; on the CPU they cost nothing but are counted
all the same), the copies between devices, and on CUDA the synchronizations CUDA reports
(``torch.cuda.set_sync_debug_mode``). The stages are the Timings fields: ``generate``, ``materialize``,
``check_caller``, ``kernel``, ``reference``,
``check_output`` (attributed by the harness functions each stage calls: see :data:`MARKS`). ``--where N``: the N
busiest (stage, operator, kvfuzz source line) triples. ``--gpu-layout``: on the CPU, chunk the reference and the data
draw as a GPU does, so the counts are a GPU's (a large batch of a CUDA target draws its data and computes its
reference on the GPU: kvfuzz.fuzz.harness.run.reference_device).

On a GPU, both trees side by side: benchmarks/gpu_harness_speed.sh. Results: docs/benchmarks.md ("A harness at the
kernel's pace").
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from hypothesis.control import BuildContext
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.internal.conjecture.data import ConjectureData
from torch.utils._python_dispatch import TorchDispatchMode

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness import attention, properties
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.configs import config_for
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.serving import serving_examples
from kvfuzz.strategies.tiers import tier_limits

STAGES = ("generate", "materialize", "check_caller", "kernel", "reference", "check_output")
#: The harness functions (names in kvfuzz.fuzz.harness.attention) that open a stage, and the stage that follows
#: when they return: how the counted pass attributes an operator to a stage (the same boundaries as the Timings).
MARKS = {"generate": ("generate", "materialize"), "materialize": ("materialize", "materialize"),
         "poison_output": ("kernel", "kernel"),
         "caller_violations": ("check_caller", "kernel"), "run_kernel": ("kernel", "reference"),
         "reference_and_envelope": ("reference", "check_output")}
#: aten operators that read a tensor's values into the host (a sync each on a GPU).
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "_unique2", "unique_dim",
              "unique_consecutive", "masked_select", "allclose"}
VIEWS = {"view", "_unsafe_view", "slice", "select", "unbind", "expand", "permute", "transpose", "t", "unsqueeze",
         "squeeze", "as_strided", "alias", "reshape", "split", "split_with_sizes", "unflatten", "flatten", "detach",
         "lift_fresh", "view_as_real", "narrow", "diagonal", "_reshape_alias", "unfold"}


# ---- counting ------------------------------------------------------------------------------------------------

class Counting(TorchDispatchMode):
    """Counts, per stage, the aten operators dispatched (views apart), the host reads and the cross-device copies."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.stage = "other"
        self.where = Counter() if where else None
        self.ops: Counter = Counter()
        self.views: Counter = Counter()
        self.reads: Counter = Counter()
        self.copies: Counter = Counter()
        self.names: dict[str, Counter] = {}

    def read(self) -> None:
        self.reads[self.stage] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.where is not None and name not in VIEWS:
            self.where[(self.stage, name, _caller())] += 1
        if name in VIEWS:
            self.views[self.stage] += 1
        else:
            self.ops[self.stage] += 1
            self.names.setdefault(self.stage, Counter())[name] += 1
        if name in HOST_READS or (name == "repeat_interleave" and "output_size" not in kwargs
                                  and isinstance(args[0], torch.Tensor) and args[0].dim() <= 1
                                  and len(args) < 3):
            self.read()
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
            self.read()
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device") or src.device
            if isinstance(src, torch.Tensor) and torch.device(dst) != src.device:
                self.copies[self.stage] += 1
                if torch.device(dst).type == "cpu":
                    self.read()
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost kvfuzz frame that led to an operator (``--where``)."""
    f = sys._getframe(2)
    while f is not None:
        file = f.f_code.co_filename
        if "/kvfuzz/" in file or any(f"/{d}/" in file for d in ("contracts", "fuzz", "api")) and "site-packages" \
                not in file and "harness_speed" not in file:
            return f"{Path(file).parent.name}/{Path(file).name}:{f.f_lineno}"
        f = f.f_back
    return "?"


@contextlib.contextmanager
def counting(counter: Counting):
    """Attribute operators to stages while the harness runs: wraps :data:`MARKS`' functions in
    kvfuzz.fuzz.harness.attention, ``Tensor.tolist``/``numpy`` (host reads outside the dispatcher) and, on CUDA,
    counts the synchronizations CUDA reports."""
    saved = {name: getattr(attention, name) for name in MARKS if hasattr(attention, name)}
    order = list(STAGES)

    def wrap(name, f):
        opens, follows = MARKS[name]

        def wrapped(*a, **k):
            before = counter.stage
            counter.stage = opens
            try:
                return f(*a, **k)
            finally:  # a stage that ran out of order (a late caller check) returns to where it was
                later = before in order and order.index(before) > order.index(follows)
                counter.stage = before if later else follows
        return wrapped

    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def read_tolist(self, *a, **k):
        counter.read()
        return tolist(self, *a, **k)

    def read_numpy(self, *a, **k):
        counter.read()
        return numpy(self, *a, **k)

    for name, f in saved.items():
        setattr(attention, name, wrap(name, f))
    torch.Tensor.tolist, torch.Tensor.numpy = read_tolist, read_numpy
    try:
        with counter:
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        for name, f in saved.items():
            setattr(attention, name, f)


class CudaSyncs:
    """Synchronizations CUDA reports per stage (``torch.cuda.set_sync_debug_mode("warn")``)."""

    def __init__(self, counter: Counting) -> None:
        self.counter, self.syncs = counter, Counter()

    def __enter__(self):
        self._warn = warnings.catch_warnings(record=True)
        self.log = self._warn.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        self._show = warnings.showwarning
        return self

    def note(self) -> None:
        """Attribute the warnings recorded since the last call to the counter's current stage."""
        for w in self.log:
            if "synchroniz" in str(w.message):
                self.syncs[self.counter.stage] += 1
        self.log.clear()

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        self._warn.__exit__(*exc)


# ---- examples ------------------------------------------------------------------------------------------------

def draw(strategy, i: int):
    data = ConjectureData(random=random.Random(i))
    with BuildContext(data, wrapped_test=lambda: None):
        return data.draw(strategy)


def draw_examples(target, tier: str, n: int, per_config: int, poisons: tuple[Poison, ...]) -> list[Example]:
    """``n`` examples of ``tier`` with ``poisons``, ``per_config`` inside each kernel configuration, drawn
    deterministically (an assumption the strategy rejects is skipped)."""
    limits = tier_limits(tier, Limits())
    out, i, strategies = [], 0, {}
    while len(out) < n and i < 20 * n + 100:
        k = len(out) // per_config
        if k not in strategies:
            pin = config_for(target.capabilities, limits, 0, k)
            make = serving_examples if tier == "serving" else examples
            strategies[k] = make(target.capabilities, limits, poisons, pin=pin)
        try:
            out.append(draw(strategies[k], 1000 * k + i))
        except UnsatisfiedAssumption:
            pass
        except BaseException as e:  # hypothesis's StopTest on a draw that overran its buffer
            if not type(e).__module__.startswith("hypothesis"):
                raise
        i += 1
    return out


def plant(target, how: str | None) -> None:
    """Make every third kernel call fail on purpose (its output changed after the kernel ran): ``nan`` one
    element NaN, ``off`` one element moved by 1.0 (a mismatch), ``mixed`` alternating the two."""
    if how is None:
        return
    run, calls = target.run, [0]

    def planted(call):
        out = run(call)
        calls[0] += 1
        i = calls[0]
        if i % 3 == 0 and isinstance(out, torch.Tensor) and out.numel():
            kind = how if how != "mixed" else ("nan" if i % 6 == 0 else "off")
            flat = out.view(-1)
            j = (i * 7919) % flat.numel()
            flat[j] = float("nan") if kind == "nan" else flat[j] + 1.0
        return out
    target.run = planted


def digest(t) -> str | None:
    if not isinstance(t, torch.Tensor):
        return None
    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def one(target, example: Example, fault) -> tuple[dict, object]:
    """Run one example through the harness; its verdict and the Run (None when it raised before one existed)."""
    run = None
    try:
        run = properties.prepare(target, example, fault)
        properties.check(target, example, fault, run=run)
        return {"verdict": "pass", "ratio": repr(float(run.ratio))}, run
    except Finding as f:
        return {"verdict": f.kind.value, "check": f.check, "message": f.message}, run
    except Exception as e:  # a layout that cannot hold the batch, an adapter's error
        return {"verdict": "error", "message": f"{type(e).__name__}: {str(e)[:300]}"}, run


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def clock(name: str):
    """``thread``: the harness's own stage clock (``time.perf_counter``) reads this thread's CPU time instead, so
    other processes on a shared machine do not count (the CPU only: a GPU's work is not this thread's)."""
    if name != "thread":
        yield
        return
    wall = time.perf_counter
    time.perf_counter = time.thread_time
    try:
        yield
    finally:
        time.perf_counter = wall


def forget_checked_shapes() -> None:
    """Start a pass as a fresh process does: no call shape's caller checks done yet (a tree that samples them,
    kvfuzz.fuzz.harness.caller), so each pass counts the first call of every shape."""
    shapes = getattr(sys.modules.get("kvfuzz.fuzz.harness.caller"), "_SHAPES_CHECKED", None)
    if shapes is not None:
        shapes.clear()


def timed_pass(target, exs: list[Example], fault, device: str) -> tuple[list[dict], dict]:
    forget_checked_shapes()
    verdicts, tot, walls = [], Counter(), []
    for e in exs:
        sync(device)
        s = time.perf_counter()  # the clock of the pass (:func:`clock`)
        v, run = one(target, e, fault)
        sync(device)
        walls.append(time.perf_counter() - s)
        if run is not None:
            for k in STAGES:
                tot[k] += getattr(run.timings, k, 0.0)
            v["reference_sha1"] = digest(run.reference)
            v["envelope_sha1"] = digest(run.envelope)
        verdicts.append(v)
    m = max(1, len(exs))
    stages = {k: round(tot[k] / m * 1e3, 3) for k in STAGES}
    harness = sum(v for k, v in stages.items() if k != "kernel")
    return verdicts, {"ms_per_example": round(sum(walls) / m * 1e3, 3),
                      "median_ms": round(statistics.median(walls) * 1e3, 3) if walls else 0.0,
                      "harness_ms": round(harness, 3), "stages_ms": stages}


def counted_pass(target, exs: list[Example], fault, device: str, where: int = 0) -> dict:
    forget_checked_shapes()
    counter = Counting(where=bool(where))
    cuda = device.startswith("cuda")
    syncs = CudaSyncs(counter) if cuda else contextlib.nullcontext()
    with counting(counter), syncs:
        for e in exs:
            counter.stage = "generate"
            one(target, e, fault)
            counter.stage = "other"
            if cuda:
                syncs.note()
    m = max(1, len(exs))
    per = lambda c: {k: round(c[k] / m, 1) for k in (*STAGES, "other") if c[k]}  # noqa: E731
    out = {"examples": len(exs), "ops": per(counter.ops), "views": per(counter.views),
           "host_reads": per(counter.reads), "device_copies": per(counter.copies),
           "top_ops": {k: dict(c.most_common(8)) for k, c in counter.names.items()}}
    if cuda:
        out["cuda_syncs"] = per(syncs.syncs)
    if where:
        out["where"] = [f"{s} {n} {w}: {c / m:.1f}" for (s, n, w), c in counter.where.most_common(where)]
    return out


def gpu_layout() -> None:
    """Count as a GPU would run the stages that chunk their work by device: the reference with the GPU's chunk budget
    (kvfuzz.contracts.checks.reference_chunks.GPU), the data drawn in one chunk (counter_rng.CHUNK)."""
    from kvfuzz.contracts.checks import reference_chunks
    from kvfuzz.contracts.model import counter_rng

    reference_chunks.CPU = reference_chunks.GPU
    counter_rng.CHUNK = counter_rng.MAX_STREAM_ELEMENTS * 16


def measure(target_name: str, tier: str, exs: list[Example], args) -> dict:
    target = get_target(target_name)
    plant(target, args.plant)
    fault = None
    if args.fault:
        from kvfuzz.fuzz.harness.faults import get_fault
        fault = get_fault(args.fault)
    device = target.device
    one(target, exs[0], fault)  # warm: lazy modules, the STALE pool, first compiles
    with clock(args.job_clock):
        verdicts, timing = timed_pass(target, exs, fault, device)
    rec = {"target": target_name, "tier": tier, "device": device, "clock": args.job_clock, "examples": len(exs),
           "plant": args.plant,
           "fault": args.fault, "timing": timing,
           "median_kv_elements": int(statistics.median(e.batch.kv_elements for e in exs)),
           "median_num_seqs": int(statistics.median(e.batch.num_seqs for e in exs)),
           "median_kv_tokens": int(statistics.median(sum(e.batch.seq_lens) for e in exs))}
    if args.count:
        rec["counts"] = counted_pass(target, exs[: args.count], fault, device, args.where)
    rec["cases"] = [{"example": e.to_dict(), **v} for e, v in zip(exs, verdicts)]
    return rec


# ---- compare -------------------------------------------------------------------------------------------------

VERDICT_FIELDS = ("verdict", "check", "message")


def _verdicts(ra: dict, rb: dict) -> dict:
    """Example by example: verdicts that differ, and how many references, envelopes and pass ratios are equal."""
    out = {"verdicts": dict(Counter(c["verdict"] for c in ra["cases"])), "differing": [], "same_reference": 0,
           "same_ratio": 0}
    for i, (ca, cb) in enumerate(zip(ra["cases"], rb["cases"])):
        if ca["example"] != cb["example"]:
            out["differing"].append(f"example {i}: not the same example (use --replay)")
            continue
        if any(ca.get(k) != cb.get(k) for k in VERDICT_FIELDS):
            out["differing"].append(f"example {i}: {[ca.get(k) for k in VERDICT_FIELDS]} != "
                                    f"{[cb.get(k) for k in VERDICT_FIELDS]}")
        out["same_reference"] += ca.get("reference_sha1") == cb.get("reference_sha1") and \
            ca.get("envelope_sha1") == cb.get("envelope_sha1")
        out["same_ratio"] += ca.get("ratio") == cb.get("ratio")
    return out


def _stage_table(ra: dict, rb: dict) -> dict:
    """Per stage: ms, torch operators, host reads (and CUDA syncs when counted there), before and after."""
    ka, kb = ra.get("counts", {}), rb.get("counts", {})
    kinds = ("ops", "host_reads") + (("cuda_syncs",) if "cuda_syncs" in ka or "cuda_syncs" in kb else ())
    table = {}
    for stage in (*STAGES, "other"):
        row = {"ms": [ra["timing"]["stages_ms"].get(stage, 0.0), rb["timing"]["stages_ms"].get(stage, 0.0)]}
        for kind in kinds:
            row[kind] = [ka.get(kind, {}).get(stage, 0), kb.get(kind, {}).get(stage, 0)]
        table[stage] = row
    return table


def compare(a_path: str, b_path: str, out: str | None = None) -> int:
    """Print the two runs side by side (and with ``out``, write it as JSON); exit 1 when an example's verdict
    differs (or the examples do)."""
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    bad, doc = 0, {"before": a_path, "after": b_path, "devices": [a["device"], b["device"]], "records": []}
    for ra, rb in zip(a["records"], b["records"]):
        name = f"{ra['target']} {ra['tier']}" + (f" plant={ra['plant']}" if ra.get("plant") else "") + \
            (f" fault={ra['fault']}" if ra.get("fault") else "")
        v, table = _verdicts(ra, rb), _stage_table(ra, rb)
        bad += len(v["differing"])
        n = len(ra["cases"])
        timing = {k: [ra["timing"][k], rb["timing"][k]] for k in ("ms_per_example", "median_ms", "harness_ms")}
        doc["records"].append({"name": name, "examples": n, "counted": ra.get("counts", {}).get("examples", 0),
                               "median_kv_elements": ra.get("median_kv_elements"), **v, **timing, "stages": table})
        print(f"== {name}: {n} examples; {a['device']} | {b['device']}")
        for line in v["differing"]:
            print("  " + line)
        print(f"  verdicts: {v['verdicts']}; differing: {len(v['differing'])}; reference and envelope bitwise equal: "
              f"{v['same_reference']}/{n}; pass ratios equal: {v['same_ratio']}/{n}")
        print(f"  ms per example: {timing['ms_per_example'][0]} -> {timing['ms_per_example'][1]}; harness (stages "
              f"but the kernel): {timing['harness_ms'][0]} -> {timing['harness_ms'][1]}")
        kinds = list(next(iter(table.values())))
        print("  " + f"{'stage':>13}" + "".join(f"{k:>22}" for k in kinds))
        for stage, row in table.items():
            print("  " + f"{stage:>13}" + "".join(f"{f'{x[0]} -> {x[1]}':>22}" for x in row.values()))
    print("verdicts identical" if not bad else f"{bad} examples differ")
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="repeatable (default vllm.cpu_attention)")
    ap.add_argument("--tier", action="append", choices=("small", "serving"), help="repeatable (default small)")
    ap.add_argument("--examples", type=int, default=50, help="per target and tier")
    ap.add_argument("--per-config", type=int, default=25, help="examples per kernel configuration")
    ap.add_argument("--count", type=int, default=0, help="count operators over the first N examples")
    ap.add_argument("--where", type=int, default=0, help="with --count: the N busiest call sites (stage, op, line)")
    ap.add_argument("--gpu-layout", action="store_true", help="on the CPU, chunk the reference and the data "
                    "draw as on a GPU (op counts as a GPU's; the reference's bits may differ from the CPU's)")
    ap.add_argument("--plant", choices=("nan", "off", "mixed"), help="every third kernel output made wrong")
    ap.add_argument("--fault", help="a caller fault (kvfuzz.fuzz.harness.faults)")
    ap.add_argument("--poisons", default=",".join(p.value for p in Poison),
                    help="comma-separated poisons of the drawn examples (default all)")
    ap.add_argument("--clock", choices=("wall", "thread"), help="what the stage times count: wall-clock, or this "
                    "thread's CPU time (default: thread on a CPU target, wall on a GPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (campaign workers use 1)")
    ap.add_argument("--replay", help="run the examples recorded in this output of an earlier run")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--out", help="the run's JSON; with --compare, the comparison's")
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare, out=a.out))
    if not a.out:
        ap.error("--out is required (or --compare BEFORE AFTER)")
    torch.set_num_threads(a.threads)
    if a.gpu_layout:
        gpu_layout()
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "kvfuzz": str(Path(attention.__file__).resolve().parents[2]),
           "gpu_layout": a.gpu_layout, "records": []}
    if a.replay:
        old = json.loads(Path(a.replay).read_text())
        jobs = [(r["target"], r["tier"], [Example.from_dict(c["example"]) for c in r["cases"]], r.get("plant"),
                 r.get("fault")) for r in old["records"]]
    else:
        jobs = []
        for name in a.target or ["vllm.cpu_attention"]:
            for tier in a.tier or ["small"]:
                jobs.append((name, tier, None, a.plant, a.fault))
    for name, tier, exs, planted, fault in jobs:
        if not get_target(name).availability().ok:
            print(f"{name}: unavailable: {get_target(name).availability().reason}", flush=True)
            continue
        a.plant, a.fault = planted, fault
        a.job_clock = a.clock or ("wall" if get_target(name).device != "cpu" else "thread")
        exs = exs or draw_examples(get_target(name), tier, a.examples, a.per_config,
                                  tuple(Poison(p) for p in a.poisons.split(",")))
        s = time.perf_counter()
        rec = measure(name, tier, exs, a)
        rec["seconds"] = round(time.perf_counter() - s, 1)
        doc["records"].append(rec)
        summary = {k: v for k, v in rec.items() if k != "cases"}
        summary["verdicts"] = dict(Counter(c["verdict"] for c in rec["cases"]))
        print(json.dumps(summary), flush=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
