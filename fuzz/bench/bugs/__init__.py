"""Real upstream bugs re-injected into the kernels kvfuzz pins (issue 31; docs/bugs.md).

Each bug is a fix that shipped upstream and is present in the pinned release (vllm 0.33.0, sglang 0.5.23);
undoing that fix, as a reviewable unified diff in ``patches/<slug>.patch`` (its header: the PR, what the fix
changed, what undoing it does), re-injects the bug. At run time the diff is applied to a copy of the
installed module's source, loaded as a private module (:mod:`.patching`; the installed package is never
edited), and the existing target class runs that module's kernel instead of upstream's: ``bug.<slug>`` is
that target (registered as the entry-point family ``"bug.*"``, so ``kvfuzz fuzz --target bug.vllm-47305``).

A patch that no longer applies (the installed source changed) is refused: :class:`~.patching.PatchDoesNotApply`
names the patch and the file, and the target's ``availability()`` says so.

FlashInfer's bugs (``flashinfer-*``, ``Bug.package``) live in CUDA headers its JIT compiles, so they are re-injected
into a patched copy of the whole installed package with a JIT workspace of its own (:mod:`.package_copy`),
imported as ``flashinfer`` in the bug's process; they run on CUDA only, and a machine without CUDA or without
flashinfer lists them as unreachable with the reason (:meth:`Bug.unreachable`).

``BUGS`` maps ``"bug.<slug>"`` to its :class:`Bug`; :func:`get_bug` returns the target, :func:`smallest_trigger`
the hand-built smallest batch that triggers the bug (with the data it needs, :meth:`Bug.trigger_data`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, ClassVar

import attrs
import numpy as np
import torch

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.fuzz.bench.bugs.package_copy import PackageCopy, import_copy
from kvfuzz.fuzz.bench.bugs.patching import Patch, PatchDoesNotApply, load_patched, load_source, parse_patches
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.targets.base import Availability, KernelCall, Target
from kvfuzz.fuzz.targets.flashinfer import FlashInferBatchDecode, FlashInferBatchPrefill
from kvfuzz.fuzz.targets.sglang_triton import (
    DECODE_MODULE,
    SglangDecodeAttentionFwd,
    prepare_sglang_runtime,
    sglang_tree,
)
from kvfuzz.fuzz.targets.triton_runtime import module_file, prepare_triton_runtime
from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode, VllmDecodeAttentionFwd, VllmUnifiedAttention

#: The folder of the re-injection patches.
PATCHES = Path(__file__).parent / "patches"

_HELPERS = "vllm.v1.attention.ops.triton_attention_helpers"
_FLASHINFER = "https://github.com/flashinfer-ai/flashinfer/"

#: Packages a bug may be re-injected into as a whole patched copy (:mod:`.package_copy`): the environment variable
#: its JIT reads its workspace from at import, and what the copy leaves out. FlashInfer: flashinfer/jit/env.py
#: (``FLASHINFER_WORKSPACE_BASE``; ``data/aot``, prebuilt modules ``get_aot_artifacts`` would load instead of the
#: JIT build of the patched sources).
PACKAGES = {"flashinfer": ("FLASHINFER_WORKSPACE_BASE", ("data/aot",))}


def installed_file(module: str) -> Path | None:
    """The installed source file of upstream ``module`` (an SGLang kernel from kvfuzz's kernel tree, else the
    installed package), found without importing it; None when it is not installed."""
    if module.startswith("sglang."):
        tree = sglang_tree()
        if tree is not None:
            return tree.joinpath(*module.split(".")).with_suffix(".py")
    return module_file(module)


@attrs.frozen
class UpstreamBug:
    """What every upstream bug kvfuzz measures has, re-injected (:class:`Bug`) or live
    (:class:`~kvfuzz.fuzz.bench.bugs.live.LiveBug`): ``slug`` (``vllm-47305``), ``upstream`` (the fix's or the
    issue's URL), ``trigger`` (when the bug changes the output), ``smallest`` (a hand-built smallest triggering
    batch, with NaN poison), ``cpu`` (whether a CPU reaches the trigger), ``why_missed`` (why a default campaign
    misses it; None: it finds it). Its ``name`` is ``<prefix>.<slug>``. The fields after ``upstream`` are keyword
    only, so a subclass adds positional fields of its own."""

    prefix: ClassVar[str]

    slug: str
    upstream: str
    trigger: str = attrs.field(kw_only=True)
    smallest: Callable[[], Batch] = attrs.field(kw_only=True)
    cpu: bool = attrs.field(default=True, kw_only=True)
    why_missed: str | None = attrs.field(default=None, kw_only=True)

    @property
    def name(self) -> str:
        return f"{self.prefix}.{self.slug}"


@attrs.frozen
class Bug(UpstreamBug):
    """One re-injected upstream bug: an :class:`UpstreamBug` (``upstream`` the fix's URL) with ``patched_module``
    (the upstream module the patch edits), ``entry`` (the kernel function the target calls, in ``kernel_module``:
    the patched module itself, or a verbatim private copy of a module that imports the patched one: ``rewire`` names
    the globals it takes from the patched module), ``base`` (the target class whose kernel is swapped),
    ``scale_query`` (the query is multiplied by it for the trigger: values kvfuzz's value ranges do not reach),
    ``big_cache`` (reached only with ``kvfuzz fuzz --big-cache``: the benchmark runs it so, under the supervisor,
    since the bug crashes the process), ``package`` (the patch edits several files of this installed package, a key
    of :data:`PACKAGES`, CUDA sources its JIT compiles among them: the target runs a patched copy of the whole
    package, :meth:`package_copy`, and ``patched_module`` is the package's name, ``entry`` unused)."""

    prefix: ClassVar[str] = "bug"

    patched_module: str
    base: type
    entry: str
    kernel_module: str | None = None
    rewire: tuple[str, ...] = ()
    scale_query: float = 1.0
    big_cache: bool = False
    package: str | None = None

    @property
    def spec(self) -> str:
        """``package.module:CLASS`` of the target (``kvfuzz fuzz --target SPEC`` without the entry point)."""
        return f"{__name__}:Bug_{self.slug.replace('-', '_')}"

    @property
    def patch_path(self) -> Path:
        return PATCHES / f"{self.slug}.patch"

    def patch(self) -> Patch:
        """The patch of a one-module bug (ValueError for a package bug's patch of several files: :meth:`patches`)."""
        return Patch.read(self.patch_path)

    def patches(self) -> tuple[Patch, ...]:
        """The patch file's patches, one per file it edits (the first carries the header)."""
        return parse_patches(self.patch_path.read_text(), str(self.patch_path))

    def package_copy(self) -> PackageCopy:
        """A package bug's patched copy (:mod:`.package_copy`; ValueError for a one-module bug)."""
        if self.package is None:
            raise ValueError(f"{self.name} re-injects one module ({self.patched_module}), not a package copy")
        env, exclude = PACKAGES[self.package]
        return PackageCopy(self.slug, self.package, self.patches(), env, exclude)

    def unreachable(self) -> str | None:
        """Why this machine cannot run the bug at all, or None. A package bug needs what its base target needs
        (FlashInfer: CUDA and an importable flashinfer) and no ``flashinfer_jit_cache`` (whose prebuilt modules
        flashinfer/jit/env.py prefers to any JIT build: the patch would never be compiled). One-module bugs: None
        (``cpu`` says whether a CPU reaches the trigger)."""
        if self.package is None:
            return None
        a = self.base().installed()
        if not a.ok:
            return a.reason
        if self.package == "flashinfer" and importlib.util.find_spec("flashinfer_jit_cache") is not None:
            return ("flashinfer_jit_cache is installed: its prebuilt modules win over the JIT build of the patched "
                    "sources (flashinfer/jit/env.py get_aot_artifacts); uninstall it to run this bug")
        return None

    def check_applies(self) -> None:
        """Raise :class:`PatchDoesNotApply` (naming the patch and the file) when the patch does not apply to
        the installed source, FileNotFoundError when the module is not installed; nothing is imported. A package
        bug whose package is not installed has nothing to check (:meth:`unreachable` says why it cannot run)."""
        if self.package is not None:
            copy = self.package_copy()
            installed = copy.installed()
            if installed is not None:
                copy.patched_sources(installed)
            return
        f = installed_file(self.patched_module)
        if f is None:
            raise FileNotFoundError(f"{self.name}: {self.patched_module} is not installed (run `make setup`)")
        self.patch().apply(f.read_text(), f)

    def private_name(self, module: str) -> str:
        return f"kvfuzz_bug_{self.slug.replace('-', '_')}.{module}"

    def kernel(self) -> Callable:
        """The re-injected kernel function (after the Triton runtime is prepared)."""
        patched = load_patched(self.patch(), installed_file(self.patched_module),
                               self.private_name(self.patched_module), self.patched_module.rpartition(".")[0])
        if self.kernel_module is None:
            return getattr(patched, self.entry)
        f = installed_file(self.kernel_module)
        module = load_source(f.read_text(), self.private_name(self.kernel_module),
                             self.kernel_module.rpartition(".")[0])
        for g in self.rewire:  # the private copy calls the patched helper; the installed module keeps upstream's
            setattr(module, g, getattr(patched, g))
        return getattr(module, self.entry)

    def trigger_data(self, data: BatchData) -> BatchData:
        """The trigger's data from a batch's drawn data: the query scaled by ``scale_query``."""
        if self.scale_query == 1.0:
            return data
        return attrs.evolve(data, query=data.query * self.scale_query)


class _Reinjected:
    """Mixin over an existing target class: the same declaration and call, the re-injected kernel run."""

    bug: Bug

    def _prepare(self) -> None:
        prepare_triton_runtime()

    def availability(self) -> Availability:
        a = super().availability()
        if not a.ok:
            return a
        try:
            self.bug.check_applies()
        except (PatchDoesNotApply, FileNotFoundError) as e:
            return Availability(False, str(e))
        return Availability(True, f"{a.reason}; {self.bug.upstream} re-injected ({self.bug.patch_path.name})",
                            a.device)

    def run(self, call: KernelCall) -> torch.Tensor:
        self._prepare()
        fn = self.bug.kernel()
        with np.errstate(all="ignore"):  # the interpreter's numpy warns on NaN poison arithmetic
            fn(**call.kwargs)
        return call.output


class _ReinjectedPackage:
    """Mixin over a FlashInfer target class: the same declaration, call and checks, run by a patched copy of the
    flashinfer package imported in this process (:func:`~.package_copy.import_copy`: its own JIT workspace)."""

    bug: Bug

    def flashinfer(self):
        fi = getattr(self, "_patched_fi", None)
        if fi is None:
            fi = self._patched_fi = import_copy(self.bug.package_copy())
        return fi

    def availability(self) -> Availability:
        ready = getattr(self, "_ready", None)  # once imported, the copy stays this process's flashinfer
        if ready is not None:  # (target.device asks for every example)
            return ready
        why = self.bug.unreachable()
        if why is not None:
            return Availability(False, why)
        try:
            self.bug.check_applies()
        except (PatchDoesNotApply, FileNotFoundError) as e:
            return Availability(False, str(e))
        a = super().availability()  # imports the patched copy (self.flashinfer)
        if not a.ok:
            return a
        self._ready = Availability(True, f"{a.reason}; {self.bug.upstream} re-injected ({self.bug.patch_path.name}) "
                                         f"in a patched copy with its own JIT workspace: "
                                         f"{self.flashinfer().__kvfuzz_patched__}", a.device)
        return self._ready


def _target_class(bug: Bug) -> type[Target]:
    attrs_ = {"name": bug.name, "bug": bug,
              "description": f"{bug.base.description}, with {bug.upstream} undone ({bug.patch_path.name})"}
    if bug.package is not None:
        cls = type(f"Bug_{bug.slug.replace('-', '_')}", (_ReinjectedPackage, bug.base), attrs_)
        cls.__module__ = __name__
        return cls
    if issubclass(bug.base, SglangDecodeAttentionFwd):
        attrs_["_prepare"] = lambda self: prepare_sglang_runtime()
    if issubclass(bug.base, VllmChunkedPrefillPagedDecode) and "freed" not in bug.trigger:
        # the freed-window state (declared on the split kernels in issue 39) shows live vllm#53628 there (docs/bugs.md):
        # a re-injected bug that does not need it is measured as before, without it, so its campaign finds the
        # re-injected bug, not the live one
        attrs_["capabilities"] = bug.base.capabilities.without_states(("freed_window_blocks",))
    if issubclass(bug.base, VllmDecodeAttentionFwd) and "pad" not in bug.trigger:
        # likewise the CUDA-graph padding declared on decode_attention_fwd in issue 39 (live vllm#57017)
        attrs_["capabilities"] = bug.base.capabilities.without_states(("cuda_graph_padding",))
    cls = type(f"Bug_{bug.slug.replace('-', '_')}", (_Reinjected, bug.base), attrs_)
    cls.__module__ = __name__
    return cls


BUGS: dict[str, Bug] = {b.name: b for b in (
    Bug("vllm-47305", "https://github.com/vllm-project/vllm/pull/47305",
        "vllm.v1.attention.ops.chunked_prefill_paged_decode", VllmChunkedPrefillPagedDecode,
        "chunked_prefill_paged_decode",
        trigger="a decode sequence with seq_len % block_size != 0 and NaN/inf in its last block's unused slots",
        smallest=lambda: small_batch([1], [0], head_size=32, block_size=16)),
    Bug("vllm-56579", "https://github.com/vllm-project/vllm/pull/56579",
        _HELPERS, VllmUnifiedAttention, "unified_attention",
        kernel_module="vllm.v1.attention.ops.triton_unified_attention", rewire=("apply_softcap",),
        trigger="softcap on and an unmasked score scale * q.k with |score| / softcap > ~88.7 (fp32 exp overflow)",
        # softcap 4 (kvfuzz's smaller one): a key equal to the query, both scaled so that q.k / sqrt(32) >> 355
        smallest=lambda: small_batch([1], [0], head_size=32, block_size=16, softcap=4.0, dtype="float32"),
        scale_query=1e4),
    Bug("sglang-2479", "https://github.com/sgl-project/sglang/pull/2479",
        DECODE_MODULE, SglangDecodeAttentionFwd, "decode_attention_fwd",
        trigger="a decode sequence with an empty split (stage 2 walks all max_kv_splits splits: any seq_len <= 32 "
                "with max_kv_splits >= 2) and a scratch holding NaN/inf or stale values",
        smallest=lambda: small_batch([1], [0], head_size=32, block_size=1)),
    Bug("vllm-47671", "https://github.com/vllm-project/vllm/pull/47671",
        "vllm.v1.attention.ops.triton_decode_attention", VllmDecodeAttentionFwd, "decode_attention_fwd",
        trigger="a used page at or past 2**31 elements of the cache (page id * page_size * Hkv * D >= 2**31)",
        # the fewest blocks: the largest declared block size (64) and the smallest head size (32)
        smallest=lambda: small_batch([1], [0], head_size=32, block_size=64, table=[[1 << 20]],
                                     num_blocks=(1 << 20) + 1),
        big_cache=True,
        why_missed="needs a page past 2**31 elements (a >= 4 GiB cache per K and V at fp16; untouched pages cost no "
                   "RAM); the default campaign's caches have < 100 blocks. kvfuzz fuzz --big-cache reaches it: the "
                   "wrapped offset reads unmapped memory, a kernel crash (SIGSEGV) under Triton's interpreter"),
    Bug("vllm-30887", "https://github.com/vllm-project/vllm/pull/30887",
        "vllm.v1.attention.ops.triton_unified_attention", VllmUnifiedAttention, "unified_attention",
        trigger="a sliding window and a freed block (its column on the null block, NaN/inf there) in the same tile "
                "as a visible key: the 2-D path (a prefill of > 8 query tokens) tiles 32 keys, so at block size 16 "
                "or 48 a tile holds a freed block and the window's first; P = 0 times its NaN V is NaN",
        # a prefill of 9 tokens (MAX_3D_QUERY_LEN = 8: the 2-D kernel, TILE_SIZE_PREFILL 32; the 3-D path's decode
        # tile is 16 for 16-bit queries, one block, and wholly freed tiles are skipped) after 16 cached ones,
        # W = 1: block 0 (positions 0..15) is freed to the null block, tile 0 holds it and key 16
        smallest=lambda: small_batch([9], [16], head_size=32, block_size=16, table=[[0, 1]], num_blocks=2,
                                     sliding_window=1, freed_window_blocks=True)),
    # FlashInfer (CUDA only; docs/bugs-research.md has the reading behind each trigger)
    Bug("flashinfer-1416", _FLASHINFER + "pull/1416", "flashinfer", FlashInferBatchPrefill, "",
        package="flashinfer", cpu=False,
        trigger="an fp8 KV cache (e4m3 or e5m2) with v_scale != 1: BatchPrefillWithPagedKVCacheWrapper.run returns "
                "the output unscaled, reference / v_scale (2x at v_scale 0.5)",
        # one decode row through the prefill wrapper (FA2: an fp8 cache with a 16-bit query), the smallest head
        # size and page size flashinfer.batch_prefill declares
        smallest=lambda: small_batch([1], [0], head_size=64, block_size=1, kv_cache_dtype="fp8_e4m3",
                                     v_scale=0.5)),
    Bug("flashinfer-350", _FLASHINFER + "pull/350", "flashinfer", FlashInferBatchDecode, "",
        package="flashinfer", cpu=False,
        trigger="a soft cap small enough to see e^-cap (kvfuzz's 4; 50 leaks ~e^-50) and a decode chunk whose kv_len "
                "is not a multiple of the keys per iteration (bdy * bdz * tile size: 64 at head size 64, 32 at 128, "
                "16 at 256, 16-bit, group 1): each masked key adds weight e^-cap to the sum, shrinking the output",
        # kv_len 1 at head size 64: 63 masked keys, output ~ v / (1 + 63 e^-4) ~ 0.46 v
        smallest=lambda: small_batch([1], [0], head_size=64, block_size=1, softcap=4.0)),
    Bug("flashinfer-4401", _FLASHINFER + "pull/4401", "flashinfer", FlashInferBatchDecode, "",
        package="flashinfer", cpu=False,
        trigger="every valid key of a row with a logit below the finite sentinel: on the CUDA-core decode "
                "sm_scale * q.k < -5e4 / log2(e) ~ -34,657 (e.g. q = +128, k = -128 at head size 64): output 0 "
                "instead of softmax . V",
        # the "shifted" value range draws such rows (q's last dim +Q, every key's -128: logits ~-40,000 to
        # -80,000) in about one example of six, and without a softcap (which caps them at -c) they stay there;
        # the fix's other half (clamps for fully masked rows) shows only through the LSE, which kvfuzz does not
        # request
        smallest=lambda: small_batch([1], [0], head_size=64, block_size=1, value_range="shifted")),
)}

_TARGETS: dict[str, type[Target]] = {n: _target_class(b) for n, b in BUGS.items()}
# module-level names, so that a worker process (or ``--target kvfuzz.fuzz.bench.bugs:Bug_vllm_47671``) can load one
Bug_vllm_47305 = _TARGETS["bug.vllm-47305"]
Bug_vllm_56579 = _TARGETS["bug.vllm-56579"]
Bug_sglang_2479 = _TARGETS["bug.sglang-2479"]
Bug_vllm_47671 = _TARGETS["bug.vllm-47671"]
Bug_vllm_30887 = _TARGETS["bug.vllm-30887"]
Bug_flashinfer_1416 = _TARGETS["bug.flashinfer-1416"]
Bug_flashinfer_350 = _TARGETS["bug.flashinfer-350"]
Bug_flashinfer_4401 = _TARGETS["bug.flashinfer-4401"]


def get_bug(name: str) -> Target:
    """The target of bug ``name`` (``"bug.<slug>"`` or ``"<slug>"``): the upstream target class with the
    re-injected kernel. Raises KeyError naming the known bugs."""
    full = name if name.startswith("bug.") else f"bug.{name}"
    if full not in BUGS:
        raise KeyError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    return _TARGETS[full]()


def smallest_trigger(name: str) -> Batch:
    """The smallest batch (fewest sequences, tokens, heads, then head size and blocks, within the target's
    declaration) that triggers bug ``name`` with kvfuzz's NaN poison (and :meth:`Bug.trigger_data`)."""
    full = name if name.startswith("bug.") else f"bug.{name}"
    return BUGS[full].smallest()


__all__ = ["BUGS", "PACKAGES", "Bug", "PATCHES", "PatchDoesNotApply", "UpstreamBug", "get_bug", "installed_file",
           "smallest_trigger"]
