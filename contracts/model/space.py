"""The parameter space a batch is drawn from, by the names vLLM uses: query dtypes, kv_cache_dtype values and
their fp8 storage, optional attention features, value ranges; and two pure helpers every model module shares
(ALiBi slopes as vLLM computes them, the vectorized (sequence, position) enumeration).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: Query/output dtypes kvfuzz models, by the names vLLM's ``--dtype`` uses.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

#: vLLM's ``kv_cache_dtype`` values (vllm/config/cache.py, CacheDType).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

#: Storage of each fp8 ``kv_cache_dtype`` (vLLM allocates uint8 and kernels view it as this dtype;
#: "fp8" means e4m3, vllm/v1/attention/ops/chunked_prefill_paged_decode.py).
FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: Optional attention features a batch may use and a target may declare
#: (:class:`~kvfuzz.contracts.model.capabilities.Capabilities`).
FEATURES = ("sliding_window", "alibi", "sinks", "softcap")

#: How the batch's queries and keys are drawn (:func:`kvfuzz.contracts.model.data.make_batch_data`), simplest
#: first. "normal": unit-variance values close to N(0, 1) (kvfuzz.contracts.model.counter_rng: Irwin-Hall of 4
#: uniforms, |x| <= 3.46). "large": queries and keys x4 (logits ~16x larger: sharp softmax, exp range).
#: "equal": every position of a sequence has the same key (all logits of a row equal). "dominant": one
#: position per sequence has a key x16 (one key takes nearly all, or nearly none, of a row's weight).
#: "extreme": queries and keys x EXTREME_FACTOR (64), logits x4096: scaled scores of standard deviation ~4096
#: (|s| to ~2e4 in a batch), so a row's softmax is nearly one-hot, a softcap of 4 or 50 is far
#: below the scores (|s| / c past the ~88.7 where exp overflows in fp32), and an fp8 e4m3 cache with a
#: k_scale below 1/2 saturates. The magnitude and its bound are derived in docs/tolerance.md ("Extreme values").
#: "shifted": every logit of a row shifted far below zero by the same amount (softmax unchanged): the queries' last
#: dimension set to +Q and every key's to -SHIFTED_KEY, so each scaled logit is the normal one minus
#: ``Q * SHIFTED_KEY * scale``, at least SHIFTED_LOGIT (past the -34,657 below which FlashInfer's finite mask sentinel
#: zeroed a row, flashinfer#4401; docs/tolerance.md, "Shifted logits").
VALUE_RANGES = ("normal", "large", "equal", "dominant", "extreme", "shifted")

#: What "extreme" multiplies queries and keys by: a power of two, so the product is exact in every dtype (the
#: same bits on every device) and ``|q_i k_i| <= (3.46 * 64)**2 = 49,036`` stays below fp16's largest finite
#: value 65,504 per product. Bound (docs/tolerance.md, "Extreme values"): the envelope's first-order logit
#: term stays within 5% of the exact perturbation while ``u32 * ds <= 0.1``; at 64 and head size 256 it is
#: ~0.04.
EXTREME_FACTOR = 64.0

#: What "shifted" sets every key's last dimension to (negated): a power of two, exact in every dtype and in fp8 e4m3
#: and e5m2 (an fp8 cache whose ``k_scale`` puts ``SHIFTED_KEY / k_scale`` past the format's largest value saturates
#: there, as any key does, and the shift is smaller).
SHIFTED_KEY = 128.0
#: The smallest shift "shifted" aims at: every scaled logit of a row at most about ``-SHIFTED_LOGIT`` plus its normal
#: value (|normal logits| <= 12 * sqrt(head_size)), past FlashInfer's sentinel of 5e4 / log2(e) ~ 34,657.
SHIFTED_LOGIT = 40000.0
#: The largest query "shifted" sets (fp16's largest power of two): the shift stops short of SHIFTED_LOGIT only
#: where an fp8 cache's scale saturates the key.
SHIFTED_MAX_QUERY = 2.0**15


@functools.lru_cache(maxsize=None)  # a pure function of num_heads, read by every stage of an ALiBi example
def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi slopes of ``num_heads`` heads, as vLLM computes them for BLOOM/MPT-style models
    (vllm/model_executor/models/bloom.py, ``_get_alibi_slopes``): geometric ``2**(-8/n * k)`` for the
    largest power of two ``n <= num_heads``, interleaved extra slopes for the rest. fp32 values."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        n = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * n, 2, dtype=torch.int32))])
    return tuple(float(x) for x in slopes)


def positions(lens: tuple[int, ...] | list[int], offsets: tuple[int, ...] | list[int] | None = None,
              device: str | torch.device | None = None):
    """Vectorized enumeration of ``(seq, pos)`` for ``pos in offsets[seq] .. offsets[seq] + lens[seq] - 1``.

    Returns two int64 tensors of length ``sum(lens)``, ordered by sequence then position (query order when
    ``lens = query_lens`` and ``offsets = ctx_lens``), on the CPU, or with ``device`` on that device, computed
    there from one copy of ``lens`` and the offsets (from pinned memory on CUDA) and without a host sync: the same
    integers either way. Raises RuntimeError for a negative length.
    """
    counts = [int(n) for n in lens]
    # pos = (flat index) - (where the sequence starts in the flat order) + (its offset)
    shift, start = [], 0
    for i, n in enumerate(counts):
        shift.append(start - (0 if offsets is None else int(offsets[i])))
        start += n
    if device is not None:
        return _positions_on(torch.device(device), counts, shift)
    seq = torch.repeat_interleave(torch.tensor(counts, dtype=torch.int64))  # [0]*lens[0] + [1]*lens[1] + ...
    pos = torch.arange(len(seq), dtype=torch.int64) - torch.tensor(shift, dtype=torch.int64)[seq]
    return seq, pos


def host_to(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``: to CUDA from pinned memory, without blocking the host (a copy from
    pageable memory synchronizes the stream first); the tensor itself elsewhere on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def table_tensor(rows, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """``rows`` (a table of Python ints, every row the same length) as an int32 or int64 (``dtype``) tensor on
    ``device`` (:func:`host_to`): through numpy, a few times faster than ``torch.tensor`` on a serving batch's
    block table (tens of thousands of entries); the same values."""
    return host_to(torch.from_numpy(np.array(rows, dtype={torch.int32: np.int32, torch.int64: np.int64}[dtype])),
                   device)


def host_tensor(values, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` (Python numbers) on ``device`` (:func:`host_to`: no host sync on
    CUDA)."""
    return host_to(torch.tensor(values, dtype=dtype), device)


def _positions_on(device: torch.device, counts: list[int], shift: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`positions`' ``(seq, pos)`` computed on ``device`` (any device) from its per-sequence ``counts`` and
    ``shift`` (where the sequence starts in the flat order, less its offset): one host-to-device copy of both
    lists (from pinned memory on CUDA, without blocking the host), and the total length passed to
    ``repeat_interleave``, so no host sync. Raises RuntimeError for a negative count."""
    if min(counts, default=0) < 0:
        raise RuntimeError(f"repeats can not be negative: lens {counts}")
    both = host_tensor(counts + shift, torch.int64, device)
    c, sh = both[: len(counts)], both[len(counts):]
    seq = torch.repeat_interleave(torch.arange(len(counts), device=device), c, output_size=sum(counts))
    return seq, torch.arange(len(seq), dtype=torch.int64, device=device) - sh[seq]


__all__ = ["DTYPES", "EXTREME_FACTOR", "FEATURES", "FP8_DTYPES", "KV_CACHE_DTYPES", "SHIFTED_KEY", "SHIFTED_LOGIT",
           "SHIFTED_MAX_QUERY", "VALUE_RANGES", "alibi_slopes", "host_tensor", "host_to", "positions", "table_tensor"]
