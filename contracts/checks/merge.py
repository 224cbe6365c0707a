"""The oracle of a ``merge_attn_states`` call: its output (and merged log-sum-exp) against the exact fp64 merge of the
very inputs it was handed (:class:`~kvfuzz.contracts.model.merge.MergeInputs`), within a bound derived from the
merge's own fp32 arithmetic (docs/tolerance.md, "Merging attention states").

The merge (vllm/v1/attention/ops/triton_merge_attn_states.py, the CUDA op behind ``vllm._custom_ops``), per token
``t`` below ``prefill_tokens_with_context`` and head ``h``, with ``p``, ``s`` the two log-sum-exps (``+inf`` read
as ``-inf``: an empty part) and ``m = max(p, s)``::

    w_p = e^(p - m) / (e^(p - m) + e^(s - m)),  w_s = 1 - w_p
    out = w_p * prefix_output + w_s * suffix_output          (0 when both parts are empty)
    lse = m + log(e^(p - m) + e^(s - m))                     (-inf when both are empty)

and for a token at or past ``prefill_tokens_with_context`` a copy of the suffix (output and log-sum-exp as handed
over). :func:`exact_merge` computes that in fp64 from the inputs; the bound (:func:`merge_bound`), per element::

    e32   = u32 * (MERGE_LSE_ULPS * |p - s| + MERGE_OP_ULPS) * (w_p |prefix_output| + w_s |suffix_output|)
            + tiny32 * (|prefix_output| + |suffix_output|)
    bound = e32 + u_out * (|exact| + e32) + tiny_out

``|p - s|`` enters because ``p - m`` is rounded to fp32 before the exponential (its absolute error ``u32 |p - s|``
is a relative error of the exponential, and an exp2-based ``exp`` multiplies it by ``log2(e)``: MERGE_LSE_ULPS
3 covers both); MERGE_OP_ULPS 8 counts the exponential, the sum, the division, the product and the sum of the two
terms, one rounding each, with margin for a fast ``exp``; ``tiny32`` covers an exponential or product flushed to
zero; ``u_out`` and ``tiny_out`` the output's rounding to its dtype. A copied token's bound is 0 (a copy is exact),
a merged log-sum-exp's ``u32 * MERGE_OP_ULPS * (1 + |lse|)``.
"""

from __future__ import annotations

import torch

from ..model.batch import Batch
from ..model.merge import MergeInputs, is_empty_lse
from .oracles import Oracle, OracleFailure, check_finite, locate
from .violations import Check, Violation, violation

#: Multiple of ``u32 * |p - s|`` a merge's weights may be off by (module docstring).
MERGE_LSE_ULPS = 3.0
#: Roundings of the merge's fp32 arithmetic per output element, with margin (module docstring).
MERGE_OP_ULPS = 8.0
U32 = 2.0**-24
TINY32 = torch.finfo(torch.float32).tiny


def _as_empty(lse: torch.Tensor) -> torch.Tensor:
    """fp64 log-sum-exps with either infinity read as ``-inf`` (an empty part)."""
    lse = lse.double().cpu()
    return torch.where(is_empty_lse(lse), torch.full_like(lse, float("-inf")), lse)


def _copied(n_tokens: int, prefill_tokens_with_context: int | None) -> int:
    """The first token that is copied from the suffix instead of merged."""
    return n_tokens if prefill_tokens_with_context is None else prefill_tokens_with_context


def merge_weights(inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_p, w_s, both_empty)``, each ``[H, T]`` fp64: the exact weights of the two parts (module docstring; 0
    and 0 where both parts are empty)."""
    p, s = _as_empty(inputs.prefix_lse), _as_empty(inputs.suffix_lse)
    m = torch.maximum(p, s)
    both = torch.isinf(m)
    m = torch.where(both, torch.zeros_like(m), m)
    ep, es = torch.exp(p - m), torch.exp(s - m)
    total = torch.where(both, torch.ones_like(m), ep + es)
    return ep / total, es / total, both


def exact_merge(inputs: MergeInputs, prefill_tokens_with_context: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of ``inputs`` (module docstring): ``(out [T, H, D], lse [H, T])``, fp64 on the CPU."""
    po, so = inputs.prefix_output.double().cpu(), inputs.suffix_output.double().cpu()
    wp, ws, both = merge_weights(inputs)
    out = po * wp.T[..., None] + so * ws.T[..., None]
    out[both.T] = 0.0
    p, s = _as_empty(inputs.prefix_lse), _as_empty(inputs.suffix_lse)
    m = torch.maximum(p, s)
    finite_m = torch.where(both, torch.zeros_like(m), m)
    lse = torch.where(both, m, finite_m + torch.log(torch.exp(p - finite_m) + torch.exp(s - finite_m)))
    n = _copied(po.shape[0], prefill_tokens_with_context)
    out[n:] = so[n:]
    lse[:, n:] = inputs.suffix_lse.double().cpu()[:, n:]
    return out, lse


def _unit(dtype: torch.dtype) -> tuple[float, float]:
    """``(unit roundoff, smallest normal)`` of a float dtype."""
    f = torch.finfo(dtype)
    return f.eps / 2, f.tiny


def merge_bound(inputs: MergeInputs, exact: torch.Tensor, exact_lse: torch.Tensor, out_dtype: torch.dtype,
                prefill_tokens_with_context: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound [T, H, D], lse_bound [H, T])``, fp64: what a correct merge may differ from ``exact`` /
    ``exact_lse`` (from :func:`exact_merge`) by, with its output rounded to ``out_dtype`` (module docstring)."""
    po, so = inputs.prefix_output.double().cpu().abs(), inputs.suffix_output.double().cpu().abs()
    p, s = _as_empty(inputs.prefix_lse), _as_empty(inputs.suffix_lse)
    gap = torch.where(torch.isfinite(p) & torch.isfinite(s), (p - s).abs(), torch.zeros_like(p))
    wp, ws, _ = merge_weights(inputs)
    e32 = U32 * (MERGE_LSE_ULPS * gap + MERGE_OP_ULPS).T[..., None] * (po * wp.T[..., None] + so * ws.T[..., None])
    e32 = e32 + TINY32 * (po + so)
    u, tiny = _unit(out_dtype)
    bound = e32 + u * (exact.abs() + e32) + tiny
    lse_bound = U32 * MERGE_OP_ULPS * (1.0 + torch.where(torch.isfinite(exact_lse), exact_lse.abs(),
                                                         torch.zeros_like(exact_lse)))
    n = _copied(po.shape[0], prefill_tokens_with_context)
    bound[n:] = 0.0
    lse_bound[:, n:] = 0.0
    return bound, lse_bound


def check_merge(batch: Batch, out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor
                ) -> tuple[OracleFailure | None, float]:
    """The merged output ``out [T, H, D]`` against ``exact`` within ``bound``: ``(failure, ratio)``, a
    :attr:`~kvfuzz.contracts.checks.oracles.Oracle.FINITE` failure for NaN/inf (always wrong: the exact merge of
    finite inputs is finite), else an :attr:`~kvfuzz.contracts.checks.oracles.Oracle.MERGE` one at the element with
    the largest ``|out - exact| / bound``; ``ratio`` that largest ratio of a passing output (0.0 on a failure)."""
    finite = check_finite(batch, out)
    if finite is not None:
        return finite, 0.0
    err = (out.double().cpu() - exact).abs()
    bad = ~(err <= bound)
    safe = torch.where(bound > 0, bound, torch.ones_like(bound))
    ratio = torch.where(bound > 0, err / safe, torch.where(err > 0, torch.full_like(err, float("inf")),
                                                           torch.zeros_like(err)))
    if not bool(bad.any()):
        return None, float(ratio.max()) if ratio.numel() else 0.0
    t, h, d = (int(i) for i in torch.unravel_index(torch.argmax(torch.where(bad, ratio, torch.zeros_like(ratio))),
                                                    ratio.shape))
    seq, pos = locate(batch, t)
    rows = bad.any(dim=-1)
    tokens = tuple(int(i) for i in torch.nonzero(rows.any(dim=1)).flatten())
    return OracleFailure(Oracle.MERGE, seq, pos, t, h, d, float(err[t, h, d]), float(bound[t, h, d]),
                         int(rows.sum()), int(bad.sum()), tokens), 0.0


def check_merged_lse(batch: Batch, lse: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor
                     ) -> OracleFailure | None:
    """The merged log-sum-exp ``lse [H, T]`` (``output_lse``) against ``exact``: an
    :attr:`~kvfuzz.contracts.checks.oracles.Oracle.MERGE_LSE` failure where it differs by more than ``bound``, or
    is not the same infinity (both parts empty: ``-inf``; a copied suffix's ``+inf`` stays ``+inf``), or NaN."""
    lse = lse.double().cpu()
    same_inf = torch.isinf(exact) & (lse == exact)
    err = torch.where(same_inf, torch.zeros_like(lse), (lse - exact).abs())
    bad = ~(err <= bound)
    if not bool(bad.any()):
        return None
    excess = torch.where(bad, (err / bound.clamp_min(TINY32)).nan_to_num(float("inf")), torch.zeros_like(err))
    h, t = (int(i) for i in torch.unravel_index(torch.argmax(excess), excess.shape))
    seq, pos = locate(batch, t)
    tokens = tuple(int(i) for i in torch.nonzero(bad.any(dim=0)).flatten())
    return OracleFailure(Oracle.MERGE_LSE, seq, pos, t, h, 0, float(err[h, t]), float(bound[h, t]),
                         int(bad.sum()), int(bad.sum()), tokens)


def check_merge_parts(expected: MergeInputs, handed: MergeInputs) -> list[Violation]:
    """Ground truth: the parts a call hands the merge (``handed``, read off its arguments) are ``expected``, the
    batch's prefix and suffix attention as a kernel returns them (:func:`~kvfuzz.contracts.model.merge.merge_inputs`),
    bit for bit (an empty part's log-sum-exp may be either infinity). One
    :attr:`~kvfuzz.contracts.checks.violations.Check.MERGE_PARTS` violation per tensor that differs."""
    out = []
    for name in ("prefix_output", "suffix_output", "prefix_lse", "suffix_lse"):
        e, h = getattr(expected, name).cpu(), getattr(handed, name)
        if not isinstance(h, torch.Tensor) or h.shape != e.shape or h.dtype != e.dtype:
            out.append(violation(Check.MERGE_PARTS, f"{name} is not the part's attention", kernel="merge_attn_states",
                                 expected=f"{e.dtype} {tuple(e.shape)}",
                                 found=f"{getattr(h, 'dtype', None)} {tuple(getattr(h, 'shape', ()))}"))
            continue
        h = h.detach().cpu()
        both = (is_empty_lse(h) & is_empty_lse(e)) if name.endswith("lse") else (h.isnan() & e.isnan())
        same = (h == e) | both
        if not bool(same.all()):
            first = tuple(int(i) for i in torch.nonzero(~same)[0])
            out.append(violation(Check.MERGE_PARTS, f"{name} differs from the part's attention at {list(first)}",
                                 kernel="merge_attn_states", expected=float(e[first]), found=float(h[first]),
                                 count=int((~same).sum())))
    return out


__all__ = ["MERGE_LSE_ULPS", "MERGE_OP_ULPS", "check_merge", "check_merge_parts", "check_merged_lse", "exact_merge",
           "merge_bound", "merge_weights"]
