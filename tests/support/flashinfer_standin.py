"""A stand-in for the ``flashinfer`` package on machines without it (this CPU machine): the wrapper classes and
``append_paged_kv_cache`` by their 0.7.2.post1 signatures (flashinfer/decode.py, flashinfer/prefill.py,
flashinfer/page.py), so the guard's hooks and the targets' calls can be exercised without CUDA.

``standin_flashinfer(compute=False)``: plan()/run() record their call and compute nothing (run() returns None),
for tests of what reaches the guard. ``compute=True``: NOT FlashInfer: run() computes what FlashInfer's
documented contract says from the page lists it was planned with (kv_len from ``get_seq_lens``, keys at
``indices[indptr[i] + p // page_size]``, causal with the queries at the end of each sequence, ``window_left``,
``logits_soft_cap``, ``sm_scale``, fp8 ``k_scale``/``v_scale``) in fp32 on the CPU, and append_paged_kv_cache
writes rows where its lists put them, so kvfuzz's whole property (caller checks, kernel, reference) runs on
FlashInfer's calls. It follows whatever lists it gets: a call with wrong lists gives a wrong answer, as the
real kernel would."""

from __future__ import annotations

import math
import sys
import types

import torch

from kvfuzz.contracts.caches.flashinfer_layouts import FlashInferLayout, unpack_paged_kv_cache


def _seq_lens(indptr, last, page_size):
    pages = (indptr[1:] - indptr[:-1]).clamp(min=0)
    return (pages - 1).clamp(min=0) * page_size + last


def attend(plan: dict, q: torch.Tensor, paged_kv_cache, kv_layout: str, k_scale=None, v_scale=None) -> torch.Tensor:
    """FlashInfer's paged attention by its contract (module docstring); ``plan``: plan()'s arguments by the
    decode names (indptr, indices, last_page_len, qo_indptr or None, num_qo_heads, num_kv_heads, window_left,
    logits_soft_cap, sm_scale)."""
    kc, vc = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    lay = FlashInferLayout(kv_layout)
    page_size = lay.dims(kc)[1]  # run() reads it from the cache
    ptr, idx = plan["indptr"].long().cpu(), plan["indices"].long().cpu()
    kv_lens = _seq_lens(ptr, plan["last_page_len"].long().cpu(), page_size)
    n = len(kv_lens)
    qo = plan.get("qo_indptr")
    qo = torch.arange(n + 1) if qo is None else qo.long().cpu()
    group = plan["num_qo_heads"] // plan["num_kv_heads"]
    scale = plan.get("sm_scale") or 1.0 / math.sqrt(q.shape[-1])
    cap, window = plan.get("logits_soft_cap") or 0.0, plan.get("window_left", -1)
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i in range(n):
        m, kv = int(qo[i + 1] - qo[i]), int(kv_lens[i])
        if m == 0:
            continue
        pos = torch.arange(kv)
        slots = idx[ptr[i] + pos // page_size] * page_size + pos % page_size
        k, v = lay.gather(kc, vc, slots.to(kc.device))
        k, v = k.float().cpu() * (k_scale or 1.0), v.float().cpu() * (v_scale or 1.0)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows = q[int(qo[i]):int(qo[i + 1])].float().cpu()
        s = torch.einsum("mhd,nhd->hmn", rows, k) * scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        qpos = kv - m + torch.arange(m)
        masked = pos[None, :] > qpos[:, None]
        if window is not None and window >= 0:
            masked |= pos[None, :] < qpos[:, None] - window
        p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1)
        out[int(qo[i]):int(qo[i + 1])] = torch.einsum("hmn,nhd->mhd", p, v)
    return out.to(q.dtype)


def append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
           kv_last_page_len, kv_layout="NHD") -> None:
    """append_paged_kv_cache's documented effect: row ``r`` to position ``positions[r]`` of sequence
    ``batch_indices[r]`` through the page lists."""
    kc, vc = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    lay = FlashInferLayout(kv_layout)
    ps = lay.dims(kc)[1]
    ptr, idx = kv_indptr.long(), kv_indices.long()
    pos, seq = positions.long(), batch_indices.long()
    slots = idx[ptr[seq] + pos // ps] * ps + pos % ps
    lay.write(kc, vc, slots, append_key, append_value)


def standin_flashinfer(compute: bool = False) -> types.ModuleType:
    """A module with FlashInfer's wrapper classes and append_paged_kv_cache, by their 0.7 signatures (module
    docstring); ``calls`` lists what was called."""
    m = types.ModuleType("flashinfer_standin")
    m.__version__ = "standin"
    calls = []

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
            self._kv_layout = kv_layout
            self.use_tensor_cores = use_tensor_cores

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                 pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
                 kv_data_type=None, data_type=None, sm_scale=None):
            calls.append("decode.plan" + ("(tensor cores)" if self.use_tensor_cores else ""))
            self._plan = dict(indptr=indptr, indices=indices, last_page_len=last_page_len, qo_indptr=None,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, window_left=window_left,
                              logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False):
            calls.append("decode.run")
            if compute:
                return attend(self._plan, q, paged_kv_cache, self._kv_layout, k_scale, v_scale)

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD"):
            self._kv_layout = kv_layout

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
                 causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16",
                 kv_data_type=None):
            calls.append("prefill.plan")
            self._plan = dict(indptr=paged_kv_indptr, indices=paged_kv_indices, last_page_len=paged_kv_last_page_len,
                              qo_indptr=qo_indptr, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                              window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False):
            calls.append("prefill.run")
            if compute:
                return attend(self._plan, q, paged_kv_cache, self._kv_layout, k_scale, v_scale)

    def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                              kv_indptr, kv_last_page_len, kv_layout="NHD"):
        calls.append("append")
        if compute:
            append(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                   kv_last_page_len, kv_layout)

    m.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    m.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    m.append_paged_kv_cache = append_paged_kv_cache
    m.calls = calls
    return m


def install_standin(monkeypatch, compute: bool = True) -> types.ModuleType:
    """Make ``import flashinfer`` return a computing stand-in for this test, with a small workspace."""
    from kvfuzz.fuzz.targets import flashinfer as targets

    m = standin_flashinfer(compute)
    monkeypatch.setitem(sys.modules, "flashinfer", m)
    monkeypatch.setattr(targets, "WORKSPACE_BYTES", 1024)
    return m
