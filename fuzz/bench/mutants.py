"""A zoo of deliberately broken paged-attention kernels, each modeled on a real bug (docs/contracts.md §5).

Every mutant subclasses :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch` (fuzz/bench/paged_torch.py), a
reference-style torch kernel over the NHD cache layout with the unified contract (the same math as
``examples/sdpa_paged_target.py``'s ``SdpaPaged``, written out step by step so that one step can be broken): it reads
the block table, addresses the cache through flat element offsets
(``block * BS*Hkv*D + slot_in_block * Hkv*D + kv_head * D + d``, as a CUDA/Triton kernel does), maps query heads to
kv heads, masks, and combines with a softmax. A mutant overrides exactly one step.

``MUTANTS`` maps ``"mutant.<slug>"`` to the class; each class is declared by
:func:`~kvfuzz.fuzz.bench.paged_torch.mutant` with a ``trigger`` string (when the defect changes the output) and a
``bug`` string (the real bug it models). :func:`smallest_trigger` returns a hand-written
minimal batch that triggers it (verified by tests/fuzz/bench/test_mutants.py with NaN poison).

Two real defects cannot be reached at real scale on a CPU, so their mutants scale the machine word down and
say so: ``int32_offset_overflow`` wraps element offsets at ``2**OFFSET_BITS`` (16, not 32) and
``block_id_16bit`` truncates block ids to ``ID_BITS`` (5, not 16) bits.
"""

from __future__ import annotations

import math

import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.fuzz.bench.paged_torch import PagedTorch, mutant, small_batch
from kvfuzz.fuzz.targets.base import Target

#: Emulated width of the element-offset word of ``int32_offset_overflow`` (real: 32 bits, signed: 2**31).
OFFSET_BITS = 16
#: Emulated width of the block-id field of ``block_id_16bit`` (real: 16 bits, 65536 blocks).
ID_BITS = 5
#: Partition (split-KV chunk) size of ``split_kv_exact_multiple``.
PARTITION = 16


# ---- the mutants --------------------------------------------------------------------------------------------

@mutant("decode_misses_own_token", "decode rows leave out the current token",
         trigger="any decode sequence (query_len == 1)",
         bug="§5.7 mask off by one (vllm issue 3385, sglang PR 26147); README's decode-token story",
         smallest=lambda: small_batch([1], [0]))
class DecodeMissesOwnToken(PagedTorch):
    """Mask off by one on decode: a decode row attends to positions ``0..seq_len-2`` and misses its own token
    (the kernel took ``context_len = seq_len - 1`` as the number of keys, the mix-up behind the vLLM seeds'
    decode-token story in README.md and the W vs W+1 off-by-ones of §5.7). A decode sequence of length 1 has
    no key left: 0/0 = NaN."""

    def allowed(self, qpos, kpos, seq_len, decode, num_seqs):
        ok = super().allowed(qpos, kpos, seq_len, decode, num_seqs)
        return ok & (kpos[None, :] < seq_len - 1) if decode else ok


def _whole_blocks(self, seq_len, block_size, decode):
    """``keys_read`` of a kernel that loads whole blocks: every slot up to the end of the sequence's last block."""
    return -(-seq_len // block_size) * block_size


@mutant("tail_v_unmasked", "V of the last block's tail slots multiplied by p = 0 (0 * NaN)",
         trigger="seq_len % block_size != 0 and NaN/inf in the unwritten tail slots",
         bug="§5.3 NaN from unmasked V tail (vllm PR 936, PR 53856: ctx 4090 fails / 4096 passes; FA issue 2374)",
         smallest=lambda: small_batch([1], [0]))
class TailVUnmasked(PagedTorch):
    """Tail slots read unmasked: the kernel loads whole blocks and masks the scores of positions past seq_len
    with -inf, but multiplies their V by the resulting 0 — ``0 * NaN = NaN``. Correct for zeroed or stale
    (finite) tails; wrong only when the unused tail of the last block holds NaN/inf."""

    keys_read = _whole_blocks


@mutant("decode_tail_unmasked", "decode rows attend to the unused tail slots of their last block",
         trigger="a decode sequence with seq_len % block_size != 0 (any poison: stale data is read)",
         bug="§5.3 / §5.5 unmasked partial final block (vllm PR 936, flash-attention PR 2711)",
         smallest=lambda: small_batch([1], [0]))
class DecodeTailUnmasked(PagedTorch):
    """Tail slots attended on decode: the decode path loops over whole blocks and checks ``kpos < nblocks *
    block_size`` instead of ``kpos < seq_len``, so a decode row also attends to the stale slots after its
    last token (prefill rows are masked causally and are right)."""

    keys_read = _whole_blocks

    def allowed(self, qpos, kpos, seq_len, decode, num_seqs):
        if decode:
            return torch.ones((len(qpos), len(kpos)), dtype=torch.bool)
        return super().allowed(qpos, kpos, seq_len, decode, num_seqs)


@mutant("gqa_modulo", "kv head h % Hkv instead of h // ratio",
         trigger="GQA with num_kv_heads >= 2 and ratio >= 2 (e.g. H=4, Hkv=2), seq_len >= 1",
         bug="§5.6 GQA mapping bugs (FlashInfer issues 2896, 2849)",
         smallest=lambda: small_batch([1], [0], heads=(4, 2)))
class GqaModulo(PagedTorch):
    """Wrong GQA head mapping: query head ``h`` reads kv head ``h % Hkv`` instead of ``h // (H // Hkv)``.
    Identical when Hkv == 1 (MQA) or H == Hkv (MHA)."""

    def kv_heads(self, num_heads, num_kv_heads):
        return torch.arange(num_heads) % num_kv_heads


@mutant("gqa_pow2_group", "kv head h >> log2(ratio): wrong for group sizes 3, 7",
         trigger="GQA ratio not a power of two (3, 7) with num_heads >= 3",
         bug="§5.6 group size 7 (28/4 heads) precision/crash (FlashInfer issue 2896)",
         smallest=lambda: small_batch([1], [0], heads=(3, 1)))
class GqaPow2Group(PagedTorch):
    """GQA group size assumed a power of two: kv head ``h >> floor(log2(ratio))``. For ratio 3 or 7 some heads
    read the wrong kv head or, past the last one, the next slot's head 0 (a flat offset past the row). Replaces
    the sliding-window off-by-one (§5.7), which kvfuzz cannot model yet (no window)."""

    def kv_heads(self, num_heads, num_kv_heads):
        shift = int(math.floor(math.log2(num_heads // num_kv_heads)))
        return torch.arange(num_heads) >> shift


@mutant("contiguous_blocks", "reads block_table[i, 0] + logical block instead of block_table[i, logical block]",
         trigger="a sequence over >= 2 blocks whose ids are not consecutive ascending (reversed/permuted table)",
         bug="§5.11 kernel assumes contiguous slots bt[i//BS]*BS + i%BS (vllm PR 42420)",
         smallest=lambda: small_batch([1], [8], table=[[0, 2]], num_blocks=3))
class ContiguousBlocks(PagedTorch):
    """Block table ignored past the first block: slot = ``block_table[i, 0] * BS + pos`` (the contiguous-slot
    assumption). Right when a sequence's blocks happen to be consecutive and ascending."""

    def physical_blocks(self, table_row, cols):
        return table_row[0].long() + cols


@mutant("int32_offset_overflow", f"block offset wraps at 2**{OFFSET_BITS} elements (scaled-down int32 overflow)",
         trigger=f"a used block id b with b * block_size * num_kv_heads * head_size >= 2**{OFFSET_BITS}",
         bug="§5.1 int32 overflow of block_idx*Hkv*D*BS (vllm PR 1514, issue 50427; FlashInfer PR 3136)",
         # the minimum in the benchmark's order (heads, then head size, then blocks) among the ids the strategies
         # draw (up to 64): one head of size 32 wraps at block 64 of 32 tokens (64 * 32 * 32 = 65536); head size 24
         # would need block 86
         smallest=lambda: small_batch([1], [0], head_size=32, block_size=32, table=[[64]], num_blocks=65))
class Int32OffsetOverflow(PagedTorch):
    """Element offset of a block computed in a narrow word: ``(block * BS*Hkv*D) mod 2**OFFSET_BITS``.

    Real: int32 ``block_idx * Hkv * D * BS`` wraps once it passes 2**31 (vllm PR 1514, FlexAttention vllm issue
    50427, FlashInfer PR 3136), i.e. 32768+ blocks of 16 x 8 x 256. kvfuzz's CPU strategies draw < 100 blocks,
    so the word is scaled down to OFFSET_BITS = 16: it wraps when ``block * BS * Hkv * D >= 65536`` — block >= 2
    at BS 32, Hkv 4, D 256; block >= 16 at BS 16, Hkv 2, D 128; block >= 64 at BS 32, Hkv 1, D 32; unreachable at
    BS 8, Hkv 1, D 24 (block 342)."""

    def block_offsets(self, blocks, block_stride):
        return (blocks * block_stride) % (1 << OFFSET_BITS)


@mutant("block_id_16bit", f"block ids & 0x{(1 << ID_BITS) - 1:X} (scaled-down 16-bit truncation)",
         trigger=f"a used block id >= 2**{ID_BITS} = {1 << ID_BITS}",
         bug="§5.2 block id truncated to 16 bits (ROCm/ATOM issue 702)",
         smallest=lambda: small_batch([1], [0], table=[[1 << ID_BITS]], num_blocks=(1 << ID_BITS) + 1))
class BlockId16Bit(PagedTorch):
    """Block ids truncated to a narrow field: ``id & (2**ID_BITS - 1)``.

    Real: ids & 0xFFFF breaks past 65535 blocks (ROCm/ATOM issue 702). Unreachable on CPU (and by vLLM's own
    grid, whose largest cache has 32768 blocks), so the field is scaled down to ID_BITS = 5: it triggers when a
    sequence uses a block id >= 32."""

    def physical_blocks(self, table_row, cols):
        return table_row[cols].long() & ((1 << ID_BITS) - 1)


@mutant("scale_ignored", "passed sm_scale ignored, 1.0 used",
         trigger="sm_scale passed explicitly and != 1 (any row attending >= 2 keys)",
         bug="§5.10 scales ignored / defaulted to 1.0 (vllm PR 42080, sglang PR 18882)",
         smallest=lambda: small_batch([1], [1], sm_scale=0.125))
class ScaleIgnored(PagedTorch):
    """An explicitly passed softmax scale is ignored and 1.0 used (the kernel reads the scale only on a path
    the caller did not take); the softmax-scale sibling of :class:`Fp8ScaleIgnored`. The default path
    (scale=None -> 1/sqrt(D)) is right, so only a caller that passes a scale sees it."""

    def softmax_scale(self, scale, num_heads, head_size):
        return 1.0 if scale is not None else 1.0 / math.sqrt(head_size)


@mutant("default_scale_num_heads", "default scale 1/sqrt(num_heads)",
         trigger="no sm_scale passed, num_heads != head_size, a row attending >= 2 keys",
         bug="§5.13 default sm_scale from num_heads (vllm PR 31380)",
         smallest=lambda: small_batch([1], [1]))
class DefaultScaleNumHeads(PagedTorch):
    """Default softmax scale from the wrong dimension: ``1/sqrt(num_heads)`` instead of ``1/sqrt(head_size)``
    when the caller passes no scale."""

    def softmax_scale(self, scale, num_heads, head_size):
        return scale if scale is not None else 1.0 / math.sqrt(num_heads)


@mutant("split_kv_exact_multiple", f"decode drops the last KV partition when seq_len % {PARTITION} == 0",
         trigger=f"a decode sequence with seq_len % {PARTITION} == 0",
         bug="§5.15 edge case at a multiple of the partition size (pytorch/xla PR 8431)",
         smallest=lambda: small_batch([1], [PARTITION - 1], block_size=16))
class SplitKvExactMultiple(PagedTorch):
    """Split-KV decode drops its last partition when seq_len is an exact multiple of the partition size
    (PARTITION = 16): the last full partition is treated as the "remainder" partition, of size
    ``seq_len % 16 == 0``. At seq_len 16 no key is left: 0/0 = NaN."""

    def allowed(self, qpos, kpos, seq_len, decode, num_seqs):
        ok = super().allowed(qpos, kpos, seq_len, decode, num_seqs)
        if decode and seq_len % PARTITION == 0:
            ok = ok & (kpos[None, :] < seq_len - PARTITION)
        return ok


@mutant("batch_dependent_split", "split count from num_seqs; multi-split combine without max rescaling",
         trigger="a decode sequence with seq_len >= 2 in a batch of <= 2 sequences",
         bug="§5.12 output depends on batch-mates (flash-attention issue 1897, FlashInfer PR 1675)",
         smallest=lambda: small_batch([1], [1]))
class BatchDependentSplit(PagedTorch):
    """Batch-dependent split count: decode rows split their keys into ``max(1, 4 // num_seqs)`` chunks (more
    splits for small batches, to fill the GPU), and the split combine forgets to rescale each chunk's partial
    sums by ``exp(m_chunk - m)``. One split (3+ sequences) is exact, so the output depends on the batch-mates."""

    def combine(self, scores, allowed, v, decode, num_seqs):
        splits = max(1, 4 // num_seqs)
        if not decode or splits == 1:
            return super().combine(scores, allowed, v, decode, num_seqs)
        s = scores.masked_fill(~allowed[None], float("-inf"))
        num = torch.zeros(v.shape[1], s.shape[1], v.shape[2])
        den = torch.zeros(v.shape[1], s.shape[1], 1)
        for chunk in torch.arange(s.shape[-1]).tensor_split(splits):
            if len(chunk) == 0:
                continue
            sc = s[..., chunk]
            m = sc.amax(-1, keepdim=True).clamp_min(-1e30)
            e = torch.exp(sc - m)  # BUG: no rescale by exp(m - global max)
            num += torch.einsum("hqs,shd->hqd", e, v[chunk])
            den += e.sum(-1, keepdim=True)
        return (num / den).transpose(0, 1)


@mutant("seq_lens_int64_as_int32", "seq_lens read as int32 words of an int64 tensor",
         trigger="a batch of >= 2 sequences",
         bug="§5.4 int64 metadata where int32 expected (FlashInfer issue 1654; vllm issue 28490 / PR 28905)",
         smallest=lambda: small_batch([1, 1], [0, 0]))
class SeqLensInt64AsInt32(PagedTorch):
    """int64 metadata read as int32: the kernel's seq_lens is promoted to int64 (a cumsum/sum upstream) and
    read as int32 words, so sequence ``i`` gets word ``i`` of ``[s0, 0, s1, 0, ...]``: sequence 1 gets length 0
    (zeros), sequence 2 gets s1, ..."""

    def seq_lens_of(self, seq_lens):
        return seq_lens.to(torch.int64).view(torch.int32)[: len(seq_lens)].tolist()


@mutant("fp8_scale_ignored", "fp8 cache read without k_scale/v_scale",
         trigger="an fp8 kv_cache_dtype with v_scale != 1 (any row), or k_scale != 1 (a row attending >= 2 keys)",
         bug="§5.10 fp8 k_scale/v_scale ignored or defaulted to 1.0 (vllm PR 42080, sglang PR 18882)",
         smallest=lambda: small_batch([1], [0], kv_cache_dtype="fp8_e4m3", v_scale=0.5))
class Fp8ScaleIgnored(PagedTorch):
    """fp8 k_scale/v_scale ignored: the kernel reads the fp8 cache and converts it to the compute dtype without
    multiplying by the scales (as if they were 1.0). A test whose cache is quantized with scale 1.0, or whose
    reference ignores the scale too, passes."""

    def dequantize(self, x, scale):
        return x


@mutant("sliding_window_off_by_one", "sliding window keeps W + 1 keys",
         trigger="a sliding window W and a query row at position >= W",
         bug="§5.7 sliding window off by one (vllm issue 3385, sglang PR 26147)",
         smallest=lambda: small_batch([1], [1], sliding_window=1))
class SlidingWindowOffByOne(PagedTorch):
    """Sliding window off by one: the kernel keeps keys with ``q_pos - k_pos <= W`` instead of ``< W``, so
    every row sees W + 1 keys (the model's W vs FlashAttention's ``window_size = (W - 1, 0)`` mix-up)."""

    def in_window(self, qpos, kpos, window, decode):
        return kpos[None, :] >= qpos[:, None] - window


@mutant("window_ignored_on_decode", "decode rows are not windowed",
         trigger="a decode sequence with seq_len > W",
         bug="§5.9 decode path ignores the sliding window (mistral.rs issue 2094)",
         smallest=lambda: small_batch([1], [1], sliding_window=1))
class WindowIgnoredOnDecode(PagedTorch):
    """Window ignored on decode: prefill rows are windowed, decode rows attend to the whole sequence (the
    decode path never received the window argument)."""

    def in_window(self, qpos, kpos, window, decode):
        ok = super().in_window(qpos, kpos, window, decode)
        return torch.ones_like(ok) if decode else ok


MUTANTS: dict[str, type[Target]] = {cls.name: cls for cls in (
    DecodeMissesOwnToken, TailVUnmasked, DecodeTailUnmasked, GqaModulo, GqaPow2Group, ContiguousBlocks,
    Int32OffsetOverflow, BlockId16Bit, Fp8ScaleIgnored, SlidingWindowOffByOne, WindowIgnoredOnDecode,
    ScaleIgnored, DefaultScaleNumHeads, SplitKvExactMultiple, BatchDependentSplit, SeqLensInt64AsInt32)}


def get_mutant(name: str) -> Target:
    """An instance of mutant ``name`` (``"mutant.<slug>"`` or ``"<slug>"``; ``"mutant.base"`` is the
    unmutated kernel). Raises KeyError naming the known mutants."""
    full = name if name.startswith("mutant.") else f"mutant.{name}"
    if full == PagedTorch.name:
        return PagedTorch()
    if full not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
    return MUTANTS[full]()


def smallest_trigger(name: str) -> Batch:
    """The smallest batch (fewest sequences, tokens, heads, then head size and blocks) that triggers mutant
    ``name`` when unwritten cache slots hold NaN (kvfuzz's first poison)."""
    return type(get_mutant(name)).smallest()


__all__ = ["MUTANTS", "PagedTorch", "get_mutant", "smallest_trigger", "OFFSET_BITS", "ID_BITS",
           "PARTITION"]
