"""What vLLM's and SGLang's Triton targets share: where Triton runs (compiled on CUDA, or Triton's interpreter on a
CPU, set up before triton/vllm are imported), the base class with their availability logic, and the helpers
their calls share (fp8 cache storage, k/v scales, sinks, poisoned split-KV scratch buffers); and how the vLLM
kernels compiled for Hopper only (FA3, FlashMLA) are found and loaded (:class:`HopperTarget`).

Sources: vllm/triton_utils (the placeholder swapped in without a GPU driver), vllm/platforms/rocm.py (stubbed
on CPU: the Triton decode path), Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, ClassVar

import attrs
import numpy as np
import torch

from kvfuzz.contracts.caches.materialize import CacheState, fill_poison
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.data import BatchData

from .base import NOT_LOADED, Availability, DeviceCapabilities, KernelCall, Target, try_import
from .signature import KernelSignature


def on_cuda() -> bool:
    return torch.cuda.is_available()


def quiet_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        import vllm.logger  # noqa: F401  (configures vLLM's loggers; then quiet its platform-probe warnings)

        logging.getLogger("vllm").setLevel(logging.ERROR)


@functools.cache
def prepare_triton_runtime() -> str:
    """Make vLLM's Triton kernels importable here; returns "cuda" or "cpu" (interpreted).

    Raises RuntimeError if triton was already imported without the interpreter on a machine without CUDA
    (the interpreter flag is read at import time): set TRITON_INTERPRET=1 before importing triton.
    """
    if on_cuda():
        quiet_vllm()
        return "cuda"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(TRITON_TOO_EARLY)
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if "vllm.platforms.rocm" not in sys.modules:
        stub = types.ModuleType("vllm.platforms.rocm")
        stub.use_rocm_custom_paged_attention = lambda *a, **k: False  # no ROCm here: the Triton decode path
        sys.modules["vllm.platforms.rocm"] = stub
    quiet_vllm()
    return "cpu"


def missing_module(*modules: str) -> str | None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            return m
    return None


#: Why vLLM's Triton kernels cannot run when triton came in before the interpreter flag (prepare_triton_runtime).
TRITON_TOO_EARLY = ("triton was imported before kvfuzz could enable its interpreter; on a machine without CUDA set "
                     "TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' in the environment before importing triton")


def triton_imported_too_early() -> bool:
    """Whether triton is already imported without its interpreter on a machine without CUDA (then too late)."""
    return not on_cuda() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted``, found from where its top-level package is installed without
    importing anything (vllm's ``__init__`` alone imports torch's compiler stack); None when it is not there."""
    top, _, rest = dotted.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin else None
    for root in spec.submodule_search_locations or ():
        base = Path(root).joinpath(*rest.split("."))
        for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def vllm_files_missing(files: tuple[str, ...]) -> list[str]:
    """Which of ``files`` (paths inside the installed vllm package, e.g. ``"_flashmla_C.abi3.so"``) the installed
    vllm lacks, found without importing vllm; all of them without vllm."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    roots = [Path(r) for r in (spec.submodule_search_locations or ())] if spec else []
    return [f for f in files if not any((r / f).is_file() for r in roots)]


def hopper_installed(files: tuple[str, ...], no_cuda: str, kernel: str, loaded_from: str) -> Availability:
    """The ``installed()`` check of a vLLM kernel compiled for Hopper only (FA3, FlashMLA): ``no_cuda`` (the
    target's one-line reason) without a CUDA device, the ``files`` of vLLM 0.33.0's CUDA wheel it needs
    (:func:`vllm_files_missing`), then an SM 9.x device; found without importing vllm. ``kernel`` names it in
    the SM message, ``loaded_from`` in the available one."""
    if not torch.cuda.is_available():
        return Availability(False, no_cuda)
    missing = vllm_files_missing(files)
    if missing:
        return Availability(False, f"the installed vllm lacks {', '.join(missing)} (vLLM 0.33.0's CUDA wheel ships "
                                   "them; `make device-bundle FA3=1` carries them)")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return Availability(False, f"{kernel} needs a Hopper GPU (SM 9.x); this one is SM {major}.{minor}")
    return Availability(True, f"CUDA (SM 9.x); {loaded_from}: {NOT_LOADED}", "cuda")


def hopper_availability(installed: Availability, module: str, unsupported: Callable[[Any], str | None],
                        loaded_from: str) -> Availability:
    """The ``availability()`` of a vLLM kernel compiled for Hopper only (FA3, FlashMLA): its ``installed`` answer
    when that is no (:func:`hopper_installed`); else vLLM's ``module`` imported (loggers quieted) and asked
    ``unsupported(module)``, the reason it cannot run here or None; ``loaded_from`` names it when it can. Never
    raises: a module that fails to load (a wrong torch ABI, a missing CUDA library) is a no that says so."""
    if not installed.ok:
        return installed

    def ask() -> str | None:
        quiet_vllm()
        return unsupported(importlib.import_module(module))

    why_not, failed = try_import(module, ask)
    if failed is not None:
        return failed
    if why_not:
        return Availability(False, why_not)
    return Availability(True, f"CUDA (SM 9.x); {loaded_from}", "cuda")


@attrs.frozen
class HopperKernel:
    """A vLLM kernel compiled for Hopper only (FA3, FlashMLA's dense decode), as its target finds and loads it.
    files: the files of vLLM 0.33.0's CUDA wheel it needs (paths inside the vllm package); no_cuda: why it cannot run
    without a CUDA device (``kvfuzz targets`` prints it); kernel: its name in the "needs a Hopper GPU" message;
    loaded_from: where it loads from, in the "available" message; module: the vllm module that says whether it runs
    here and defines what the target calls; unsupported: ``module -> reason or None`` (vLLM's own support check);
    functions: the names of what the target calls from ``module``."""

    files: tuple[str, ...]
    no_cuda: str
    kernel: str
    loaded_from: str
    module: str
    unsupported: Callable[[Any], str | None]
    functions: tuple[str, ...]


class HopperTarget(Target):
    """A target of a :class:`HopperKernel` (its class's :attr:`hopper`): installed (:func:`hopper_installed`) and
    available (:func:`hopper_availability`) as that kernel is, calling the functions :meth:`kernels` loads. A
    subclass for another GPU generation of the same module (FA2, FA4 beside FA3) overrides the two checks."""

    hopper: ClassVar[HopperKernel]

    def installed(self) -> Availability:
        h = self.hopper
        return hopper_installed(h.files, h.no_cuda, h.kernel, h.loaded_from)

    def availability(self) -> Availability:
        h = self.hopper
        return hopper_availability(self.installed(), h.module, h.unsupported, h.loaded_from)

    def kernels(self) -> tuple[Callable[..., Any], ...]:
        """The functions :attr:`hopper` names, in its order, from its module (a subclass may hand others)."""
        module = importlib.import_module(self.hopper.module)
        return tuple(getattr(module, f) for f in self.hopper.functions)


def _device_dtypes(cls: type) -> dict[str, tuple[str, ...]]:
    """A Triton target's dtypes where Triton runs here: its class's ``cuda_dtypes`` on CUDA, else ``cpu_dtypes``."""
    return {"dtypes": tuple(cls.cuda_dtypes if on_cuda() else cls.cpu_dtypes)}


class VllmTritonTarget(Target):
    """Shared availability logic for vLLM's Triton kernels.

    dtypes depend on where the kernel runs: interpreted on CPU, fp16 and fp32 (the interpreter computes
    bf16 wrongly); compiled on CUDA, fp16 and bf16 (Triton's ``tl.dot`` takes fp32 inputs as TF32 by
    default, an error kvfuzz's fp32 tolerance does not model yet; docs/targets.md gives the measurement).
    """

    #: ``--sanitize auto`` on: a sanitized child loads one Triton kernel under memcheck in seconds, and these kernels
    #: have had real memory-safety bugs (vllm#56862; docs/fuzzing.md)
    sanitize_by_default: ClassVar[bool] = True

    cpu_dtypes: tuple[str, ...] = ("float16", "float32")
    cuda_dtypes: tuple[str, ...] = ("float16", "bfloat16")

    def __init_subclass__(cls, **kw) -> None:
        """A class body's ``capabilities`` becomes a :class:`~kvfuzz.fuzz.targets.base.DeviceCapabilities`: the
        class and its instances read the same declaration, with the dtypes of where Triton runs here."""
        super().__init_subclass__(**kw)
        declared = vars(cls).get("capabilities")
        if isinstance(declared, Capabilities):
            cls.capabilities = DeviceCapabilities(declared, _device_dtypes)

    def installed(self) -> Availability:
        """From what is installed: triton and vllm, the kernel's module file, and (on CPU) triton not yet
        imported without its interpreter; nothing is imported."""
        missing = missing_module("triton", "vllm")
        if missing:
            return Availability(False, f"python package {missing!r} is not installed (run `make setup`, or "
                                       "`pip install triton vllm` on a GPU machine)")
        if triton_imported_too_early():
            return Availability(False, TRITON_TOO_EARLY)
        device = "cuda" if on_cuda() else "cpu"
        if device == "cpu" and not set(self.capabilities.dtypes) - {"bfloat16"}:
            return Availability(False, "only bf16 declared, and Triton's interpreter computes bf16 wrongly")
        module = self.kernel_module()
        if module_file(module) is None:
            return Availability(False, f"the installed vllm has no {module} (kvfuzz pins vllm 0.33.0: `make setup`)")
        where = "compiled (CUDA)" if device == "cuda" else "Triton interpreter (CPU)"
        return Availability(True, f"{where}; {module}: {NOT_LOADED}", device)

    def kernel_module(self) -> str:
        """The module holding the kernel (what :meth:`installed` looks for)."""
        return self.kernel[0]

    def availability(self) -> Availability:
        missing = missing_module("triton", "vllm")
        if missing:
            return Availability(False, f"python package {missing!r} is not installed (run `make setup`, or "
                                       "`pip install triton vllm` on a GPU machine)")
        try:
            device = prepare_triton_runtime()
        except RuntimeError as e:
            return Availability(False, str(e))
        if device == "cpu" and not set(self.capabilities.dtypes) - {"bfloat16"}:
            return Availability(False, "only bf16 declared, and Triton's interpreter computes bf16 wrongly")
        return Availability(True, "compiled (CUDA)" if device == "cuda" else "Triton interpreter (CPU)", device)

    @property
    def interpreted(self) -> bool:
        return not on_cuda()

    @property
    def kernel(self) -> tuple[str, str]:
        """``(module, function)`` of the kernel entry point :meth:`run` calls with the call's kwargs: the
        ``checked_kernel``'s first defining module and its function (described once, in its signature)."""
        for cls in type(self).__mro__:  # a subclass may name its kernel by name, or not at all (checked_kernel)
            sig = vars(cls).get("checked_kernel")
            if isinstance(sig, KernelSignature):
                return sig.modules[0], sig.attr
        raise AttributeError(f"{type(self).__name__} has no KernelSignature as checked_kernel to name its kernel")

    def run(self, call: KernelCall) -> torch.Tensor:
        prepare_triton_runtime()
        fn = getattr(importlib.import_module(self.kernel[0]), self.kernel[1])
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison arithmetic
            fn(**call.kwargs)
        return call.output


def fp8_storage(batch: Batch, cache: torch.Tensor) -> torch.Tensor:
    """The cache as vLLM hands it to the split/prefix kernels: uint8 storage for an fp8 kv_cache_dtype
    (vllm/utils/torch_utils.py maps every fp8 name to torch.uint8; the kernels view it back by name)."""
    return cache.view(torch.uint8) if batch.fp8_dtype is not None else cache


def scales(batch: Batch, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scalar tensors ``k_scale``, ``v_scale`` (vLLM's ``layer._k_scale``/``_v_scale``)."""
    return (torch.tensor(batch.k_scale, dtype=torch.float32, device=dev),
            torch.tensor(batch.v_scale, dtype=torch.float32, device=dev))


def sinks(data: BatchData, dev) -> torch.Tensor | None:
    return None if data.sinks is None else data.sinks.to(device=dev, dtype=torch.float32)


def poisoned_scratch(shape: tuple[int, ...], cache: CacheState, seed_offset: int) -> torch.Tensor:
    """An fp32 scratch buffer filled with the example's poison.

    vLLM allocates these buffers with ``torch.empty`` once and reuses them across layers and steps, so a
    kernel that reads a scratch element it did not write in this call reads stale data: the poison makes
    such a read visible (NaN/inf) or wrong (stale) instead of silently plausible.
    """
    t = torch.empty(shape, dtype=torch.float32, device=cache.key_cache.device)
    fill_poison(t, cache.poison, seed_offset)
    return t


__all__ = ["TRITON_TOO_EARLY", "HopperKernel", "HopperTarget", "VllmTritonTarget", "fp8_storage", "hopper_availability",
           "hopper_installed", "missing_module", "module_file", "on_cuda", "poisoned_scratch", "prepare_triton_runtime",
           "quiet_vllm", "scales", "sinks", "triton_imported_too_early", "vllm_files_missing"]
