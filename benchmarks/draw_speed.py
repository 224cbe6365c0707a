"""What Hypothesis and kvfuzz's strategies cost per example, without the harness (issue 51): the draw and
Hypothesis's engine of a campaign chunk, for any tier on any machine (benchmarks/campaign_speed.py runs the harness
too: it had not finished 45 serving examples of vllm.unified_attention after 20 minutes on a 2-core CPU).

    python benchmarks/draw_speed.py --target vllm.unified_attention --tier serving --examples 200 --out new.json
    python benchmarks/draw_speed.py --compare old.json new.json      # the same examples? ms per example

One Hypothesis run as a campaign chunk makes it (kvfuzz.fuzz.campaign.engine.Campaign._test): the target's strategy
for ``--tier`` (its declaration read as on ``--device``, no pin), ``--seed``, the generate phase, an in-memory
example database, every health check off, and a body that reports ``hypothesis.target()`` under the campaign's label
with a value read off the example's digest (a stand-in for the agreement ratio: Hypothesis keeps a Pareto front and
mutates as in a campaign) and nothing else. ``--repeat`` runs follow each other (the medians are reported); each
takes this thread's CPU time (other processes on a shared machine do not count; the body's own time left out) split
into ``draw`` (Hypothesis's ``draw_times``: the strategy's draw) and ``hypothesis`` (the rest: the engine between
draws), and the digest of every example drawn, so two trees' runs of one seed can be compared example by example.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(args) -> dict:
    time.perf_counter = time.thread_time  # before Hypothesis imports it: its draw_times in this thread's CPU time
    import draw_identity
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
    from hypothesis.control import current_build_context
    from hypothesis.database import InMemoryExampleDatabase

    import kvfuzz
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.runner import TARGET_LABEL
    from kvfuzz.fuzz.targets.registry import BUILTIN

    for speedup in ("remember_sort_keys", "fast_mutator_groups"):  # as a Campaign does (where the tree has them)
        getattr(engine, speedup, lambda: None)()
    module, _, cls = BUILTIN[args.target].partition(":")
    with draw_identity.device(args.device):
        target = getattr(__import__(module, fromlist=[cls]), cls)
        caps = target.capabilities
        strategy = draw_identity.strategy(caps, args.tier)
        runs = []
        for r in range(args.repeat + 1):  # the first: a warm-up (imports, caches)
            digests, draw_s, body_s = [], [0.0], [0.0]

            def body(example):
                entered = time.thread_time()
                digest = draw_identity.digest(example)
                digests.append(digest)
                draw_s[0] += math.fsum(current_build_context().data.draw_times.values())
                hypothesis.target((zlib.crc32(digest.encode()) % 1000) / 1000, label=TARGET_LABEL)
                body_s[0] += time.thread_time() - entered

            n = args.examples if r else max(5, args.examples // 10)
            test = settings(database=InMemoryExampleDatabase(), max_examples=n, deadline=None,
                            phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                            verbosity=Verbosity.quiet, derandomize=False, print_blob=False)(
                seed(args.seed if r else args.seed + 1)(given(strategy)(body)))
            began = time.thread_time()
            test()
            spent = time.thread_time() - began - body_s[0]  # the body's digest is not the campaign's
            if r:
                runs.append({"examples": len(digests), "ms_per_example": 1e3 * spent / len(digests),
                             "draw_ms": 1e3 * draw_s[0] / len(digests),
                             "hypothesis_ms": 1e3 * (spent - draw_s[0]) / len(digests), "digests": digests})
    first = runs[0]["digests"]
    if any(r["digests"] != first for r in runs):
        raise SystemExit("draw_speed.py: two runs of one seed drew different examples")
    med = {k: round(statistics.median(r[k] for r in runs), 3) for k in ("ms_per_example", "draw_ms", "hypothesis_ms")}
    return {"kvfuzz": str(Path(kvfuzz.__file__).parent), "target": args.target, "device": args.device,
            "tier": args.tier, "seed": args.seed, "examples": len(first), "repeat": args.repeat, **med,
            "runs_ms": [round(r["ms_per_example"], 3) for r in runs],
            "digests_sha1": hashlib.sha1("".join(first).encode()).hexdigest(), "digests": first}


def compare(paths: list[str]) -> int:
    """Each run's median ms per example side by side, and whether every run drew the first's examples."""
    runs = [json.load(open(p)) for p in paths]
    first = runs[0]
    print(f"== {first['target']} ({first['device']}) {first['tier']}: {first['examples']} examples, seed "
          f"{first['seed']}, median of {first['repeat']} runs, thread CPU ms per example")
    print(f"{'':>14} " + " ".join(f"{p.rsplit('/', 1)[-1][:14]:>14}" for p in paths))
    for key in ("draw_ms", "hypothesis_ms", "ms_per_example"):
        print(f"{key:>14} " + " ".join(f"{r[key]:14.3f}" for r in runs))
    bad = [p for p, r in zip(paths[1:], runs[1:]) if r["digests"] != first["digests"]]
    for p in bad:
        print(f"{p}: examples differ from {paths[0]}")
    if not bad:
        print(f"examples identical in all {len(runs)} runs ({len(first['digests'])} examples)")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="vllm.unified_attention")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                    help="read the target's declaration as on this device (no kernel runs)")
    ap.add_argument("--tier", default="small")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+")
    args = ap.parse_args(argv)
    if args.compare:
        sys.exit(compare(args.compare))
    if args.examples < 1 or args.repeat < 1:
        print("draw_speed.py: --examples and --repeat must be at least 1", file=sys.stderr)
        sys.exit(2)
    rec = run(args)
    print(json.dumps({k: v for k, v in rec.items() if k != "digests"}))
    if args.out:
        Path(args.out).write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
