"""Ground-truth tensors of a :class:`~kvfuzz.contracts.model.batch.Batch`, drawn from its seed.

Everything is drawn in float32 by the counter-based generator :mod:`~kvfuzz.contracts.model.counter_rng` and
rounded once to the batch dtype, so the kernel and the fp64 reference see bit-identical inputs, and a batch
drawn on a GPU is bitwise the batch drawn on the CPU.
"""

from __future__ import annotations

import math

import attrs
import torch

from . import counter_rng
from .batch import Batch, positions
from .space import EXTREME_FACTOR, SHIFTED_KEY, SHIFTED_LOGIT, SHIFTED_MAX_QUERY, host_tensor, host_to


@attrs.frozen(eq=False)
class BatchData:
    """Tensors of one batch, in ``batch.dtype``, all on one device (where :func:`make_batch_data` drew them;
    :meth:`to` copies them to another).

    query:  ``[num_tokens, num_heads, head_size]``, in query order (``query_start_loc``).
    keys, values: ``[sum(seq_lens), num_kv_heads, head_size]``: every position ``0 .. seq_len-1`` of every
        sequence, sequence ``i`` starting at ``batch.seq_start_loc[i]``. Positions ``ctx_len ..`` are the
        new tokens, whose k/v the split contract passes separately. A latent batch (``batch.value_head_size``
        = Dv, MLA): values ``[sum(seq_lens), 1, Dv]``, the keys' first Dv dims.
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    #: What the cache stores for ``keys``/``values``: the same tensors for kv_cache_dtype "auto", the fp8
    #: codes ``round_fp8(k / k_scale)`` (``keys == codes * k_scale`` exactly) for an fp8 cache.
    cache_keys: torch.Tensor | None = None
    cache_values: torch.Tensor | None = None
    #: fp32 ``[num_heads]`` sink logits when ``batch.sinks``, else None.
    sinks: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        if self.cache_keys is None:
            object.__setattr__(self, "cache_keys", self.keys)
        if self.cache_values is None:
            object.__setattr__(self, "cache_values", self.values)

    def token_rows(self, batch: Batch, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Row indices into ``keys``/``values`` of positions ``pos`` of sequences ``seq`` (int64, on the device
        of ``keys``, whatever the device of ``seq``/``pos``)."""
        dev = self.keys.device
        return host_tensor(batch.seq_start_loc[:-1], torch.int64, dev)[seq.to(dev)] + pos.to(dev)

    def select(self, query_rows: torch.Tensor, kv_rows: torch.Tensor) -> "BatchData":
        """The data of another batch made of these rows (int64 indices, on any device): queries ``query_rows``,
        keys/values (and their cache codes) ``kv_rows``; sinks are kept."""
        query_rows, kv_rows = query_rows.to(self.query.device), kv_rows.to(self.keys.device)
        return BatchData(query=self.query[query_rows], keys=self.keys[kv_rows], values=self.values[kv_rows],
                         cache_keys=self.cache_keys[kv_rows], cache_values=self.cache_values[kv_rows],
                         sinks=self.sinks)

    def to(self, device: str | torch.device) -> "BatchData":
        """The same tensors on ``device`` (``self`` when they are there already): the fp64 reference of a CUDA
        target's batch runs on its GPU."""
        d, here = torch.device(device), self.query.device
        if here == d or (d.index is None and here.type == d.type):
            return self
        return BatchData(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(d)
                            for f in attrs.fields(BatchData)})

    def new_kv(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``: the new tokens in query order, as a
        split-contract kernel receives them."""
        rows = self.token_rows(batch, *positions(batch.query_lens, offsets=batch.ctx_lens))
        return self.keys.index_select(0, rows), self.values.index_select(0, rows)


def quantize_fp8(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """``round_fp8(x / scale)``, saturated to the fp8 range (as vLLM's scaled_fp8_quant does). The divisor is a
    float32 tensor on ``x``'s device, not a Python float: CUDA divides by a CPU scalar as a multiply by its
    reciprocal, which is not the correctly rounded quotient the CPU computes."""
    m = torch.finfo(fp8).max
    return (x.float() / host_tensor(scale, torch.float32, x.device)).clamp(-m, m).to(fp8)


def exactly_dequantized(codes: torch.Tensor, scale: float, dt: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dt`` (fp8 codes times a per-tensor scale: an fp8 cache's keys and values, an fp8
    query); raises ValueError if that is not exact (then a kernel dequantizing in fp32 and the reference would see
    different keys or queries)."""
    deq = codes.float() * scale
    out = deq.to(dt)
    if not torch.equal(out.float(), deq):
        raise ValueError(f"fp8 values times scale {scale} are not exact in {dt}: use a scale with few "
                         "significant bits (e.g. kvfuzz.strategies.batches.KV_SCALES)")
    return out


def _shape_values(batch: Batch, query: torch.Tensor, keys: torch.Tensor) -> None:
    """Apply ``batch.value_range`` in place (see :data:`~kvfuzz.contracts.model.batch.VALUE_RANGES`), on the
    device of ``keys``."""
    if batch.value_range in ("large", "extreme"):  # powers of two: exact in every dtype
        factor = 4.0 if batch.value_range == "large" else EXTREME_FACTOR
        query.mul_(factor)
        keys.mul_(factor)
    elif batch.value_range == "shifted":  # every logit of a row lowered by the same amount: softmax unchanged
        query[..., -1] = shifted_query(batch)
        keys[..., -1] = -SHIFTED_KEY
    elif batch.value_range in ("equal", "dominant"):
        starts = host_tensor(batch.seq_start_loc[:-1], torch.int64, keys.device)
        lens = host_tensor(batch.seq_lens, torch.int64, keys.device)
        if batch.value_range == "equal":  # every position repeats the sequence's first key
            keys.copy_(keys[torch.repeat_interleave(starts, lens, output_size=len(keys))])
        else:  # one position per sequence, drawn from the seed (its own stream), gets a key 16x larger
            keys[starts + counter_rng.below(batch.seed, counter_rng.DOMINANT, lens)] *= 16.0


def shifted_query(batch: Batch) -> float:
    """The query's last dimension under the "shifted" value range: the smallest power of two ``Q`` with ``Q * K *
    batch.scale >= SHIFTED_LOGIT``, at most :data:`~kvfuzz.contracts.model.space.SHIFTED_MAX_QUERY`, ``K`` the keys'
    last dimension as the cache stores it (:data:`~kvfuzz.contracts.model.space.SHIFTED_KEY`, or an fp8 cache's
    largest value times ``k_scale`` where that is smaller). So every scaled logit is the normal one minus at least
    40,000 (docs/tolerance.md, "Shifted logits")."""
    key = SHIFTED_KEY
    if batch.fp8_dtype is not None:
        key = min(key, torch.finfo(batch.fp8_dtype).max * batch.k_scale)
    return min(SHIFTED_MAX_QUERY, 2.0 ** math.ceil(math.log2(SHIFTED_LOGIT / (key * batch.scale))))


def _split(qkv: torch.Tensor, nq: int, shape_q: tuple[int, ...], shape_kv: tuple[int, ...]):
    """Query, keys and values: views of the flat ``qkv`` (queries first, then the keys, then as many values)."""
    nkv = (qkv.numel() - nq) // 2
    return qkv[:nq].view(shape_q), qkv[nq:nq + nkv].view(shape_kv), qkv[nq + nkv:].view(shape_kv)


def make_batch_data(batch: Batch, device: str | torch.device | None = None) -> BatchData:
    """Draw the queries and the keys/values of every position from ``batch.seed``, on ``device`` (default the
    CPU), and return them as a :class:`BatchData` on that device: query ``[num_tokens, num_heads, head_size]``,
    keys/values ``[sum(seq_lens), num_kv_heads, head_size]``, in ``batch.dtype``. A latent batch
    (``batch.value_head_size`` = Dv) has values ``[sum(seq_lens), 1, Dv]``: views of the keys' first Dv dims (the
    values' stream is drawn and unused, so the queries and keys are those of the same batch without it).

    Each element is drawn by :func:`kvfuzz.contracts.model.counter_rng.normal` (approximately standard normal:
    the Irwin–Hall sum of 4 uniforms scaled to variance 1, ``|x| <= 3.46``; queries, keys, values and sinks
    each from their own stream, so e.g. the keys do not depend on the number of queries), shaped by
    ``batch.value_range`` and rounded to ``batch.dtype``. Every step is exact or one correctly rounded IEEE
    operation, so the result depends only on the batch: the same bits on the CPU and on a GPU, across runs,
    machines and torch versions. For an fp8 ``kv_cache_dtype`` the keys/values are
    first quantized with ``k_scale``/``v_scale`` and the logical keys are the exact dequantized values, so
    the fp64 reference models the quantization and a kernel that drops a scale disagrees with it. Positions
    in shared prefix blocks (:meth:`~kvfuzz.contracts.model.batch.Batch.shared_prefix_rows`) get the keys and
    values of the block's first user (drawn as usual, then copied: batches without sharing draw exactly what
    they drew before sharing existed). "dominant" scales one position per sequence, chosen from the seed's
    own stream; "extreme" multiplies queries and keys by
    :data:`~kvfuzz.contracts.model.space.EXTREME_FACTOR` (scaled scores of standard deviation ~4096; an fp8 cache then
    saturates where ``k / k_scale`` passes the format's largest value); "shifted" sets the queries' last dimension
    to :func:`shifted_query` and the keys' to ``-SHIFTED_KEY`` (every logit of a row at least 40,000 lower).
    Sinks: fp32 ``[num_heads]`` ``2 * x`` with ``x`` as above when ``batch.sinks``.

    Raises ValueError if a scale does not dequantize exactly in ``batch.dtype``, or if a tensor has more than
    ``2**28`` elements (the generator's stream length)."""
    dev = torch.device("cpu" if device is None else device)
    total = sum(batch.seq_lens)
    shape_q = (batch.num_tokens, batch.num_heads, batch.head_size)
    shape_kv = (total, batch.num_kv_heads, batch.head_size)
    nq, nkv = math.prod(shape_q), math.prod(shape_kv)
    counts = [(counter_rng.QUERY, nq), (counter_rng.KEYS, nkv), (counter_rng.VALUES, nkv)]
    if batch.sinks:
        counts.append((counter_rng.SINKS, batch.num_heads))
    flat = counter_rng.normal(batch.seed, counts, dev)
    qkv = flat[:nq + 2 * nkv]
    query, keys, values = _split(qkv, nq, shape_q, shape_kv)
    sinks = flat[nq + 2 * nkv:] * 2.0 if batch.sinks else None
    shared = batch.shared_prefix_rows()
    if shared is not None:  # shared prefix blocks: later users see the first user's keys and values
        dst, src = host_to(shared[0], dev), host_to(shared[1], dev)
        keys[dst], values[dst] = keys[src], values[src]
    if batch.value_range != "normal":
        _shape_values(batch, query, keys)
        if shared is not None:  # "dominant" scales one position per sequence: keep shared positions equal
            keys[dst] = keys[src]
    if batch.value_head_size is not None:  # latent (MLA): the value is the key row's first Dv dims
        values = keys[..., : batch.value_head_size]
    dt = batch.torch_dtype
    fp8 = batch.fp8_dtype
    if fp8 is None and batch.value_head_size is not None:
        keys = keys.to(dt)
        return BatchData(query=query.to(dt), keys=keys, values=keys[..., : batch.value_head_size], sinks=sinks)
    if fp8 is None:  # one rounding of the three: views of one tensor (a copy of ``flat``'s unless float32)
        query, keys, values = _split(qkv.to(dt), nq, shape_q, shape_kv)
        return BatchData(query=query, keys=keys, values=values, sinks=sinks)
    return fp8_batch_data(batch, query, keys, values, sinks)


def fp8_batch_data(batch: Batch, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   sinks: torch.Tensor | None) -> BatchData:
    """The :class:`BatchData` of a batch with an fp8 ``kv_cache_dtype``, from its query and keys/values (shapes as
    in :class:`BatchData`, any float dtype, one device): the keys/values quantized with ``k_scale``/``v_scale``
    (:func:`quantize_fp8`) are the cache codes, their exact dequantized values the logical keys/values, the
    query rounded to ``batch.dtype``. Raises ValueError if a scale does not dequantize exactly in
    ``batch.dtype``."""
    dt, fp8 = batch.torch_dtype, batch.fp8_dtype
    kc, vc = quantize_fp8(keys, fp8, batch.k_scale), quantize_fp8(values, fp8, batch.v_scale)
    return BatchData(query=query.to(dt), keys=exactly_dequantized(kc, batch.k_scale, dt),
                     values=exactly_dequantized(vc, batch.v_scale, dt), cache_keys=kc, cache_values=vc,
                     sinks=sinks)


__all__ = ["BatchData", "exactly_dequantized", "fp8_batch_data", "make_batch_data", "quantize_fp8", "shifted_query"]
