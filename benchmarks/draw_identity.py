"""Prove a refactor leaves generation unchanged: draw fixed-seed batches from every built-in target's declarations
and write one digest per batch, or compare two such files.

    .venv/bin/python benchmarks/draw_identity.py draw new.jsonl                # this tree's kvfuzz
    (cd /work/main && .venv/bin/python /work/wt-x/benchmarks/draw_identity.py draw /tmp/old.jsonl)
    .venv/bin/python benchmarks/draw_identity.py compare /tmp/old.jsonl new.jsonl   # exit 0 identical, 1 not

``draw`` uses the kvfuzz the running interpreter imports (an editable install of whichever tree), so the same
script measures an old and a new tree. It reads each built-in target's ``capabilities`` twice, as they read on CPU
and on CUDA (``torch.cuda.is_available`` patched: no kernel, no GPU needed), keeps each declaration whose
``devices`` include that device, and draws from it in every size tier the contract allows (a cache writer: no
``serving`` or ``big-cache``, as ``Target.size_tiers`` and ``kvfuzz fuzz --big-cache`` rule), with
``kvfuzz.strategies``' public strategies under the default ``Limits`` and every poison, Hypothesis seeded per
(target, device, tier). ``--batches`` (1,500 by default) are shared out evenly over those draws. Each line of the
output: target, device, tier, index, the sha256 of the example's JSON (``Example.to_dict`` with the batch's derived
structure: seq_lens, query_start_loc, shared and freed blocks) and the batch's one-line summary. ~1-2 minutes on a
2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

TIERS = ("small", "serving", "long", "wide", "big-cache")


@contextlib.contextmanager
def device(name: str) -> Iterator[None]:
    """Targets read their device-dependent declarations (``DeviceCapabilities``) as on ``name``."""
    with mock.patch.object(torch.cuda, "is_available", lambda: name == "cuda"):
        yield


def declarations() -> list[tuple[str, str, object]]:
    """``(target, device, capabilities)`` of every built-in target on each device its declaration names."""
    from kvfuzz.fuzz.targets.registry import BUILTIN

    out = []
    for name in sorted(BUILTIN):
        module, cls = BUILTIN[name].split(":")
        target = getattr(importlib.import_module(module), cls)
        for dev in ("cpu", "cuda"):
            with device(dev):
                caps = target.capabilities
            if dev in caps.devices:
                out.append((name, dev, caps))
    return out


def strategy(caps, tier: str):
    """The examples a campaign chunk of ``tier`` draws from ``caps`` (no gate, no pin, default limits)."""
    from kvfuzz.strategies.batches import big_cache_examples, examples
    from kvfuzz.strategies.limits import Limits
    from kvfuzz.strategies.serving import serving_examples
    from kvfuzz.strategies.tiers import tier_limits

    limits = tier_limits(tier, Limits())
    if tier == "big-cache":
        return big_cache_examples(caps, limits)
    if tier == "serving":
        return serving_examples(caps, limits)
    return examples(caps, limits)


def digest(example) -> str:
    """sha256 of the example's JSON and its batch's derived structure."""
    b = example.batch
    record = {"example": example.to_dict(), "seq_lens": b.seq_lens, "query_start_loc": b.query_start_loc,
              "shared_prefix_blocks": b.shared_prefix_blocks,
              "freed_blocks": [b.freed_blocks(i) for i in range(b.num_seqs)]}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def draw(caps, tier: str, count: int, key: str) -> list:
    """Up to ``count`` examples of ``strategy(caps, tier)``, Hypothesis seeded from ``key``."""
    got = []

    @seed(zlib.crc32(key.encode()))
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy(caps, tier))
    def collect(example):
        if len(got) < count:
            got.append(example)

    collect()
    return got


def run_draw(out: Path, total: int) -> int:
    combos = [(name, dev, caps, tier) for name, dev, caps in declarations() for tier in TIERS
              if caps.contract.is_attention or tier not in ("serving", "big-cache")]
    with out.open("w") as f:
        for i, (name, dev, caps, tier) in enumerate(combos):
            count = total // len(combos) + (i < total % len(combos))
            with device(dev):
                examples = draw(caps, tier, count, f"{name}/{dev}/{tier}")
            for j, example in enumerate(examples):
                f.write(json.dumps({"target": name, "device": dev, "tier": tier, "index": j,
                                    "digest": digest(example), "summary": example.batch.summary()}) + "\n")
            print(f"{name:36} {dev:4} {tier:9} {len(examples):3} batches", file=sys.stderr)
    return 0


def run_compare(old: Path, new: Path) -> int:
    rows = []
    for path in (old, new):
        try:
            rows.append([json.loads(line) for line in path.read_text().splitlines()])
        except (OSError, ValueError) as e:
            print(f"draw_identity: {path}: cannot read a draw file ({e}); write one with `draw`", file=sys.stderr)
            return 2
    a, b = rows
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    for x, y in differ[:5]:
        print(f"differs: {x['target']} {x['device']} {x['tier']} #{x['index']}\n  old {x['summary']}\n"
              f"  new {y['summary']}")
    if len(a) != len(b):
        print(f"{old} has {len(a)} batches, {new} {len(b)}")
    print(f"{len(a)} and {len(b)} batches; {len(differ)} differ" + ("" if differ or len(a) != len(b)
                                                                      else ": identical"))
    return 1 if differ or len(a) != len(b) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("draw", help="draw the batches and write one digest per line")
    d.add_argument("out", type=Path)
    d.add_argument("--batches", type=int, default=1500, help="batches in all (default 1500)")
    c = sub.add_parser("compare", help="compare two draw files: exit 0 identical, 1 not")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    args = p.parse_args(argv)
    if args.mode == "draw":
        return run_draw(args.out, args.batches)
    return run_compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
