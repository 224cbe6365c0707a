"""What a kernel needs of its caller, declared as data: the code paths a call can take and, per path, the index
dtypes it reads correctly and the ``max_*`` scalars it reads; whether the value head size may differ from the
key head size; whether the kernel writes the cache.

vLLM's attention backends declare their capabilities as class data that the selector reads
(vllm/v1/attention/backend.py, ``AttentionBackend``: ``supported_dtypes``, ``get_supported_head_sizes``, ...);
kvfuzz's guard does the same for the caller contract: :mod:`kvfuzz.contracts.calls.call_checks` reads a call's
:class:`KernelDeclaration` instead of branching on kernel names, and every declaration lives next to the
kernel's signature (in its family's home, ``kvfuzz.fuzz.targets.<family>``), with the vLLM or SGLang source it
was read from.

The rule the checks apply (README, "What the guard calls an error"): a violation is an **error** only when the
call breaks what the kernel needs *on a path it takes here* (:meth:`KernelDeclaration.paths_here`); when only
a path taken on another platform needs it (:meth:`KernelDeclaration.paths_elsewhere`), it is a **portability
warning** naming that path; when no path reads it, it is not reported.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

#: A :class:`~kvfuzz.contracts.calls.paged_call.PagedCall` (not imported: paged_call imports this module).
PagedCall = Any

#: Index dtypes a Triton kernel loads correctly: it loads each index with the pointer's element type.
TRITON_INDEX_DTYPES = frozenset({torch.int32, torch.int64})
INT32_ONLY = frozenset({torch.int32})
#: The ``max_*`` scalars a path may read (PagedCall field names).
MAX_SCALARS = ("max_seq_len", "max_query_len")


@attrs.frozen
class KernelPath:
    """One code path a call of a kernel can take.

    name: what it is, for messages (e.g. ``"the ROCm custom kernel (csrc/rocm/attention.cu
    paged_attention)"``). index_dtypes: the dtypes of block_table/seq_lens/query_start_loc (CSR: kv_indptr,
    kv_indices, qo_indptr, num_kv_splits) it reads correctly. reads: which of :data:`MAX_SCALARS` it reads
    (an understated one makes it compute less than asked). kv_cache_dtypes: the kv_cache_dtype strings it
    accepts (None: whatever the kernel's own checks accept). taken_on: None for a path every call takes on
    every platform; else ``(call, rocm_arch) -> (taken, why)``, whether a call on that ROCm architecture takes it
    (only ROCm-conditional paths exist today). source: the file and function the declaration was read from.
    """

    name: str
    index_dtypes: frozenset[torch.dtype] = TRITON_INDEX_DTYPES
    reads: frozenset[str] = frozenset()
    kv_cache_dtypes: tuple[str, ...] | None = None
    taken_on: Callable[[PagedCall, str], tuple[bool, str]] | None = None
    source: str = ""

    def __attrs_post_init__(self) -> None:
        unknown = set(self.reads) - set(MAX_SCALARS)
        if unknown:
            raise ValueError(f"KernelPath {self.name!r}: reads {sorted(unknown)}, not among {MAX_SCALARS}")


@attrs.frozen
class TakenPath:
    """A path and why this call takes it (where: "here", or the ROCm architecture it would run on)."""

    path: KernelPath
    where: str
    why: str = ""


@attrs.frozen
class KernelDeclaration:
    """What a kernel needs of its caller (see the module docstring).

    paths: every path a call can take (at least one unconditional). value_head_size_may_differ: the value cache
    (and ``value``) may have a head size other than the key's (MLA: 576/512; vLLM's decode_attention_fwd,
    SGLang's kernels). writes_cache: the kernel writes the cache (a writer: sequences sharing a block they both
    write clobber each other; a reader computes what the shared block holds).
    trailing_query_rows: the query may have rows past ``query_start_loc[-1]`` that no sequence owns, which the
    kernel leaves alone: vLLM's FULL CUDA-graph padding passes ``query[:num_actual_tokens]`` with
    ``num_actual_tokens = num_tokens_padded`` and pads of query_len 0 (vllm/v1/worker/gpu_model_runner.py
    ``_build_attention_metadata``; :mod:`kvfuzz.contracts.model.padding`).
    empty_decode_rows: a decode kernel (one query row per sequence) may get rows of seq_len 0, which it must
    compute as a finite row: vLLM's FULL CUDA-graph padding of TRITON_MLA decode batches (``seq_lens`` 0 and
    ``NULL_BLOCK_ID`` rows, one query row each: vllm/v1/attention/backends/mla/triton_mla.py ``forward_mqa``;
    vllm#57017, its proposed fix vllm#57094 writes zeros there). Not a caller violation.
    """

    paths: tuple[KernelPath, ...]
    value_head_size_may_differ: bool = False
    writes_cache: bool = False
    trailing_query_rows: bool = False
    empty_decode_rows: bool = False

    def __attrs_post_init__(self) -> None:
        if not any(p.taken_on is None for p in self.paths):
            raise ValueError("a KernelDeclaration needs at least one path taken on every platform")

    def paths_here(self, call: PagedCall, rocm_arch: str | None) -> list[TakenPath]:
        """The paths this call takes where it runs (``rocm_arch``: the ROCm architecture, None off ROCm).
        Memoized on the call (``PagedCall.routes``): several checks ask."""
        key = ("here", rocm_arch)
        if key not in call.routes:
            call.routes[key] = self._paths_here(call, rocm_arch)
        return call.routes[key]

    def _paths_here(self, call: PagedCall, rocm_arch: str | None) -> list[TakenPath]:
        out = []
        for p in self.paths:
            if p.taken_on is None:
                out.append(TakenPath(p, "here"))
            elif rocm_arch:
                taken, why = p.taken_on(call, rocm_arch)
                if taken:
                    out.append(TakenPath(p, rocm_arch, why))
        return out

    def paths_elsewhere(self, call: PagedCall, rocm_arch: str | None,
                        archs: tuple[str, ...]) -> list[TakenPath]:
        """Conditional paths this call does not take here but would on one of ``archs`` (checked only off
        ROCm: on ROCm the call's own architecture decides); ``where`` lists every architecture taking it, ``why``
        is the first one's reason. Memoized on the call, as :meth:`paths_here`."""
        key = ("elsewhere", rocm_arch, tuple(archs))
        if key not in call.routes:
            call.routes[key] = self._paths_elsewhere(call, rocm_arch, archs)
        return call.routes[key]

    def first_path(self, call: PagedCall, rocm_arch: str | None, archs: tuple[str, ...],
                   where: Callable[[KernelPath], bool]) -> tuple[TakenPath, bool] | None:
        """The first path for which ``where`` holds, and whether this call takes it here: a path taken here
        first (``(path, True)``: the checks' errors), else one taken only on another of ``archs``
        (``(path, False)``: portability warnings); None when no path qualifies. The rule every
        declaration-driven check applies (module docstring)."""
        for tp in self.paths_here(call, rocm_arch):
            if where(tp.path):
                return tp, True
        for tp in self.paths_elsewhere(call, rocm_arch, archs):
            if where(tp.path):
                return tp, False
        return None

    def _paths_elsewhere(self, call: PagedCall, rocm_arch: str | None,
                         archs: tuple[str, ...]) -> list[TakenPath]:
        if rocm_arch:
            return []
        out = []
        for p in self.paths:
            if p.taken_on is None:
                continue
            hits = [(arch, why) for arch in archs for taken, why in [p.taken_on(call, arch)] if taken]
            if hits:
                out.append(TakenPath(p, ", ".join(a for a, _ in hits), hits[0][1]))
        return out


#: The declaration of a kernel kvfuzz knows nothing particular about: one Triton-style path.
GENERIC = KernelDeclaration(paths=(KernelPath("the kernel"),))


__all__ = ["GENERIC", "INT32_ONLY", "KernelDeclaration", "KernelPath", "MAX_SCALARS", "TRITON_INDEX_DTYPES",
           "TakenPath"]
