"""The "CUDA-graph padding" production state: a decode batch padded up to a captured batch size.

An engine that replays a CUDA graph captured for ``B`` requests runs a batch of ``N < B`` requests as ``B``:
``B - N`` trailing **pad sequences** (``Batch.num_pad_seqs``) whose metadata the engine fills with a constant,
and one query row per pad. The kernel computes the pad rows too; the engine drops them afterwards, but inside
the model they flow on (one NaN there reaches batch-wide fp8 activation scales and so every co-batched
request). The contract: real rows come out exactly as without the padding, pad rows come out finite.

Two conventions (:data:`CONVENTIONS`), as each engine pads (read off the sources named):

``"vllm"`` (vllm 0.33.0, vllm/v1/worker/gpu_model_runner.py, under ``cudagraph_mode == FULL``: ``pad_attn``)
    ``_prepare_inputs``: ``query_start_loc.np[num_reqs + 1:].fill(cu_num_tokens[-1])`` (a pad has query_len
    0: query_start_loc repeats its last real value) and ``optimistic_seq_lens_cpu[num_reqs:].fill_(0)`` (seq_len
    0). ``_build_attention_metadata._get_block_table``: ``blk_table_tensor[num_reqs:num_reqs_padded]
    .fill_(NULL_BLOCK_ID)`` (block id 0, vllm/v1/attention/backends/utils.py), ``num_actual_tokens =
    num_tokens_padded`` and ``max_seq_len`` over the real requests only. ``_get_slot_mappings``: pad tokens'
    slots are ``-1`` (PAD_SLOT_ID), so no cache writer writes them. The backend
    (vllm/v1/attention/backends/triton_attn.py, ``TritonAttentionImpl.forward``) then calls
    ``unified_attention(q=query[:num_actual_tokens], out=output[:num_actual_tokens], ...)``: the query and
    output carry one row per pad token (uniform decode: one per pad request) past ``query_start_loc[-1]``, rows
    no sequence owns; FLASH_ATTN (vllm/v1/attention/backends/flash_attn.py, FA3) passes the same to
    ``flash_attn_varlen_func``. The MLA decode backends (TRITON_MLA, FLASHMLA) take no query_start_loc: row ``i``
    is sequence ``i``, so each pad owns its query row (``query_start_loc(row_per_seq=True)``).
``"sglang"`` (sglang, python/sglang/srt/model_executor/cuda_graph_runner.py, ``CudaGraphRunner.replay_prepare``)
    ``seq_lens.fill_(seq_len_fill_value)`` and ``out_cache_loc.zero_()`` before copying the real rows in; the
    Triton backend's ``get_cuda_graph_seq_len_fill_value`` returns 1, so a pad is a decode of seq_len 1
    whose one position is token slot 0 (``req_to_token`` of the reserved row is 0), the slot every allocator
    keeps back "for writing dummy outputs from padded tokens" (mem_cache/allocator.py ``clear``: free pages
    start at 1). The pad token's own key and value were written there (out_cache_loc 0), so slot 0 holds
    finite values.

Nothing here knows a kernel: :class:`Padding` gives the padded metadata of one call as the engine builds it;
each adapter that declares a convention (``Capabilities.cuda_graph_padding``) builds its call from it.
"""

from __future__ import annotations

import attrs
import torch

from .space import host_tensor, table_tensor
from .state import State

#: The padding conventions a target can declare (``Capabilities.cuda_graph_padding``); see the module docstring.
CONVENTIONS = ("vllm", "sglang")
#: vLLM's null block (vllm/v1/attention/backends/utils.py ``NULL_BLOCK_ID``), every pad's block table row.
NULL_BLOCK_ID = 0
#: SGLang's reserved token slot (and page) 0, the one position a pad reads.
PAD_SLOT = 0
#: Seed offset of the pad rows' query values (finite, drawn from ``batch.seed``).
PAD_QUERY_SEED = 7


@attrs.frozen
class Padding:
    """The padded call of ``batch`` (``batch.num_pad_seqs`` pads, :data:`CONVENTIONS` ``convention``).

    Real sequences come first, unchanged; pads follow. With no pads every method returns what the batch's own
    method does (``Batch.query_start_loc_tensor`` ...), so an adapter can build every call through it.
    """

    batch: object
    convention: str = "vllm"

    def __attrs_post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"unknown padding convention {self.convention!r}; known: {list(CONVENTIONS)}")

    @property
    def num_pads(self) -> int:
        return self.batch.num_pad_seqs

    @property
    def num_seqs(self) -> int:
        """Sequences in the call: real and pad."""
        return self.batch.num_seqs + self.num_pads

    @property
    def num_rows(self) -> int:
        """Query (and output) rows in the call: the batch's tokens and one per pad."""
        return self.batch.num_tokens + self.num_pads

    @property
    def pad_seq_len(self) -> int:
        """A pad's seq_len: 0 (vLLM) or SGLang's ``seq_len_fill_value`` 1."""
        return 0 if self.convention == "vllm" else 1

    def seq_lens(self) -> tuple[int, ...]:
        return self.batch.seq_lens + (self.pad_seq_len,) * self.num_pads

    def query_start_loc(self, row_per_seq: bool = False) -> tuple[int, ...]:
        """vLLM: the last real value repeated (pads own no row); SGLang: one row per pad. ``row_per_seq``: as a
        decode-only kernel sees it, which takes no query_start_loc and computes row ``i`` for sequence ``i``, so
        each pad owns its row under either convention (vLLM's TRITON_MLA ``forward_mqa``: ``B = q.shape[0]``,
        the padded tokens, over ``seq_lens.shape[0]``, the padded requests; FLASHMLA's ``forward_mqa``: ``q`` of
        ``num_decode_tokens`` rows, ``cache_seqlens`` the padded ``seq_lens[:num_decodes]``)."""
        qsl = self.batch.query_start_loc
        t = qsl[-1]
        step = 0 if self.convention == "vllm" and not row_per_seq else 1
        return qsl + tuple(t + step * (i + 1) for i in range(self.num_pads))

    def block_table(self) -> tuple[tuple[int, ...], ...]:
        """Pad rows all :data:`NULL_BLOCK_ID` (SGLang's pad reads page 0, the same id)."""
        return self.batch.block_table + ((NULL_BLOCK_ID,) * self.batch.max_blocks_per_seq,) * self.num_pads

    def seq_lens_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs]`` (real + pads)."""
        return host_tensor(self.seq_lens(), torch.int32, device)

    def query_start_loc_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs + 1]`` (real + pads)."""
        return host_tensor(self.query_start_loc(), torch.int32, device)

    def block_table_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """int32 ``[num_seqs, max_blocks_per_seq]`` (real + pads)."""
        return table_tensor(self.block_table(), torch.int32, device)

    def query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` ``[T, H, D]`` with one finite row per pad after it ``[T + pads, H, D]`` (the engine's pad
        tokens are embeddings of token 0: finite values the kernel may read, drawn from the batch's seed)."""
        if not self.num_pads:
            return query
        gen = torch.Generator().manual_seed(self.batch.seed + PAD_QUERY_SEED)
        pad = torch.randn((self.num_pads, *query.shape[1:]), generator=gen, dtype=torch.float32)
        return torch.cat([query, pad.to(query.dtype).to(query.device)])

    def output(self, shape_tail: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """An output buffer ``[T + pads, *shape_tail]`` (the harness fills it before the kernel runs)."""
        return torch.empty((self.num_rows, *shape_tail), dtype=dtype, device=device)

    def token_slots(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's CSR token lists with the pads appended: each pad lists :data:`PAD_SLOT` once."""
        if not self.num_pads:
            return kv_indptr, kv_indices
        end = int(kv_indptr[-1])
        step = self.pad_seq_len
        more = torch.arange(1, self.num_pads + 1, dtype=kv_indptr.dtype, device=kv_indptr.device) * step + end
        pads = torch.full((self.num_pads * step,), PAD_SLOT, dtype=kv_indices.dtype, device=kv_indices.device)
        return torch.cat([kv_indptr, more]), torch.cat([kv_indices[:end], pads, kv_indices[end:]])


def padding(batch, convention: str | None) -> Padding:
    """The :class:`Padding` of ``batch`` under ``convention`` (a target's ``Capabilities.cuda_graph_padding``;
    None: no convention, and the batch must have no pads). Raises ValueError for pads without a convention."""
    if convention is None:
        if batch.num_pad_seqs:
            raise ValueError(f"the batch has {batch.num_pad_seqs} CUDA-graph pad sequences but the target declares "
                             "no padding convention (Capabilities.cuda_graph_padding)")
        return Padding(batch)
    return Padding(batch, convention)


def _validate(capabilities) -> None:
    if capabilities.cuda_graph_padding is not None and capabilities.cuda_graph_padding not in CONVENTIONS:
        raise ValueError(f"unknown cuda_graph_padding {capabilities.cuda_graph_padding!r}; known: "
                         f"{list(CONVENTIONS)} (or None)")


#: The state's declaration: ``Capabilities.cuda_graph_padding``, a convention of :data:`CONVENTIONS` or None; a
#: batch is in it with pad sequences (``Batch.num_pad_seqs``). Its oracle's hooks: kvfuzz.fuzz.harness.padding.
STATE = State("cuda_graph_padding", "cuda-graph padding", None, "CUDA-graph pad sequences", "cuda-graph-padding",
              __name__, lambda b: b.num_pad_seqs > 0, _validate)


__all__ = ["CONVENTIONS", "NULL_BLOCK_ID", "PAD_QUERY_SEED", "PAD_SLOT", "STATE", "Padding", "padding"]
