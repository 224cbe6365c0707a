"""The base of kvfuzz's mutant zoo (:mod:`kvfuzz.fuzz.bench.mutants`): :class:`PagedTorch`, a reference-style
torch paged-attention kernel over the NHD cache layout with the unified contract, written out step by step
(block table, flat element offsets, query head -> kv head, masks, softmax) so that a mutant can break one
step; :func:`mutant`, the class decorator that declares a mutant; :func:`small_batch`, the hand-written small
batches the mutants' smallest triggers are made of; and :func:`batch_size`, the sizes a shrunk case is compared
by."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch

from kvfuzz.contracts.caches.layouts import NHDLayout
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.fuzz.targets.base import Availability, KernelCall, Target
from kvfuzz.strategies.reductions import SIZE_FIELDS, size_key


class PagedTorch(Target):
    """The unmutated base: correct paged attention in torch (fp32 accumulation), unified contract, NHD cache.

    Arguments (``KernelCall.kwargs``): query ``[T, H, D]``, key_cache/value_cache ``[NB, BS, Hkv, D]`` (in the
    batch dtype, or fp8 for an fp8 kv_cache_dtype, dequantized as ``fp8 * k_scale``), block_table int32
    ``[N, W]``, seq_lens int32 ``[N]``, query_start_loc int32 ``[N+1]``, scale (float, or None for the
    kernel's default ``1/sqrt(head_size)``; kvfuzz passes ``batch.sm_scale``), k_scale/v_scale (float),
    sliding_window (None or W keys), softcap (None or c), alibi_slopes (None or float32 ``[H]``),
    output ``[T, H, D]``.
    """

    name: ClassVar[str] = "mutant.base"
    description: ClassVar[str] = "unmutated torch paged attention (the base every mutant breaks)"
    trigger: ClassVar[str] = "never (correct kernel)"
    bug: ClassVar[str] = ""
    capabilities = Capabilities(contract=Contract.UNIFIED, devices=("cpu",),
                                dtypes=("float32", "float16", "bfloat16"), head_sizes=(24, 32, 64, 128, 256),
                                block_sizes=(8, 16, 32), kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
                                features=("sliding_window", "alibi", "softcap"))

    def availability(self) -> Availability:
        return Availability(True, f"torch {torch.__version__}", "cpu")

    def layout(self, batch: Batch) -> NHDLayout:
        return NHDLayout()

    def build_call(self, batch, data, cache) -> KernelCall:
        dev = cache.key_cache.device
        out = torch.zeros((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype,
                          device=dev)
        kwargs = dict(query=data.query.to(dev), key_cache=cache.key_cache, value_cache=cache.value_cache,
                      block_table=batch.block_table_tensor(dev), seq_lens=batch.seq_lens_tensor(dev),
                      query_start_loc=batch.query_start_loc_tensor(dev), scale=batch.sm_scale, output=out,
                      k_scale=batch.k_scale, v_scale=batch.v_scale, sliding_window=batch.sliding_window,
                      softcap=batch.softcap, alibi_slopes=batch.alibi_slopes_tensor(dev))
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    # ---- the steps a mutant may break ------------------------------------------------------------------
    def softmax_scale(self, scale: float | None, num_heads: int, head_size: int) -> float:
        return scale if scale is not None else 1.0 / math.sqrt(head_size)

    def seq_lens_of(self, seq_lens: torch.Tensor) -> list[int]:
        return seq_lens.tolist()

    def physical_blocks(self, table_row: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Physical block ids of logical blocks ``cols`` (int64)."""
        return table_row[cols].long()

    def block_offsets(self, blocks: torch.Tensor, block_stride: int) -> torch.Tensor:
        """Element offset of each block's first element (int64)."""
        return blocks * block_stride

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """kv head read by each query head (vLLM's grouping ``h // (H // Hkv)``)."""
        return torch.arange(num_heads) // (num_heads // num_kv_heads)

    def keys_read(self, seq_len: int, block_size: int, decode: bool) -> int:
        """How many leading positions the kernel loads (K and V)."""
        return seq_len

    def dequantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """fp32 cache elements (fp8 codes or plain values) -> the values attention uses."""
        return x * scale

    def in_window(self, qpos: torch.Tensor, kpos: torch.Tensor, window: int, decode: bool) -> torch.Tensor:
        """``[Q, S]`` bool: keys inside a sliding window of ``window`` keys ending at each query position."""
        return kpos[None, :] > qpos[:, None] - window

    def allowed(self, qpos: torch.Tensor, kpos: torch.Tensor, seq_len: int, decode: bool,
                num_seqs: int) -> torch.Tensor:
        """``[Q, S]`` bool: which loaded keys each query row attends to (causal)."""
        return kpos[None, :] <= qpos[:, None]

    def combine(self, scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, decode: bool,
                num_seqs: int) -> torch.Tensor:
        """``scores [H, Q, S]`` (fp32, unmasked), ``allowed [Q, S]``, ``v [S, H, D]`` -> ``[Q, H, D]``."""
        p = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        return torch.einsum("hqs,shd->qhd", p, v)

    # ---- the kernel -------------------------------------------------------------------------------------
    def gather(self, cache: torch.Tensor, table_row: torch.Tensor, n: int, heads: torch.Tensor) -> torch.Tensor:
        """``[n, H, D]`` fp32: positions ``0..n-1`` of one sequence, for every query head, read through flat
        element offsets (an offset past the cache wraps around, so a wrong one reads some other slot)."""
        nb, bs, hkv, d = cache.shape
        pos = torch.arange(n)
        cols = pos // bs
        blocks = self.physical_blocks(table_row, cols)
        base = self.block_offsets(blocks, bs * hkv * d)
        idx = (base + (pos % bs) * hkv * d)[:, None, None] + heads[None, :, None] * d + torch.arange(d)[None, None]
        return cache.reshape(-1)[idx % cache.numel()].float()

    def run(self, call: KernelCall) -> torch.Tensor:
        a = call.kwargs
        q_all, kc, vc, out = a["query"], a["key_cache"], a["value_cache"], a["output"]
        nb, bs, hkv, d = kc.shape
        h = q_all.shape[1]
        scale = self.softmax_scale(a["scale"], h, d)
        qsl = a["query_start_loc"].tolist()
        seq_lens = self.seq_lens_of(a["seq_lens"])
        flat_table = a["block_table"].reshape(-1)
        width = a["block_table"].shape[1]
        heads = self.kv_heads(h, hkv)
        n_seqs = len(qsl) - 1
        for i in range(n_seqs):
            qs, qe = qsl[i], qsl[i + 1]
            seq_len = seq_lens[i]
            if qe == qs:
                continue
            if seq_len <= 0:  # an empty sequence: the kernel writes zeros
                out[qs:qe] = 0
                continue
            decode = qe - qs == 1
            n = self.keys_read(seq_len, bs, decode)
            # a row's columns, read row-major from the flat table (a column past the row reads the next row)
            row = flat_table[(i * width + torch.arange(-(-n // bs))) % flat_table.numel()]
            k = self.dequantize(self.gather(kc, row, n, heads), a["k_scale"])
            v = self.dequantize(self.gather(vc, row, n, heads), a["v_scale"])
            q = q_all[qs:qe].float()
            scores = torch.einsum("qhd,shd->hqs", q, k) * scale
            qpos = seq_len - (qe - qs) + torch.arange(qe - qs)
            kpos = torch.arange(n)
            if a["softcap"] is not None:
                scores = a["softcap"] * torch.tanh(scores / a["softcap"])
            if a["alibi_slopes"] is not None:
                scores = scores + a["alibi_slopes"][:, None, None] * (kpos[None, None, :] - qpos[None, :, None])
            allowed = self.allowed(qpos, kpos, seq_len, decode, n_seqs)
            if a["sliding_window"] is not None:
                allowed = allowed & self.in_window(qpos, kpos, a["sliding_window"], decode)
            out[qs:qe] = self.combine(scores, allowed, v, decode, n_seqs).to(out.dtype)
        return out


def mutant(slug: str, description: str, *, trigger: str, bug: str, smallest: Callable[[], Batch]):
    """A class decorator declaring a mutant of :class:`PagedTorch` (kvfuzz.fuzz.bench.mutants): sets its ``name``
    (``"mutant.<slug>"``), ``description`` (what it breaks), ``trigger`` (when the defect changes the output), ``bug``
    (the real bug it models) and ``smallest``, a static method returning its smallest trigger (a :class:`Batch`,
    :func:`~kvfuzz.fuzz.bench.mutants.smallest_trigger`)."""

    def declare(cls: type[PagedTorch]) -> type[PagedTorch]:
        cls.name, cls.description, cls.trigger, cls.bug = f"mutant.{slug}", description, trigger, bug
        cls.smallest = staticmethod(smallest)
        return cls

    return declare


def small_batch(query_lens, ctx_lens, heads=(1, 1), head_size=24, block_size=8, num_blocks=None, table=None,
                **kw) -> Batch:
    """A small batch (a mutant's smallest trigger, a test's case): ``heads`` is ``(num_heads, num_kv_heads)``;
    ``table`` the block table (default: contiguous, :func:`~kvfuzz.contracts.model.batch.contiguous_batch`) and
    ``num_blocks`` the pool (default: one past the largest used id)."""
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, ctx_lens)]
    if table is None:
        return contiguous_batch(query_lens, ctx_lens, block_size=block_size, num_heads=heads[0],
                                num_kv_heads=heads[1], head_size=head_size,
                                spare_blocks=0 if num_blocks is None else num_blocks - sum(need), **kw)
    if num_blocks is None:
        num_blocks = max(max(r[:n]) for r, n in zip(table, need)) + 1
    return Batch(query_lens=query_lens, ctx_lens=ctx_lens, num_heads=heads[0], num_kv_heads=heads[1],
                 head_size=head_size, block_size=block_size, num_blocks=num_blocks, block_table=table, **kw)


def batch_size(batch: Batch) -> dict[str, int]:
    """The sizes a shrunk case is compared by (:func:`kvfuzz.strategies.reductions.size_key`, its fields
    named), plus ``kv_heads`` and ``block_size`` for display."""
    return {**dict(zip(SIZE_FIELDS, size_key(batch))), "kv_heads": batch.num_kv_heads,
            "block_size": batch.block_size}


__all__ = ["PagedTorch", "batch_size", "mutant", "small_batch"]
