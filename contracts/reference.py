"""The fp64 reference: causal paged attention computed on the logical (un-paged) keys and values.

Query token ``j`` of sequence ``i`` (position ``ctx_len + j``) attends to positions ``0 .. ctx_len + j``;
query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (vLLM's GQA grouping). This is the math
every vLLM paged kernel implements (e.g. vllm/v1/attention/ops/prefix_prefill.py, _fwd_kernel).
"""

from __future__ import annotations

import torch

from .batch import Batch
from .data import BatchData


def _attend(batch: Batch, data: BatchData, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=dtype)
    g = batch.gqa_ratio
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    for i in range(batch.num_seqs):  # one vectorized block per sequence (not per token)
        q = data.query[qsl[i] : qsl[i + 1]].to(dtype)
        k = data.keys[ssl[i] : ssl[i + 1]].to(dtype).repeat_interleave(g, dim=1)
        v = data.values[ssl[i] : ssl[i + 1]].to(dtype).repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        qpos = batch.ctx_lens[i] + torch.arange(batch.query_lens[i])
        kpos = torch.arange(batch.seq_lens[i])
        scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
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
