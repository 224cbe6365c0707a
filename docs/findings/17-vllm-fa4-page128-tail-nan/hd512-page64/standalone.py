#!/usr/bin/env python3
"""Standalone reproducer for vllm.flash_attn_varlen_fa4, written by kvfuzz.

It needs only torch, safetensors and the kernel's own package. Run it from anywhere:
    python standalone.py
Exit status: 1 while the bug reproduces, 0 once the kernel is fixed, 2 when it cannot run here (a package
missing: it says what to install)."""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads(
    '{"target": "vllm.flash_attn_varlen_fa4", "family": "module", "kind": "non-finite output", '
    '"check": "finite output", "blame": "kernel", "message": "non-finite output: 32768 elements in 64 (token'
    ', head) rows; first at sequence 0 position 2 (output row 0), head 0, dim 0: nan", '
    '"details": {"path": "fa4,gqa=1,paged64,fp8_kv_dequant", "kernel": {"outcome": "non-finite", '
    '"oracle": "finite output", "seq": 0, "position": 2, "token": 0, "head": 0, "dim": 0, '
    '"error": "nan", "bound": "nan", "bad_rows": 64, "bad_elements": 32768, '
    '"bad_tokens": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, '
    '26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, '
    '54, 55, 56, 57, 58, 59, 60, 61, 62, 63], "message": "non-finite output: 32768 elements in 64 (token, '
    'head) rows; first at sequence 0 position 2 (output row 0), head 0, dim 0: nan"}, '
    '"oracle": {"oracle": "finite output", "seq": 0, "position": 2, "token": 0, "head": 0, "dim": 0, '
    '"error": "nan", "bound": "nan", "bad_rows": 64, "bad_elements": 32768, '
    '"bad_tokens": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, '
    '26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, '
    '54, 55, 56, 57, 58, 59, 60, 61, 62, 63], "message": "non-finite output: 32768 elements in 64 (token, '
    'head) rows; first at sequence 0 position 2 (output row 0), head 0, dim 0: nan"}, '
    '"baseline": {"known": "finding-17", "reason": "FA4 (flash_attn_varlen_func, fa_version=4, '
    "the CuTe-DSL kernels, paged) on SM90 with pages of 128 reads a sequence's last page past seq_len and multiplies t"
    'hose V rows by probability 0: 0 x NaN = NaN (pages of 16-64 and head size 256 are right); on an H200 one decode, '
    'seq_len 1, head size 64, block size 128 gave NaN with NaN or Inf in the tail", '
    '"reference": "docs/findings.md, Findings on real kernels, '
    '17; docs/findings/17-vllm-fa4-page128-tail-nan/ISSUE.md"}}, "why_not": null, '
    '"kernel": ["vllm.vllm_flash_attn", "flash_attn_varlen_func"], "dtype": "float16", "num_heads": 1, '
    '"num_kv_heads": 1, "head_size": 512, "block_size": 64, "query_lens": [64], "seq_lens": [66], '
    '"scale": 0.044194173824159216, "softcap": null, "sliding_window": 2, "kv_cache_dtype": "fp8_e4m3", '
    '"alibi": false, "sinks": true, "value_range": "normal", "poison": "nan", '
    '"versions": {"python": "3.12.3", "kvfuzz": "0.2.0", "torch": "2.11.0", "triton": "3.6.0", '
    '"vllm": "0.33.0", "hypothesis": "6.170.15", "sglang": null, "flashinfer-python": null, '
    '"torch_cuda": "13.0", "device": "NVIDIA H200", "driver": "580.159.04"}, "num_pad_seqs": 0}'
)
SPEC = json.loads(  # None: no call recorded
    '{"kwargs": {"q": {"__tensor__": 0, "dtype": "float16", "size": [64, 1, 512], '
    '"stride": [512, 512, 1], "offset": 0, "device": "cuda"}, "k": {"__tensor__": 1, '
    '"dtype": "float8_e4m3fn", "size": [2, 64, 1, 512], "stride": [65536, 1024, 512, 1], "offset": 0, '
    '"device": "cuda"}, "v": {"__tensor__": 1, "dtype": "float8_e4m3fn", "size": [2, 64, 1, 512], '
    '"stride": [65536, 1024, 512, 1], "offset": 512, "device": "cuda"}, "out": {"__tensor__": 2, '
    '"dtype": "float16", "size": [64, 1, 512], "stride": [512, 512, 1], "offset": 0, '
    '"device": "cuda"}, "cu_seqlens_q": {"__tensor__": 3, "dtype": "int32", "size": [2], '
    '"stride": [1], "offset": 0, "device": "cuda"}, "max_seqlen_q": 64, "seqused_k": {"__tensor__": 4, '
    '"dtype": "int32", "size": [1], "stride": [1], "offset": 0, "device": "cuda"}, '
    '"max_seqlen_k": 66, "softmax_scale": 0.044194173824159216, "causal": true, "alibi_slopes": null, '
    '"window_size": {"__list__": [1, 0]}, "block_table": {"__tensor__": 5, "dtype": "int32", '
    '"size": [1, 2], "stride": [2, 1], "offset": 0, "device": "cuda"}, "softcap": 0, '
    '"scheduler_metadata": null, "fa_version": 4, "q_descale": null, "k_descale": {"__tensor__": 6, '
    '"dtype": "float32", "size": [1, 1], "stride": [0, 0], "offset": 0, "device": "cuda"}, '
    '"v_descale": {"__tensor__": 7, "dtype": "float32", "size": [1, 1], "stride": [0, 0], "offset": 0, '
    '"device": "cuda"}, "num_splits": 0, "s_aux": {"__tensor__": 8, "dtype": "float32", "size": [1], '
    '"stride": [1], "offset": 0, "device": "cuda"}}, "output_kwarg": "out", '
    '"output_shape": [64, 1, 512], "cache_views": [{"__tensor__": 1, "dtype": "float8_e4m3fn", '
    '"size": [2, 64, 1, 512], "stride": [65536, 1024, 512, 1], "offset": 0, '
    '"device": "cuda"}, {"__tensor__": 1, "dtype": "float8_e4m3fn", "size": [2, 64, 1, 512], '
    '"stride": [65536, 1024, 512, 1], "offset": 512, "device": "cuda"}], "isa": null}'
)
#: The pip name of each module this script may import, when it differs.
PIP_NAMES = {"flashinfer": "flashinfer-python"}


def require():
    """Exit 2 (it cannot run here: never 1, which says the bug reproduces) naming what to pip install when a
    package this reproducer imports is missing, at the versions the case was found with."""
    import importlib.util

    fam, kernel = META["family"], META.get("kernel") or [""]
    need = ["torch"] + (["safetensors"] if fam else [])
    need += {"triton": ["triton", "vllm"], "writer_triton": ["triton", "vllm"], "sglang": ["triton"],
             "flashinfer": ["flashinfer"], "writer_flashinfer": ["flashinfer"]}.get(fam, [])
    if fam == "module":
        need.append(kernel[0].split(".")[0])
    try:
        missing = [m for m in need if importlib.util.find_spec(m) is None]
    except (ImportError, ValueError):  # a package that is half there
        missing = need
    if not missing:
        return
    versions = META.get("versions") or {}
    pins = []
    for m in missing:
        name = PIP_NAMES.get(m, m)
        v = str(versions.get(name) or versions.get(m) or "").split("+")[0]
        pins.append(f"{name}=={v}" if v else name)
    print(f"error: this reproducer needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
          f"installed here: pip install {' '.join(pins)} (the versions the case was found with); it did not run",
          file=sys.stderr)
    sys.exit(2)


require()

if META["family"] in ("triton", "sglang", "writer_triton", "merge"):
    import importlib.util
    import types

    if not os.environ.get("CUDA_VISIBLE_DEVICES") and importlib.util.find_spec("torch") is not None:
        import torch

        CUDA = torch.cuda.is_available()
    else:
        CUDA = False
    if not CUDA:  # no GPU: Triton's interpreter (set before triton is imported), vLLM's Triton path on CPU
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # vllm.platforms.rocm needs a GPU to import; on CPU no ROCm path is taken
        if META["family"] in ("triton", "writer_triton"):
            stub = types.ModuleType("vllm.platforms.rocm")
            stub.use_rocm_custom_paged_attention = lambda *a, **k: False
            sys.modules["vllm.platforms.rocm"] = stub

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

DTYPE = getattr(torch, META["dtype"])
TENSORS = {}  # tensors.safetensors, once main() loaded it


def show_batch():
    m = META
    print(f"{m['target']}: {m['kind']} ({m['check']})")
    print(f"  dtype={m['dtype']} kv_cache_dtype={m['kv_cache_dtype']} num_heads={m['num_heads']} "
          f"num_kv_heads={m['num_kv_heads']} head_size={m['head_size']} block_size={m['block_size']}")
    ctx = [s - q for s, q in zip(m["seq_lens"], m["query_lens"])]
    print(f"  query_lens={m['query_lens']} ctx_lens={ctx} seq_lens={m['seq_lens']} scale={m['scale']:.6g} "
          f"softcap={m['softcap']} sliding_window={m['sliding_window']} alibi={m['alibi']} sinks={m['sinks']}")
    print(f"  values drawn from the {m['value_range']!r} range; unused cache slots hold {m['poison']}")


def rebuild(stored, v, device):
    """A recorded argument: a tensor view of a saved storage, a tuple/list, a dtype, or a plain value."""
    if isinstance(v, dict) and "__tensor__" in v:
        raw = stored[f"call.storage{v['__tensor__']}"].to(device if v["device"] != "cpu" else "cpu")
        return torch.empty(0, dtype=getattr(torch, v["dtype"]), device=raw.device).set_(
            raw.untyped_storage(), v["offset"], v["size"], v["stride"])
    if isinstance(v, dict) and "__tuple__" in v:
        return tuple(rebuild(stored, x, device) for x in v["__tuple__"])
    if isinstance(v, dict) and "__list__" in v:
        return [rebuild(stored, x, device) for x in v["__list__"]]
    if isinstance(v, dict) and "__dtype__" in v:
        return getattr(torch, v["__dtype__"])
    if isinstance(v, dict) and "__dict__" in v:
        return {k: rebuild(stored, x, device) for k, x in v["__dict__"].items()}
    return v


def kwargs_of(stored, device):
    """The call's arguments by name; arguments that shared a storage share the rebuilt one (a cache written
    through one view and read through another), and so do ``CACHES``, the key and value caches' views."""
    seen = {}

    def view(v):
        if isinstance(v, dict) and "__tensor__" in v:
            key = v["__tensor__"]
            if key not in seen:
                raw = stored[f"call.storage{key}"]
                seen[key] = raw.to(device) if v["device"] != "cpu" else raw
            base = seen[key]
            return torch.empty(0, dtype=getattr(torch, v["dtype"]), device=base.device).set_(
                base.untyped_storage(), v["offset"], v["size"], v["stride"])
        if isinstance(v, dict) and "__tuple__" in v:
            return tuple(view(x) for x in v["__tuple__"])
        if isinstance(v, dict) and "__list__" in v:
            return [view(x) for x in v["__list__"]]
        return rebuild(stored, v, device)

    out = {k: view(v) for k, v in SPEC["kwargs"].items()}
    CACHES[:] = [view(v) for v in SPEC.get("cache_views") or ()]
    return out


CACHES = []  # the key and value caches as the adapter saw them (views of the call's storages), for the writers


def call_kernel(kw):
    """The kernel call exactly as kvfuzz's adapter made it (its ``run``)."""
    fam = META["family"]
    if fam in ("triton", "sglang", "module"):
        import importlib

        import numpy as np

        module, name = META["kernel"]
        fn = getattr(importlib.import_module(module), name)
        if "tile_scheduler_metadata" in kw:  # FlashMLA's: an empty FlashMLASchedMeta the first call fills,
            # made as the adapter and vLLM's FlashMLAMetadataBuilder make it: get_mla_metadata(cache_seqlens,
            # q_len * num_heads, 1 (MQA), is_fp8_kvcache)[0]
            get_mla_metadata = importlib.import_module(module).get_mla_metadata
            q = kw["q"]
            kw["tile_scheduler_metadata"] = get_mla_metadata(kw["cache_seqlens"], q.shape[1] * q.shape[2], 1,
                                                             is_fp8_kvcache=kw["is_fp8_kvcache"])[0]
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison
            ret = fn(**kw)
    out = kw[SPEC["output_kwarg"]] if SPEC["output_kwarg"] else (ret[0] if isinstance(ret, tuple) else ret)
    return out.reshape(SPEC["output_shape"])


def attention(t, dtype):
    """Plain-torch attention over the dense per-sequence q/k/v: fp64 (the reference) or naively in the batch
    dtype (scores in the dtype, softmax accumulated in fp32, P@V in the dtype: FlashAttention's out_pt)."""
    m = META
    q_all, k_all, v_all = t["query"], t["keys_ground_truth"], t["values_ground_truth"]
    g = m["num_heads"] // m["num_kv_heads"]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    slopes, sinks = t.get("alibi_slopes"), t.get("sinks")
    out = torch.zeros(sum(m["query_lens"]), m["num_heads"], v_all.shape[-1], dtype=dtype)
    qs = ks = 0
    for ql, sl in zip(m["query_lens"], m["seq_lens"]):
        q = q_all[qs:qs + ql].to(dtype)
        k = k_all[ks:ks + sl].to(dtype).repeat_interleave(g, dim=1)
        v = v_all[ks:ks + sl].to(dtype).repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * m["scale"]
        qpos = (sl - ql) + torch.arange(ql)  # query token j of a sequence with ctx_len c sits at position c + j
        kpos = torch.arange(sl)
        if m["softcap"]:
            s = m["softcap"] * torch.tanh(s.to(acc) / m["softcap"]).to(dtype)
        if slopes is not None:  # ALiBi: slope * (k_pos - q_pos)
            s = s + (slopes.double()[:, None, None] * (kpos[None, None, :] - qpos[None, :, None])).to(dtype)
        masked = kpos[None, :] > qpos[:, None]  # causal
        if m["sliding_window"] is not None:  # a window of W keys: q_pos - W < k_pos <= q_pos
            masked |= kpos[None, :] <= qpos[:, None] - m["sliding_window"]
        s = s.masked_fill(masked[None], float("-inf"))
        if sinks is not None:  # one extra logit per head, dropped after the softmax
            sink = sinks.to(dtype)[:, None, None].expand(-1, ql, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1, dtype=acc)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1, dtype=acc)
        out[qs:qs + ql] = torch.einsum("hqk,khd->qhd", p.to(dtype), v)
        qs, ks = qs + ql, ks + sl
    return out


def report_only():
    show_batch()
    print(f"\n{META['message']}")
    if META["details"]:
        print("recorded details: " + json.dumps(META["details"], indent=1, default=str)[:3000])
    print(f"\nno standalone kernel call in this script: {META['why_not']}")
    print("replay it with kvfuzz: kvfuzz replay " + str(HERE))
    # a caller violation is shown as recorded (1: the case stands); a kernel finding this script cannot call
    # gives no verdict of its own (2), never a claim that the bug reproduces
    return 1 if META["blame"] == "caller" else 2


def main():
    if SPEC is None or META["family"] is None:
        return report_only()
    t = load_file(str(HERE / "tensors.safetensors"))
    TENSORS.update(t)
    device = "cuda" if any(isinstance(v, dict) and v.get("device") == "cuda" for v in SPEC["kwargs"].values()) \
        else "cpu"
    show_batch()
    if device == "cuda" and not torch.cuda.is_available():
        print("error: this reproducer's kernel runs on CUDA and torch sees no CUDA device here", file=sys.stderr)
        return 2
    if META["family"].endswith("flashinfer"):
        import importlib.util

        if importlib.util.find_spec("flashinfer") is None:
            print("error: flashinfer is not installed (pip install flashinfer-python==" +
                  str((META["versions"] or {}).get("flashinfer-python")) + ")", file=sys.stderr)
            return 2
    kw = kwargs_of(t, device)
    n, pads = sum(META["query_lens"]), META.get("num_pad_seqs", 0)
    if pads and SPEC["output_kwarg"]:  # CUDA-graph pad rows (one per pad, after the real rows) start at zero,
        kw[SPEC["output_kwarg"]].view(SPEC["output_shape"])[n:].zero_()  # as kvfuzz's harness zeroes them
    out = call_kernel(kw)
    if device == "cuda":
        torch.cuda.synchronize()
    if pads:  # vLLM's FULL CUDA graphs pad the batch with sequences of seq_len 0 on the null block; the engine
        # drops their rows, but inside the model they flow on: a non-finite one poisons what follows
        pad_rows = out[n:n + pads].detach().cpu()
        print(f"{pads} CUDA-graph pad sequence(s) (seq_len 0, the null block): output rows {n}..{n + pads - 1}")
        if not bool(torch.isfinite(pad_rows).all()):
            print(f"REPRODUCED: {int((~torch.isfinite(pad_rows)).sum())} non-finite elements in the pad rows")
            return 1
        print("pad rows finite")
    out = out[:n].detach().cpu().double()
    ref = attention(t, torch.float64)
    lowp = attention(t, DTYPE).double()
    err = (out - ref).abs()
    naive = 2 * (lowp - ref).abs().amax(dim=-1, keepdim=True)
    naive = torch.where(torch.isfinite(naive), naive, torch.zeros_like(naive))
    envelope = t["envelope"].double()[:n] if "envelope" in t else torch.zeros_like(ref)
    bound = torch.maximum(naive, envelope)
    bad = ~(err <= bound)  # NaN/inf compare false: wrong
    nonfinite = int((~torch.isfinite(out)).sum())
    finite_err = err[torch.isfinite(err)]
    print(f"max |out - ref| = {float(finite_err.max()) if finite_err.numel() else float('nan'):.4g} "
          f"(non-finite output elements: {nonfinite})")
    if bad.any():
        i = tuple(int(x) for x in torch.nonzero(bad)[0])
        print(f"first wrong element [token {i[0]}, head {i[1]}, dim {i[2]}]: out {float(out[i]):.6g}, "
              f"ref {float(ref[i]):.6g}, bound {float(bound[i]):.4g}")
    print(f"bound per element: max(2 * max_d |out_lp - ref| (naive attention in {META['dtype']}), envelope "
          f"(kvfuzz's rounding bound of a correct FlashAttention-style kernel, stored in the file)); "
          f"largest bound {float(bound.max()):.4g}; see kvfuzz docs/tolerance.md")
    print(f"wrong elements: {int(bad.sum())} of {bad.numel()} ({100.0 * float(bad.float().mean()):.3g}%)")
    if bad.any():
        print("REPRODUCED: the kernel's output disagrees with the fp64 reference")
        return 1
    print("not reproduced: the output agrees with the fp64 reference")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except ModuleNotFoundError as e:  # a package the kernel's own package imports: it cannot run here, exit 2
        print(f"error: {e.name} is not installed here (pip install {PIP_NAMES.get(e.name, e.name)}); the reproducer "
              "did not run", file=sys.stderr)
        status = 2
    sys.exit(status)
