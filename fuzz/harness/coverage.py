"""What a campaign exercised: kernel paths, the modeled ROCm decode-kernel selection, lengths at block
boundaries, GQA ratios, batch mixes and the declared parameter space (dtypes, kv_cache_dtypes, head and block
sizes, features). Each example's labels become Hypothesis events and campaign counts; :func:`declared_space`
sets the counts against what the target declares, so a user sees what was never drawn."""

from __future__ import annotations

import collections

import attrs

from kvfuzz.contracts.calls.rocm import rocm_custom_paged_attention_selected
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.states import PRODUCTION_STATES
from kvfuzz.fuzz.targets.base import Target
from kvfuzz.strategies.focus import log2_bin  # one definition: the bins a steered chunk's focus aims at

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


def batch_states(batch: Batch) -> str:
    """The production states a batch models, "+"-joined ("none" for none): each state's tag
    (:data:`~kvfuzz.contracts.model.states.PRODUCTION_STATES`, in its order): "shared-prefix" when sequences share
    full prefix blocks (vLLM's prefix caching, SGLang's radix cache; ``Batch.shared_prefix_blocks``),
    "freed-window" when blocks before the window are on the null block (``Batch.freed_window_blocks``),
    "cuda-graph-padding" when the call carries pad sequences (``Batch.num_pad_seqs``)."""
    out = [s.tag for s in PRODUCTION_STATES.values() if s.in_batch(batch)]
    return "+".join(out) or "none"


#: The shape dimensions (log2 bins; :func:`log2_bin`): the batch's longest context by its longest query, and its head
#: size by its window. ``kvfuzz report`` draws them as grids (fuzz/campaign/store/report.py).
SHAPE_DIMENSIONS = ("ctx_len x query_len", "head_size x window")


def labels(target: Target, batch: Batch) -> dict[str, str]:
    """Coverage labels of one example (dimension -> value): the kernel path, the batch mix, GQA, lengths against
    block boundaries, the modeled ROCm routing, the declared parameter space it exercised (dtype,
    kv_cache_dtype, head_size, block_size, the combination of features, the value range), the production
    states it models (:func:`batch_states`) and its shape on log2 bins (:data:`SHAPE_DIMENSIONS`)."""
    kinds = "".join(sorted({"d" if q == 1 else ("p" if c else "p0") for q, c in zip(batch.query_lens, batch.ctx_lens)}))
    out = {
        "path": target.path(batch),
        "mix": kinds,
        "gqa": "mqa" if batch.num_kv_heads == 1 and batch.num_heads > 1 else f"{batch.gqa_ratio}",
        "seq_len": ",".join(sorted({boundary_class(s, batch.block_size) for s in batch.seq_lens})),
        "dtype": batch.dtype,
        "kv_cache_dtype": batch.kv_cache_dtype,
        "head_size": str(batch.head_size),
        "block_size": str(batch.block_size),
        "features": "+".join(batch.features) or "none",
        "values": batch.value_range,
        "states": batch_states(batch),
        # shapes on log2 bins, so a report shows which a campaign never reached
        SHAPE_DIMENSIONS[0]: f"{log2_bin(max(batch.ctx_lens))} x {log2_bin(max(batch.query_lens))}",
        SHAPE_DIMENSIONS[1]: f"{batch.head_size} x "
                             f"{log2_bin(batch.sliding_window) if batch.sliding_window else 'none'}",
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


#: Coverage dimensions that correspond to a declared set of values, and the Capabilities field declaring it.
DECLARED_DIMENSIONS = {"dtype": "dtypes", "kv_cache_dtype": "kv_cache_dtypes", "head_size": "head_sizes",
                       "block_size": "block_sizes"}


def declared_space(target: Target, coverage: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """For each declared dimension (and each declared feature), how many examples drew each declared value:
    ``{"dtype": {"float16": 120, "float32": 0}, ..., "feature": {"sliding_window": 40, "alibi": 0}}``. A 0 is a
    value the campaign never exercised."""
    caps = target.capabilities
    out = {}
    for dim, field in DECLARED_DIMENSIONS.items():
        seen = coverage.get(dim, {})
        out[dim] = {str(v): seen.get(str(v), 0) for v in getattr(caps, field)}
    combos = coverage.get("features", {})
    out["feature"] = {f: sum(n for combo, n in combos.items() if f in combo.split("+")) for f in sorted(caps.features)}
    return out


__all__ = ["DECLARED_DIMENSIONS", "ROCM_FAMILIES", "ROCM_ROUTED", "SHAPE_DIMENSIONS", "Coverage", "batch_states",
           "boundary_class", "declared_space", "labels", "log2_bin", "rocm_decode_kernel"]
