"""Kernel targets: adapters from a kvfuzz batch to a real kernel call. ``get_target`` resolves a name."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .base import Availability, KernelCall, Target

#: Built-in targets: name -> "module:class" (imported lazily, so a missing kernel never breaks the CLI).
BUILTIN = {
    "vllm.chunked_prefill_paged_decode": "kvfuzz.fuzz.targets.vllm_triton:VllmChunkedPrefillPagedDecode",
    "vllm.context_attention_fwd": "kvfuzz.fuzz.targets.vllm_triton:VllmContextAttentionFwd",
    "vllm.unified_attention": "kvfuzz.fuzz.targets.vllm_triton:VllmUnifiedAttention",
    "vllm.decode_attention_fwd": "kvfuzz.fuzz.targets.vllm_triton:VllmDecodeAttentionFwd",
    "vllm.cpu_attention": "kvfuzz.fuzz.targets.vllm_cpu:VllmCpuAttention",
    "vllm.reshape_and_cache": "kvfuzz.fuzz.targets.cache_writers:VllmReshapeAndCacheFlash",
    "vllm.cpu_reshape_and_cache": "kvfuzz.fuzz.targets.cache_writers:VllmCpuReshapeAndCache",
    "torch.flex_paged": "kvfuzz.fuzz.targets.torch_flex:TorchFlexPaged",
}

_cache: dict[str, Target] = {}


def _load(spec: str) -> Target:
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"target {spec!r}: expected NAME, path/to/file.py:CLASS or package.module:CLASS")
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.exists():
            raise ValueError(f"target {spec!r}: file {path} does not exist")
        mspec = importlib.util.spec_from_file_location(f"kvfuzz_user_target_{path.stem}", path)
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_part)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"target {spec!r}: {module_part} has no attribute {attr!r}")
    target = obj() if isinstance(obj, type) else obj
    if not isinstance(target, Target):
        raise ValueError(f"target {spec!r}: {attr} is not a kvfuzz.fuzz.targets.Target")
    return target


def get_target(name: str) -> Target:
    """A built-in target by name, a mutant of :mod:`kvfuzz.fuzz.mutants` by its name (``mutant.<slug>``, as
    reproducers record it), or a user adapter as ``path/to/file.py:CLASS`` / ``package.module:CLASS``.

    Raises ValueError naming the known targets when ``name`` is none of these.
    """
    if name not in _cache:
        if name in BUILTIN:
            _cache[name] = _load(BUILTIN[name])
        elif ":" in name:
            _cache[name] = _load(name)
        elif name.startswith("mutant."):
            from kvfuzz.fuzz.mutants import get_mutant

            try:
                _cache[name] = get_mutant(name)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        else:
            raise ValueError(f"unknown target {name!r}; built-in targets: {', '.join(BUILTIN)} "
                             "(or mutant.<slug>, or path/to/file.py:CLASS)")
    return _cache[name]


__all__ = ["BUILTIN", "Availability", "KernelCall", "Target", "get_target"]
