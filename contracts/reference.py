"""The fp64 reference: causal paged attention computed on the logical (un-paged) keys and values.

Query token ``j`` of sequence ``i`` (position ``p = ctx_len + j``) attends to positions ``0 .. p``;
query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (vLLM's GQA grouping). This is the math
every vLLM paged kernel implements (e.g. vllm/v1/attention/ops/prefix_prefill.py, _fwd_kernel), with the
optional features in unified_attention's order (vllm/v1/attention/ops/triton_unified_attention.py,
kernel_unified_attention):

    s = scale * q.k  ->  softcap: c * tanh(s / c)  ->  + alibi slope[h] * (k_pos - p)
      ->  mask k_pos > p, and k_pos <= p - sliding_window  ->  softmax over the row plus exp(sink[h])

A sink adds ``exp(sink[h] - m)`` to the denominator and nothing to the numerator. The keys/values of an fp8
cache are already the dequantized ``fp8 * scale`` values (:func:`~kvfuzz.contracts.data.make_batch_data`).
"""

from __future__ import annotations

import torch

from .batch import Batch
from .data import BatchData


def _attend(batch: Batch, data: BatchData, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=dtype)
    g = batch.gqa_ratio
    slopes = batch.alibi_slopes_tensor()
    slopes = None if slopes is None else slopes.to(torch.float64)
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    for i in range(batch.num_seqs):  # one vectorized block per sequence (not per token)
        q = data.query[qsl[i] : qsl[i + 1]].to(dtype)
        k = data.keys[ssl[i] : ssl[i + 1]].to(dtype).repeat_interleave(g, dim=1)
        v = data.values[ssl[i] : ssl[i + 1]].to(dtype).repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        qpos = batch.ctx_lens[i] + torch.arange(batch.query_lens[i])
        kpos = torch.arange(batch.seq_lens[i])
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        if batch.softcap is not None:
            scores = batch.softcap * torch.tanh(scores.to(acc) / batch.softcap).to(dtype)
        if slopes is not None:
            scores = scores + (slopes[:, None, None] * (kpos[None, None, :] - qpos[None, :, None])).to(dtype)
        masked = kpos[None, :] > qpos[:, None]
        if batch.sliding_window is not None:
            masked |= kpos[None, :] <= qpos[:, None] - batch.sliding_window
        scores = scores.masked_fill(masked[None], float("-inf"))
        if data.sinks is not None:  # one extra logit per head, dropped after the softmax
            sink = data.sinks.to(dtype)[:, None, None].expand(-1, scores.shape[1], 1)
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=acc)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1, dtype=acc)
        out[qsl[i] : qsl[i + 1]] = torch.einsum("hqk,khd->qhd", p.to(dtype), v)
    return out


def reference_attention(batch: Batch, data: BatchData) -> torch.Tensor:
    """fp64 ``[num_tokens, num_heads, head_size]``: the exact answer for ``batch`` (the oracle)."""
    return _attend(batch, data, torch.float64)


def same_precision_attention(batch: Batch, data: BatchData) -> torch.Tensor:
    """The same math done naively in ``batch.dtype`` (softmax accumulated in fp32, as torch does), returned
    as fp64. Its distance from :func:`reference_attention` measures how much error the dtype itself costs;
    the tolerance rule (:mod:`kvfuzz.contracts.oracles`) allows a kernel a multiple of it, as
    FlashAttention's tests do (tests/test_flash_attn.py, ``out_pt``)."""
    return _attend(batch, data, batch.torch_dtype).to(torch.float64)
