"""The model of a ``merge_attn_states`` call: attention over one context computed in two parts, each part's output
and log-sum-exp, merged into the output of the whole (vllm/v1/attention/ops/merge_attn_states.py; section 2.2 of
https://arxiv.org/abs/2501.01005).

vLLM merges a *prefix* part (attention over the cached context: the context chunk of MLA's chunked prefill,
vllm/model_executor/layers/attention/mla_attention.py; the DCP-combined context of
vllm/v1/attention/backends/flash_attn.py ``_forward_with_dcp``) with a *suffix* part (attention over the new tokens,
causal among themselves). :func:`attention_parts` computes both in fp64 from a batch's ground truth: for query token
``j`` of sequence ``i`` (position ``ctx_len + j``) the prefix attends to keys ``0 .. ctx_len - 1``, the suffix to
``ctx_len .. ctx_len + j``. A sequence without context has an empty prefix: output 0, log-sum-exp ``-inf``
(FlashAttention 3's convention; FlashAttention 2 returns ``+inf``, which vLLM's merges read as empty too).
:func:`merge_inputs` rounds the parts as a kernel hands them over: outputs to the batch dtype, log-sum-exps to fp32.

Shapes (vLLM's docstring): outputs ``[num_tokens, num_heads, head_size]``, log-sum-exps ``[num_heads, num_tokens]``.
"""

from __future__ import annotations

import attrs
import torch

from .batch import Batch

#: The log-sum-exp of an empty part, by convention: FlashAttention 3's ``-inf`` and FlashAttention 2's ``+inf``
#: (triton_merge_attn_states.py: "FA2 and FA3 have different behavior for when the sum-exp is 0").
EMPTY_LSE = (float("-inf"), float("inf"))


@attrs.frozen
class MergeInputs:
    """The two parts a merge is handed. prefix_output, suffix_output: ``[T, H, D]``; prefix_lse, suffix_lse:
    ``[H, T]``; the dtypes as produced (fp64 from :func:`attention_parts`, the batch dtype and fp32 from
    :func:`merge_inputs`)."""

    prefix_output: torch.Tensor
    prefix_lse: torch.Tensor
    suffix_output: torch.Tensor
    suffix_lse: torch.Tensor


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """fp64 attention of ``q [Q, H, D]`` over ``k/v [K, H, D]`` where ``visible [Q, K]``: ``(out [Q, H, D],
    lse [H, Q])``; a row with no visible key gets output 0 and log-sum-exp ``-inf``."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for an empty row
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.einsum("hqk,khd->qhd", p, v), lse


def attention_parts(batch: Batch, data) -> MergeInputs:
    """The prefix (context) and suffix (new tokens, causal) parts of every query token of ``batch`` in fp64
    (module docstring), from ``data`` (a :class:`~kvfuzz.contracts.model.data.BatchData`). GQA: query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``. Raises ValueError for a batch with a window, ALiBi,
    sinks, a softcap or a latent cache (the merge family declares none of them)."""
    if batch.features or batch.value_head_size is not None:
        raise ValueError(f"attention_parts models plain causal attention; the batch has {list(batch.features)}"
                         + (" and a latent cache" if batch.value_head_size is not None else ""))
    g = batch.num_heads // batch.num_kv_heads
    q_all = data.query.double().cpu()
    k_all = data.keys.double().cpu().repeat_interleave(g, dim=1)
    v_all = data.values.double().cpu().repeat_interleave(g, dim=1)
    t, h, d = q_all.shape
    outs = [torch.zeros((t, h, d), dtype=torch.float64) for _ in range(2)]
    lses = [torch.full((h, t), float("-inf"), dtype=torch.float64) for _ in range(2)]
    qsl, ksl = batch.query_start_loc, batch.seq_start_loc
    for i, (ql, c) in enumerate(zip(batch.query_lens, batch.ctx_lens)):
        q = q_all[qsl[i]:qsl[i + 1]]
        k, v = k_all[ksl[i]:ksl[i] + c + ql], v_all[ksl[i]:ksl[i] + c + ql]
        jq, jk = torch.arange(ql)[:, None], torch.arange(ql)[None, :]
        if c:
            o, lse = _part(q, k[:c], v[:c], torch.ones((ql, c), dtype=torch.bool), batch.scale)
            outs[0][qsl[i]:qsl[i + 1]], lses[0][:, qsl[i]:qsl[i + 1]] = o, lse
        o, lse = _part(q, k[c:], v[c:], jk <= jq, batch.scale)
        outs[1][qsl[i]:qsl[i + 1]], lses[1][:, qsl[i]:qsl[i + 1]] = o, lse
    return MergeInputs(outs[0], lses[0], outs[1], lses[1])


def merge_inputs(batch: Batch, data, empty_lse: float = float("-inf")) -> MergeInputs:
    """:func:`attention_parts` as a kernel hands them to the merge: outputs rounded to ``batch.dtype``,
    log-sum-exps to fp32, an empty part's log-sum-exp ``empty_lse`` (one of :data:`EMPTY_LSE`). Raises ValueError
    for another ``empty_lse``."""
    if not any(empty_lse == e for e in EMPTY_LSE):
        raise ValueError(f"empty_lse must be -inf (FlashAttention 3) or +inf (FlashAttention 2), got {empty_lse}")
    parts = attention_parts(batch, data)
    dt = batch.torch_dtype

    def lse(x: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isinf(x), torch.full_like(x, empty_lse), x).float()

    return MergeInputs(parts.prefix_output.to(dt), lse(parts.prefix_lse), parts.suffix_output.to(dt),
                       lse(parts.suffix_lse))


def is_empty_lse(x: torch.Tensor) -> torch.Tensor:
    """Where a log-sum-exp marks an empty part (either infinity, :data:`EMPTY_LSE`)."""
    return torch.isinf(x)


__all__ = ["EMPTY_LSE", "MergeInputs", "attention_parts", "is_empty_lse", "merge_inputs"]
