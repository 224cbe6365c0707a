"""Real models' attention shapes, as one tensor-parallel rank of a serving engine hands them to a kernel (no torch,
no Hypothesis at import).

:data:`MODELS` lists published model configurations (each row cites its ``config.json`` on the Hugging Face hub):
query heads (``num_attention_heads``), kv heads (``num_key_value_heads``), ``head_dim``, the sliding window and
which layers use it, ``attn_logit_softcapping``, attention sinks and MLA's latent ranks. Only values checked
against the cited config (or a source quoting it) are listed; a field the config does not set is None. Each row's
:attr:`ModelAttention.checked` names where its values were checked (2026-11-27; huggingface.co itself was not
reachable then): the vendor's own code or configs where it publishes them (meta-llama/llama-models,
google/gemma_pytorch, openai/gpt-oss, deepseek-ai/DeepSeek-V3), else copies of the config.json on the hub (a pull
request branch of the official repo, or fine-tunes and quantizations whose config names the model in
``_name_or_path`` and keeps its attention fields). Every row matched; none was changed.

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
    ``num_key_value_heads`` (for MLA: the query heads and one latent kv head, not the config's
    ``num_key_value_heads``, which equals ``num_attention_heads``: vLLM caches MLA as one head,
    vllm/config/model.py ``ModelConfig.get_num_kv_heads`` returns 1 when ``use_mla``). head_size: ``head_dim``, or
    ``hidden_size // num_attention_heads`` where the config has none (transformers' default; MLA: the cache row,
    ``kv_lora_rank + qk_rope_head_dim``). sliding_window: keys of the windowed layers (None: full attention
    everywhere); window_layers: which layers use it, in words. softcap: ``attn_logit_softcapping``. sinks: learned
    per-head attention sinks. kv_lora_rank, qk_rope_head_dim: MLA's latent ranks (None: not MLA). source: the
    config.json the values are from. checked: where they were checked against it (module docstring)."""

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
    checked: str = ""

    @property
    def source(self) -> str:
        return _HF.format(self.name)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None


#: Published configurations (every value from the config.json at :attr:`ModelAttention.source`, checked where
#: :attr:`ModelAttention.checked` says).
_LLAMA = ("meta-llama/llama-models models/sku_list.py @364ed4e, llama3_1_base_models arch_args: dim {}, n_heads {}, "
          "n_kv_heads 8; head_dim = dim // n_heads (models/llama3/model.py Attention)")
_GEMMA = ("google/gemma_pytorch gemma/config.py {}: num_attention_heads, num_key_value_heads, head_dim, attn_types "
          "({}), sliding_window_size {}, attn_logit_softcapping {}")
_GPT_OSS = ("openai/gpt-oss gpt_oss/torch/model.py: ModelConfig (head_dim 64, 64/8 heads, sliding_window 128), "
            "AttentionBlock (window on even layers, one sink per query head); ")
#: The rows of :data:`MODELS`: hub id, num_heads, num_kv_heads, head_size, and the fields a model sets beyond
#: them (the rest keep :class:`ModelAttention`'s defaults).
_ROWS: tuple[tuple[str, int, int, int, dict], ...] = (
    ("meta-llama/Llama-3.1-8B",      32,   8, 128, dict()),
    ("meta-llama/Llama-3.1-70B",     64,   8, 128, dict()),
    ("mistralai/Mistral-7B-v0.1",    32,   8, 128, dict(sliding_window=4096, window_layers="all")),
    ("mistralai/Mixtral-8x7B-v0.1",  32,   8, 128, dict()),
    ("Qwen/Qwen2.5-7B",              28,   4, 128, dict()),
    ("Qwen/Qwen2.5-72B",             64,   8, 128, dict()),
    ("Qwen/Qwen3-8B",                32,   8, 128, dict()),
    ("google/gemma-2-9b",            16,   8, 256, dict(sliding_window=4096, window_layers="every other",
                                                        softcap=50.0)),
    ("google/gemma-2-27b",           32,  16, 128, dict(sliding_window=4096, window_layers="every other",
                                                        softcap=50.0)),
    ("google/gemma-3-27b-pt",        32,  16, 128, dict(sliding_window=1024, window_layers="5 of every 6")),
    ("openai/gpt-oss-20b",           64,   8,  64, dict(sliding_window=128, window_layers="every other", sinks=True)),
    ("openai/gpt-oss-120b",          64,   8,  64, dict(sliding_window=128, window_layers="every other", sinks=True)),
    ("microsoft/phi-4",              40,  10, 128, dict()),
    # multi-query attention: one kv head (Falcon's multi_query, GPTBigCode's multi_query), replicated on every rank
    # (vllm/model_executor/models/falcon.py FalconAttention: total_num_kv_heads 1, num_kv_heads max(1, 1 // tp);
    # GPTBigCode's c_attn_kv replicated across ranks)
    ("tiiuae/falcon-7b",             71,   1,  64, dict()),
    ("bigcode/starcoder",            48,   1, 128, dict()),
    ("tiiuae/falcon-180B",          232,   8,  64, dict()),
    ("deepseek-ai/DeepSeek-V3",     128,   1, 576, dict(kv_lora_rank=512, qk_rope_head_dim=64)),
    ("deepseek-ai/DeepSeek-V2-Lite", 16,   1, 576, dict(kv_lora_rank=512, qk_rope_head_dim=64)),
)
#: Where each row's values were checked (:attr:`ModelAttention.checked`), by hub id.
_CHECKED: dict[str, str] = {
    "meta-llama/Llama-3.1-8B": _LLAMA.format(4096, 32),
    "meta-llama/Llama-3.1-70B": _LLAMA.format(8192, 64),
    "mistralai/Mistral-7B-v0.1":
        ("hub config.json of bartowski/OpenOrca-Zephyr-7B-exl2 (_name_or_path a "
         "mistralai/Mistral-7B-v0.1 snapshot): 32/8 heads, hidden_size 4096, sliding_window 4096; "
         "mlx-community/mistral-7B-v0.1 params.json: n_heads 32, n_kv_heads 8, head_dim 128, "
         "sliding_window 4096"),
    "mistralai/Mixtral-8x7B-v0.1":
        ("hub mistralai/Mixtral-8x7B-v0.1 discussion #19 (Mistral AI, merged): config.json "
         "sliding_window null, 'Doesn't use sliding window attention'; config.json of "
         "YeungNLP/firefly-mixtral-8x7b (_name_or_path the base): 32/8 heads, hidden_size 4096"),
    "Qwen/Qwen2.5-7B":
        ("hub config.json of EVA-UNIT-01/EVA-Qwen2.5-7B-v0.0 (_name_or_path the base): 28/4 "
         "heads, hidden_size 3584, use_sliding_window false"),
    "Qwen/Qwen2.5-72B":
        ("hub config.json of sumuks/purple-wintermute-0.2-72b (_name_or_path the base): 64/8 "
         "heads, hidden_size 8192, use_sliding_window false"),
    "Qwen/Qwen3-8B":
        ("hub thejaminator/qwen-hook-layer-9 commit 'Copy config.json from Qwen/Qwen3-8B': 32/8 "
         "heads, head_dim 128, use_sliding_window false"),
    "google/gemma-2-9b": _GEMMA.format("get_config_for_9b", "LOCAL_SLIDING, GLOBAL alternating", 4096, 50.0),
    "google/gemma-2-27b": _GEMMA.format("get_config_for_27b", "LOCAL_SLIDING, GLOBAL alternating", 4096, 50.0),
    "google/gemma-3-27b-pt": _GEMMA.format("get_config_for_27b_v3", "5 LOCAL_SLIDING, then GLOBAL", 1024, "unset"),
    "openai/gpt-oss-20b":
        _GPT_OSS + "hub keras/gpt_oss_20b_en task.json: 24 layers, 64/8 heads, head_dim 64, sliding_window 128",
    "openai/gpt-oss-120b":
        _GPT_OSS + ("its defaults are the 120b's (36 layers, 128 experts), as in hub witflag/AlphaMind "
                    "original/config.json, duplicated from openai/gpt-oss-120b"),
    "microsoft/phi-4":
        ("hub microsoft/phi-4 config.json on refs/pr/10: 40/10 heads, hidden_size 5120, "
         "sliding_window null"),
    "tiiuae/falcon-7b":
        ("hub config of tiiuae/falcon-7b-instruct as copied into tenstorrent's Falcon benchmark "
         "(RWConfig params): hidden_size 4544, n_head 71, multi_query true, alibi false; "
         "kimborgen/falcon-llm README (a copy of the hub repo): query_key_value out_features 4672 = "
         "(71 + 2) x 64, one k and one v head; vLLM asserts 71 % tp == 0, so tp 1 only"),
    "bigcode/starcoder":
        ("Cerebras modelzoo tools/checkpoint_converters/starcoder.py, the hub config's defaults: "
         "n_embd 6144, n_head 48, n_layer 40, multi_query true (c_attn packs embed_dim + 2 x head_dim)"),
    "tiiuae/falcon-180B":
        ("NVIDIA/TensorRT-LLM performance docs, the checkpoint config of tiiuae/falcon-180B: "
         "num_attention_heads 232, num_key_value_heads 8, hidden_size 14848, new_decoder_architecture "
         "true; a group of 29 query heads per kv head at every tp"),
    "deepseek-ai/DeepSeek-V3":
        ("deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json: n_heads 128, kv_lora_rank "
         "512, qk_rope_head_dim 64; inference/model.py MLA caches kv_lora_rank + qk_rope_head_dim"),
    "deepseek-ai/DeepSeek-V2-Lite":
        ("deepseek-ai/DeepSeek-V3 inference/configs/config_16B.json (the V2-Lite shape: 27 "
         "layers, 64 experts): n_heads 16, kv_lora_rank 512, qk_rope_head_dim 64; hub config.json of "
         "ModelCloud/DeepSeek-V2-Lite-gptq-4bit: the same, q_lora_rank null"),
}
MODELS: tuple[ModelAttention, ...] = tuple(
    ModelAttention(name, num_heads, num_kv_heads, head_size, **fields, checked=_CHECKED[name])
    for name, num_heads, num_kv_heads, head_size, fields in _ROWS)


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
