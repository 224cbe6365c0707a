"""What a campaign worker's memory (RSS) is made of, over time: one target's campaign run in this process the way a
``kvfuzz fuzz`` worker runs it (glibc tuned as a worker tunes it, the CLI's defaults), sampled every few minutes
(issue 49: the soak's goal is a worker's RSS within 10% of its first sample after warm-up).

    python benchmarks/rss_probe.py --target vllm.unified_attention --minutes 25 --out DIR [--sample 300]
        [--tracemalloc FRAMES] [--trim {example,chunk,keep}] [--no-tune-malloc] [--mallopt NAME=BYTES]
        [--baseline kvfuzz-baseline.toml]

Each sample (``DIR/samples.jsonl``) holds:

- ``smaps``: ``/proc/self/smaps_rollup`` in MiB: ``rss``, ``anon`` (anonymous: the heap, mmap'd blocks, thread
  stacks), ``file`` (``rss - anon``: pages of mapped files, i.e. shared libraries paged in on first use);
- ``malloc``: glibc's ``mallinfo2`` in MiB: ``arena`` (heap bytes from the kernel, every arena), ``mmap``
  (blocks mapped on their own), ``in_use`` (allocated and not freed), ``free`` (freed and kept by malloc: what a
  ``malloc_trim`` could give back), ``top`` (the releasable top of the main heap); ``arenas``: MiB of each malloc
  arena (``malloc_info``), ``threads``: the process's threads;
- ``tracemalloc`` (with ``--tracemalloc N``): the MiB Python's allocators hold (numpy arrays' data included, torch
  tensors' not), tracemalloc's own overhead, and the 12 tracebacks that grew most since the first sample;
- ``objects``: the gc-tracked objects by type, the 12 types that grew most since the first sample;
- ``caches``: every ``functools.lru_cache`` of a loaded module (``currsize``/``maxsize``), Hypothesis's
  module-level caches and Triton's interpreter cache by size, and kvfuzz's module-level containers (dict, list,
  set, deque) by length: a container that grows with the examples is a leak; a cache at its maxsize is warm-up.

Every example also appends a line to ``DIR/examples.jsonl``: the example's size (tokens, blocks, heads, head size,
dtype, kv_cache_dtype), the RSS and malloc's arena right after it, so a step in RSS can be matched to the example
that caused it. ``--trim example`` calls glibc's ``malloc_trim(0)`` after every example (``rss_trimmed``: the RSS
after it), ``--trim chunk`` after every chunk (``DIR/chunks.jsonl``: the RSS before and after, the seconds it took),
``--trim keep`` after every chunk what a worker does between tasks (``trim_heap``: only past ``HEAP_KEEP``);
``--no-tune-malloc`` leaves glibc's defaults (a worker applies
``kvfuzz.fuzz.campaign.workers.worker.MALLOC_SETTINGS``); ``--mallopt M_TRIM_THRESHOLD=BYTES`` changes one of them.
Each sample also has the process's CPU seconds (user, system) and minor page faults so far: what a malloc setting
costs. ``MALLOC_ARENA_MAX`` etc. come from the environment.
``DIR/probe.json`` (rewritten after every sample) sums it up. Nothing is asserted: the numbers go to
docs/campaigns.md, "What a long campaign costs".
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import gc
import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

MIB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def mallinfo() -> dict | None:
    """glibc's ``mallinfo2`` in MiB (the module docstring), None without glibc 2.33+."""
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {"arena": round(m.arena / MIB, 1), "mmap": round(m.hblkhd / MIB, 1), "in_use": round(m.uordblks / MIB, 1),
            "free": round(m.fordblks / MIB, 1), "top": round(m.keepcost / MIB, 1)}


def arenas() -> list[float] | None:
    """MiB each of glibc's malloc arenas holds from the kernel (``malloc_info``'s ``<system type="current">`` per
    ``<heap>``: the main arena first, then one per thread that allocated, up to ``MALLOC_ARENA_MAX``)."""
    fn = getattr(LIBC, "malloc_info", None)
    if fn is None:
        return None
    import re
    import tempfile

    LIBC.fopen.restype, LIBC.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    LIBC.fclose.argtypes, fn.argtypes = [ctypes.c_void_p], [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = LIBC.fopen(f.name.encode(), b"w")
        fn(0, fp)
        LIBC.fclose(fp)
        xml = Path(f.name).read_text()
    heaps = re.findall(r'<heap nr="\d+">.*?<system type="current" size="(\d+)"/>', xml, re.S)
    return [round(int(b) / MIB, 1) for b in heaps]


def threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def smaps() -> dict:
    """``/proc/self/smaps_rollup`` in MiB: rss, anon, file (rss - anon)."""
    kib = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            kib[key] = int(rest.split()[0])
    rss, anon = kib.get("Rss", 0), kib.get("Anonymous", 0)
    return {"rss": round(rss / 1024, 1), "anon": round(anon / 1024, 1), "file": round((rss - anon) / 1024, 1)}


def rss_mib() -> float:
    """The resident set (``/proc/self/statm``: cheap enough for every example), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return round(pages * resource.getpagesize() / MIB, 1)


def trim() -> None:
    if LIBC is not None:
        LIBC.malloc_trim(0)


def object_counts() -> collections.Counter:
    gc.collect()
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def _grown(now: collections.Counter, first: collections.Counter, n: int = 12) -> list:
    diff = [(k, now[k] - first.get(k, 0), now[k]) for k in now]
    return [list(d) for d in sorted(diff, key=lambda d: -d[1])[:n] if d[1] > 0]


def lru_caches() -> dict:
    """Every lru_cache wrapper reachable from a loaded module's globals or its classes: ``name: [currsize,
    maxsize]`` (only those holding something)."""
    out = {}
    for modname, mod in list(sys.modules.items()):
        space = getattr(mod, "__dict__", None)
        if not isinstance(space, dict):
            continue
        for name, obj in list(space.items()):
            for attr, fn in [(name, obj)] + ([(f"{name}.{a}", v) for a, v in vars(obj).items()]
                                             if isinstance(obj, type) and obj.__module__ == modname else []):
                fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
                if isinstance(fn, functools._lru_cache_wrapper):
                    i = fn.cache_info()
                    if i.currsize:
                        out[f"{modname}.{attr}"] = [i.currsize, i.maxsize]
    return out


def named_caches() -> dict:
    """Hypothesis's module-level caches, Triton's interpreter's rewritten functions, by entries."""
    out = {}
    for mod, names in (("hypothesis.strategies._internal.utils", ("_STRATEGY_CACHE",)),
                       ("hypothesis.internal.conjecture.providers", ("CONSTANTS_CACHE",)),
                       ("hypothesis.internal.conjecture.data", ("POOLED_CONSTRAINTS_CACHE",)),
                       ("triton.runtime.interpreter", ("InterpretedFunction",))):
        m = sys.modules.get(mod)
        for name in names:
            obj = getattr(m, name, None)
            obj = getattr(obj, "rewritten_fn", obj)
            try:
                out[f"{mod}.{name}"] = len(obj)
            except TypeError:
                pass
    return out


def kvfuzz_containers() -> dict:
    """kvfuzz's module-level dicts, lists, sets and deques (and those of its classes), by length."""
    out = {}
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("kvfuzz"):
            continue
        for name, obj in list(vars(mod).items()):
            pairs = [(name, obj)]
            if isinstance(obj, type) and obj.__module__ == modname:
                pairs += [(f"{name}.{a}", v) for a, v in vars(obj).items()]
            for attr, value in pairs:
                if isinstance(value, (dict, list, set, collections.deque)) and not attr.startswith("__"):
                    out[f"{modname}.{attr}"] = len(value)
    return out


class Probe:
    """The samples and the per-example lines (the module docstring)."""

    def __init__(self, out: Path, sample_s: float, frames: int, trim_each: str | None) -> None:
        self.out, self.sample_s, self.frames, self.trim_each = out, sample_s, frames, trim_each
        self.start = time.monotonic()
        self.next_at = self.start
        self.samples: list[dict] = []
        self.first_objects: collections.Counter | None = None
        self.first_containers: dict = {}
        self.first_snapshot = None
        self.example: dict = {}
        self.examples = 0
        self.jl = open(out / "samples.jsonl", "a")
        self.el = open(out / "examples.jsonl", "a")

    def begin(self, example) -> None:
        b = example.batch
        self.example = {"tokens": sum(b.query_lens) + sum(b.ctx_lens), "query": sum(b.query_lens),
                        "seqs": len(b.query_lens), "num_blocks": b.num_blocks, "block_size": b.block_size,
                        "heads": [b.num_heads, b.num_kv_heads], "head_size": b.head_size, "dtype": b.dtype,
                        "kv_cache_dtype": b.kv_cache_dtype}

    def end(self, outcome) -> None:
        self.examples += 1
        line = {"t_s": round(time.monotonic() - self.start, 1), "n": self.examples, **self.example,
                "stages": list(getattr(outcome, "stages", ()) or ()), "rss": rss_mib()}
        m = mallinfo()
        if m is not None:
            line["arena"], line["in_use"] = m["arena"], m["in_use"]
        if self.trim_each == "example":
            trim()
            line["rss_trimmed"] = rss_mib()
        self.el.write(json.dumps(line) + "\n")
        self.el.flush()
        if time.monotonic() >= self.next_at:
            self.sample()

    def sample(self) -> None:
        t0 = time.monotonic()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        s: dict = {"t_s": round(t0 - self.start, 1), "examples": self.examples, "smaps": smaps(),
                   "malloc": mallinfo(), "arenas": arenas(), "threads": threads(),
                   "cpu_s": {"user": round(ru.ru_utime, 1), "system": round(ru.ru_stime, 1)},
                   "minor_faults": ru.ru_minflt}
        if self.frames:
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            current, peak = tracemalloc.get_traced_memory()
            s["tracemalloc"] = {"current": round(current / MIB, 1), "peak": round(peak / MIB, 1),
                                "overhead": round(tracemalloc.get_tracemalloc_memory() / MIB, 1)}
            if self.first_snapshot is None:
                self.first_snapshot = snap
            else:
                s["tracemalloc"]["grown"] = [
                    {"kib": round(d.size_diff / 1024, 1), "count": d.count_diff, "at": d.traceback.format()[-6:]}
                    for d in snap.compare_to(self.first_snapshot, "traceback")[:12] if d.size_diff > 0]
            del snap
        objects = object_counts()
        self.first_objects = self.first_objects or objects
        s["objects"] = {"total": sum(objects.values()), "grown": _grown(objects, self.first_objects)}
        containers = kvfuzz_containers()
        self.first_containers = self.first_containers or containers
        s["caches"] = {"lru": lru_caches(), "named": named_caches(),
                       "kvfuzz_grown": {k: [self.first_containers.get(k, 0), v] for k, v in containers.items()
                                        if v > self.first_containers.get(k, 0)}}
        s["sample_s"] = round(time.monotonic() - t0, 1)
        self.samples.append(s)
        self.jl.write(json.dumps(s) + "\n")
        self.jl.flush()
        (self.out / "probe.json").write_text(json.dumps(self.summary(), indent=1))
        self.next_at = max(self.next_at + self.sample_s, time.monotonic())

    def summary(self) -> dict:
        return {"argv": sys.argv[1:], "examples": self.examples,
                "rows": [{"t_s": s["t_s"], "examples": s["examples"], **s["smaps"],
                          **{f"malloc_{k}": v for k, v in (s["malloc"] or {}).items()},
                          **({"python": s["tracemalloc"]["current"]} if "tracemalloc" in s else {}),
                          "arenas": len(s["arenas"] or ()), "threads": s["threads"], **s["cpu_s"],
                          "minor_faults": s["minor_faults"],
                          "objects": s["objects"]["total"]} for s in self.samples]}


def config(args):
    """The campaign's config as ``kvfuzz fuzz --target T --duration D [--baseline B] --seed S`` makes it."""
    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.store.baseline import load_baseline
    from kvfuzz.strategies.limits import Limits

    return CampaignConfig(out=args.out / "campaign", max_examples=10**9, duration=args.minutes * 60, seed=args.seed,
                          limits=Limits(), poisons=tuple(Poison), tiers=("auto",), steer=True, pin_configs=None,
                          structural_shrink=60.0, baseline=load_baseline(args.baseline) if args.baseline else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sample", type=float, default=300.0, help="seconds between samples (the first: at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default="kvfuzz-baseline.toml")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES", help="trace Python's allocations, "
                    "FRAMES deep (0: off; it slows the campaign)")
    ap.add_argument("--trim", choices=["example", "chunk", "keep"], default=None, help="malloc_trim(0) after every "
                    "example or every chunk, or a worker's trim_heap after every chunk")
    ap.add_argument("--no-tune-malloc", action="store_true", help="glibc's defaults, not a worker's mallopt")
    ap.add_argument("--mallopt", action="append", default=[], metavar="NAME=BYTES",
                    help="after the worker's settings, one of MALLOC_SETTINGS's names set otherwise")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_tune_malloc:
        from kvfuzz.fuzz.campaign.workers.worker import tune_malloc

        tune_malloc()
    for item in args.mallopt:
        from kvfuzz.fuzz.campaign.workers.worker import MALLOC_SETTINGS

        name, value = item.split("=")
        assert LIBC.mallopt(MALLOC_SETTINGS[name][0], int(value)) == 1, item
    import torch

    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.targets import get_target

    torch.set_num_threads(1)  # a worker's --threads default
    target = get_target(args.target)
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    probe = Probe(args.out, args.sample, args.tracemalloc, args.trim)

    class Probed(engine._Counting):  # the campaign's own counting listener, with the probe beside it
        def begin(self, t, example) -> None:
            probe.begin(example)

        def end(self, t, outcome) -> None:
            super().end(t, outcome)
            probe.end(outcome)

    engine._Counting = Probed
    if args.trim in ("chunk", "keep"):
        from kvfuzz.fuzz.campaign.workers.worker import trim_heap

        run_chunk, chunks = engine.Campaign.run_chunk, open(args.out / "chunks.jsonl", "a")

        def trimmed(self, *a, **k):
            try:
                return run_chunk(self, *a, **k)
            finally:
                before, t0 = rss_mib(), time.monotonic()
                did = trim_heap() if args.trim == "keep" else trim() is None
                chunks.write(json.dumps({"t_s": round(t0 - probe.start, 1), "examples": probe.examples, "rss": before,
                                         "trimmed": did, "rss_trimmed": rss_mib(),
                                         "trim_s": round(time.monotonic() - t0, 3)}) + "\n")
                chunks.flush()

        engine.Campaign.run_chunk = trimmed
    stats = engine.fuzz_target(target, config(args))
    probe.sample()
    print(json.dumps({"examples": stats.examples, "failures": len(stats.failures), **probe.summary()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
