"""Kernel configurations: what a compiled kernel specializes on, and the order a campaign visits them.

A Triton kernel is compiled once per combination of its ``tl.constexpr`` arguments (and of the divisibility
of its integer arguments). In vLLM's ``kernel_unified_attention``
(vllm/v1/attention/ops/triton_unified_attention.py) those are ``num_query_heads``, ``num_queries_per_kv``,
``BLOCK_SIZE``, ``HEAD_SIZE``, ``USE_ALIBI_SLOPES``, ``USE_SOFTCAP``, ``USE_SINKS``, ``SLIDING_WINDOW``,
``USE_FP8``/``KV_QUANT_MODE`` and the tensors' dtypes; SGLang's ``_fwd_kernel`` (extend_attention.py) and
vLLM's ``_fwd_kernel`` (prefix_prefill.py) take the same quantities as constexprs. A :class:`KernelConfig`
holds exactly those: one compile per configuration (plus a few for integer arguments that are 1 or multiples
of 16), and every batch inside it reuses the compiled kernel (~ms instead of ~1 s).

:func:`config_for` orders the configurations a campaign visits: round ``r`` lists, for every dimension
(dtype, GQA group size, kv heads, head size, kv_cache_dtype, block size, each declared feature on and off),
values in a random order, so every declared value appears within the first round (about as many
configurations as the longest dimension has values) and the combinations vary from round to round.
Deterministic in ``(seed, index)``.

Not every kernel compiles for all of these: FlashInfer's JIT modules are keyed by dtypes, head size and whether
a window and a soft cap are used (flashinfer/jit/attention/modules.py ``get_batch_decode_uri``,
``get_batch_prefill_uri``), while heads, GQA group, page size and the window's size are runtime arguments. A
configuration can leave such fields free (``KernelConfig.free``, from ``Target.runtime_fields``): a chunk then
stays in one compiled module and still draws them freely, and the rotation counts only the pinned dimensions
(every declared value of those appears within the round).
"""

from __future__ import annotations

import functools
import random

import attrs

from kvfuzz.contracts.model.batch import FEATURES
from kvfuzz.contracts.model.capabilities import Capabilities

from .limits import Limits

#: GQA group sizes (num_heads // num_kv_heads), simplest first (a failure shrinks toward MHA): 1 is MHA, 7 is the
#: FlashInfer 28/4 case; past 16 (with one kv head, multi-query attention) a kernel's tiles change: vLLM's unified
#: kernel pads its query tile to ``BLOCK_M = next_power_of_2(group)`` above 16 (32, 64: triton_unified_attention.py
#: ``unified_attention``), and the grouped decode kernels (vLLM's and SGLang's ``_fwd_grouped_kernel_stage1``, 16
#: heads a program) split a group over several programs; 24 is a group past 16 that is not a multiple of 16 (MQA
#: StarCoder at tensor-parallel size 2 runs 24/1; strategies/models.py holds the published rows).
GQA_RATIOS = (1, 2, 4, 8, 16, 3, 7, 32, 64, 24)
NUM_KV_HEADS = (1, 2, 4)
#: Fields of a configuration a kernel may take at run time rather than compile for (``KernelConfig.free``):
#: the heads (and so the GQA group), the block (page) size, the sliding window's size (its presence stays pinned).
RUNTIME_FIELDS = ("heads", "block_size", "window")
_ROUND_DIMS = {"heads": ("ratio", "kv"), "block_size": ("block_size",), "window": ()}


@attrs.frozen
class KernelConfig:
    """What one compiled specialization of an attention kernel is fixed to (see the module docstring).

    dtype, kv_cache_dtype: names as in :class:`~kvfuzz.contracts.model.batch.Batch`. num_heads, num_kv_heads:
    query and kv heads (``num_kv_heads`` in :data:`NUM_KV_HEADS`, the group size in :data:`GQA_RATIOS`).
    head_size, block_size: elements per head, tokens per block. features: the optional features on
    (:data:`~kvfuzz.contracts.model.batch.FEATURES`). sliding_window: the window drawn when ``"sliding_window"`` is
    on (keys, before the target's ``min_sliding_window``), else None. free: fields of :data:`RUNTIME_FIELDS` the
    batches of a chunk draw freely although they are set here (the kernel does not compile for them)."""

    dtype: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str
    block_size: int
    features: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    sliding_window: int | None = None
    free: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)

    def __attrs_post_init__(self) -> None:
        if self.num_kv_heads not in NUM_KV_HEADS or self.num_heads % self.num_kv_heads \
                or self.num_heads // self.num_kv_heads not in GQA_RATIOS:
            raise ValueError(f"KernelConfig: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}: "
                             f"num_kv_heads must be one of {NUM_KV_HEADS} and the group size one of {GQA_RATIOS}")
        if ("sliding_window" in self.features) != (self.sliding_window is not None):
            raise ValueError("KernelConfig: sliding_window is set exactly when the feature is on")
        if not self.free <= set(RUNTIME_FIELDS):
            raise ValueError(f"KernelConfig: free fields {sorted(self.free - set(RUNTIME_FIELDS))} are not among "
                             f"{RUNTIME_FIELDS}")

    def pins(self, field: str) -> bool:
        """Whether batches keep ``field`` (one of :data:`RUNTIME_FIELDS`) as configured."""
        return field not in self.free

    def summary(self) -> str:
        """One line: ``float16 H8/2 D64 auto BS16 sliding_window=5,softcap`` (a free field as ``*``)."""
        window = self.sliding_window if self.pins("window") else "*"
        feats = ",".join(f"sliding_window={window}" if f == "sliding_window" else f
                         for f in FEATURES if f in self.features)
        heads = f"H{self.num_heads}/{self.num_kv_heads}" if self.pins("heads") else "H*"
        block = f"BS{self.block_size}" if self.pins("block_size") else "BS*"
        return (f"{self.dtype} {heads} D{self.head_size} {self.kv_cache_dtype} {block}"
                + (f" {feats}" if feats else ""))

    def to_dict(self) -> dict:
        return {**attrs.asdict(self), "features": sorted(self.features), "free": sorted(self.free)}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        return cls(**d)


def gqa_ratios(limits: Limits) -> tuple[int, ...]:
    """The group sizes a campaign draws under ``limits`` (at most ``max_num_heads`` query heads)."""
    return tuple(r for r in GQA_RATIOS if r <= limits.max_num_heads)


def window_edges(block_size: int, max_seq_len: int) -> tuple[int, ...]:
    """Windows where off-by-one bugs live: 1, 2 and ``block_size - 1 .. + 1`` (within ``1 .. max_seq_len``)."""
    return tuple(sorted({w for w in (1, 2, block_size - 1, block_size, block_size + 1) if 1 <= w <= max_seq_len}))


@functools.lru_cache(maxsize=64)
def _round(capabilities: Capabilities, limits: Limits, seed: int, r: int,
           free: frozenset[str] = frozenset()) -> tuple[KernelConfig, ...]:
    """Round ``r``: configurations until every value of every pinned dimension has appeared (each position
    takes, per dimension, a value not yet seen in the round when one is left; conflicts between dimensions, such
    as a head size an fp8 cache does not take, keep the value not yet seen; a block size an fp8 cache does not
    take moves to one it takes). ``free``: fields left to the batches (:data:`RUNTIME_FIELDS`), whose dimensions
    do not lengthen the round."""
    rng = random.Random(f"kvfuzz-configs:{seed}:{r}")
    features = [f for f in FEATURES if f in capabilities.features]
    ratios = tuple(r for r in gqa_ratios(limits) if capabilities.gqa_ratios is None or r in capabilities.gqa_ratios)
    kvs = [1] if capabilities.value_head_size is not None else list(NUM_KV_HEADS)  # a latent cache: MQA
    dims: dict[str, list] = {"dtype": list(capabilities.dtypes), "ratio": list(ratios), "kv": kvs,
                             "head_size": list(capabilities.head_sizes),
                             "kv_cache_dtype": list(capabilities.kv_cache_dtypes),
                             "block_size": list(capabilities.block_sizes), **{f: [False, True] for f in features}}
    loose = {d for f in free for d in _ROUND_DIMS[f]}
    unseen = {d: (set() if d in loose else set(v)) for d, v in dims.items()}
    max_seq_len = max(1, limits.max_ctx_len + limits.max_query_len)
    out: list[KernelConfig] = []

    def pick(d: str, allowed=None):
        values = [v for v in dims[d] if allowed is None or v in allowed]
        fresh = [v for v in values if v in unseen[d]]
        return rng.choice(fresh or values)

    while any(unseen.values()) and len(out) < 8 * max(len(v) for v in dims.values()):
        c = {d: pick(d) for d in dims}
        # a head size or group size an fp8 cache does not take: move the one already seen this round
        if c["head_size"] not in capabilities.head_sizes_for(c["kv_cache_dtype"]) or \
                not capabilities.fp8_accepts_gqa(c["kv_cache_dtype"], c["ratio"]):
            fits = [k for k in dims["kv_cache_dtype"] if c["head_size"] in capabilities.head_sizes_for(k)
                    and capabilities.fp8_accepts_gqa(k, c["ratio"])]
            if c["kv_cache_dtype"] not in unseen["kv_cache_dtype"] and fits:
                c["kv_cache_dtype"] = pick("kv_cache_dtype", fits)
            else:
                heads = capabilities.head_sizes_for(c["kv_cache_dtype"])
                groups = [g for g in ratios if capabilities.fp8_accepts_gqa(c["kv_cache_dtype"], g)]
                if not heads or not groups:
                    continue  # a declared cache dtype no head or group size fits: nothing to draw
                if c["head_size"] not in heads:
                    c["head_size"] = pick("head_size", heads)
                if c["ratio"] not in groups:
                    c["ratio"] = pick("ratio", groups)
        if c["block_size"] not in capabilities.block_sizes_for(c["kv_cache_dtype"]):  # fp8 at its own block sizes
            blocks = capabilities.block_sizes_for(c["kv_cache_dtype"])
            if not blocks:
                continue
            c["block_size"] = pick("block_size", blocks)
        if c["dtype"] not in capabilities.dtypes_for(c["kv_cache_dtype"]):  # fp8 with its own dtypes
            dtypes = capabilities.dtypes_for(c["kv_cache_dtype"])
            if not dtypes:
                continue
            c["dtype"] = pick("dtype", dtypes)
        on = [f for f in features if c[f]]
        while not capabilities.combinable(on):  # an exclusive pair: drop a feature already seen on
            drop = next((f for f in on if True not in unseen[f]), on[-1])
            on.remove(drop)
            c[drop] = False
        kv = c["kv"]
        while kv > 1 and kv * c["ratio"] > limits.max_num_heads:
            kv //= 2
        c["kv"] = kv
        for d, v in c.items():
            unseen[d].discard(v)
        window = None
        if "sliding_window" in on:
            edges = window_edges(c["block_size"], max_seq_len)
            window = rng.choice(edges) if rng.random() < 0.5 else rng.randint(1, max_seq_len)
        out.append(KernelConfig(c["dtype"], kv * c["ratio"], kv, c["head_size"], c["kv_cache_dtype"],
                                c["block_size"], frozenset(on), window, free))
    return tuple(out)


def round_length(capabilities: Capabilities, limits: Limits, seed: int = 0, r: int = 0,
                 free: frozenset[str] = frozenset()) -> int:
    """Configurations in round ``r`` of a campaign with ``seed``: as many as it takes for every declared
    value of the pinned dimensions to appear (at least the number of values of the longest one)."""
    return len(_round(capabilities, limits, seed, r, frozenset(free)))


def config_for(capabilities: Capabilities, limits: Limits, seed: int, index: int,
               free: frozenset[str] = frozenset()) -> KernelConfig:
    """The ``index``-th configuration a campaign with ``seed`` visits (module docstring); ``free``: the fields
    its batches draw freely (:data:`RUNTIME_FIELDS`)."""
    r = 0
    while True:
        configs = _round(capabilities, limits, seed, r, frozenset(free))
        if index < len(configs):
            return configs[index]
        index -= len(configs)
        r += 1


__all__ = ["GQA_RATIOS", "NUM_KV_HEADS", "RUNTIME_FIELDS", "KernelConfig", "config_for", "gqa_ratios",
           "round_length", "window_edges"]
