"""torch's paged FlexAttention: ``torch.nn.attention.experimental._paged_attention.PagedAttention`` with
``flex_attention`` (torch 2.13; experimental API).

Cache layout (:class:`FlexPagedLayout`): one key and one value tensor ``[1, Hkv, n_pages * page_size, D]``;
slot ``page * page_size + offset`` is row ``slot`` of dimension 2 (``PagedAttention.assign`` computes the same
address, ``physical_block_idx * page_size + logical_block_offset``). kvfuzz's ``num_blocks`` is ``n_pages``
and its ``block_size`` the ``page_size``.

Page table: kvfuzz's block table *is* the page table. ``PagedAttention`` keeps its own table
(``page_table [max_batch, n_pages]``: logical block -> physical page, ``physical_to_logical [max_batch,
n_pages]``: the inverse, ``capacity``, ``empty_pages``) and fills it in ``reserve()`` by popping pages from a
descending free list. The adapter does not call ``reserve()``: it writes the batch's block table into
``page_table`` (the ``blocks_needed`` used columns of each row; padding columns stay -1), the inverse into
``physical_to_logical``, sets ``capacity`` to the reserved length and ``empty_pages`` to the pages no sequence
uses — the state ``reserve()`` leaves, but for any table kvfuzz generates (permuted, reversed, fragmented),
which ``reserve()`` alone would never produce. The materializer writes the cache at the slots kvfuzz's block
table names, and the kernel reads it through the very same table: the block mask's ``kv_indices`` are mapped
by ``convert_logical_block_mask`` through ``page_table``, and its ``mask_mod`` maps each physical kv index back
to a logical position through ``physical_to_logical``.

Mixed batch -> flex_attention: the batch dimension is the sequence. Queries are padded to
``[N, H, max_query_len, D]`` (query ``j`` of sequence ``i`` at ``[i, :, j]``); the logical mask is
``q_idx < query_len[b] and kv_idx <= ctx_len[b] + q_idx`` (the contract: query ``j`` sees positions
``0 .. ctx_len + j``), built with ``create_block_mask`` over ``max(blocks_needed) * page_size`` logical positions
at the block sizes vLLM's FlexAttention backend builds its mask at (16 query tokens x one page, torch >= 2.9:
:func:`~kvfuzz.fuzz.targets.flex_options.block_mask_sizes`), then converted with ``kv_len = seq_lens``. Padding
query rows are fully masked and dropped from the output; GQA by ``enable_gqa`` (query head ``h`` reads kv head
``h // (H // Hkv)``, vLLM's grouping; set, as vLLM sets it, when ``H != Hkv``).

Kernel options: those vLLM 0.33.0's FlexAttention backend passes for the same call, computed by vLLM's own
``get_kernel_options`` (:mod:`kvfuzz.fuzz.targets.flex_options`): ``FORCE_USE_FLEX_ATTENTION`` (the main kernel,
never flex-decoding), ``BLOCK_M`` 16 and ``BLOCK_N`` the page size, on every device (the eager path ignores them).
A crash of the compiled kernel is then one vLLM's engine meets too, not one of kvfuzz's choosing.

Runs eagerly on the CPU (flex's math implementation: the whole ``[N, H, Q, n_pages*page_size]`` score matrix
with the paged ``mask_mod``; its block sparsity is not used), ``torch.compile``d on CUDA (the fused Triton
kernel, which does walk ``kv_indices``). :meth:`TorchFlexPaged.path` says which.

Known defect (kvfuzz finding, docs/contracts.md §5, bug 3): NaN/inf in the V rows of slots no query may see reach
the output as ``0 * NaN``: eagerly from any slot of the pool (free pages and other sequences' pages included),
compiled from the tail of a sequence's last page. Fuzz past it with ``--poison stale --poison zeros``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from kvfuzz.contracts.caches.layouts import LayoutError
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.model.batch import Batch, positions
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.poison import Poison

from . import flex_options
from .base import NOT_LOADED, Availability, DeviceCapabilities, KernelCall, Target, try_import

#: Why the target is not available before torch 2.9 (its version in the braces).
TORCH_BEFORE_2_9 = ("torch {}: vLLM's FlexAttention backend masks in 128 x 128 blocks before torch 2.9 "
                    "(vllm/v1/attention/backends/flex_attention.py, FlexAttentionMetadataBuilder._get_block_sizes), "
                    "which a paged mask (KV block = page) cannot be; torch.flex_paged needs torch >= 2.9")


class FlexPagedLayout:
    """torch PagedAttention's cache: key and value ``[1, num_kv_heads, num_blocks * block_size, head_size]``,
    slot ``s`` at ``[0, :, s, :]``."""

    name = "torch-flex-paged"

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        if batch.kv_cache_dtype != "auto":
            raise LayoutError(f"{self.name}: kv_cache_dtype={batch.kv_cache_dtype!r} is not modeled; use 'auto'")
        shape = (1, batch.num_kv_heads, batch.num_blocks * batch.block_size, batch.head_size)
        dt = batch.torch_dtype
        return torch.empty(shape, dtype=dt, device=device), torch.empty(shape, dtype=dt, device=device)

    def write(self, key_cache, value_cache, slots, key, value) -> None:
        key_cache[0, :, slots, :] = key.to(key_cache.dtype).transpose(0, 1)
        value_cache[0, :, slots, :] = value.to(value_cache.dtype).transpose(0, 1)

    def gather(self, key_cache, value_cache, slots):
        return key_cache[0, :, slots, :].transpose(0, 1), value_cache[0, :, slots, :].transpose(0, 1)


def on_cuda() -> bool:
    return torch.cuda.is_available()


def _flex_api() -> None:
    """Import what the target calls: torch's ``PagedAttention`` and ``flex_attention`` (torch >= 2.6)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention  # noqa: F401
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def paged_attention_for(batch: Batch, device: str | torch.device):
    """A ``PagedAttention`` whose page table is ``batch.block_table`` (see the module docstring)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    pa = PagedAttention(batch.num_blocks, batch.block_size, batch.num_seqs, device=str(device))
    used: set[int] = set()
    for i, row in enumerate(batch.block_table):
        need = batch.blocks_needed(i)
        pages = torch.tensor(row[:need], dtype=torch.int64, device=device)
        pa.page_table[i, :need] = pages
        pa.physical_to_logical[i, pages] = torch.arange(need, dtype=torch.int64, device=device)
        pa.capacity[i] = need * batch.block_size
        used.update(row[:need])
    pa.empty_pages = [p for p in range(batch.num_blocks - 1, -1, -1) if p not in used]
    return pa


class TorchFlexPaged(Target):
    """torch ``PagedAttention`` + ``flex_attention`` over kvfuzz's paged cache (unified contract), called with the
    block mask sizes and kernel options vLLM 0.33.0's FlexAttention backend uses (:mod:`.flex_options`).

    Declared: what vLLM's backend runs (vllm/v1/attention/backends/flex_attention.py, ``FlexAttentionBackend``):
    float32/float16/bfloat16, kv_cache_dtype "auto", page sizes that are powers of two and multiples of 16 (16..128
    here; ``get_supported_kernel_block_sizes``, ``_get_block_sizes``); head sizes 16..256 including non powers of
    two (48, 80) and any GQA group; on CUDA (the compiled kernel) the powers of two (48/80 not tried there).
    Features: sliding windows (vLLM's too), and ALiBi
    and softcap as ``score_mod``, which vLLM's backend refuses (``FlexAttentionImpl.__init__`` raises
    NotImplementedError) but torch's flex runs (Finding 8 is one).
    Needs torch >= 2.9: before it vLLM masks in 128 x 128 blocks, which a paged mask (KV block = page) cannot be.
    """

    name = "torch.flex_paged"
    upstream = ("torch", "torch/nn/attention/experimental/_paged_attention.py, torch/nn/attention/flex_attention.py",
                "PagedAttention + flex_attention")
    # Known limitation (docs/findings.md): NaN/inf in unused V slots reaches the output (eager: any slot of the
    # pool; compiled: the tail of the sequence's last page). The gate checks finite poisons; `kvfuzz fuzz`
    # keeps reporting NaN.
    gate_poisons = (Poison.STALE, Poison.ZEROS)
    description = ("torch PagedAttention (torch.nn.attention.experimental._paged_attention) + flex_attention, "
                   "kvfuzz's block table as its page table, vLLM's FlexAttention kernel options (unified contract)")
    capabilities = DeviceCapabilities(Capabilities(
        contract=Contract.UNIFIED,
        devices=("cpu", "cuda"),
        dtypes=("float32", "float16", "bfloat16"),
        head_sizes=(16, 32, 48, 64, 80, 128, 256),
        block_sizes=(16, 32, 64, 128),  # each one vllm_runs_block_size (a test holds them together)
        features=("sliding_window", "alibi", "softcap"),  # window in the block mask, the others as score_mod
        shared_prefix_blocks=True,  # a page table may map one full page into several sequences
    ), lambda cls: {"head_sizes": cls.cuda_head_sizes} if on_cuda() else {})
    #: head sizes on CUDA (the compiled kernel), in place of the declared ones (the class and its instances read
    #: them alike: DeviceCapabilities)
    cuda_head_sizes = (16, 32, 64, 128, 256)
    # GQA groups: any, on CUDA too. Groups past 16 were undeclared there after a compile crash at 64 with kvfuzz's
    # former fixed kernel options; with vLLM's options, benchmarks/flex_gqa_probe.py --cases groups passed groups
    # 24, 32 and 64 at head sizes 64, 128 and 256, pages 16 and 64, decodes and prefills, fp16 and bf16 (48 of 48,
    # H200, 2026-11-29; benchmarks/results/flex-gqa-probe-h200.txt).

    def availability(self) -> Availability:
        flex_options.keep_triton_interpretable()
        _, why = try_import("torch's paged flex attention", _flex_api, fix=f"torch {torch.__version__}; it needs "
                                                                           "torch >= 2.6")
        if why:
            return why
        if not torch._dynamo.is_dynamo_supported():
            return Availability(False, "flex_attention needs dynamo, which this Python/torch does not support")
        if not flex_options.supports_small_blocks():
            return Availability(False, TORCH_BEFORE_2_9.format(torch.__version__))
        _, where = flex_options.upstream_function(flex_options.GET_KERNEL_OPTIONS)
        how = "torch.compile'd flex_attention (CUDA)" if on_cuda() else "eager flex_attention (CPU)"
        return Availability(True, f"{how}; vLLM's kernel options from {where}", "cuda" if on_cuda() else "cpu")

    def installed(self) -> Availability:
        """From this torch's modules, found without importing them (flex_attention imports dynamo and
        inductor); whether dynamo supports this Python is left to :meth:`availability`."""
        for module in ("torch.nn.attention.flex_attention", "torch.nn.attention.experimental._paged_attention"):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return Availability(False, f"torch {torch.__version__} has no {module} (paged flex attention "
                                           "needs torch >= 2.6)")
        if not flex_options.supports_small_blocks():
            return Availability(False, TORCH_BEFORE_2_9.format(torch.__version__))
        where = "torch.compile'd flex_attention (CUDA)" if on_cuda() else "eager flex_attention (CPU)"
        return Availability(True, f"{where}; torch {torch.__version__}: {NOT_LOADED}",
                            "cuda" if on_cuda() else "cpu")

    def layout(self, batch: Batch) -> FlexPagedLayout:
        return FlexPagedLayout()

    def path(self, batch: Batch) -> str:
        if not on_cuda():
            return "eager (cpu)"
        try:
            opts = self.kernel_options(batch)
        except ValueError:  # a page vLLM's backend refuses (build_call raises LayoutError for it)
            return "compiled (cuda), no page vLLM runs"
        return f"compiled (cuda), BLOCK_M={opts.get('BLOCK_M')} BLOCK_N={opts.get('BLOCK_N')}"

    @staticmethod
    def logical_mask_mod(query_lens: torch.Tensor, ctx_lens: torch.Tensor, sliding_window: int | None = None):
        """The contract's mask on logical positions: padded query rows masked, query ``q_idx`` of sequence
        ``b`` sees kv positions ``0 .. ctx_len[b] + q_idx`` (with a window of W keys: the last W of them)."""

        def causal_paged(b, h, q_idx, kv_idx):
            return (q_idx < query_lens[b]) & (kv_idx <= ctx_lens[b] + q_idx)

        if sliding_window is None:
            return causal_paged

        def windowed(b, h, q_idx, kv_idx):
            return causal_paged(b, h, q_idx, kv_idx) & (kv_idx > ctx_lens[b] + q_idx - sliding_window)

        return windowed

    @staticmethod
    def logical_score_mod(batch: Batch, ctx_lens: torch.Tensor, device):
        """``score_mod`` on logical positions for softcap (``c * tanh(s / c)``) and ALiBi
        (``slope[h] * (kv_idx - query position)``), in the reference's order; None without either.

        The softcap is closed over as a 0-d device tensor, not a Python float: compiled (torch 2.11, H200), a
        float that changes between calls makes dynamo recompile with it as a dynamic float, and Inductor then
        fails ("LoweringException: RuntimeError: unbacked_bindings"; docs/findings.md, Finding 8)."""
        cap = None if batch.softcap is None else torch.tensor(batch.softcap, dtype=torch.float32, device=device)
        slopes = batch.alibi_slopes_tensor(device)
        if cap is None and slopes is None:
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score + slopes[h] * (kv_idx - ctx_lens[b] - q_idx)
            return score

        return score_mod

    def paged_attention(self, batch: Batch, device: str | torch.device):
        """The ``PagedAttention`` the kernel reads through: :func:`paged_attention_for` (kvfuzz's table)."""
        return paged_attention_for(batch, device)

    @staticmethod
    def kernel_options(batch: Batch) -> dict:
        """The ``kernel_options`` vLLM's FlexAttention backend passes ``flex_attention`` for ``batch``'s dtype and page
        size (:func:`~kvfuzz.fuzz.targets.flex_options.vllm_kernel_options`: vLLM's own ``get_kernel_options``,
        vllm/v1/attention/backends/flex_attention.py), on every device: with torch >= 2.9
        ``{"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": page_size}``. Raises ValueError, as vLLM does,
        for a page size that is not a power of two.

        kvfuzz used to pass a fixed config of its own (``BLOCK_M=32, BLOCK_N=min(page_size, 32), num_warps=4,
        num_stages=1``); with it an H200 compile failed at a GQA group of 64 where flex's defaults passed, a crash
        of kvfuzz's making (docs/benchmarks.md)."""
        return flex_options.vllm_kernel_options(batch.torch_dtype, batch.block_size)

    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        from torch.nn.attention.flex_attention import create_block_mask

        if not isinstance(cache.layout, FlexPagedLayout):
            raise LayoutError(f"{self.name} reads a FlexPagedLayout cache, got {cache.layout!r}")
        dev = cache.key_cache.device
        n, qmax = batch.num_seqs, batch.max_query_len
        seq, j = positions(batch.query_lens)
        seq, j = seq.to(dev), j.to(dev)
        query = torch.zeros((n, batch.num_heads, qmax, batch.head_size), dtype=batch.torch_dtype, device=dev)
        query[seq, :, j] = data.query.to(dev)
        query_lens = torch.tensor(batch.query_lens, dtype=torch.int64, device=dev)
        ctx_lens = torch.tensor(batch.ctx_lens, dtype=torch.int64, device=dev)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=dev)

        logical_kv = max(batch.blocks_needed(i) for i in range(n)) * batch.block_size
        try:
            q_block, kv_block, _ = flex_options.block_mask_sizes(batch.block_size)  # (16, page): vLLM's mask
        except ValueError as e:  # vLLM's backend refuses the page size: there is no call of vLLM's to make
            raise LayoutError(f"{self.name}: vLLM's FlexAttention backend runs no page of {batch.block_size} ({e})"
                              ) from None
        logical = create_block_mask(self.logical_mask_mod(query_lens, ctx_lens, batch.sliding_window), n, None,
                                    qmax, logical_kv, device=str(dev), BLOCK_SIZE=(q_block, kv_block))
        pa = self.paged_attention(batch, dev)
        block_mask = pa.convert_logical_block_mask(logical, torch.arange(n, device=dev), seq_lens)
        score_mod = self.logical_score_mod(batch, ctx_lens, dev)
        if score_mod is not None:
            score_mod = pa.get_score_mod(score_mod, seq_lens)
        output = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype,
                             device=dev)
        kwargs = dict(query=query, key=cache.key_cache, value=cache.value_cache, block_mask=block_mask,
                      scale=float(batch.scale), enable_gqa=batch.num_heads != batch.num_kv_heads,
                      kernel_options=self.kernel_options(batch),
                      score_mod=score_mod,
                      # not passed to flex_attention: where each output row comes from, the page table, and the
                      # logical mask's block sizes (a standalone script builds the mask again at them)
                      _token_seq=seq, _token_j=j, _paged_attention=pa, mask_block_size=(q_block, kv_block),
                      block_table=batch.block_table_tensor(dev), seq_lens=batch.seq_lens_tensor(dev),
                      query_start_loc=batch.query_start_loc_tensor(dev))
        return KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, output)

    def run(self, call: KernelCall) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        kw = call.kwargs
        fn = _compiled_flex() if kw["query"].is_cuda else flex_attention
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            with torch._dynamo.config.patch(recompile_limit=10_000, accumulated_recompile_limit=10_000,
                                            fail_on_recompile_limit_hit=True):
                out = fn(kw["query"], kw["key"], kw["value"], score_mod=kw["score_mod"],
                         block_mask=kw["block_mask"], scale=kw["scale"],
                         enable_gqa=kw["enable_gqa"], kernel_options=kw["kernel_options"])
        call.output.copy_(out[kw["_token_seq"], :, kw["_token_j"]])
        return call.output


#: This family's checked kernels: none yet (the guard has no signature for torch's PagedAttention).
SIGNATURES = ()


#: This family's built-in targets (kvfuzz.fuzz.targets.registry.BUILTIN lists them by name, in this order).
TARGETS = (TorchFlexPaged,)

__all__ = ["FlexPagedLayout", "SIGNATURES", "TorchFlexPaged", "paged_attention_for"]
