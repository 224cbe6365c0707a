"""What a campaign exercised: kernel paths, the modeled ROCm decode-kernel selection, lengths at block
boundaries, GQA ratios and batch mixes. Each example's labels become Hypothesis events and campaign counts."""

from __future__ import annotations

import collections

import attrs

from kvfuzz.contracts.batch import Batch
from kvfuzz.contracts.rocm import rocm_custom_paged_attention_selected
from kvfuzz.fuzz.targets.base import Target

#: ROCm families and the architecture that stands for each in vLLM's selection rule (docs/contracts.md §4).
ROCM_FAMILIES = {"gfx90a/gfx942/gfx950": "gfx942", "gfx11/gfx12": "gfx1100"}
#: Targets whose decode sequences vLLM would route to the ROCm custom kernel where the rule allows.
ROCM_ROUTED = ("vllm.chunked_prefill_paged_decode",)


def rocm_decode_kernel(target: Target, batch: Batch) -> dict[str, str]:
    """Per ROCm family, which decode kernel vLLM would pick for this batch ("rocm-custom" or "triton"), for
    targets that route decode sequences that way; {} otherwise (no decode sequence, or another target)."""
    if target.name not in ROCM_ROUTED or not batch.decode_seqs:
        return {}
    out = {}
    for family, arch in ROCM_FAMILIES.items():
        selected, _ = rocm_custom_paged_attention_selected(
            arch, batch.torch_dtype, batch.head_size, batch.block_size, batch.gqa_ratio, batch.max_seq_len,
            kv_cache_dtype=batch.kv_cache_dtype)
        out[family] = "rocm-custom" if selected else "triton"
    return out


def boundary_class(length: int, block_size: int) -> str:
    """Where a length sits relative to block boundaries: "0", "k*bs", "k*bs-1", "k*bs+1" or "inside"."""
    if length == 0:
        return "0"
    r = length % block_size
    return {0: "k*bs", block_size - 1: "k*bs-1", 1: "k*bs+1"}.get(r, "inside")


def labels(target: Target, batch: Batch) -> dict[str, str]:
    """Coverage labels of one example (dimension -> value)."""
    kinds = "".join(sorted({"d" if q == 1 else ("p" if c else "p0") for q, c in zip(batch.query_lens, batch.ctx_lens)}))
    out = {
        "path": target.path(batch),
        "mix": kinds,
        "gqa": "mqa" if batch.num_kv_heads == 1 and batch.num_heads > 1 else f"{batch.gqa_ratio}",
        "seq_len": ",".join(sorted({boundary_class(s, batch.block_size) for s in batch.seq_lens})),
    }
    for family, kernel in rocm_decode_kernel(target, batch).items():
        out[f"rocm {family}"] = kernel
    return out


@attrs.define
class Coverage:
    """Counts of each label value per dimension."""

    counts: dict = attrs.Factory(lambda: collections.defaultdict(collections.Counter))

    def add(self, lab: dict[str, str]) -> None:
        for k, v in lab.items():
            self.counts[k][v] += 1

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v.most_common()) for k, v in self.counts.items()}

    def rarity(self, lab: dict[str, str]) -> float:
        """Higher for examples whose path and ROCm routing were seen less: the Hypothesis target() score."""
        keys = [k for k in lab if k == "path" or k.startswith("rocm")]
        return sum(1.0 / (1 + self.counts[k][lab[k]]) for k in keys)
