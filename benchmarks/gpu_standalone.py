"""Issue 41 on a GPU: reproducers' standalone.py, run where kvfuzz is not importable, agree with ``kvfuzz replay``
for compiled Triton, FA3, FlashMLA, compiled torch flex and FlashInfer (benchmarks/gpu_standalone.sh runs it).

Cases (each: write the reproducer, replay it, run standalone.py in a fresh python3 whose PYTHONPATH lacks kvfuzz),
by group (``CASES``, space-separated groups; default "triton fa3 mla"):
- triton: bug.vllm-47305 and bug.vllm-30887 (re-injected upstream bugs, compiled Triton: the patched copy beside
  the script) and decode_attention_fwd's fp16 scores (findings 3, may pass compiled), failing; unified_attention
  passing;
- fa3, mla: FA3 and FlashMLA with a planted fault in the call (softmax_scale x 1.05, a subclass that keeps the
  built-in ``run``), and the built-in FA3 (with a sliding window and a softcap) and FlashMLA passing (FlashMLA's
  scheduler metadata is made again in the script with ``get_mla_metadata``);
- flex: torch.compile'd flex_attention (its block mask, score_mod with softcap and ALiBi, and kernel_options made
  in the script), planted (scale x 1.05) and passing;
- flashinfer: batch_decode, batch_decode_tc and batch_prefill (window and softcap; planted sm_scale x 1.05, and
  passing) and append_paged_kv_cache (planted: keys written twice as large; and passing), over four cache forms
  (NHD/HND x 5-D/(k, v), from the seed). First JIT compiles: ~21 s decode, ~86 s prefill, ~19 s append (H100).
A passing case is written with a stand-in finding (what a fixed kernel's reproducer shows: exit 0).

Prints one line per case: ``<case>: replay=<reproduced|passes> standalone=<exit> agree=<yes|NO>``; exit 1 when one
disagrees. Usage: python3 benchmarks/gpu_standalone.py OUT NOKV_PYTHONPATH"""

import os
import subprocess
import sys
from pathlib import Path

import attrs

from kvfuzz.contracts.checks.failures import Finding, KernelMismatch
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.campaign.workers.replay import TargetUnavailable, replay
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets.flashinfer import (
    FlashInferAppendPagedKvCache,
    FlashInferBatchDecode,
    FlashInferBatchDecodeTC,
    FlashInferBatchPrefill,
)
from kvfuzz.fuzz.targets.registry import get_target
from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged
from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttnVarlen
from kvfuzz.fuzz.targets.vllm_mla import VllmFlashMlaDecode


def planted(base: type, cls_name: str, name: str, kwarg: str, factor: float) -> type:
    """A subclass ``cls_name`` of target class ``base``, registered as ``name``, whose call has argument ``kwarg``
    multiplied by ``factor`` (the caller's arguments otherwise as the built-in's): a planted fault."""

    def build_call(self, batch, data, cache):
        call = base.build_call(self, batch, data, cache)
        call.kwargs[kwarg] = call.kwargs[kwarg] * factor
        return call

    doc = f"{base.__name__} called with {kwarg} x {factor}."
    return type(cls_name, (base,), {"name": name, "build_call": build_call, "__doc__": doc, "__module__": __name__})


# softmax scales 5% too large; append_paged_kv_cache handed keys twice as large as the tokens' (the cache then
# differs from the expected). Module attributes: a reproducer names them as "gpu_standalone.py:CLASS".
PlantedFA3 = planted(VllmFlashAttnVarlen, "PlantedFA3", "planted.fa3_scale", "softmax_scale", 1.05)
PlantedFlashMLA = planted(VllmFlashMlaDecode, "PlantedFlashMLA", "planted.flashmla_scale", "softmax_scale", 1.05)
PlantedFlex = planted(TorchFlexPaged, "PlantedFlex", "planted.flex_scale", "scale", 1.05)
PlantedFIDecode = planted(FlashInferBatchDecode, "PlantedFIDecode", "planted.fi_decode_scale", "sm_scale", 1.05)
PlantedFIDecodeTC = planted(FlashInferBatchDecodeTC, "PlantedFIDecodeTC", "planted.fi_decode_tc_scale", "sm_scale",
                            1.05)
PlantedFIPrefill = planted(FlashInferBatchPrefill, "PlantedFIPrefill", "planted.fi_prefill_scale", "sm_scale", 1.05)
PlantedFIAppend = planted(FlashInferAppendPagedKvCache, "PlantedFIAppend", "planted.fi_append_keys", "append_key", 2)


def batch(lens, **kw) -> Batch:
    """:func:`~kvfuzz.contracts.model.batch.contiguous_batch` of ``(query_len, ctx_len)`` pairs: block size 16
    (``kw`` may set another), two spare blocks."""
    return contiguous_batch(*zip(*lens), **{"block_size": 16, "spare_blocks": 2, **kw})


def cases():
    """``(group, label, target, example, target spec: None, "pass" or module:Class)``."""
    from kvfuzz.fuzz.bench.bugs import get_bug, smallest_trigger

    me = f"{Path(__file__).resolve()}"
    mla = dict(dtype="bfloat16", head_size=576, value_head_size=512, num_heads=16, num_kv_heads=1, block_size=64)
    yield "triton", "bug.vllm-47305", get_bug("vllm-47305"), Example(smallest_trigger("vllm-47305"), Poison.NAN), None
    yield "triton", "bug.vllm-30887", get_bug("vllm-30887"), Example(smallest_trigger("vllm-30887"), Poison.NAN), None
    yield "triton", "finding-3 decode fp16", get_target("vllm.decode_attention_fwd"), Example(attrs.evolve(batch(
        [(1, 1)], dtype="float16", head_size=32, num_heads=1, num_kv_heads=1, seed=230), value_range="large"),
        Poison.NAN), None
    yield "fa3", "planted FA3", PlantedFA3(), Example(batch([(5, 20), (1, 40)], dtype="float16", head_size=128,
                                                            num_heads=8, num_kv_heads=2), Poison.NAN), \
        f"{me}:PlantedFA3"
    yield "mla", "planted FlashMLA", PlantedFlashMLA(), Example(batch([(1, 70), (1, 5)], **mla), Poison.NAN), \
        f"{me}:PlantedFlashMLA"
    yield "fa3", "FA3 window+softcap passes", get_target("vllm.flash_attn_varlen"), Example(batch(
        [(7, 30), (1, 50), (3, 0)], dtype="bfloat16", head_size=128, num_heads=8, num_kv_heads=2,
        sliding_window=9, softcap=30.0), Poison.NAN), "pass"
    yield "mla", "FlashMLA passes", get_target("vllm.flashmla_decode"), Example(batch([(1, 70), (1, 5)], **mla),
                                                                                Poison.NAN), "pass"
    yield "triton", "unified compiled passes", get_target("vllm.unified_attention"), Example(batch(
        [(5, 20), (1, 40)], dtype="float16", head_size=64, num_heads=4, num_kv_heads=2, sliding_window=11),
        Poison.NAN), "pass"
    flex = batch([(5, 20), (1, 40), (9, 0)], dtype="float16", head_size=64, num_heads=4, num_kv_heads=2,
                 sliding_window=11, softcap=30.0, alibi=True)
    yield "flex", "planted compiled flex", PlantedFlex(), Example(flex, Poison.STALE), f"{me}:PlantedFlex"
    yield "flex", "compiled flex passes", get_target("torch.flex_paged"), Example(flex, Poison.STALE), "pass"
    fi = dict(dtype="float16", head_size=128, num_heads=8, num_kv_heads=2, sm_scale=128 ** -0.5)
    feats = dict(sliding_window=6, softcap=30.0)
    decode = [(1, 13), (1, 20), (1, 9)]
    mixed = [(5, 8), (1, 20), (4, 0)]
    for label, planted, name, lens, seed, kw in (
            ("batch_decode", PlantedFIDecode, "flashinfer.batch_decode", decode, 1, feats),
            ("batch_decode_tc", PlantedFIDecodeTC, "flashinfer.batch_decode_tc", decode, 2, feats),
            ("batch_prefill", PlantedFIPrefill, "flashinfer.batch_prefill", mixed, 3, feats),
            ("append_paged_kv_cache", PlantedFIAppend, "flashinfer.append_paged_kv_cache", mixed, 0, {})):
        ex = Example(batch(lens, seed=seed, **fi, **kw), Poison.STALE)
        yield "flashinfer", f"planted {label}", planted(), ex, f"{me}:{planted.__name__}"
        yield "flashinfer", f"{label} passes", get_target(name), ex, "pass"


def main() -> int:
    out, nokv = Path(sys.argv[1]), sys.argv[2]
    groups = os.environ.get("CASES", "triton fa3 mla").split()
    disagree = 0
    for group, label, t, ex, spec in cases():
        if group not in groups:
            continue
        a = t.availability()
        if not a.ok:
            print(f"{label}: skipped ({a.reason})")
            continue
        run = properties.prepare(t, ex)
        try:
            properties.check(t, ex, run=run, run_unsafe=True)
            f = KernelMismatch("agreement with the fp64 reference", "stand-in: recorded before a fix") \
                if spec == "pass" else None
        except Finding as e:
            f = e
        if f is None:
            print(f"{label}: kvfuzz found nothing on this case (no reproducer to compare)")
            continue
        d = write_reproducer(out / "repro", t, ex, f, run)
        try:
            rr = replay(d, target_spec=spec if spec not in (None, "pass") else None, trust_target=True)
            rep = rr.reproduced
        except TargetUnavailable as e:
            print(f"{label}: replay unavailable ({e})")
            continue
        env = dict(os.environ, PYTHONPATH=nokv)
        probe = subprocess.run([sys.executable, "-c", "import kvfuzz"], env=env, cwd=d, capture_output=True)
        s = subprocess.run([sys.executable, str(d / "standalone.py")], env=env, cwd=d, capture_output=True,
                           text=True, timeout=600)
        (d / "standalone.out").write_text(s.stdout + s.stderr)
        agree = (s.returncode == 1) == rep and s.returncode in (0, 1) and probe.returncode != 0
        disagree += not agree
        print(f"{label}: {d.name} replay={'reproduced' if rep else 'passes'} standalone={s.returncode} "
              f"kvfuzz-importable={probe.returncode == 0} agree={'yes' if agree else 'NO'}")
        print("   " + " | ".join(s.stdout.strip().splitlines()[-4:])[:600])
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
