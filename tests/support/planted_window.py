"""Torch paged-attention kernels with planted sliding-window defects.

Two torch paged-attention kernels behind a sliding-window KV manager that frees the blocks before the window
(``Capabilities.freed_window_blocks``): one reads them, one does not. The test of the freed-window state
(tests/fuzz/harness/test_freed_window_blocks.py).

Both are :class:`~kvfuzz.fuzz.bench.paged_torch.PagedTorch` (reads all ``seq_len`` positions through the block
table, masks the scores by causality and window) declaring the state:

- :class:`ReadsFreedBlocks` multiplies P by V over every key it loaded, so a key before the window contributes
  ``0 * V``: NaN/inf when its block was freed to the null block (the defect of vLLM PR #30887 before its fix,
  unified_attention's missing V mask);
- :class:`SkipsFreedBlocks` zeroes V outside every query row's window first (#30887's fix,
  ``V = tl.where(sw_mask_v, V, 0.0)``), so it never uses what the null block holds.

And :class:`WindowStraddledAtLargeHeads`, wrong only on serving-sized batches: the serving tier's test
(tests/fuzz/campaign/test_tiers_campaign.py). :class:`IgnoresWindow` (wrong only with a window, Finding 12's shape)
and :class:`IgnoresWindowAndScales` (wrong with or without one): the baseline's ``"sliding_window"`` feature
(tests/fuzz/campaign/test_baseline.py).
"""

import attrs
import torch

from kvfuzz.fuzz.bench.paged_torch import PagedTorch

_CAPS = attrs.evolve(PagedTorch.capabilities, freed_window_blocks=True)


class ReadsFreedBlocks(PagedTorch):
    name = "planted.window_reads_freed"
    description = "torch paged attention that multiplies P by V over out-of-window keys (reads freed blocks)"
    capabilities = _CAPS


class SkipsFreedBlocks(PagedTorch):
    name = "planted.window_skips_freed"
    description = "torch paged attention that zeroes V outside the window (never uses freed blocks)"
    capabilities = _CAPS

    def combine(self, scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, decode: bool,
                num_seqs: int) -> torch.Tensor:
        p = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        return torch.einsum("hqs,shd->qhd", p, v.masked_fill(~allowed.any(dim=0)[:, None, None], 0.0))


class WindowStraddledAtLargeHeads(PagedTorch):
    """A planted serving-sized defect shaped like vLLM 0.33.0's FA3 sliding-window failure (issue 38): correct
    torch paged attention, except that at head size >= 192 with a window of >= 256 keys, the rows of a prefill
    chunk (query_len >= 2) whose context runs past the window (ctx_len >= sliding_window) come out scaled by 1.5.
    The small tier never draws it (contexts of at most 96 tokens); the serving tier's chunks straddle windows.
    Declares the small and serving tiers."""

    name = "planted.window_straddled_large_heads"
    description = "torch paged attention wrong on a prefill chunk past a window >= 256 keys at head size >= 192"
    tiers = ("small", "serving")
    capabilities = attrs.evolve(PagedTorch.capabilities, head_sizes=(192, 256), kv_cache_dtypes=("auto",),
                                features=("sliding_window",))

    def run(self, call):
        out = super().run(call)
        a = call.kwargs
        window, d = a["sliding_window"], a["query"].shape[-1]
        if window is None or window < 256 or d < 192:
            return out
        qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
        for i, seq_len in enumerate(seq_lens):
            q = qsl[i + 1] - qsl[i]
            if q >= 2 and seq_len - q >= window:
                out[qsl[i]:qsl[i + 1]] *= 1.5
        return out


class IgnoresWindow(PagedTorch):
    """Finding 12's shape (FA3's wrong output past a sliding window): correct torch paged attention that attends to
    every causal key, the window ignored, so only query positions past a window come out wrong; declares the
    freed-window state (a freed block's keys then reach the output too)."""

    name = "planted.window_ignored"
    description = "torch paged attention that ignores the sliding window (wrong only with one)"
    capabilities = _CAPS

    def in_window(self, qpos: torch.Tensor, kpos: torch.Tensor, window: int, decode: bool) -> torch.Tensor:
        return torch.ones(len(qpos), len(kpos), dtype=torch.bool)


class IgnoresWindowAndScales(IgnoresWindow):
    """:class:`IgnoresWindow` whose output is also scaled by 1.5: wrong with or without a window."""

    name = "planted.window_ignored_and_scaled"
    description = "torch paged attention that ignores the sliding window and scales its output by 1.5"

    def run(self, call):
        return super().run(call).mul_(1.5)
