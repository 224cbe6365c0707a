"""FlashInfer's arithmetic emulated in torch on the CPU (NOT FlashInfer): what flashinfer-python 0.7.2.post1's FA2
batch prefill computes for fp16/bf16 queries over an fp16/bf16 or fp8 cache, step by step, so that kvfuzz's
envelope can be checked against it without a GPU (tests/contracts/test_flashinfer_numerics.py).

Upstream, file by file (the wheel's flashinfer/data/include/flashinfer/...):

- ``attention/prefill.cuh`` ``compute_qk``: fp8 K codes converted to the query dtype (exact: every e4m3/e5m2 value
  is an fp16 value) and ``q . k_code`` on tensor cores, fp32 accumulation; ``k_scale`` never touches K:
  flashinfer/prefill.py ``BatchPrefillWithPagedKVCacheWrapper.run`` folds it into ``sm_scale *= k_scale`` (Python
  float, passed to the kernel as fp32).
- ``attention/variants.cuh`` ``DefaultAttention``: with a soft cap ``c``, ``soft_cap_pre_tanh_scale = sm_scale *
  rcp(c)``, ``LogitsTransform`` = ``math::tanh(logits * soft_cap_pre_tanh_scale)`` (``math.cuh``: PTX
  ``tanh.approx.f32``) and ``sm_scale_log2 = log2e * c``; without one ``sm_scale_log2 = sm_scale * log2e``.
- ``update_mdo_states``: online softmax over KV tiles, ``p = ex2.approx(s * sm_scale_log2 - m * sm_scale_log2)``,
  the running output and row sum rescaled by ``ex2(m_prev * sl - m_new * sl)``.
- ``compute_sfm_v``: P cast to the query dtype (``s_frag_f16``), the row sum ``d`` accumulated from that rounded
  P (``m16k16_rowsum_f16f16f32``), P@V on tensor cores over the V codes (converted exactly), fp32 accumulation.
- the epilogue (``variant_helper.cuh`` ``AttentionVariantBase::OutputTransform``): ``o * rcp(d) * v_scale`` with
  ``v_scale`` 1.0 unless the params have one, which ``BatchPrefillPagedParams`` (default_prefill_params.cuh) does
  not; cast to the output dtype (round to nearest): the output in the value cache's units.
- flashinfer/prefill.py ``run`` (and decode.py's): ``out *= v_scale`` on that fp16/bf16 tensor when ``v_scale``
  is given and not 1.0 (``# TODO(Zihao): fused into kernel``): torch multiplies in fp32 and rounds to the dtype
  again.

Knobs: ``tile`` (keys per KV tile), ``p_rounded`` (False: P kept in fp32 for both sums, the CUDA-core decode's
form), ``rescale_after`` (False: ``v_scale`` applied before the one rounding, a kernel that fuses it; "toward_zero": a
planted defect, the kernel's own rounding truncating),
``tanh_rel`` and ``tanh_sign`` (a relative error on every ``tanh`` result: ``tanh_sign`` +1/-1 for a systematic
one, None for a uniformly random one from ``generator``, or a function of a sequence's ``tanh`` results ``[H, Q, K]``
and values ``[K, H, D]`` giving each result's sign, e.g. :func:`toward_larger_output`)."""

from __future__ import annotations

import math

import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData

F32, F64 = torch.float32, torch.float64
LOG2E = 1.44269504088896340736


def flashinfer_prefill_model(batch: Batch, data: BatchData, *, tile: int = 32, p_rounded: bool = True,
                             rescale_after: bool = True, tanh_rel: float = 0.0, tanh_sign: int | None = 1,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """FlashInfer's output for ``batch`` (no ALiBi, no sinks: FlashInfer's paged wrappers take neither from kvfuzz),
    emulated as the module docstring says; fp64 ``[num_tokens, num_heads, head_size]``."""
    assert batch.alibi_slopes is None and data.sinks is None
    dt, g = batch.torch_dtype, batch.gqa_ratio
    fp8 = batch.fp8_dtype is not None
    sm_scale = (1.0 / math.sqrt(batch.head_size) if batch.sm_scale is None else batch.sm_scale)
    if fp8:
        sm_scale *= batch.k_scale  # run(): sm_scale *= k_scale, a Python float
    sm32 = torch.tensor(sm_scale, dtype=F32)
    cap = batch.softcap
    if cap is not None:
        pre = sm32 * torch.tensor(1.0 / cap, dtype=F32)  # soft_cap_pre_tanh_scale = sm_scale * rcp(c)
        sl = torch.tensor(LOG2E, dtype=F32) * torch.tensor(cap, dtype=F32)
    else:
        sl = sm32 * torch.tensor(LOG2E, dtype=F32)
    keys = data.cache_keys if fp8 else data.keys
    values = data.cache_values if fp8 else data.values
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=F64)
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    for i in range(batch.num_seqs):
        q = data.query[qsl[i]:qsl[i + 1]].to(F32)
        k = keys[ssl[i]:ssl[i + 1]].to(dt).to(F32).repeat_interleave(g, dim=1)  # codes: exact in the dtype
        v = values[ssl[i]:ssl[i + 1]].to(dt).to(F32).repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k)  # fp32 accumulation
        if cap is not None:
            t = torch.tanh((s * pre).to(F64)).to(F32)  # tanh rounded once; tanh.approx's error below
            if tanh_rel:
                if callable(tanh_sign):
                    e = tanh_sign(t, v).to(F64)
                elif tanh_sign is None:
                    e = torch.rand(t.shape, generator=generator, dtype=F64) * 2 - 1
                else:
                    e = torch.full_like(t, float(tanh_sign), dtype=F64)
                t = (t.to(F64) * (1 + tanh_rel * e)).to(F32)
            s = t
        Q, K = q.shape[0], k.shape[0]
        qpos = batch.ctx_lens[i] + torch.arange(Q)
        kpos = torch.arange(K)
        masked = kpos[None, :] > qpos[:, None]
        if batch.sliding_window is not None:
            masked |= kpos[None, :] <= qpos[:, None] - batch.sliding_window
        s = s.masked_fill(masked[None], float("-inf"))
        H = s.shape[0]
        m = torch.full((H, Q, 1), float("-inf"), dtype=F32)
        d = torch.zeros((H, Q, 1), dtype=F32)
        o = torch.zeros((H, Q, v.shape[-1]), dtype=F32)
        for k0 in range(0, K, tile):
            st = s[..., k0:k0 + tile]
            m_new = torch.maximum(m, st.amax(-1, keepdim=True))
            m_scaled = (m_new * sl).clamp_min(-torch.finfo(F32).max)  # the kernel's per-row clamp
            scale = torch.exp2(m * sl - m_scaled)
            d, o = d * scale, o * scale
            p = torch.exp2((st.to(F64) * sl.to(F64) - m_scaled.to(F64)).to(F32))  # one fma, then ex2
            pr = p.to(dt).to(F32) if p_rounded else p
            d = d + pr.sum(-1, keepdim=True)
            o = o + torch.einsum("hqk,khd->hqd", pr, v[k0:k0 + tile])
            m = m_new
        o = o * (1.0 / d)
        if fp8 and batch.v_scale != 1.0:
            vs = torch.tensor(batch.v_scale, dtype=F32)
            if rescale_after == "toward_zero":  # a planted defect: the kernel's rounding truncates
                y = (toward_zero(o, dt).to(F32) * vs).to(dt)
            else:
                y = (o.to(dt).to(F32) * vs).to(dt) if rescale_after else (o * vs).to(dt)
        else:
            y = o.to(dt)
        out[qsl[i]:qsl[i + 1]] = y.permute(1, 0, 2).to(F64)
    return out


def toward_zero(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded to ``dt`` toward zero."""
    y = x.to(dt)
    return torch.where(y.to(F32).abs() > x.abs(), torch.nextafter(y, torch.zeros_like(y)), y)


def toward_larger_output(t: torch.Tensor, v: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Signs ``[H, Q, K]`` for ``tanh_sign`` that move output dim ``dim`` of every row one way: key ``k``'s logit up
    where its value lies above the row's output there (``v_kd > o_d``, ``o`` the exact softmax average of ``t``),
    down where below, so every ``tanh`` error pushes ``o_d`` up (the worst case the envelope's tanh term bounds)."""
    p = torch.softmax(t.to(F64), dim=-1).nan_to_num(0.0)
    vd = v[..., dim].to(F64).T[:, None, :]  # [H, 1, K]
    od = (p * vd).sum(-1, keepdim=True)
    return torch.sign(t.to(F64)) * torch.sign(vd - od)


__all__ = ["flashinfer_prefill_model", "toward_larger_output"]
