#!/usr/bin/env python3
"""Standalone reproducer for torch.flex_paged, written by kvfuzz.

It needs only torch, safetensors and the kernel's own package. Run it from anywhere:
    python standalone.py
Exit status: 1 while the bug reproduces, 0 once the kernel is fixed, 2 when it cannot run here."""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads(
    '{"target": "torch.flex_paged", "family": "flex", "kind": "non-finite output", '
    '"check": "finite output", "blame": "kernel", "message": "non-finite output: 16 elements in 1 (token, '
    'head) rows; first at sequence 0 position 0 (output row 0), head 0, dim 0: nan", '
    '"details": {"path": "eager (cpu)", "kernel": {"outcome": "non-finite", '
    '"oracle": "finite output", "seq": 0, "position": 0, "token": 0, "head": 0, "dim": 0, '
    '"error": "nan", "bound": "nan", "bad_rows": 1, "bad_elements": 16, "bad_tokens": [0], '
    '"message": "non-finite output: 16 elements in 1 (token, head) rows; first at sequence 0 position 0 (output row '
    '0), head 0, dim 0: nan"}, "oracle": {"oracle": "finite output", "seq": 0, "position": 0, '
    '"token": 0, "head": 0, "dim": 0, "error": "nan", "bound": "nan", "bad_rows": 1, '
    '"bad_elements": 16, "bad_tokens": [0], "message": "non-finite output: 16 elements in 1 (token, '
    'head) rows; first at sequence 0 position 0 (output row 0), head 0, dim 0: nan"}}, "why_not": null, '
    '"kernel": null, "dtype": "float32", "num_heads": 1, "num_kv_heads": 1, "head_size": 16, '
    '"block_size": 8, "query_lens": [1], "seq_lens": [1], "scale": 0.25, "softcap": null, '
    '"sliding_window": null, "kv_cache_dtype": "auto", "alibi": false, "sinks": false, '
    '"value_range": "normal", "poison": "nan", "versions": {"python": "3.11.7", "kvfuzz": "0.2.0", '
    '"torch": "2.13.0+cpu", "triton": "3.9.0", "vllm": "0.33.0", "hypothesis": "6.170.17", '
    '"sglang": null, "flashinfer-python": null, "torch_cuda": null, "device": "cpu"}}'
)
SPEC = json.loads(  # None: no call recorded
    '{"kwargs": {"query": {"__tensor__": 0, "dtype": "float32", "size": [1, 1, 1, 16], '
    '"stride": [16, 16, 16, 1], "offset": 0, "device": "cpu"}, "key": {"__tensor__": 1, '
    '"dtype": "float32", "size": [1, 1, 8, 16], "stride": [128, 128, 16, 1], "offset": 0, '
    '"device": "cpu"}, "value": {"__tensor__": 2, "dtype": "float32", "size": [1, 1, 8, 16], '
    '"stride": [128, 128, 16, 1], "offset": 0, "device": "cpu"}, '
    '"block_mask": {"__rebuilt__": "BlockMask"}, "scale": 0.25, "enable_gqa": true, '
    '"kernel_options": null, "score_mod": {"__rebuilt__": "NoneType"}, "block_table": {"__tensor__": 3, '
    '"dtype": "int32", "size": [1, 1], "stride": [1, 1], "offset": 0, "device": "cpu"}, '
    '"seq_lens": {"__tensor__": 4, "dtype": "int32", "size": [1], "stride": [1], "offset": 0, '
    '"device": "cpu"}, "query_start_loc": {"__tensor__": 5, "dtype": "int32", "size": [2], '
    '"stride": [1], "offset": 0, "device": "cpu"}}, "output_kwarg": null, "output_shape": [1, 1, 16], '
    '"cache_views": [{"__tensor__": 1, "dtype": "float32", "size": [1, 1, 8, 16], '
    '"stride": [128, 128, 16, 1], "offset": 0, "device": "cpu"}, {"__tensor__": 2, "dtype": "float32", '
    '"size": [1, 1, 8, 16], "stride": [128, 128, 16, 1], "offset": 0, "device": "cpu"}]}'
)

if META["family"] in ("triton", "sglang", "writer_triton"):
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
    if fam == "flex":
        ret = flex_call(kw)
    out = kw[SPEC["output_kwarg"]] if SPEC["output_kwarg"] else (ret[0] if isinstance(ret, tuple) else ret)
    return out.reshape(SPEC["output_shape"])


def flex_call(kw):
    """torch's PagedAttention + flex_attention as kvfuzz's adapter calls it (kvfuzz/fuzz/targets/torch_flex.py):
    the batch's block table is the page table (page_table, physical_to_logical, capacity, empty_pages set as
    reserve() leaves them), the logical mask (query j of sequence b sees kv positions 0 .. ctx_len + j, the last
    W with a window) converted through it, softcap and ALiBi as score_mod; queries padded to
    [N, H, max_query_len, D]; eager on CPU, torch.compile'd on CUDA."""
    import warnings

    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    m = META
    dev = kw["query"].device
    n, bs = len(m["query_lens"]), m["block_size"]
    query_lens = torch.tensor(m["query_lens"], dtype=torch.int64, device=dev)
    seq_lens = torch.tensor(m["seq_lens"], dtype=torch.int64, device=dev)
    ctx_lens = seq_lens - query_lens
    need = [-(-s // bs) for s in m["seq_lens"]]
    num_pages = kw["key"].shape[2] // bs
    pa = PagedAttention(num_pages, bs, n, device=str(dev))
    used = set()
    for i in range(n):
        pages = kw["block_table"][i, :need[i]].to(device=dev, dtype=torch.int64)
        pa.page_table[i, :need[i]] = pages
        pa.physical_to_logical[i, pages] = torch.arange(need[i], dtype=torch.int64, device=dev)
        pa.capacity[i] = need[i] * bs
        used.update(pages.tolist())
    pa.empty_pages = [p for p in range(num_pages - 1, -1, -1) if p not in used]
    window = m["sliding_window"]

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (q_idx < query_lens[b]) & (kv_idx <= ctx_lens[b] + q_idx)
        if window is not None:
            visible = visible & (kv_idx > ctx_lens[b] + q_idx - window)
        return visible

    qmax = kw["query"].shape[2]
    logical = create_block_mask(mask_mod, n, None, qmax, max(need) * bs, device=str(dev), BLOCK_SIZE=(128, bs))
    block_mask = pa.convert_logical_block_mask(logical, torch.arange(n, device=dev), seq_lens)
    # softcap as a 0-d tensor (a Python float recompiles and fails compiled: kvfuzz docs/findings.md 8)
    cap = None if m["softcap"] is None else torch.tensor(m["softcap"], dtype=torch.float32, device=dev)
    slopes = TENSORS["alibi_slopes"].to(dev) if m["alibi"] else None
    score_mod = None
    if cap is not None or slopes is not None:
        def logical_score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score + slopes[h] * (kv_idx - ctx_lens[b] - q_idx)
            return score

        score_mod = pa.get_score_mod(logical_score_mod, seq_lens)
    fn = torch.compile(flex_attention) if dev.type == "cuda" else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        with torch._dynamo.config.patch(recompile_limit=10_000, accumulated_recompile_limit=10_000,
                                        fail_on_recompile_limit_hit=True):
            out = fn(kw["query"], kw["key"], kw["value"], score_mod=score_mod, block_mask=block_mask,
                     scale=kw["scale"], enable_gqa=kw["enable_gqa"], kernel_options=kw["kernel_options"])
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(m["query_lens"]))
    j = torch.cat([torch.arange(q) for q in m["query_lens"]])
    return out[seq.to(dev), :, j.to(dev)]


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
    out = call_kernel(kwargs_of(t, device))
    if device == "cuda":
        torch.cuda.synchronize()
    n = sum(META["query_lens"])
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
    sys.exit(main())
