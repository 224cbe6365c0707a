"""The kernel options vLLM's FlexAttention backend passes to ``flex_attention``, for torch.flex_paged
(:mod:`kvfuzz.fuzz.targets.torch_flex`). Source: vllm 0.33.0, vllm/v1/attention/backends/flex_attention.py.

vLLM chooses them per call, for a decoder layer over a paged cache (the default engine: no ``flex_attn_*``
settings in its ``AttentionConfig``, no per-layer ``block_m``/``block_n``, no R-SWA):

1. ``FlexAttentionMetadataBuilder.__init__``: ``supports_small_blocks = is_torch_equal_or_newer("2.9.0.dev0")``;
   ``q_block_size, kv_block_size = FlexAttentionMetadataBuilder._get_block_sizes(attention_config,
   supports_small_blocks, block_size, uses_paged_kv=True)``: ``(16, block_size)`` with torch >= 2.9, else
   ``(128, 128)``; a block size that is not a power of two raises ValueError. ``direct_build`` is
   ``supports_small_blocks and kv_block_size == block_size``.
2. The block mask's ``BLOCK_SIZE`` is ``(q_block_size, kv_block_size)`` (``_build_block_mask_direct``,
   ``build_block_mask``).
3. ``FlexAttentionImpl.forward``: ``get_kernel_options(query, *block_mask.BLOCK_SIZE, direct_build)``: with a direct
   build ``{"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": q_block_size, "BLOCK_N": kv_block_size}`` (the main flex
   kernel, never flex-decoding), else 64 (32 for fp32 queries) divided down to the block, halved on devices with
   less than 144 KiB of shared memory per block, at least 16. Under ``VLLM_BATCH_INVARIANT=1``
   (``FlexAttentionImpl.__init__``), BLOCK_M and BLOCK_N are then 16 and ``IS_DIVISIBLE`` False.

The two vLLM functions, ``get_kernel_options`` and ``_get_block_sizes``, are vLLM's own code wherever vLLM is
installed, so kvfuzz follows upstream when they change: imported from their module when it imports (a full vLLM
install), else compiled from that module's source file alone (:func:`upstream_function`; the module imports
``vllm.config``, which needs pydantic and transformers, absent from the ``--no-deps`` installs of ``make setup`` and
the GPU bundle). Without vLLM's files, kvfuzz's copies of vllm 0.33.0's functions are used; a test pins them
to vLLM's on a grid. :func:`vllm_runs_block_size` is vLLM's rule for which block sizes the backend runs at all.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import os
import types
from pathlib import Path
from typing import Callable

import torch
from torch.torch_version import TorchVersion

#: The module vLLM's FlexAttention backend lives in, and its file under the vllm package.
VLLM_FLEX_MODULE = "vllm.v1.attention.backends.flex_attention"
VLLM_FLEX_FILE = ("v1", "attention", "backends", "flex_attention.py")
#: The two functions kvfuzz takes from it (a method as ``Class.name``).
GET_KERNEL_OPTIONS = "get_kernel_options"
GET_BLOCK_SIZES = "FlexAttentionMetadataBuilder._get_block_sizes"

#: vLLM's ``AttentionConfig`` as the backend reads it, at its defaults (vllm/config/attention.py: each None). The
#: minimum ``_get_block_sizes`` needs of a vLLM config object.
DEFAULT_ATTENTION_CONFIG = types.SimpleNamespace(flex_attn_q_block_size=None, flex_attn_kv_block_size=None,
                                                 flex_attn_block_m=None, flex_attn_block_n=None)
#: vLLM's kernel block sizes for the backend: ``FlexAttentionBackend.get_supported_kernel_block_sizes`` is
#: ``[MultipleOf(16)]`` (``AttentionBackend.supports_block_size``: a multiple of it).
KERNEL_BLOCK_MULTIPLE = 16


def _copy_get_kernel_options(query, block_m, block_n, use_direct_build: bool) -> dict[str, int | bool]:
    """kvfuzz's copy of vllm 0.33.0's ``get_kernel_options`` (vllm/v1/attention/backends/flex_attention.py), used
    where vLLM's own is not installed. ROCm's 64 KiB fallback is kept as ``torch.version.hip``."""
    kernel_options: dict[str, int | bool] = {"FORCE_USE_FLEX_ATTENTION": True}

    def ensure_divisible(candidate: int, block_size: int) -> int:
        if block_size <= 0:
            return candidate
        candidate = min(candidate, block_size)
        if candidate <= 0:
            return block_size
        if block_size % candidate == 0:
            return candidate
        candidate = math.gcd(candidate, block_size)
        return block_size if candidate <= 1 else candidate

    if use_direct_build:
        kernel_options["BLOCK_M"] = block_m
        kernel_options["BLOCK_N"] = block_n
        return kernel_options
    preferred_block = 32 if query.dtype == torch.float32 else 64
    block_m_candidate = ensure_divisible(preferred_block, block_m)
    block_n_candidate = ensure_divisible(preferred_block, block_n)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties()
        if hasattr(props, "shared_memory_per_block_optin"):
            max_shared_memory = props.shared_memory_per_block_optin
        elif torch.version.hip is not None:
            max_shared_memory = 65536
        else:
            raise RuntimeError("Unable to determine shared memory size on this hardware.")
        if max_shared_memory < 144 * 1024:
            block_m_candidate = ensure_divisible(max(1, block_m_candidate // 2), block_m)
            block_n_candidate = ensure_divisible(max(1, block_n_candidate // 2), block_n)
    kernel_options["BLOCK_M"] = max(block_m_candidate, 16)
    kernel_options["BLOCK_N"] = max(block_n_candidate, 16)
    return kernel_options


def _copy_get_block_sizes(attn_cfg, supports_small_blocks: bool, cache_block_size: int,
                          uses_paged_kv: bool) -> tuple[int, int]:
    """kvfuzz's copy of vllm 0.33.0's ``FlexAttentionMetadataBuilder._get_block_sizes`` (same file)."""
    use_small_blocks = supports_small_blocks and uses_paged_kv
    q_block_size = attn_cfg.flex_attn_q_block_size or (16 if use_small_blocks else 128)
    if (q_block_size & (q_block_size - 1)) != 0 or (
            attn_cfg.flex_attn_block_m is not None and q_block_size % attn_cfg.flex_attn_block_m != 0):
        raise ValueError(f"flex_attn_q_block_size must be a power of 2 and divisible by flex_attn_block_m, got "
                         f"{q_block_size}, {attn_cfg.flex_attn_block_m}")
    kv_block_size = attn_cfg.flex_attn_kv_block_size or (cache_block_size if use_small_blocks else 128)
    if (kv_block_size & (kv_block_size - 1)) != 0 or (
            attn_cfg.flex_attn_block_n is not None and kv_block_size % attn_cfg.flex_attn_block_n != 0):
        raise ValueError(f"flex_attn_kv_block_size must be a power of 2 and divisible by flex_attn_block_n, got "
                         f"{kv_block_size}, {attn_cfg.flex_attn_block_n}")
    return q_block_size, kv_block_size


#: kvfuzz's copies of the two vLLM functions, by name (what :func:`upstream_function` falls back to).
COPIES = {GET_KERNEL_OPTIONS: _copy_get_kernel_options, GET_BLOCK_SIZES: _copy_get_block_sizes}


class _PlatformStandIn:
    """What ``get_kernel_options`` asks of vLLM's ``current_platform`` (only on a CUDA device without
    ``shared_memory_per_block_optin``): whether this is ROCm."""

    @staticmethod
    def is_rocm() -> bool:
        return torch.version.hip is not None


def vllm_flex_source() -> Path | None:
    """The installed vLLM's flex_attention.py, found without importing vllm; None without vLLM or the file."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).joinpath(*VLLM_FLEX_FILE)
        if path.is_file():
            return path
    return None


def compile_from_source(path: Path, qualname: str) -> Callable:
    """The function ``qualname`` (``name`` or ``Class.name``) of the Python file ``path``, compiled alone, its
    decorators and its signature's annotations dropped, with ``math``, ``torch`` and a ``current_platform``
    stand-in as its globals. Raises LookupError when the file defines no such function, SyntaxError/OSError as
    reading it does."""
    nodes = ast.parse(path.read_text(), filename=str(path)).body
    *classes, name = qualname.split(".")
    for cls in classes:
        nodes = next((n.body for n in nodes if isinstance(n, ast.ClassDef) and n.name == cls), [])
    fn = next((n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        raise LookupError(f"{path} defines no function {qualname}")
    fn.decorator_list, fn.returns = [], None
    for arg in ast.walk(fn.args):
        if isinstance(arg, ast.arg):
            arg.annotation = None
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec", dont_inherit=True)
    namespace = {"__name__": VLLM_FLEX_MODULE, "math": math, "torch": torch, "current_platform": _PlatformStandIn()}
    exec(code, namespace)
    return namespace[name]


def _imported(qualname: str) -> Callable:
    obj = importlib.import_module(VLLM_FLEX_MODULE)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _works(qualname: str, fn: Callable) -> None:
    """Call ``fn`` as the target will (raising what it raises), so a vLLM function whose body now needs more than
    :func:`compile_from_source` gives it falls back to the copy here, not in a worker."""
    if qualname == GET_KERNEL_OPTIONS:
        for args in ((16, 16, True), (128, 16, False)):
            opts = fn(torch.empty(0, dtype=torch.float16), *args)
            if not {"BLOCK_M", "BLOCK_N"} <= set(opts):
                raise ValueError(f"{qualname}{args} returned {opts!r}: no BLOCK_M/BLOCK_N")
    else:
        fn(DEFAULT_ATTENTION_CONFIG, True, 16, True)


def keep_triton_interpretable() -> None:
    """Importing vLLM's modules (and calling flex_attention, even eagerly) imports triton. On a machine without
    CUDA, enable Triton's interpreter first (:func:`~kvfuzz.fuzz.targets.triton_runtime.prepare_triton_runtime`), so
    vLLM's Triton targets still run in the same process; too late (triton already imported) changes nothing."""
    if torch.cuda.is_available():
        return
    from .triton_runtime import prepare_triton_runtime

    try:
        prepare_triton_runtime()
    except RuntimeError:
        pass


@functools.cache
def upstream_function(qualname: str) -> tuple[Callable, str]:
    """``(function, where)`` for ``qualname`` (:data:`GET_KERNEL_OPTIONS` or :data:`GET_BLOCK_SIZES`): vLLM's own,
    imported from :data:`VLLM_FLEX_MODULE` ("vllm (imported)"), else compiled from its source file ("vllm source
    PATH"), else kvfuzz's copy of vllm 0.33.0's ("kvfuzz's copy of vllm 0.33.0 (WHY)"). Never raises."""
    why = "vLLM's flex_attention.py not found"
    keep_triton_interpretable()
    try:
        fn, where = _imported(qualname), "vllm (imported)"
        _works(qualname, fn)
        return fn, where
    except Exception as e:  # a --no-deps vLLM: ModuleNotFoundError (pydantic); a broken one: anything
        why = f"importing it: {type(e).__name__}: {e}"
    path = vllm_flex_source()
    if path is not None:
        try:
            fn = compile_from_source(path, qualname)
            _works(qualname, fn)
            return fn, f"vllm source {path}"
        except Exception as e:  # vLLM moved or changed the function: fall back to the copy, saying why
            why = f"{path}: {type(e).__name__}: {e}"
    return COPIES[qualname], f"kvfuzz's copy of vllm 0.33.0 ({why})"


def supports_small_blocks(version: str | None = None) -> bool:
    """vLLM's ``is_torch_equal_or_newer("2.9.0.dev0")`` for torch ``version`` (default: this torch's), the
    builder's ``supports_small_blocks`` (vllm/utils/torch_version.py: packaging's version order; torch's
    ``TorchVersion`` compares the same way)."""
    return TorchVersion(torch.__version__ if version is None else version) >= "2.9.0.dev0"


def block_mask_sizes(block_size: int) -> tuple[int, int, bool]:
    """``(q_block_size, kv_block_size, direct_build)``: the block mask vLLM builds for a decoder layer over a
    paged cache of ``block_size`` tokens a block (this module's step 1). Raises ValueError as vLLM does for a block
    size that is not a power of two."""
    get_block_sizes, _ = upstream_function(GET_BLOCK_SIZES)
    small = supports_small_blocks()
    q_block, kv_block = get_block_sizes(DEFAULT_ATTENTION_CONFIG, small, block_size, True)
    return q_block, kv_block, small and kv_block == block_size


def batch_invariant() -> bool:
    """vLLM's ``envs.VLLM_BATCH_INVARIANT`` (vllm/envs.py: ``bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))``)."""
    return bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))


def forward_kernel_options(query: torch.Tensor, block_m: int, block_n: int, direct_build: bool) -> dict:
    """The ``kernel_options`` ``FlexAttentionImpl.forward`` passes ``flex_attention`` for a block mask of
    ``BLOCK_SIZE == (block_m, block_n)``: vLLM's ``get_kernel_options`` (which reads only ``query.dtype``), then
    16 x 16 tiles and ``IS_DIVISIBLE=False`` under ``VLLM_BATCH_INVARIANT=1`` (this module's step 3)."""
    get_kernel_options, _ = upstream_function(GET_KERNEL_OPTIONS)
    options = dict(get_kernel_options(query, block_m, block_n, direct_build))
    if batch_invariant():
        options.update(BLOCK_M=16, BLOCK_N=16, IS_DIVISIBLE=False)
    return options


def vllm_kernel_options(dtype: torch.dtype, block_size: int) -> dict:
    """The ``kernel_options`` vLLM's FlexAttention backend passes for queries of ``dtype`` over a paged cache of
    ``block_size``: :func:`forward_kernel_options` at :func:`block_mask_sizes`. With torch >= 2.9 and vLLM's
    defaults, ``{"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": block_size}`` at every head size, GQA
    group and dtype. Raises ValueError for a block size that is not a power of two."""
    q_block, kv_block, direct = block_mask_sizes(block_size)
    return forward_kernel_options(torch.empty(0, dtype=dtype), q_block, kv_block, direct)


def vllm_runs_block_size(block_size: int) -> bool:
    """Whether vLLM 0.33.0 runs its FlexAttention backend over a cache of ``block_size`` tokens a block: a multiple
    of :data:`KERNEL_BLOCK_MULTIPLE` (``supports_block_size``) and a power of two (``_get_block_sizes`` raises
    otherwise)."""
    return block_size > 0 and block_size % KERNEL_BLOCK_MULTIPLE == 0 and block_size & (block_size - 1) == 0


__all__ = ["COPIES", "DEFAULT_ATTENTION_CONFIG", "GET_BLOCK_SIZES", "GET_KERNEL_OPTIONS", "KERNEL_BLOCK_MULTIPLE",
           "VLLM_FLEX_MODULE", "batch_invariant", "block_mask_sizes", "compile_from_source", "forward_kernel_options",
           "keep_triton_interpretable", "supports_small_blocks", "upstream_function", "vllm_flex_source",
           "vllm_kernel_options", "vllm_runs_block_size"]
