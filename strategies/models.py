"""Real models' attention shapes, as one tensor-parallel rank of a serving engine hands them to a kernel (no torch,
no Hypothesis at import).

:data:`MODELS` lists published model configurations (each row cites its ``config.json`` on the Hugging Face hub):
query heads (``num_attention_heads``), kv heads (``num_key_value_heads``), ``head_dim``, the sliding window and
which layers use it, ``attn_logit_softcapping``, attention sinks and MLA's latent ranks. Only values checked
against the cited config (or a source quoting it) are listed; a field the config does not set is None.

:func:`shard_heads` divides the heads by a tensor-parallel size as vLLM does
(vllm/model_executor/models/llama.py ``LlamaAttention.__init__``: ``num_heads = total_num_heads // tp_size``;
``num_kv_heads = max(1, total_num_kv_heads // tp_size)``, the kv heads replicated when ``tp_size`` exceeds
them; vLLM asserts ``total_num_heads % tp_size == 0`` and that one of ``total_num_kv_heads`` and ``tp_size``
divides the other). :func:`model_shapes` keeps the (model, tp) pairs a target's Capabilities accept: the serving
size tier (:mod:`kvfuzz.strategies.serving`) draws from them.
"""

from __future__ import annotations

import attrs

#: Tensor-parallel sizes a model is served at.
TP_SIZES = (1, 2, 4, 8)

_HF = "https://huggingface.co/{}/blob/main/config.json"


@attrs.frozen
class ModelAttention:
    """One model's attention layers. name: the hub id. num_heads, num_kv_heads: ``num_attention_heads``,
    ``num_key_value_heads`` (for MLA: the query heads, one latent kv head). head_size: ``head_dim`` (MLA: the
    cache row, ``kv_lora_rank + qk_rope_head_dim``). sliding_window: keys of the windowed layers (None: full
    attention everywhere); window_layers: which layers use it, in words. softcap: ``attn_logit_softcapping``.
    sinks: learned per-head attention sinks. kv_lora_rank, qk_rope_head_dim: MLA's latent ranks (None: not MLA).
    source: the config.json it was read from."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None
    window_layers: str = ""
    softcap: float | None = None
    sinks: bool = False
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @property
    def source(self) -> str:
        return _HF.format(self.name)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None


#: Published configurations (every value from the config.json at :attr:`ModelAttention.source`).
MODELS: tuple[ModelAttention, ...] = (
    ModelAttention("meta-llama/Llama-3.1-8B", 32, 8, 128),
    ModelAttention("meta-llama/Llama-3.1-70B", 64, 8, 128),
    ModelAttention("mistralai/Mistral-7B-v0.1", 32, 8, 128, sliding_window=4096, window_layers="all"),
    ModelAttention("mistralai/Mixtral-8x7B-v0.1", 32, 8, 128),
    ModelAttention("Qwen/Qwen2.5-7B", 28, 4, 128),
    ModelAttention("Qwen/Qwen2.5-72B", 64, 8, 128),
    ModelAttention("Qwen/Qwen3-8B", 32, 8, 128),
    ModelAttention("google/gemma-2-9b", 16, 8, 256, sliding_window=4096, window_layers="every other",
                   softcap=50.0),
    ModelAttention("google/gemma-2-27b", 32, 16, 128, sliding_window=4096, window_layers="every other",
                   softcap=50.0),
    ModelAttention("google/gemma-3-27b-pt", 32, 16, 128, sliding_window=1024, window_layers="5 of every 6"),
    ModelAttention("openai/gpt-oss-20b", 64, 8, 64, sliding_window=128, window_layers="every other", sinks=True),
    ModelAttention("openai/gpt-oss-120b", 64, 8, 64, sliding_window=128, window_layers="every other", sinks=True),
    ModelAttention("microsoft/phi-4", 40, 10, 128),
    ModelAttention("deepseek-ai/DeepSeek-V3", 128, 1, 576, kv_lora_rank=512, qk_rope_head_dim=64),
    ModelAttention("deepseek-ai/DeepSeek-V2-Lite", 16, 1, 576, kv_lora_rank=512, qk_rope_head_dim=64),
)


def shard_heads(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int] | None:
    """``(num_heads, num_kv_heads)`` on one of ``tp`` tensor-parallel ranks as vLLM shards them (module
    docstring), or None where vLLM refuses the size (``num_heads % tp``, or neither of ``num_kv_heads`` and
    ``tp`` dividing the other)."""
    if tp < 1 or num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
        return None
    return num_heads // tp, max(1, num_kv_heads // tp)


@attrs.frozen
class Shape:
    """One rank's attention call of ``model`` at tensor-parallel size ``tp``."""

    model: str
    tp: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    softcap: float | None
    sinks: bool


def model_shapes(capabilities, models: tuple[ModelAttention, ...] = MODELS,
                 tp_sizes: tuple[int, ...] = TP_SIZES) -> tuple[Shape, ...]:
    """The (model, tp) shapes ``capabilities`` (a :class:`~kvfuzz.contracts.model.capabilities.Capabilities`)
    accept: the head size declared, the GQA group size accepted (``gqa_ratios``), MLA rows only for a latent
    cache (``value_head_size`` set) and only there. A window, softcap or sinks the target does not declare is
    left off (the model's full-attention layers, or its call without the feature). Sorted fewest heads first."""
    out = []
    latent = capabilities.value_head_size is not None
    for m in models:
        if m.mla != latent or m.head_size not in capabilities.head_sizes:
            continue
        for tp in tp_sizes:
            heads = shard_heads(m.num_heads, m.num_kv_heads, tp)
            if heads is None:
                continue
            h, kv = heads
            if capabilities.gqa_ratios is not None and h // kv not in capabilities.gqa_ratios:
                continue
            features = capabilities.features
            out.append(Shape(m.name, tp, h, kv, m.head_size,
                             m.sliding_window if "sliding_window" in features else None,
                             m.softcap if "softcap" in features else None, m.sinks and "sinks" in features))
    return tuple(sorted(out, key=lambda s: (s.num_heads, s.num_kv_heads, s.head_size, s.model, s.tp)))


#: Windows of the models in :data:`MODELS`, smallest first.
MODEL_WINDOWS = tuple(sorted({m.sliding_window for m in MODELS if m.sliding_window}))

__all__ = ["MODELS", "MODEL_WINDOWS", "TP_SIZES", "ModelAttention", "Shape", "model_shapes", "shard_heads"]
