"""The adapter protocol between kvfuzz and a real kernel.

A target declares what it accepts (:class:`~kvfuzz.contracts.model.capabilities.Capabilities`, whose contract also
decides which property checks it: attention kernels against the fp64 reference, cache writers
(:attr:`~kvfuzz.contracts.model.contract.Contract.WRITER`) by the cache they leave), names the cache
layout it reads, builds the exact arguments of one kernel call from a batch and a materialized cache
(:meth:`Target.build_call`), and runs it (:meth:`Target.run`). kvfuzz checks the call's arguments against
the contract before the kernel runs, and the output against the fp64 reference after.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, Callable, ClassVar, Mapping

import attrs
import torch

from kvfuzz.contracts.caches.layouts import CacheLayout
from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.checks.reference import FLASH_ATTENTION, Numerics
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.strategies.tiers import TIERS

from .signature import CheckedKernel, KernelSignature


@attrs.frozen
class Availability:
    ok: bool
    reason: str = ""
    device: str = "cpu"


#: What an answer of :meth:`Target.installed` says it did not do (``kvfuzz targets`` without ``--check``).
NOT_LOADED = "installed, not loaded (--check loads it)"


def try_import(what: str, load: Callable[[], Any] | None = None, fix: str = "") -> tuple[Any, Availability | None]:
    """``(load(), None)`` (``load`` default: import the module ``what``), or, when it raises anything (a bad install
    raises ImportError, RuntimeError, OSError: a wrong torch ABI, a missing CUDA library), ``(None, why)`` with
    ``why = Availability(False, "importing WHAT failed: TYPE: MESSAGE (FIX)")``: what a target's
    :meth:`~Target.availability` returns instead of raising."""
    try:
        return (importlib.import_module(what) if load is None else load()), None
    except Exception as e:
        return None, Availability(False, f"importing {what} failed: {type(e).__name__}: {e}" + (f" ({fix})" if fix
                                                                                              else ""))


@attrs.define
class KernelCall:
    """One call's arguments, by the kernel's own parameter names, plus the tensors the contract checkers read.

    kwargs: passed to the kernel as is.
    key_cache, value_cache: the caches (as passed; read through ``layout``).
    key, value: the new tokens' k/v ``[num_tokens, num_kv_heads, head_size]`` for split-contract kernels,
        ``None`` for unified kernels.
    output: ``[num_tokens, num_heads, head_size]`` tensor the kernel writes.
    """

    kwargs: dict[str, Any]
    layout: CacheLayout
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    output: torch.Tensor
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


def require_decode(name: str, batch: Batch) -> None:
    """Raise ValueError naming target ``name`` and the sequences when ``batch`` has a prefill (query_len > 1): a
    decode-only kernel's call cannot be built for it."""
    if batch.prefill_seqs:
        raise ValueError(f"{name} takes decode sequences only (query_len == 1); sequences "
                         f"{list(batch.prefill_seqs)} have query_len > 1")


class DeviceCapabilities:
    """A target's ``capabilities`` that depend on where its kernel runs, read from the class or an instance alike:
    the ``declared`` :class:`~kvfuzz.contracts.model.capabilities.Capabilities` with the fields ``fields(cls)``
    returns (field name -> value; asked at each read, so a device chosen after import counts) replaced. Set it as
    the class attribute ``capabilities``; an instance may still set its own (a non-data descriptor). Examples: the
    Triton targets' dtypes (kvfuzz.fuzz.targets.triton_runtime), torch flex's CUDA head sizes and GQA groups."""

    def __init__(self, declared: Capabilities, fields: Callable[[type], Mapping[str, Any]]) -> None:
        self.declared = declared
        self.fields = fields
        self._made: dict[tuple, Capabilities] = {}

    def __get__(self, obj: object, cls: type) -> Capabilities:
        fields = dict(self.fields(cls))
        key = (cls, tuple(sorted(fields.items())))
        if key not in self._made:
            self._made[key] = attrs.evolve(self.declared, **fields) if fields else self.declared
        return self._made[key]


class Target(abc.ABC):
    """Base class for kernel adapters. Subclasses set the class attributes and implement the methods."""

    #: Registry name, e.g. "vllm.chunked_prefill_paged_decode".
    name: ClassVar[str]
    #: One line on what the kernel is and where it lives.
    description: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: The signature of the kernel call this target makes (kvfuzz.fuzz.targets.signature: a KernelSignature,
    #: or a PageListSignature for FlashInfer's calls), from the target's family home: the property then also
    #: runs the runtime guard's argument checks (index dtypes, lengths, block ids, max_seq_len, page lists, ...)
    #: on every call. A name in the guard's table (kvfuzz.fuzz.guard.signatures) works too; None: unchecked.
    checked_kernel: ClassVar[CheckedKernel | str | None] = None
    #: Where the kernel lives upstream, ``(package, file, function)``, for a kernel whose ``checked_kernel`` does
    #: not say it (a ``torch.ops`` op, a FlashInfer wrapper, an unchecked kernel); None: :meth:`upstream_source`
    #: derives it from the ``checked_kernel``'s defining module. ``kvfuzz report --issue`` names it.
    upstream: ClassVar[tuple[str, str, str] | None] = None
    #: Fields of a kernel configuration (kvfuzz.strategies.configs.RUNTIME_FIELDS: "heads", "block_size",
    #: "window") the kernel takes as run-time arguments instead of compiling for them: a pinned chunk then stays
    #: in one compiled specialization and still draws these freely (FlashInfer: all three).
    runtime_fields: ClassVar[frozenset[str]] = frozenset()
    #: Poisons the pre-merge gate (``kvfuzz check``) uses; None: all. A target restricts this only for a
    #: documented, known kernel limitation, which ``kvfuzz fuzz`` (all poisons) keeps reporting.
    gate_poisons: ClassVar[tuple[Poison, ...] | None] = None
    #: Value ranges the pre-merge gate draws (kvfuzz.contracts.model.batch.VALUE_RANGES); None: all. Restricted, as
    #: ``gate_poisons``, only for a documented, known kernel limitation that ``kvfuzz fuzz`` keeps reporting.
    gate_value_ranges: ClassVar[tuple[str, ...] | None] = None
    #: Production states (names in kvfuzz.contracts.model.states.PRODUCTION_STATES, e.g. "freed_window_blocks",
    #: "cuda_graph_padding") the pre-merge gate leaves undrawn (Capabilities.without_states), as
    #: ``gate_poisons``, only for a documented live upstream bug that ``kvfuzz fuzz`` keeps reporting (docs/bugs.md).
    gate_states_off: ClassVar[tuple[str, ...]] = ()
    #: Whether ``kvfuzz fuzz --sanitize auto`` (the default) re-runs this target's examples under compute-sanitizer
    #: memcheck on CUDA (kvfuzz.fuzz.harness.sanitizer): kernels whose sanitized child starts in seconds (vLLM's and
    #: SGLang's Triton kernels, :class:`~kvfuzz.fuzz.targets.triton_runtime.VllmTritonTarget`). An explicit
    #: ``--sanitize SHARE`` applies to every CUDA target.
    sanitize_by_default: ClassVar[bool] = False
    #: How the kernel's arithmetic goes beyond the FlashAttention family the envelope bounds by default
    #: (kvfuzz.contracts.checks.reference.Numerics: tanh.approx in the softcap, the output rounded before ``v_scale``
    #: is applied); the envelope of its outputs adds those errors (docs/tolerance.md, "Declared numerics").
    numerics: ClassVar[Numerics] = FLASH_ATTENTION
    #: Size tiers (kvfuzz.strategies.tiers.TIERS) this target runs: None declares the default,
    #: :meth:`size_tiers`. ``kvfuzz fuzz`` mixes them on CUDA (``--tier``; docs/fuzzing.md).
    tiers: ClassVar[tuple[str, ...] | None] = None
    #: Seconds a steered campaign's free chunk of this target generates for after its first example, with
    #: ``--duration`` (kvfuzz.fuzz.campaign.chunks ``chunk_time_limit``; 0: only a pinned chunk's share of
    #: ``--duration``); ``KVFUZZ_FREE_SECONDS`` overrides it for every target. 0 by default: on a kernel compiled per
    #: configuration (Triton, CuTe DSL, JIT modules) a short chunk is mostly its compiles, and 5 s free chunks of
    #: vLLM's Triton unified kernel found vllm#56862 later on 3 of 3 seeds on an H200
    #: (benchmarks/results/free-ab-h200.txt). A target compiled ahead of time may set it (FlashAttention 3: 5).
    free_chunk_seconds: ClassVar[float] = 0.0

    def gate_capabilities(self):
        """``capabilities`` less :attr:`gate_states_off` (the declaration the pre-merge gate draws from)."""
        return self.capabilities.without_states(self.gate_states_off)

    @classmethod
    def upstream_source(cls) -> tuple[str, str, str] | None:
        """``(package, file, function)`` of the kernel upstream: :attr:`upstream`, else the first defining module of
        a :class:`~kvfuzz.fuzz.targets.signature.KernelSignature` ``checked_kernel`` as a file, and its function
        (``("vllm", "vllm/v1/attention/ops/prefix_prefill.py", "context_attention_fwd")``); None when neither
        says. Imports nothing."""
        if cls.upstream is not None:
            return cls.upstream
        sig = cls.checked_kernel
        if isinstance(sig, KernelSignature) and sig.modules:
            module = sig.modules[0]
            return module.split(".")[0], module.replace(".", "/") + ".py", sig.attr
        return None

    def __new__(cls, *args, **kwargs):
        # A subclass that does not set its own name would share its parent's reproducer directories, database
        # key and replay resolution: refuse it here, where it is made, with the fix.
        if not isinstance(getattr(cls, "name", None), str) or "name" not in vars(cls):
            parent = next((b.__name__ for b in cls.__mro__[1:] if "name" in vars(b)), None)
            shared = f": it would share {parent}'s name {getattr(cls, 'name', '')!r}" if parent else ""
            raise TypeError(f"target class {cls.__qualname__} does not set its own `name`{shared}; give it a "
                            f"unique one, e.g. name = \"mykernels.{cls.__name__.lower()}\"")
        return super().__new__(cls)

    def release_memory(self) -> None:
        """Give back device memory the kernel's library keeps pooled (a CuPy or JAX memory pool, a workspace it
        caches); kvfuzz calls it whenever it gives its own cached device memory back (between tasks, when another
        worker of the GPU needs room: kvfuzz.fuzz.harness.memory.Releases). Default: nothing. Never raise."""

    @abc.abstractmethod
    def availability(self) -> Availability:
        """Whether the kernel can run here and, if not, why (say what to install)."""

    def installed(self) -> Availability | None:
        """Whether the kernel looks runnable here from what is installed (packages, files, the torch version),
        without importing or loading the kernel: cheap, for ``kvfuzz targets``. None (the default): this target
        cannot tell without loading it, and :meth:`availability` is asked instead. A yes here is a forecast
        (its reason says :data:`NOT_LOADED`); :meth:`availability` has the last word. Never raises."""
        return None

    @abc.abstractmethod
    def layout(self, batch: Batch) -> CacheLayout:
        """The physical cache layout the kernel reads."""

    def size_tiers(self) -> tuple[str, ...]:
        """The size tiers this target declares (:data:`kvfuzz.strategies.tiers.TIERS`, in that order): its
        ``tiers``, or by default every tier for an attention kernel that declares CUDA, every tier but
        ``big-cache`` and ``serving`` for a CUDA cache writer (its property compares whole caches; serving batches
        are attention calls), ``small`` for the rest."""
        if self.tiers is not None:
            return tuple(t for t in TIERS if t in self.tiers)
        if "cuda" not in self.capabilities.devices:
            return ("small",)
        if self.capabilities.contract.is_attention:
            return TIERS
        return tuple(t for t in TIERS if t not in ("big-cache", "serving"))

    @property
    def device(self) -> str:
        return self.availability().device

    def numerics_for(self, batch: Batch) -> Numerics:
        """The numerics of this batch's call (:attr:`numerics` unless a path of the kernel computes otherwise, e.g.
        FlashAttention 3's fp8 forward rounds P to e4m3 for fp8 caches only)."""
        return self.numerics

    def call_data(self, batch: Batch, data: BatchData) -> BatchData:
        """The ground truth as the kernel's caller hands it over, when the caller rounds an input before the kernel
        (e.g. vLLM's attention layer quantizes the query to fp8 for FlashAttention 3's fp8 forward:
        ``Attention.query_quant``): the reference and the reproducer then hold exactly what the kernel gets. Default:
        ``data`` unchanged. Must be idempotent (a replay hands the stored, already rounded data back)."""
        return data

    @abc.abstractmethod
    def build_call(self, batch: Batch, data: BatchData, cache: CacheState) -> KernelCall:
        """The arguments of one kernel call for ``batch`` with ``cache`` as the paged cache."""

    @abc.abstractmethod
    def run(self, call: KernelCall) -> torch.Tensor:
        """Run the kernel; return the output ``[num_tokens, num_heads, head_size]``."""

    def faithful_dtypes(self) -> tuple[str, ...]:
        """Dtypes this environment computes faithfully for the target, declared or not (where undeclared
        configurations may be drawn). Default: the declared ones."""
        return self.capabilities.dtypes

    def path(self, batch: Batch) -> str:
        """Which kernel path ``batch`` takes inside the target (reported as a Hypothesis event)."""
        return "default"


__all__ = ["NOT_LOADED", "Availability", "DeviceCapabilities", "KernelCall", "Target", "require_decode", "try_import"]
