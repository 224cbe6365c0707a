"""Oracles a kernel's output must pass: finiteness, and agreement with the fp64 reference.

Tolerance rule (calibration in docs/tolerance.md): per output row (query token t, head h),

    max_d |out - ref|  <=  RTOL[dtype] * max_d |out_lp - ref|  +  row_floor

where ``ref`` is the fp64 reference and ``out_lp`` the same math done naively in the batch dtype
(:func:`~kvfuzz.contracts.reference.same_precision_attention`). This is FlashAttention's rule
(tests/test_flash_attn.py: ``max|out - ref| <= 2 * max|out_pt - ref|``) applied row by row instead of over
the whole batch, so an error confined to one token cannot hide behind a large rounding error elsewhere;
the floor (:func:`row_floor`) is FA3's ``fwd_atol`` idea (rounding of values of magnitude ~0.3 in the dtype;
for fp32 scaled up for rows whose values are larger) and covers rows where ``out_lp`` happens to be exact.
"""

from __future__ import annotations

import attrs
import torch

from .batch import Batch

#: Multiple of the same-precision error a kernel may make, per dtype (calibration: docs/tolerance.md).
#: fp16/bf16: FlashAttention's 2 (worst per-row ratio measured on vLLM's kernels: 1.34 on CPU, 1.16 and 1.12
#: on an H200 with fp8 caches and every feature). fp32: a naive fp32 einsum is almost exact per row while kernels
#: accumulate in other orders (online softmax, exp2, blocked dot products): worst measured 10.2
#: (vllm.cpu_attention, N(0, 1) data), 3.9 (Triton), then 56.6 on the CPU op with "large" values (logits
#: ~16x wider: the dot-product rounding grows with them; 2.8e-5 absolute at |out| 2.8); 128 leaves 2x margin
#: and is still ~100x below a one-position mask error.
RTOL: dict[str, float] = {"float16": 2.0, "bfloat16": 2.0, "float32": 128.0}


def atol_floor(dtype: torch.dtype) -> float:
    """FA3's rounding floor ``2 * |(x + 0.3 - 0.3) - x|`` for x ~ 1 in ``dtype``: 2 ulp at 0.3."""
    x = torch.tensor(0.3, dtype=torch.float64)
    return 2.0 * float(((x.to(dtype) + 0.3) - 0.3).to(torch.float64).sub(x).abs().clamp_min(
        torch.finfo(dtype).eps * 0.25))


#: The magnitude ``atol_floor`` is defined at; rows with larger values get a proportionally larger floor.
FLOOR_MAGNITUDE = 0.3


#: With a softcap ``c``, kernels compute ``c * tanh(s / c)`` in fp32 as ``c * (1 - 2 / (exp(2 s / c) + 1))``
#: (vLLM's apply_softcap; the CPU op alike), which cancels for small ``s / c``: the logit is off by about
#: ``c * eps(fp32)``. Measured with c = 50 on fp32: 6.6e-6 (unified_attention), 4.2e-6 (vllm.cpu_attention)
#: against 4.7e-7 for torch.tanh. The floor allows ``SOFTCAP_ULPS * c * eps(fp32) * max(1, max_d |ref|)``.
SOFTCAP_ULPS = 4.0


def row_floor(batch: Batch, ref: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, num_heads]`` rounding floor per row: ``atol_floor(dtype)``, for float32 scaled by
    ``max(1, max_d |ref| / 0.3)``, plus the softcap term of :data:`SOFTCAP_ULPS` when ``batch.softcap`` is set.

    Why fp32 scales: a row with one or two visible keys (a window of 1, sinks) can come out of the naive fp32
    ``out_lp`` exact, while a kernel rounds it once more: 1 ulp of a value ~2 (1.2e-7) exceeded the 0.3-sized
    floor (6e-8; found with sliding_window=1 and sinks). In fp16/bf16 the naive output is itself rounded to
    the dtype, so ``RTOL * |out_lp - ref|`` already grows with the magnitude, and a magnitude-scaled floor
    (2.4e-3 at |ref| = 1.5 in fp16) would hide real precision defects such as decode_attention_fwd's fp16
    logits (README Findings 3)."""
    absmax = ref.abs().amax(dim=-1).nan_to_num(0.0)
    floor = torch.full_like(absmax, atol_floor(batch.torch_dtype))
    if batch.torch_dtype == torch.float32:
        floor = floor * (absmax / FLOOR_MAGNITUDE).clamp_min(1.0)
    if batch.softcap is not None:
        floor = floor + SOFTCAP_ULPS * batch.softcap * torch.finfo(torch.float32).eps * absmax.clamp_min(1.0)
    return floor


@attrs.frozen
class OracleFailure:
    """A failed oracle, located at its worst element.

    oracle: "finite" or "agreement". seq, position: sequence and token position of the worst row; token:
    its row in the output; head, dim: the worst element; error, bound: its error and the allowed bound
    (NaN/inf for "finite"); bad_rows: how many (token, head) rows fail; bad_elements: elements that fail.
    """

    oracle: str
    seq: int
    position: int
    token: int
    head: int
    dim: int
    error: float
    bound: float
    bad_rows: int
    bad_elements: int
    bad_tokens: tuple[int, ...] = ()

    def message(self) -> str:
        if self.oracle == "finite":
            return (f"non-finite output: {self.bad_elements} elements in {self.bad_rows} (token, head) rows; "
                    f"first at sequence {self.seq} position {self.position} (output row {self.token}), "
                    f"head {self.head}, dim {self.dim}: {self.error}")
        return (f"kernel disagrees with the fp64 reference in {self.bad_rows} (token, head) rows; worst at "
                f"sequence {self.seq} position {self.position} (output row {self.token}), head {self.head}, "
                f"dim {self.dim}: |out - ref| = {self.error:.3g} > bound {self.bound:.3g}")

    def to_dict(self) -> dict:
        return attrs.asdict(self) | {"message": self.message()}


def _locate(batch: Batch, token: int) -> tuple[int, int]:
    qsl = batch.query_start_loc
    seq = max(i for i in range(batch.num_seqs) if qsl[i] <= token)
    return seq, batch.ctx_lens[seq] + token - qsl[seq]


def check_finite(batch: Batch, out: torch.Tensor) -> OracleFailure | None:
    """NaN or inf anywhere in ``out`` ``[num_tokens, num_heads, head_size]`` is always a failure."""
    bad = ~torch.isfinite(out.cpu())
    if not bad.any():
        return None
    t, h, d = (int(i) for i in torch.nonzero(bad)[0])
    rows = bad.any(dim=-1)
    seq, pos = _locate(batch, t)
    tokens = tuple(int(i) for i in torch.nonzero(rows.any(dim=1)).flatten())
    return OracleFailure("finite", seq, pos, t, h, d, float(out[t, h, d]), float("nan"), int(rows.sum()),
                         int(bad.sum()), tokens)


def check_agreement(batch: Batch, out: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
                    rtol: float | None = None) -> OracleFailure | None:
    """Row-wise tolerance rule of the module docstring (``rtol`` defaults to ``RTOL[batch.dtype]``). ``out``
    any float dtype, ``ref``/``lowp`` fp64, all ``[num_tokens, num_heads, head_size]``. Returns None when
    every row passes."""
    rtol = RTOL[batch.dtype] if rtol is None else rtol
    err = (out.cpu().to(torch.float64) - ref).abs()
    pt = (lowp - ref).abs().amax(dim=-1)
    bound = rtol * pt + row_floor(batch, ref)
    row_err = err.amax(dim=-1)
    bad_rows = ~(row_err <= bound)  # NaN counts as bad
    if not bad_rows.any():
        return None
    excess = torch.where(bad_rows, row_err - bound, torch.zeros_like(row_err)).nan_to_num(float("inf"))
    t, h = divmod(int(torch.argmax(excess)), batch.num_heads)
    d = int(torch.argmax(err[t, h].nan_to_num(float("inf"))))
    seq, pos = _locate(batch, t)
    tokens = tuple(int(i) for i in torch.nonzero(bad_rows.any(dim=1)).flatten())
    bad_el = int((~(err <= bound[..., None])).sum())
    return OracleFailure("agreement", seq, pos, t, h, d, float(err[t, h, d]), float(bound[t, h]),
                         int(bad_rows.sum()), bad_el, tokens)


def error_ratio(batch: Batch, out: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor) -> float:
    """``max over rows of (|out - ref| - floor) / |out_lp - ref|``: how close a passing kernel came to
    the bound (the calibration statistic of docs/tolerance.md; fails at ``> RTOL[dtype]``)."""
    err = (out.cpu().to(torch.float64) - ref).abs().amax(dim=-1)
    pt = (lowp - ref).abs().amax(dim=-1)
    r = (err - row_floor(batch, ref)).clamp_min(0) / pt.clamp_min(1e-300)
    return float(r.max())
