"""What a kernel target declares it accepts, in the manner of vLLM's AttentionBackend class data
(vllm/v1/attention/backend.py: supported_dtypes, supported_kv_cache_dtypes, get_supported_head_sizes,
supports_block_size). Strategies read a declaration and generate only batches inside it."""

from __future__ import annotations

import attrs

from .batch import DTYPES, FEATURES, KV_CACHE_DTYPES
from .contract import Contract
from .states import PRODUCTION_STATES, states_off

#: Production states a target may declare (``Capabilities`` fields) and their names in :attr:`Capabilities.states`
#: (``kvfuzz targets``), read from the registry :data:`kvfuzz.contracts.model.states.PRODUCTION_STATES`;
#: strategies draw a state only for targets declaring it.
STATES = {name: s.label for name, s in PRODUCTION_STATES.items()}

#: How a kernel's caller describes where each sequence's tokens are (``Capabilities.metadata``).
METADATA = ("block_table", "csr")


def _nonempty(instance, attribute, value) -> None:
    if not value:
        raise ValueError(f"Capabilities.{attribute.name} must not be empty")


@attrs.frozen
class Capabilities:
    """A target's declaration.

    contract: which cache contract the kernel has (:class:`Contract`).
    devices: where it runs ("cpu", "cuda").
    dtypes, kv_cache_dtypes, head_sizes, block_sizes: what it accepts (names as in :class:`Batch`).
    decode_only: the kernel takes decode sequences only (query_len == 1), e.g. vLLM's decode_attention_fwd.
    features: optional attention features it implements, names from :data:`~kvfuzz.contracts.model.batch.FEATURES`
        ("sliding_window", "alibi", "sinks", "softcap").
    exclusive: pairs of features it cannot combine (e.g. prefix_prefill's ALiBi kernel has no sliding window
        and asserts ``sinks is None``).
    fp8_head_sizes: head sizes accepted with an fp8 kv_cache_dtype (None: all of ``head_sizes``), e.g. the
        5-D cache needs ``head_size % 16 == 0`` for 1-byte elements.
    fp8_block_sizes: block sizes accepted with an fp8 kv_cache_dtype (None: all of ``block_sizes``), e.g.
        FlashAttention 4's SM90 fp8-KV-dequant kernel reads one 64-token page per TMA tile (vLLM's
        ``_get_sm90_fa4_fp8_kv_block_size``: block size 64).
    fp8_dtypes: model dtypes accepted with an fp8 kv_cache_dtype (None: all of ``dtypes``), e.g. FlashAttention
        3's fp8 forward writes bf16 only (hopper/flash_api.cpp: "For FP8 input, output must have dtype BF16").
    gqa_ratios: GQA group sizes (``num_heads // num_kv_heads``) the kernel accepts at all (None: all), e.g.
        FlashInfer's CUDA-core decode dispatches group sizes 1, 2, 3, 4 and 8 only (``DISPATCH_GQA_GROUP_SIZE``;
        others raise "Unsupported group_size").
    fp8_gqa_ratios: GQA group sizes (``num_heads // num_kv_heads``) accepted with an fp8 kv_cache_dtype (None:
        all), e.g. SGLang's grouped decode kernel rounds q to the fp8 cache dtype by design, its MHA kernel not.
    min_sliding_window: the smallest window (``Batch.sliding_window``, keys) the kernel can express (SGLang's
        ``sliding_window_size = W - 1`` reads 0 as "no window": 2).
    metadata: how the kernel is told where each sequence's tokens are (:data:`METADATA`): "block_table"
        (vLLM: a per-sequence block table with seq_lens and query_start_loc) or "csr" (SGLang, FlashInfer:
        ``kv_indptr``/``kv_indices`` page lists, :mod:`kvfuzz.contracts.model.csr`); CSR targets also get
        ``Batch.csr_tail`` drawn.
    value_head_size: None, or the latent form (MLA): the values are the first ``value_head_size`` dims of each
        cached key row (:attr:`~kvfuzz.contracts.model.batch.Batch.value_head_size`), one kv head (MQA over the
        latent cache), every head size in ``head_sizes`` larger than it; strategies draw every batch so.
    shared_prefix_blocks: the target was verified with full context blocks shared by several sequences
        (SGLang's radix cache, vLLM's prefix caching; :class:`~kvfuzz.contracts.model.batch.Batch`); strategies draw
        such batches only for targets that declare it.
    cuda_graph_padding: None, or how the target's engine pads a batch up to a captured CUDA-graph size, one of
        :data:`~kvfuzz.contracts.model.padding.CONVENTIONS` ("vllm": seq_len 0, the null block, query rows no
        sequence owns; "sglang": seq_len 1 reading token slot 0): the "CUDA-graph padding" state
        (:mod:`kvfuzz.contracts.model.padding`). Strategies draw ``Batch.num_pad_seqs`` only for targets that
        declare one, and the target builds its call through :class:`~kvfuzz.contracts.model.padding.Padding`.
    freed_window_blocks: the target runs behind a sliding-window KV manager that gives back the blocks wholly
        before the window and points their columns at the null block
        (:attr:`~kvfuzz.contracts.model.batch.Batch.freed_window_blocks`; vLLM's ``SlidingWindowManager``,
        vllm/v1/core/single_type_kv_cache_manager.py ``remove_skipped_blocks``), and its kernel must never read
        them; strategies draw such batches (about half the windowed ones) only for targets that declare it.
        Needs ``"sliding_window"`` in ``features``.
    quant_query: with an fp8 cache the kernel takes the query in fp8 with its ``q_descale``, as vLLM's attention
        layer hands it to a backend whose ``supports_quant_query_input`` (vllm/model_executor/layers/attention/
        attention.py ``Attention.forward``, ``query_quant``; FlashAttention 3's fp8 forward): strategies draw
        ``Batch.q_scale`` (a checkpoint's calibrated query scale) only for targets that declare it. Needs an fp8
        ``kv_cache_dtypes`` entry.
    """

    contract: Contract
    devices: tuple[str, ...] = attrs.field(converter=tuple, validator=_nonempty)
    dtypes: tuple[str, ...] = attrs.field(converter=tuple, validator=_nonempty)
    head_sizes: tuple[int, ...] = attrs.field(converter=tuple, validator=_nonempty)
    block_sizes: tuple[int, ...] = attrs.field(converter=tuple, validator=_nonempty)
    kv_cache_dtypes: tuple[str, ...] = attrs.field(default=("auto",), converter=tuple, validator=_nonempty)
    decode_only: bool = False
    features: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    exclusive: tuple[frozenset[str], ...] = attrs.field(
        default=(), converter=lambda pairs: tuple(frozenset(p) for p in pairs))
    fp8_head_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))
    fp8_gqa_ratios: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))
    fp8_block_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))
    fp8_dtypes: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))
    gqa_ratios: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v))
    min_sliding_window: int = 1
    metadata: str = "block_table"
    shared_prefix_blocks: bool = False
    value_head_size: int | None = None
    cuda_graph_padding: str | None = None
    freed_window_blocks: bool = False
    quant_query: bool = False

    def __attrs_post_init__(self) -> None:
        for state in PRODUCTION_STATES.values():  # each state's own rules (its home module)
            state.validate(self)
        if self.value_head_size is not None and not 1 <= self.value_head_size < min(self.head_sizes):
            raise ValueError(f"Capabilities.value_head_size {self.value_head_size} must be in [1, smallest head "
                             f"size {min(self.head_sizes)}): the value is a prefix of the key row")
        bad = sorted(set(self.features).union(*self.exclusive) - set(FEATURES))
        if bad:
            raise ValueError(f"unknown features {bad}; known: {list(FEATURES)}")
        bad = [d for d in (*self.dtypes, *(self.fp8_dtypes or ())) if d not in DTYPES]
        if bad:
            raise ValueError(f"unknown dtypes {bad}; known: {list(DTYPES)}")
        bad = [d for d in self.kv_cache_dtypes if d not in KV_CACHE_DTYPES]
        if bad:
            raise ValueError(f"unknown kv_cache_dtypes {bad}; known: {list(KV_CACHE_DTYPES)}")
        if self.quant_query and all(d == "auto" for d in self.kv_cache_dtypes):
            raise ValueError("Capabilities.quant_query (an fp8 query with an fp8 cache) needs an fp8 kv_cache_dtype; "
                             f"kv_cache_dtypes is {list(self.kv_cache_dtypes)}")
        if self.metadata not in METADATA:
            raise ValueError(f"unknown metadata {self.metadata!r}; known: {list(METADATA)}")

    def fp8_accepts_gqa(self, kv_cache_dtype: str, gqa_ratio: int) -> bool:
        """Whether the GQA group size ``gqa_ratio`` is accepted with ``kv_cache_dtype`` (``gqa_ratios`` and,
        for an fp8 cache, ``fp8_gqa_ratios``)."""
        if self.gqa_ratios is not None and gqa_ratio not in self.gqa_ratios:
            return False
        return kv_cache_dtype == "auto" or self.fp8_gqa_ratios is None or gqa_ratio in self.fp8_gqa_ratios

    def head_sizes_for(self, kv_cache_dtype: str) -> tuple[int, ...]:
        """The head sizes accepted with ``kv_cache_dtype``."""
        if kv_cache_dtype == "auto" or self.fp8_head_sizes is None:
            return self.head_sizes
        return tuple(h for h in self.head_sizes if h in self.fp8_head_sizes)

    def block_sizes_for(self, kv_cache_dtype: str) -> tuple[int, ...]:
        """The block sizes accepted with ``kv_cache_dtype``."""
        if kv_cache_dtype == "auto" or self.fp8_block_sizes is None:
            return self.block_sizes
        return tuple(b for b in self.block_sizes if b in self.fp8_block_sizes)

    def dtypes_for(self, kv_cache_dtype: str) -> tuple[str, ...]:
        """The model dtypes accepted with ``kv_cache_dtype``."""
        if kv_cache_dtype == "auto" or self.fp8_dtypes is None:
            return self.dtypes
        return tuple(d for d in self.dtypes if d in self.fp8_dtypes)

    def kv_cache_dtypes_for(self, dtype: str, head_size: int, gqa_ratio: int) -> tuple[str, ...]:
        """The kv_cache_dtypes accepted with model ``dtype``, ``head_size`` and GQA group size ``gqa_ratio``, in
        declaration order (empty when none is)."""
        return tuple(k for k in self.kv_cache_dtypes
                     if head_size in self.head_sizes_for(k) and dtype in self.dtypes_for(k)
                     and self.fp8_accepts_gqa(k, gqa_ratio))

    def combinable(self, features) -> bool:
        """Whether ``features`` (names) are all declared and no declared-exclusive pair is among them."""
        f = set(features)
        return f <= self.features and not any(pair <= f for pair in self.exclusive)

    def outside(self, batch) -> list[str]:
        """What of ``batch`` this declaration does not accept, one phrase each (empty when it accepts it)."""
        out = []
        if batch.dtype not in self.dtypes_for(batch.kv_cache_dtype):
            out.append(f"dtype {batch.dtype}" + (
                f" with kv_cache_dtype {batch.kv_cache_dtype}" if batch.dtype in self.dtypes else ""))
        if batch.kv_cache_dtype not in self.kv_cache_dtypes:
            out.append(f"kv_cache_dtype {batch.kv_cache_dtype}")
        if batch.head_size not in self.head_sizes_for(batch.kv_cache_dtype):
            out.append(f"head_size {batch.head_size}" + (
                f" with kv_cache_dtype {batch.kv_cache_dtype}" if batch.head_size in self.head_sizes else ""))
        if batch.block_size not in self.block_sizes_for(batch.kv_cache_dtype):
            out.append(f"block_size {batch.block_size}" + (
                f" with kv_cache_dtype {batch.kv_cache_dtype}" if batch.block_size in self.block_sizes else ""))
        if self.gqa_ratios is not None and batch.gqa_ratio not in self.gqa_ratios:
            out.append(f"GQA group size {batch.gqa_ratio}")
        elif not self.fp8_accepts_gqa(batch.kv_cache_dtype, batch.gqa_ratio):
            out.append(f"GQA group size {batch.gqa_ratio} with kv_cache_dtype {batch.kv_cache_dtype}")
        if batch.sliding_window is not None and batch.sliding_window < self.min_sliding_window:
            out.append(f"sliding_window {batch.sliding_window} (< {self.min_sliding_window})")
        out += [s.outside for s in PRODUCTION_STATES.values()
                if getattr(self, s.name) == s.off and s.in_batch(batch)]
        if self.decode_only and any(q != 1 for q in batch.query_lens):
            out.append("prefill sequences (decode-only kernel)")
        if batch.value_head_size != self.value_head_size:
            out.append("values of their own (a latent-cache kernel)" if batch.value_head_size is None else
                       f"a latent cache with value_head_size {batch.value_head_size}")
        f = set(batch.features)
        out += [f"feature {x}" for x in sorted(f - self.features)]
        out += [" with ".join(sorted(pair)) + " together" for pair in self.exclusive if pair <= f]
        return out

    def accepts(self, batch) -> bool:
        """Whether ``batch`` (a :class:`~kvfuzz.contracts.model.batch.Batch`) is inside this declaration."""
        return (batch.dtype in self.dtypes_for(batch.kv_cache_dtype) and batch.kv_cache_dtype in self.kv_cache_dtypes
                and batch.head_size in self.head_sizes_for(batch.kv_cache_dtype)
                and batch.block_size in self.block_sizes_for(batch.kv_cache_dtype)
                and self.fp8_accepts_gqa(batch.kv_cache_dtype, batch.gqa_ratio)
                and (batch.sliding_window is None or batch.sliding_window >= self.min_sliding_window)
                and not any(getattr(self, s.name) == s.off and s.in_batch(batch) for s in PRODUCTION_STATES.values())
                and (not self.decode_only or all(q == 1 for q in batch.query_lens))
                and batch.value_head_size == self.value_head_size
                and self.combinable(batch.features))

    @property
    def states(self) -> tuple[str, ...]:
        """The production states this declaration draws, by name (:data:`STATES`; ``kvfuzz targets``), the padding
        with its convention: e.g. ``("shared prefix", "freed window blocks", "cuda-graph padding (vllm)")``;
        ``()`` for none."""
        out = []
        for field, state in PRODUCTION_STATES.items():
            value = getattr(self, field)
            if value != state.off:
                out.append(state.label if value is True else f"{state.label} ({value})")
        return tuple(out)

    def without_states(self, names) -> "Capabilities":
        """This declaration with the production states ``names`` (:data:`STATES` keys, e.g.
        ``("freed_window_blocks",)``) declared off; raises ValueError naming an unknown state."""
        return attrs.evolve(self, **states_off(self, names)) if names else self

    def restrict(self, **kw) -> "Capabilities":
        """A narrower declaration (e.g. ``dtypes=("float32",)``); raises ValueError if a value is not in
        the original declaration."""
        for k, v in kw.items():
            extra = set(v) - set(getattr(self, k))
            if extra:
                raise ValueError(f"{k} {sorted(extra)} are not declared by this target ({getattr(self, k)})")
        return attrs.evolve(self, **kw)


__all__ = ["METADATA", "STATES", "Capabilities"]
