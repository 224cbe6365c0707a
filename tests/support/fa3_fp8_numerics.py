"""FlashAttention 3's fp8 forward emulated in torch on the CPU (NOT FlashAttention 3): what vLLM's
``_vllm_fa3_C`` computes for an e4m3 query over an e4m3 cache, step by step, with the fp8 tensor cores' accumulator
as published measurements describe it, so kvfuzz's envelope can be checked against that arithmetic without a GPU.

- Q@K^T and P@V run on SM90 fp8 tensor cores (WGMMA, k = 32 fp8 elements an instruction). Their accumulator keeps
  13 fraction bits, not fp32's 23 (e8m13, "FP22": SageAttention2, Zhang et al. 2024; DeepSeek-V3 technical report,
  section 3.3.2: "around 14 bits"; Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv
  2512.07004, bit-accurate H100 models): :func:`mma` aligns the running sum and the instruction's 32 exact products
  to the largest exponent among them, truncates each to ``acc_bits`` fraction bits below it, sums, and truncates
  the sum to ``acc_bits`` fraction bits. ``acc_bits=23`` is the fp32-like accumulation a 16-bit forward has.
- hopper/softmax.h with ``Max_offset = 8``: ``P = exp2(s * scale_log2 - (m * scale_log2 - 8))`` (``scale_log2 =
  softmax_scale * q_descale * k_descale * log2(e)``, fp32), the row sum of the unrounded P in fp32, P converted to
  e4m3 before P@V; the output ``acc * v_descale / row_sum`` (fp32), rounded to bf16.

The scores and P are computed in fp64 from the exact products except where the steps above round them; the online
softmax's rescaling (exact powers of two for the row max's updates only when they are) is not modelled."""

from __future__ import annotations

import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData

F64 = torch.float64
LOG2E = 1.44269504088896340736
#: Fraction bits of the SM89/SM90 fp8 tensor cores' accumulator (e8m13).
FP8_MMA_BITS = 13
#: fp8 elements one WGMMA instruction sums (k of m64nNk32 for e4m3).
MMA_K = 32


def _trunc_to(x: torch.Tensor, e: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` truncated toward zero to a multiple of ``2**(e - bits)``."""
    q = torch.exp2(e - bits)
    return torch.trunc(x / q) * q


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|), 0 where x == 0 (any value serves: every addend is then 0)."""
    a = x.abs()
    return torch.where(a > 0, torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))), torch.zeros_like(a))


def mma(acc: torch.Tensor, products: torch.Tensor, bits: int = FP8_MMA_BITS) -> torch.Tensor:
    """One accumulation step: ``acc [...]`` plus ``products [..., k]`` (exact, fp64) as the truncating accumulator
    does it (module docstring)."""
    addends = torch.cat([acc[..., None], products], dim=-1)
    e = _exponent(addends).amax(dim=-1, keepdim=True)
    s = _trunc_to(addends, e, bits).sum(dim=-1)
    return _trunc_to(s, _exponent(s), bits)


def dot_mma(a: torch.Tensor, b: torch.Tensor, bits: int = FP8_MMA_BITS) -> torch.Tensor:
    """``sum_i a[..., i] * b[..., i]`` in instructions of :data:`MMA_K` elements through :func:`mma`."""
    acc = torch.zeros(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]), dtype=F64)
    for j in range(0, a.shape[-1], MMA_K):
        acc = mma(acc, a[..., j:j + MMA_K] * b[..., j:j + MMA_K], bits)
    return acc


def fa3_fp8_model(batch: Batch, data: BatchData, acc_bits: int = FP8_MMA_BITS, q_scale: float = 1.0,
                  last_rows: int | None = None) -> torch.Tensor:
    """FA3's fp8 forward for ``batch`` (fp8 cache, bf16, no ALiBi, no sinks), ``data`` as the target hands it over
    (the query already e4m3 values: :meth:`~kvfuzz.fuzz.targets.vllm_flash_attn.VllmFlashAttnVarlen.call_data`);
    fp64 ``[num_tokens, num_heads, head_size]`` holding bf16 values. ``last_rows``: emulate only each sequence's
    last ``last_rows`` query rows (the others NaN), for long prefills."""
    assert batch.fp8_dtype is not None and not batch.alibi and data.sinks is None
    g = batch.gqa_ratio
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    scale_log2 = float(f32(batch.scale) * f32(q_scale) * f32(batch.k_scale) * f32(LOG2E))
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    out = torch.full(data.query.shape, float("nan"), dtype=F64)
    for i in range(batch.num_seqs):
        first = qsl[i] if last_rows is None else max(qsl[i], qsl[i + 1] - last_rows)
        q = (data.query[first:qsl[i + 1]].double() / q_scale)  # e4m3 values
        kc = data.cache_keys[ssl[i]:ssl[i + 1]].double().repeat_interleave(g, dim=1)  # [K, H, D] codes
        vc = data.cache_values[ssl[i]:ssl[i + 1]].double().repeat_interleave(g, dim=1)
        nq, nk = q.shape[0], kc.shape[0]
        s = dot_mma(q.permute(1, 0, 2)[:, :, None, :], kc.permute(1, 0, 2)[:, None, :, :], acc_bits)  # [H, Q, K]
        s = s.float().double()  # the accumulator's value is an fp32 register
        if batch.softcap is not None:  # tanh(s * scale / c) * c, then scale_log2 = log2e * c... as FA3: in fp32
            c = batch.softcap
            s = (torch.tanh((s * (scale_log2 / LOG2E) / c).float()).double() * c) / (scale_log2 / LOG2E)
        qpos = batch.ctx_lens[i] + (first - qsl[i]) + torch.arange(nq)
        kpos = torch.arange(nk)
        masked = kpos[None, :] > qpos[:, None]
        if batch.sliding_window is not None:
            masked |= kpos[None, :] <= qpos[:, None] - batch.sliding_window
        s = s.masked_fill(masked[None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        x = (s * scale_log2 - (m * scale_log2 - 8.0)).float().double()  # one fp32 FFMA
        p = torch.exp2(x)  # ex2.approx: 2 ulp; modelled exact
        row = p.sum(-1, keepdim=True).float().double()
        p8 = p.to(torch.float8_e4m3fn).double()
        acc = dot_mma(p8[:, :, None, :], vc.permute(1, 2, 0)[:, None, :, :], acc_bits)  # [H, Q, D]
        o = (acc.float() * torch.tensor(batch.v_scale, dtype=torch.float32) / row.float()).to(torch.bfloat16)
        out[first:qsl[i + 1]] = o.double().permute(1, 0, 2)
    return out
