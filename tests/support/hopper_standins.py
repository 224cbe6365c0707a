"""Torch stand-ins for the compiled Hopper ops behind vLLM's FlashAttention 3 and FlashMLA wrappers, so their real
Python wrappers run on a CPU: ``torch.ops._vllm_fa3_C.fwd`` / ``get_scheduler_metadata`` (called by
vllm/vllm_flash_attn/flash_attn_interface.py) and ``torch.ops._flashmla_C.dense_decode_fwd`` (called by
vllm/third_party/flashmla/flash_mla_interface.py).

Each stand-in takes the op's positional arguments in the compiled schema's order (read off the ``.so`` files of
vLLM 0.33.0), asserts what the extension checks (dtypes, shapes, int32 indices; FA3: bf16 ``s_aux``, descales
``[N, Hkv]``, a ``scheduler_metadata`` made for this very batch) and computes paged attention in fp64 from
exactly those arguments: the block table, ``cu_seqlens_q``, ``seqused_k``/``seqlens_k``, the window
``(left, right)``, softcap and sinks as FlashAttention defines them. A wrong argument either trips an assertion
or changes the output, which the test compares with kvfuzz's own fp64 reference.

:func:`install` loads the real wrapper files (by path, from the installed vllm: their packages' ``__init__``
refuse to import without the extensions) and registers them, with the stand-ins, under the module names vLLM's
callers and tests import (``vllm.vllm_flash_attn``, ``vllm.v1.attention.ops.flashmla``, ...), through pytest's
``monkeypatch`` (everything is undone after the test).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import attrs
import torch

from kvfuzz.fuzz.targets.base import Availability
from kvfuzz.fuzz.targets.triton_runtime import module_file, prepare_triton_runtime
from kvfuzz.fuzz.targets.vllm_flash_attn import VllmFlashAttn2Varlen, VllmFlashAttn4Varlen, VllmFlashAttnVarlen
from kvfuzz.fuzz.targets.vllm_mla import VllmFlashMlaDecode

#: What the stand-ins saw: the last call's arguments by name, and every scheduler_metadata they handed out.
SEEN: dict = {"fwd": [], "sched": {}, "mla": [], "fa2": [], "fa4": []}


def _attend(q, k_rows, v_rows, scale, *, left=-1, right=0, causal=True, softcap=0.0, sink=None, alibi=None,
            p_fp8=False, compute=None):
    """fp64 attention of ``q [s_q, H, D]`` over ``k_rows/v_rows [L, Hkv, *]``, the query rows the last s_q
    positions; ``alibi`` fp32 ``[H]`` slopes: FlashAttention's bias ``-slope * |pos_q - pos_k|``; ``p_fp8``: P goes
    into P@V as FA3's fp8 forward hands it over, ``exp(s - m) * 2**8`` rounded to e4m3 (the row sum unrounded);
    ``compute``: the dtype the kernel computes in (FA4's SM90 fp8-KV path: fp16), the query narrowed to it and P
    rounded to it before P@V (the row sum unrounded); returns ``(out [s_q, H, Dv], lse [H, s_q])``."""
    if compute is not None:
        q = q.to(compute)
    s_q, h, _ = q.shape
    n_k, hkv = k_rows.shape[0], k_rows.shape[1]
    g = h // hkv
    k = k_rows.double().repeat_interleave(g, dim=1)  # [L, H, D]
    v = v_rows.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(s_q)[:, None] + (n_k - s_q)
    j = torch.arange(n_k)[None, :]
    if alibi is not None:
        s = s - alibi.double()[:, None, None] * (pos - j).abs()[None]
    visible = torch.ones(s_q, n_k, dtype=torch.bool)
    if causal:
        visible &= j <= pos
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0 and not causal:
        visible &= j <= pos + right
    s = s.masked_fill(~visible[None], float("-inf"))
    v = torch.where(visible.any(dim=0)[:, None, None], v, torch.zeros_like(v))  # keys no query sees: never loaded
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.double()[:, None, None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    if sink is not None:
        den = den + torch.exp(sink.double()[:, None, None] - m)
    if p_fp8:  # hopper/softmax.h Max_offset = 8, convert_type_out to e4m3 before the P@V GEMM
        p = (p * 2.0**8).to(torch.float8_e4m3fn).double() / 2.0**8
    if compute is not None:  # cute/flash_fwd_sm90.py fp8_kv_dequant: "compute is always fp16", P too
        p = p.to(compute).double()
    w = torch.where(den > 0, p / den.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", w, v)  # a row with no visible key: 0 (FlashAttention's convention)
    return out, (torch.log(den) + m).squeeze(-1)


def _rows(cache, table_row, n):
    """The first ``n`` token rows of one sequence through its block table row (``cache [NB, BS, Hkv, D]``)."""
    bs = cache.shape[1]
    blocks = table_row[: -(-n // bs)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def fa3_fwd(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
            max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
            seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left,
            window_size_right, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
            s_aux, cp_world_size, cp_rank, cp_tot_seqused_k):
    """``_vllm_fa3_C::fwd`` on a paged cache, as a torch computation with the extension's checks."""
    SEEN["fwd"].append(dict(locals()))
    fp8 = q.dtype == torch.float8_e4m3fn
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn) and k.dtype == q.dtype \
        and v.dtype == q.dtype, "query and key must have the same dtype"
    out_type = torch.bfloat16 if fp8 else q.dtype
    assert out is None or out.dtype == out_type, \
        "For FP16/BF16 input, output must have the same dtype as inputs. For FP8 input, output must have dtype BF16"
    assert q.shape[-1] % (16 if fp8 else 8) == 0, "head_size should be a multiple of 16 (fp8) or 8"
    assert page_table is not None and page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert cu_seqlens_q.dtype == torch.int32 and seqused_k.dtype == torch.int32
    assert cu_seqlens_k is None and k_new is None and kv_batch_idx is None and leftpad_k is None
    n, (nb, bs, hkv, d), h = len(seqused_k), k.shape, q.shape[1]
    assert q.dim() == 3 and q.shape[2] == d and h % hkv == 0 and k.stride(-1) == 1 and v.shape == k.shape
    assert page_table.shape[0] == n and len(cu_seqlens_q) == n + 1
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        assert t is None or tuple(t.shape) == (n, hkv), f"{name} must have shape (batch_size, num_heads_k)"
    if s_aux is not None:
        assert s_aux.dtype == torch.bfloat16, "We only support bf16 dtype for S aux."
        assert tuple(s_aux.shape) == (h,), "s_aux must have shape (num_heads)"
    if scheduler_metadata is not None:
        assert scheduler_metadata.dtype == torch.int32
        made = SEEN["sched"][scheduler_metadata.data_ptr()]
        assert made["batch_size"] == n and made["max_seqlen_q"] == max_seqlen_q \
            and made["max_seqlen_k"] == max_seqlen_k and made["num_heads"] == h and made["num_heads_k"] == hkv \
            and made["page_size"] == bs and made["num_splits"] == num_splits \
            and (made["window_size_left"], made["window_size_right"]) == (window_size_left, window_size_right), \
            f"scheduler_metadata made for another batch: {made}"
    qsl, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert max_seqlen_q >= max(b - a for a, b in zip(qsl, qsl[1:])) and max_seqlen_k >= max(lens)
    # rows no sequence owns (CUDA-graph pad tokens past cu_seqlens_q[-1]) keep what `out` held: FA3 writes none
    res = out.double() if out is not None else torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty((h, q.shape[0]), dtype=torch.float32)
    for i in range(n):
        a, b = qsl[i], qsl[i + 1]
        if a == b:  # a query_len-0 sequence (a CUDA-graph pad): no query row, nothing computed
            continue
        qi = q[a:b].double()
        ki, vi = _rows(k, page_table[i], lens[i]).double(), _rows(v, page_table[i], lens[i]).double()
        if fp8:  # the descales [N, Hkv]: per sequence and kv head (a query head's is its kv head's)
            qi = qi * q_descale[i].double().repeat_interleave(h // hkv)[None, :, None]
            ki, vi = ki * k_descale[i].double()[None, :, None], vi * v_descale[i].double()[None, :, None]
        o, ls = _attend(qi, ki, vi, softmax_scale, left=window_size_left, right=window_size_right, causal=is_causal,
                        softcap=softcap, sink=s_aux, p_fp8=fp8)
        res[a:b], lse[:, a:b] = o, ls
    if out is None:
        out = torch.empty(q.shape, dtype=out_type)
    out.copy_(res.to(out_type))
    return [out, lse, torch.empty(0), torch.empty(0)]


def fa3_get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                               qkv_dtype, seqused_k, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                               leftpad_k, page_size, max_seqlen_k_new, is_causal, window_size_left,
                               window_size_right, has_softcap, num_splits, pack_gqa, sm_margin):
    """``_vllm_fa3_C::get_scheduler_metadata``: an int32 tensor of FA3's size, its arguments remembered."""
    t = torch.zeros(1 + -(-batch_size // 4) * 4 * 4, dtype=torch.int32)
    SEEN["sched"][t.data_ptr()] = dict(locals())
    return t


def fa2_varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, return_softmax, num_splits, gen):
    """``_vllm_fa2_C::varlen_fwd`` on a paged cache (schema read off the ``.so``), with mha_varlen_fwd's checks and
    its argument rewrites (a window past ``max_seqlen_k`` is none; one query token without ALiBi is not causal)."""
    SEEN["fa2"].append(dict(locals()))
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype"
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert cu_seqlens_q.dtype == torch.int32 and seqused_k.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    n, (nb, bs, hkv, d), h = len(seqused_k), k.shape, q.shape[1]
    assert bs % 16 == 0, "Paged KV cache block size must be divisible by 16"
    assert d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8"
    assert d <= 256, "FlashAttention forward only supports head dimension at most 256"
    assert h % hkv == 0 and block_table.shape[0] == n and len(cu_seqlens_q) == n + 1
    assert num_splits <= 1, "num_splits > 1 is not supported for varlen paged KV"
    if alibi_slopes is not None:
        assert alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32"
        assert tuple(alibi_slopes.shape) in ((h,), (n, h))
    if max_seqlen_q == 1 and alibi_slopes is None:
        is_causal = False
    if is_causal:
        window_size_right = 0
    if window_size_left >= max_seqlen_k:
        window_size_left = -1
    if window_size_right >= max_seqlen_k:
        window_size_right = -1
    qsl, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    res = out.double() if out is not None else torch.empty(q.shape, dtype=torch.float64)
    lse = torch.full((h, q.shape[0]), float("inf"), dtype=torch.float32)
    for i in range(n):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i])
        o, ls = _attend(q[a:b], _rows(k, block_table[i], lens[i]), _rows(v, block_table[i], lens[i]), softmax_scale,
                        left=window_size_left, right=window_size_right, causal=is_causal,
                        softcap=softcap, alibi=slopes)
        res[a:b], lse[:, a:b] = o, ls
    out = torch.empty_like(q) if out is None else out
    out.copy_(res.to(q.dtype))
    return [out, lse]


def fa4_flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, page_table=None, gather_kv_indices=None, gather_kv_valid_length=None,
                       softmax_scale=None, causal=False, dynamic_causal=None, softcap=None, window_size_left=None,
                       window_size_right=None, num_splits=1, return_lse=False, out=None, learnable_sink=None,
                       mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_tensor_leading_dims=None,
                       q_descale=None, k_descale=None, v_descale=None, output_scale=None, fp8_kv_dequant=False):
    """``vllm.vllm_flash_attn.cute.interface._flash_attn_fwd`` (FA4) on a paged cache, with its checks on SM90
    (``_validate_head_dims``, the dtypes, ``page_table``, ``learnable_sink``, descales only for fp8) and its
    fp8-KV dequant (k/v e4m3 times ``k_descale``/``v_descale [N, Hkv]``, computed in fp16 as the kernel does)."""
    SEEN["fa4"].append(dict(locals()))
    assert page_table is not None and page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
    n, (nb, bs, hkv, d), h = len(seqused_k), k.shape, q.shape[1]
    assert page_table.shape[0] == n and v.shape == k.shape and h % hkv == 0
    for t in (cu_seqlens_q, seqused_k):
        assert t.dtype == torch.int32 and t.stride(0) == 1
    if fp8_kv_dequant:
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == torch.float8_e4m3fn
        assert tuple(k_descale.shape) == (n, hkv) and tuple(v_descale.shape) == (n, hkv) and q_descale is None
        assert bs == 64 and d == 512, "FA4 SM90 fp8-KV-dequant: page_size == tile_n (64) at head size 512"
    else:
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert q_descale is None and k_descale is None and v_descale is None
    alignment = 16 // v.element_size()
    assert 8 <= d <= 512 and d % alignment == 0, f"head_dim {d} is not supported on SM90"
    if learnable_sink is not None:
        assert tuple(learnable_sink.shape) == (h,) and learnable_sink.dtype in (torch.float16, torch.bfloat16,
                                                                               torch.float32)
    qsl, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    kd = k.float() * (k_descale[0, 0] if fp8_kv_dequant else 1.0)
    vd = v.float() * (v_descale[0, 0] if fp8_kv_dequant else 1.0)
    res = out.double()
    for i in range(n):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        o, _ = _attend(q[a:b], _rows(kd, page_table[i], lens[i]), _rows(vd, page_table[i], lens[i]), softmax_scale,
                       left=-1 if window_size_left is None else window_size_left,
                       right=-1 if window_size_right is None else window_size_right, causal=causal,
                       softcap=softcap or 0.0, sink=learnable_sink,
                       compute=torch.float16 if fp8_kv_dequant else None)
        res[a:b] = o
    out.copy_(res.to(out.dtype))
    return out, None, None, None


def flashmla_dense_decode_fwd(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                              tile_scheduler_metadata, num_splits, out_):
    """``_flashmla_C::dense_decode_fwd``: ``q [B, s_q, H, D]``, ``kcache [NB, BS, 1, D]``, the value the first
    ``head_size_v`` dims of each row; returns ``(out [B, s_q, H, Dv], lse [B, H, s_q], metadata, splits)``."""
    SEEN["mla"].append(dict(locals()))
    assert q.dtype in (torch.float16, torch.bfloat16) and kcache.dtype == q.dtype
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert seqlens_k.dtype == torch.int32, "seqlens_k must have dtype int32"
    b, s_q, h, d = q.shape
    assert kcache.dim() == 4 and kcache.shape[2] == 1 and kcache.shape[3] == d and head_size_v == 512
    assert tuple(block_table.shape[:1]) == (b,) and tuple(seqlens_k.shape) == (b,)
    out = torch.empty((b, s_q, h, head_size_v), dtype=q.dtype)
    lse = torch.empty((b, h, s_q), dtype=torch.float32)
    for i, n in enumerate(seqlens_k.tolist()):
        if n == 0:  # a CUDA-graph pad (seq_len 0): a zero row (what the real kernel writes: benchmarks/gpu_padding.sh)
            out[i], lse[i] = 0, float("inf")
            continue
        rows = _rows(kcache, block_table[i], n)
        o, ls = _attend(q[i], rows, rows[..., :head_size_v], softmax_scale, causal=is_causal)
        out[i], lse[i] = o.to(q.dtype), ls
    meta = torch.zeros((1, 8), dtype=torch.int32) if tile_scheduler_metadata is None else tile_scheduler_metadata
    splits = torch.zeros((b + 1,), dtype=torch.int32) if num_splits is None else num_splits
    return out, lse, meta, splits


def _load(name: str, dotted_file: str, monkeypatch) -> types.ModuleType:
    """The installed vllm's file of module ``dotted_file``, executed as module ``name`` (registered)."""
    path = module_file(dotted_file)
    assert path is not None, f"the installed vllm has no {dotted_file}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


def install_fa3(monkeypatch) -> types.ModuleType:
    """vLLM's real flash_attn_interface.py over the FA3 stand-ins, registered as ``vllm.vllm_flash_attn`` and
    ``vllm.vllm_flash_attn.flash_attn_interface``; returns the interface module."""
    SEEN["fwd"].clear()
    SEEN["sched"].clear()
    prepare_triton_runtime()  # in case anything below imports vllm (which imports triton)
    ns = torch.ops._vllm_fa3_C
    monkeypatch.setattr(ns, "fwd", fa3_fwd, raising=False)
    monkeypatch.setattr(ns, "get_scheduler_metadata", fa3_get_scheduler_metadata, raising=False)
    # the package first: the interface's `from . import _vllm_fa2_C` (ImportError, caught there) then finds it
    # instead of importing vllm and the real package, whose __init__ refuses to import without an extension
    pkg = types.ModuleType("vllm.vllm_flash_attn")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", pkg)
    iface = _load("vllm.vllm_flash_attn.flash_attn_interface", "vllm.vllm_flash_attn.flash_attn_interface",
                  monkeypatch)
    assert not (iface.FA2_AVAILABLE or iface.FA3_AVAILABLE)  # the compiled ops are the stand-ins
    for attr in ("flash_attn_varlen_func", "get_scheduler_metadata", "is_fa_version_supported",
                 "fa_version_unsupported_reason"):
        setattr(pkg, attr, getattr(iface, attr))
    return iface


def install_fa2_fa4(monkeypatch) -> types.ModuleType:
    """:func:`install_fa3` plus the FA2 stand-in as ``torch.ops._vllm_fa2_C.varlen_fwd`` and the FA4 stand-in as
    ``vllm.vllm_flash_attn.cute.interface._flash_attn_fwd`` (the module the wrapper imports it from), with
    ``torch.cuda.get_device_capability`` an SM90's; returns the interface module."""
    iface = install_fa3(monkeypatch)
    SEEN["fa2"].clear()
    SEEN["fa4"].clear()
    monkeypatch.setattr(torch.ops._vllm_fa2_C, "varlen_fwd", fa2_varlen_fwd, raising=False)
    # the FA4 stand-in is SM90's: the wrapper asks the device's major for its fp8-KV path (fa4_fp8_kv_dequant)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cute = types.ModuleType("vllm.vllm_flash_attn.cute")
    cute.__path__ = []
    interface = types.ModuleType("vllm.vllm_flash_attn.cute.interface")
    interface._flash_attn_fwd = fa4_flash_attn_fwd
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.cute.interface", interface)
    return iface


def install_flashmla(monkeypatch) -> types.ModuleType:
    """vLLM's real flash_mla_interface.py over the FlashMLA stand-in, registered under its own name and as
    ``vllm.v1.attention.ops.flashmla`` (the wrapper module vLLM's backend and tests import from); returns it."""
    SEEN["mla"].clear()
    prepare_triton_runtime()  # the interface's `import vllm._flashmla_C` imports vllm, which imports triton
    monkeypatch.setattr(torch.ops._flashmla_C, "dense_decode_fwd", flashmla_dense_decode_fwd, raising=False)
    monkeypatch.setitem(sys.modules, "vllm._flashmla_C", types.ModuleType("vllm._flashmla_C"))
    iface = _load("vllm.third_party.flashmla.flash_mla_interface", "vllm.third_party.flashmla.flash_mla_interface",
                  monkeypatch)
    ops = types.ModuleType("vllm.v1.attention.ops.flashmla")
    ops.flash_mla_with_kvcache, ops.get_mla_metadata = iface.flash_mla_with_kvcache, iface.get_mla_metadata
    ops.is_flashmla_dense_supported = lambda: (True, None)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.flashmla", ops)
    return iface


class StandInFA3(VllmFlashAttnVarlen):
    """``vllm.flash_attn_varlen`` on a CPU: vLLM's real wrapper over the stand-in ops (after :func:`install_fa3`)."""

    name = "test.fa3_standin"
    capabilities = attrs.evolve(VllmFlashAttnVarlen.capabilities, devices=("cpu",))

    def availability(self):
        return Availability(True, "vLLM's flash_attn_interface over torch stand-ins", "cpu")


class StandInFA2(VllmFlashAttn2Varlen):
    """``vllm.flash_attn_varlen_fa2`` on a CPU: vLLM's real wrapper over the FA2 stand-in (:func:`install_fa2_fa4`)."""

    name = "test.fa2_standin"
    capabilities = attrs.evolve(VllmFlashAttn2Varlen.capabilities, devices=("cpu",))

    def availability(self):
        return Availability(True, "vLLM's flash_attn_interface over a torch stand-in for _vllm_fa2_C", "cpu")


class StandInFA4(VllmFlashAttn4Varlen):
    """``vllm.flash_attn_varlen_fa4`` on a CPU: vLLM's real wrapper over the FA4 stand-in (:func:`install_fa2_fa4`)."""

    name = "test.fa4_standin"
    capabilities = attrs.evolve(VllmFlashAttn4Varlen.capabilities, devices=("cpu",))

    def availability(self):
        return Availability(True, "vLLM's flash_attn_interface over a torch stand-in for FA4's _flash_attn_fwd", "cpu")


class StandInFlashMla(VllmFlashMlaDecode):
    """``vllm.flashmla_decode`` on a CPU: vLLM's real FlashMLA interface over the stand-in op (after
    :func:`install_flashmla`)."""

    name = "test.flashmla_standin"
    capabilities = attrs.evolve(VllmFlashMlaDecode.capabilities, devices=("cpu",))

    def availability(self):
        return Availability(True, "vLLM's flash_mla_interface over a torch stand-in", "cpu")


__all__ = ["StandInFA2", "StandInFA3", "StandInFA4", "StandInFlashMla", "SEEN", "fa2_varlen_fwd", "fa3_fwd",
           "fa3_get_scheduler_metadata", "fa4_flash_attn_fwd", "flashmla_dense_decode_fwd", "install_fa2_fa4",
           "install_fa3", "install_flashmla"]
