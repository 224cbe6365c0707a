"""Deliberately broken kernels for the metamorphic relations (tests/fuzz/harness/test_relations.py): torch SDPA over a
paged cache (examples/sdpa_paged_target.py) with one defect each, every one of which the fp64 oracle may miss (finite
poison, small errors) but exactly one relation catches."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from sdpa_paged_target import SdpaPaged  # noqa: E402


def _scale(a):
    """The call's softmax scale; None (the batch left it to the kernel) is SDPA's default 1/sqrt(head_size)."""
    return a["scale"] if a["scale"] is not None else a["query"].shape[-1] ** -0.5


def _sdpa(a, seq_order=None, extra_slot=False, first_block_only=False, scale_of=None):
    """SDPA per sequence, with the defects as switches."""
    bs = a["key_cache"].shape[1]
    qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
    out = a["output"]
    for i, seq_len in enumerate(seq_lens):
        n = seq_len + 1 if extra_slot and seq_len % bs else seq_len  # one slot past seq_len, inside the block
        pos = torch.arange(n)
        if first_block_only:  # assumes the sequence's blocks are contiguous after its first
            slots = (a["block_table"][i, 0].long() * bs + pos) % (a["key_cache"].shape[0] * bs)
        else:
            slots = a["block_table"][i, pos // bs].long() * bs + pos % bs
        k = a["key_cache"][slots // bs, slots % bs].transpose(0, 1)
        v = a["value_cache"][slots // bs, slots % bs].transpose(0, 1)
        q = a["query"][qsl[i]:qsl[i + 1]].transpose(0, 1)
        ql = q.shape[1]
        mask = pos[None, :] <= (n - ql + torch.arange(ql))[:, None]
        scale = a["scale"] if scale_of is None else scale_of(i, len(seq_lens))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
    return out


class ReadsPastSeqLen(SdpaPaged):
    """Attends to one more key than seq_len (the slot after the last token, in the last block's tail)."""

    name = "broken.reads_past_seq_len"
    description = "SDPA reading one slot past seq_len"

    def run(self, call):
        return _sdpa(call.kwargs, extra_slot=True)


class FirstBlockOnly(SdpaPaged):
    """Uses the block table's first column only and assumes the rest follow contiguously."""

    name = "broken.first_block_only"
    description = "SDPA ignoring the block table past the first block"

    def run(self, call):
        return _sdpa(call.kwargs, first_block_only=True)


class SequenceIndexDependent(SdpaPaged):
    """Sequence i's softmax scale drifts by 1e-6 * i (as a kernel mixing up per-sequence metadata would)."""

    name = "broken.sequence_index_dependent"
    description = "SDPA whose result depends on a sequence's index in the batch"

    def run(self, call):
        base = _scale(call.kwargs)
        return _sdpa(call.kwargs, scale_of=lambda i, n: base * (1 + 1e-6 * i))


class BatchSizeDependent(SdpaPaged):
    """Takes another (here: slightly perturbed) path when the batch has more than one sequence, as a kernel
    whose split heuristic depends on the batch does."""

    name = "broken.batch_size_dependent"
    description = "SDPA whose result depends on the number of sequences"

    def run(self, call):
        base = _scale(call.kwargs)
        return _sdpa(call.kwargs, scale_of=lambda i, n: base * (1 + 1e-6 * (n > 1)))


class Noisy(SdpaPaged):
    """Adds fresh random noise of 1e-6 to every output (an atomic-add reduction's run-to-run jitter)."""

    name = "broken.noisy"
    description = "SDPA with run-to-run noise"

    def run(self, call):
        out = _sdpa(call.kwargs)
        out += 1e-6 * torch.randn(out.shape, dtype=out.dtype)
        return out


class DecodeReadsStaleRow(SdpaPaged):
    """Decode rows (query_len == 1) leave out the current token: a decode path off by one that a prefill path
    of the same kernel does not share."""

    name = "broken.decode_misses_own_token"
    description = "SDPA whose decode rows leave out the current token"

    def run(self, call):
        a = call.kwargs
        out = _sdpa(a)
        qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
        for i, n in enumerate(seq_lens):
            if qsl[i + 1] - qsl[i] == 1 and n > 1:
                sub = dict(a, query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([n - 1]),
                           block_table=a["block_table"][i:i + 1], query=a["query"][qsl[i]:qsl[i] + 1],
                           output=torch.empty_like(out[qsl[i]:qsl[i] + 1]))
                out[qsl[i]] = _sdpa(sub)[0]
        return out
