"""torch.flex_paged's compiled flex_attention at GQA groups past 16, each batch through the target with one or more
kernel options: ``target`` (the target as it is: vLLM's FlexAttention options, kvfuzz.fuzz.targets.flex_options),
``former`` (kvfuzz's former fixed options, BLOCK_M=32 BLOCK_N=min(page, 32) num_warps=4 num_stages=1) and
``defaults`` (flex's own, no kernel_options). An H200 sweep (2026-11-28) met "InductorError: SubprocException" with
the former options on one decode, 64 query heads over 1 kv head, head size 16, fp32, where flex's defaults passed.

Cases: ``gqa`` (default) that decode at groups 16, 24, 32 and 64, pages 16 and 64, and a 16-token prefill at 64
heads over 4, head size 256, page 128, fp16 (the crash of flex's defaults); ``sizes`` a 16-token prefill at a
GQA group of 8 for each head size 16..256 and page 16..128 (``--dtype`` picks the dtype): the declared CUDA space
under vLLM's options, whose BLOCK_N is the whole page (with FORCE_USE_FLEX_ATTENTION a decode runs the same
kernel); ``groups`` decodes and 16-token prefills at groups 24, 32 and 64 (one or two kv heads, head sizes 64,
128 and 256, pages 16 and 64, ``--dtype``): what declaring those groups on CUDA needs. Prints one line a case and
option (``passed`` or the error's type and last lines) and a count of those
that did not pass; exits 0 once it ran (2 for a bad option). Runs on the CPU too (eager: the options are not
used), which tests/fuzz/bench/test_flex_gqa_probe.py checks.

On a CUDA machine (after benchmarks/gpu_env.sh): python3 benchmarks/flex_gqa_probe.py --options target"""

import argparse
import sys
import traceback

import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets import flex_options
from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged

#: the kernel options a case can run with: None keeps the target's own
OPTIONS = {
    "target": None,
    "former": staticmethod(lambda batch: {"BLOCK_M": 32, "BLOCK_N": min(batch.block_size, 32), "num_warps": 4,
                                          "num_stages": 1}),
    "defaults": staticmethod(lambda batch: None),
}


def cases(which: str, dtype: str) -> list[dict]:
    """The batches of ``which`` ("gqa", "groups" or "sizes"), as Batch keyword arguments (one sequence, no context)."""
    if which == "gqa":
        out = [dict(query_lens=[1], num_heads=h, num_kv_heads=1, head_size=16, block_size=p, dtype="float32")
               for h in (16, 24, 32, 64) for p in (16, 64)]
        return out + [dict(query_lens=[16], num_heads=64, num_kv_heads=4, head_size=256, block_size=128,
                           dtype="float16")]
    if which == "groups":
        return [dict(query_lens=[q], num_heads=g * kv, num_kv_heads=kv, head_size=d, block_size=p, dtype=dtype)
                for g in (24, 32, 64) for q, kv, d, p in ((1, 1, 128, 16), (1, 1, 128, 64), (16, 1, 128, 16),
                                                          (16, 2, 64, 64), (1, 1, 256, 16), (1, 1, 256, 64),
                                                          (16, 1, 256, 16), (16, 2, 256, 64))]
    return [dict(query_lens=[16], num_heads=16, num_kv_heads=2, head_size=d, block_size=p, dtype=dtype)
            for d in (16, 32, 64, 128, 256) for p in (16, 32, 64, 128)]


def run_case(kw: dict, label: str) -> str:
    """One batch through torch.flex_paged with the options ``label`` names: the line to print."""
    batch = Batch(ctx_lens=[0], num_blocks=1, block_table=[[0]], **kw)
    name = (f"H={kw['num_heads']}/{kw['num_kv_heads']} D={kw['head_size']} q={kw['query_lens'][0]} "
            f"page={kw['block_size']} {kw['dtype']}")
    own = TorchFlexPaged.__dict__["kernel_options"]  # the staticmethod itself, to put back as it was
    if OPTIONS[label] is not None:
        TorchFlexPaged.kernel_options = OPTIONS[label]
    try:
        shown = TorchFlexPaged.kernel_options(batch)
        properties.check(TorchFlexPaged(), Example(batch, Poison.ZEROS))
        return f"{name}, {label} {shown}: passed"
    except Exception as e:  # what the probe is for: the error's words
        tail = "".join(traceback.format_exception(e)).strip().splitlines()[-12:]
        return f"{name}, {label}: {type(e).__name__}\n    " + "\n    ".join(line[:300] for line in tail)
    finally:
        TorchFlexPaged.kernel_options = own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--options", default="target,former,defaults",
                    help="comma-separated, each of: " + ", ".join(OPTIONS))
    ap.add_argument("--cases", choices=("gqa", "groups", "sizes"), default="gqa")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16",
                    help="the dtype of --cases sizes and groups")
    args = ap.parse_args(argv)
    labels = [s for s in args.options.split(",") if s]
    bad = [s for s in labels if s not in OPTIONS]
    if bad or not labels:
        print(f"flex_gqa_probe: --options {args.options!r}: each must be one of {', '.join(OPTIONS)}",
              file=sys.stderr)
        return 2
    _, where = flex_options.upstream_function(flex_options.GET_KERNEL_OPTIONS)
    print(f"# torch {torch.__version__}, {'compiled (cuda)' if torch.cuda.is_available() else 'eager (cpu)'}; "
          f"vLLM's get_kernel_options: {where}", flush=True)
    failed = 0
    for kw in cases(args.cases, args.dtype):
        for label in labels:
            line = run_case(kw, label)
            failed += not line.endswith(": passed")
            print(line, flush=True)
    print(f"# {failed} of {len(labels) * len(cases(args.cases, args.dtype))} did not pass", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
