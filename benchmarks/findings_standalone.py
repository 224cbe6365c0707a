"""Write the upstream findings of docs/findings.md that a CPU reaches as ready-to-file reproducers (issue 41):
docs/findings/<finding>/ holds kvfuzz's reproducer (case.json, tensors.safetensors, test_case.py), its
standalone.py (no kvfuzz needed) and ISSUE.md (``kvfuzz report --issue``). Each case is the one the tests pin
(5: a smaller batch of the same class).

    .venv/bin/python benchmarks/findings_standalone.py [OUT [FINDING...]]   (default: docs/findings, all of them;
                                                                            ~2 minutes on CPU)

Then checks every standalone.py in ``python -S`` with only site-packages on the path (kvfuzz not importable)
and prints its exit status (1: the bug reproduces). Exit 1 if one does not reproduce."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvfuzz.contracts.checks.failures import Finding
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store.issue import write_issue
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets.registry import get_target

#: finding -> (target, example, undeclared): the cases the tests pin (docs/findings.md numbers).
FINDINGS = {
    "1-vllm-cpu-nan-tail-slots": ("vllm.cpu_attention", Example(contiguous_batch(
        [1], [0], block_size=16, dtype="float32", head_size=32, num_heads=1, num_kv_heads=1, seed=1), Poison.NAN),
        False),
    "2-torch-flex-nan-in-unused-slots": ("torch.flex_paged", Example(Batch(
        query_lens=[1], ctx_lens=[0], num_heads=1, num_kv_heads=1, head_size=16, block_size=8, num_blocks=1,
        block_table=[[0]], dtype="float32"), Poison.NAN), False),
    "3-vllm-decode-attention-fp16-scores": ("vllm.decode_attention_fwd", Example(contiguous_batch(
        [1], [1], block_size=16, dtype="float16", head_size=32, num_heads=1, num_kv_heads=1, seed=230,
        value_range="large"),
        Poison.NAN), False),
    # smaller than tests/fuzz/targets/test_attention_params.py's pinned case (two sequences, 8 heads): one
    # two-token prefill, two heads, where row 1's sink weight is off by exp(slope): 0.0151 against a bound of 7.3e-7
    "5-vllm-unified-attention-alibi-with-sinks": ("vllm.unified_attention", Example(Batch(
        query_lens=[2], ctx_lens=[0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16, num_blocks=1,
        block_table=[[0]], dtype="float32", alibi=True, sinks=True), Poison.NAN), True),
    "6-vllm-context-attention-alibi-ignores-window": ("vllm.context_attention_fwd", Example(contiguous_batch(
        [1, 4], [9, 6], block_size=16, dtype="float32", head_size=32, num_heads=4, num_kv_heads=2, alibi=True,
        sliding_window=2), Poison.NAN), True),
    "9-sglang-decode-mha-product-rounding": ("sglang.decode_attention_fwd", Example(Batch(
        query_lens=[1], ctx_lens=[1], num_heads=1, num_kv_heads=1, head_size=128, block_size=1, num_blocks=2,
        block_table=[[0, 1]], dtype="float16", seed=39, value_range="large"), Poison.NAN), False),
    "11-vllm-cpu-softcap-overflow": ("vllm.cpu_attention", Example(contiguous_batch(
        [1], [0], block_size=16, dtype="float32", head_size=32, num_heads=1, num_kv_heads=1, seed=3,
        value_range="extreme", softcap=4.0), Poison.ZEROS), False),
    # one decode of 4 keys, 48 query heads over 2 kv heads (a group of 24; tests/fuzz/targets/test_wide_groups.py)
    "14-vllm-grouped-decode-wrong-kv-head": ("vllm.decode_attention_fwd", Example(contiguous_batch(
        [1], [3], block_size=16, dtype="float32", head_size=32, num_heads=48, num_kv_heads=2, seed=1), Poison.NAN),
        False),
    "14-sglang-grouped-decode-wrong-kv-head": ("sglang.decode_attention_fwd", Example(contiguous_batch(
        [1], [3], block_size=16, dtype="float32", head_size=32, num_heads=48, num_kv_heads=2, seed=1), Poison.NAN),
        False),
    # one decode after 8 cached tokens, a window of 4, every logit ~-40,000 ("shifted"): the 4 keys before the window,
    # masked with -10000, take the row
    "15-vllm-paged-decode-window-mask-sentinel": ("vllm.chunked_prefill_paged_decode", Example(contiguous_batch(
        [1], [8], block_size=16, dtype="float32", head_size=32, num_heads=1, num_kv_heads=1, sliding_window=4,
        value_range="shifted"), Poison.NAN), False),
}


def write(out: Path, slug: str, name: str, example: Example, undeclared: bool) -> Path:
    t = get_target(name)
    run = properties.prepare(t, example)
    try:
        if undeclared:
            properties.check_undeclared(t, example, run=run)
        else:
            properties.check(t, example, run=run, run_unsafe=True)
    except Finding as f:
        tmp = write_reproducer(out / ".tmp", t, example, f, run)
    else:
        raise SystemExit(f"{slug}: {name} passes this case now")
    d = out / slug
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    write_issue(d)
    return d


def standalone_status(d: Path, lib: str | None) -> int:
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin"}
    if lib:
        env["VLLM_CPU_LIB"] = lib
    from kvfuzz.fuzz.targets.sglang_triton import sglang_tree

    if sglang_tree() is not None:
        env["SGLANG_KERNEL_TREE"] = str(sglang_tree())
    return subprocess.run([sys.executable, "-S", str(d.resolve() / "standalone.py")], env=env, cwd=d,
                          capture_output=True, text=True).returncode


def main() -> int:
    from kvfuzz.fuzz.targets.vllm_cpu import _find_library

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/findings")
    only = sys.argv[2:]
    unknown = [s for s in only if s not in FINDINGS]
    if unknown:
        print(f"error: unknown finding {unknown[0]!r}; one of: {', '.join(FINDINGS)}", file=sys.stderr)
        return 2
    lib = _find_library()[0]
    bad = 0
    for slug, (name, example, undeclared) in FINDINGS.items():
        if only and slug not in only:
            continue
        d = write(out, slug, name, example, undeclared)
        rc = standalone_status(d, lib)
        bad += rc != 1
        print(f"{slug}: {d} standalone.py exit {rc}")
    shutil.rmtree(out / ".tmp", ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
