"""What one campaign worker spends per example, stage by stage, on the path a campaign runs (issue 51): the engine's
chunks, Hypothesis, :class:`~kvfuzz.fuzz.campaign.runner.ExampleRunner` and a worker's pipe to its supervisor, so
the stages outside the harness (``draw``, ``hypothesis``, ``other``) are measured too, not only the harness's.

    python benchmarks/campaign_speed.py --target vllm.cpu_attention --examples 600 --out after.json
    python benchmarks/campaign_speed.py --compare before.json after.json     # outcomes identical? stage table

One process runs :func:`kvfuzz.fuzz.campaign.engine.fuzz_target` (replay, then chunks of ``--chunk`` examples from
``--seed``, kernel configurations pinned per chunk as on CUDA, ``--tier``'s size limits, ``--poison`` as given)
after a warm-up campaign of another seed, and reads its stage table (summary.json's ``time``): mean ms per example
of each stage. Every event the worker's listener sends (kvfuzz.fuzz.campaign.workers.worker.PipeListener: ``begin``
with the example, ``phase``, ``end``) goes through a real pipe to a child that reads it, as a supervisor does.
``--clock thread`` (the default) makes ``time.perf_counter`` this thread's CPU time before anything imports it, so
other processes on a shared machine do not count (torch runs one thread, as in a worker). Each example's outcome is
kept (its labels, failure signature, agreement ratio, KV tokens): the same seed in two trees runs the same examples
when their draws and verdicts are the same, which ``--compare`` checks example by example.

Two trees side by side: run each tree's interpreter (an editable install) with this script in turn, alternated.
Results: docs/benchmarks.md ("The campaign's own time per example").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

#: The stages always shown (kvfuzz.fuzz.campaign.stages.STAGES: any other stage a run spent time in is shown too).
STAGES = ("draw", "generate", "materialize", "check_caller", "kernel", "reference", "check_output", "hypothesis",
          "other")
#: kvfuzz's own work per example: the harness's stages and the runner's (``other``); not Hypothesis's (``draw``,
#: ``hypothesis``), the kernel's, nor the waits (``compile``, ``queued``, ``memory_wait``).
HARNESS = ("generate", "materialize", "check_caller", "reference", "check_output", "other")


def _drain(conn) -> None:
    """The supervisor's side of the pipe: say it is ready, then read every message until the pipe closes."""
    conn.send("ready")
    try:
        while True:
            conn.recv()
    except EOFError:
        pass


def _reader():
    """A spawned child reading a pipe as the supervisor does, ready before this returns (no send waits on its
    start): this end of the pipe and the child."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    reader = ctx.Process(target=_drain, args=(theirs,), daemon=True)
    reader.start()
    theirs.close()
    mine.recv()
    return mine, reader


def run(args) -> dict:
    if args.clock == "thread":
        time.perf_counter = time.thread_time  # before Hypothesis and kvfuzz import it
    import tempfile
    from pathlib import Path

    import torch

    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.config import CampaignConfig
    from kvfuzz.fuzz.campaign.workers.worker import PipeListener
    from kvfuzz.fuzz.targets import get_target

    torch.set_num_threads(1)
    target = get_target(args.target)
    poisons = tuple(Poison(p) for p in args.poison) if args.poison else tuple(Poison)
    mine, reader = _reader()
    pipe, outcomes = PipeListener(mine), []
    counting = engine._Counting
    end = counting.end

    def ended(self, name, outcome):
        pipe.end(name, outcome)
        outcomes.append({"labels": dict(sorted(outcome.labels.items())), "signature": outcome.signature,
                         "ratio": repr(float(outcome.ratio)), "kv_tokens": outcome.kv_tokens})
        end(self, name, outcome)

    counting.begin = lambda self, name, example: pipe.begin(name, example)
    counting.phase = lambda self, name: pipe.phase(name)
    counting.end = ended

    def config(seed: int, n: int) -> CampaignConfig:
        return CampaignConfig(out=Path(tempfile.mkdtemp(prefix="kvfuzz-speed-")), max_examples=n, seed=seed,
                              poisons=poisons, pin_configs=True, chunk_examples=args.chunk, tiers=(args.tier,),
                              structural_shrink=0.0)

    engine.fuzz_target(target, config(args.seed + 1, args.warmup))  # imports, pools, first calls
    outcomes.clear()
    began = time.perf_counter()
    stats = engine.fuzz_target(target, config(args.seed, args.examples))
    spent = time.perf_counter() - began
    mine.close()
    reader.join(10)
    rows = stats.stages.to_dict()
    row = rows.get(args.tier, {"examples": 0, "seconds": {}})
    n = max(1, row["examples"])
    ms = {s: round(1e3 * row["seconds"].get(s, 0.0) / n, 3) for s in (*STAGES, *(set(row["seconds"]) - set(STAGES)))}
    import kvfuzz
    return {"kvfuzz": str(Path(kvfuzz.__file__).parent), "target": args.target, "tier": args.tier,
            "seed": args.seed, "clock": args.clock, "examples": row["examples"], "shrink_ms": round(
                1e3 * sum(r["seconds"].get("shrink", 0.0) for r in rows.values()) / n, 3),
            "ms_per_example": round(1e3 * spent / n, 3), "stages_ms": ms,
            "harness_ms": round(sum(ms[k] for k in HARNESS), 3),
            "outcomes_sha1": hashlib.sha1(json.dumps(outcomes, sort_keys=True).encode()).hexdigest(),
            "outcomes": outcomes}


def messages(args) -> dict:
    """``--messages N``: what the worker's listener costs per example alone (its ``begin``: the example's dict,
    pickled and sent; ``phase`` twice; ``end``), for ``N`` examples of ``--tier`` drawn from the target's strategy,
    through a real pipe to a reading child: mean ms per example (this thread's CPU time with ``--clock thread``) and
    the bytes ``begin`` sends."""
    if args.clock == "thread":
        time.perf_counter = time.thread_time
    import pickle
    import random
    from pathlib import Path

    from hypothesis.control import BuildContext
    from hypothesis.internal.conjecture.data import ConjectureData

    import kvfuzz
    from kvfuzz.fuzz.campaign.records import Outcome
    from kvfuzz.fuzz.campaign.workers.worker import PipeListener
    from kvfuzz.fuzz.targets import get_target
    from kvfuzz.strategies.batches import examples
    from kvfuzz.strategies.limits import Limits
    from kvfuzz.strategies.serving import serving_examples
    from kvfuzz.strategies.tiers import tier_limits

    target = get_target(args.target)
    make = serving_examples if args.tier == "serving" else examples
    strategy = make(target.capabilities, tier_limits(args.tier, Limits()))
    drawn, i = [], 0
    while len(drawn) < args.messages and i < 20 * args.messages:
        data = ConjectureData(random=random.Random(i))
        i += 1
        try:
            with BuildContext(data, wrapped_test=lambda: None):
                drawn.append(data.draw(strategy))
        except BaseException as e:  # an assumption rejected, a draw that overran its buffer
            if not type(e).__module__.startswith("hypothesis"):
                raise
    mine, reader = _reader()
    pipe = PipeListener(mine)
    outcome = Outcome({"tier": args.tier}, stages={"draw": 0.001, "other": 0.001})
    began = time.perf_counter()
    for example in drawn:
        pipe.begin(target.name, example)
        pipe.phase("kernel")
        pipe.phase("check")
        pipe.end(target.name, outcome)
    spent = time.perf_counter() - began
    sizes = sorted(len(pickle.dumps(("begin", target.name, e.to_dict()))) for e in drawn)
    mine.close()
    reader.join(10)
    return {"kvfuzz": str(Path(kvfuzz.__file__).parent), "target": args.target, "tier": args.tier,
            "clock": args.clock, "examples": len(drawn),
            "listener_ms_per_example": round(1e3 * spent / len(drawn), 3),
            "begin_bytes_median": sizes[len(sizes) // 2], "begin_bytes_max": sizes[-1]}


def compare(paths: list[str]) -> int:
    """Print the stage table of each run side by side (ms per example) and whether every run's outcomes are those of
    the first, example by example; exit 1 where they differ."""
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    print(f"== {first['target']} {first['tier']}: {first['examples']} examples, seed {first['seed']}, clock "
          f"{first['clock']}")
    print(f"{'ms per example':>14} " + " ".join(f"{p.rsplit('/', 1)[-1][:14]:>14}" for p in paths))
    extra = sorted({k for r in runs for k in r["stages_ms"]} - set(STAGES))
    for key in (*STAGES, *extra, "harness", "per example"):
        vals = [r["harness_ms"] if key == "harness" else r["ms_per_example"] if key == "per example"
                else r["stages_ms"].get(key, 0.0) for r in runs]
        print(f"{key:>14} " + " ".join(f"{v:14.3f}" for v in vals))
    bad = 0
    for path, r in zip(paths[1:], runs[1:]):
        diff = [i for i, (a, b) in enumerate(zip(first["outcomes"], r["outcomes"])) if a != b]
        if diff or len(first["outcomes"]) != len(r["outcomes"]):
            bad += 1
            print(f"{path}: outcomes differ from {paths[0]} (examples {diff[:5]}, counts {len(first['outcomes'])} "
                  f"and {len(r['outcomes'])})")
    if not bad:
        print(f"outcomes identical in all {len(runs)} runs ({len(first['outcomes'])} examples: labels, failure "
              "signature, agreement ratio bits, KV tokens)")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="vllm.cpu_attention")
    ap.add_argument("--tier", default="small")
    ap.add_argument("--examples", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=1000, help="examples per chunk (CUDA's pinned default: 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--poison", action="append", choices=("nan", "inf", "stale", "zeros"),
                    help="repeatable; default every poison")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+")
    ap.add_argument("--messages", type=int, default=0,
                    help="only the worker's messages to its supervisor, for this many examples of --tier")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(args.compare))
    for name in ("examples", "warmup", "chunk"):
        if getattr(args, name) < 1:
            print(f"campaign_speed.py: --{name} {getattr(args, name)}: must be at least 1", file=sys.stderr)
            sys.exit(2)
    if args.messages:
        print(json.dumps(messages(args)))
        return
    rec = run(args)
    print(json.dumps({k: v for k, v in rec.items() if k != "outcomes"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":
    main()
