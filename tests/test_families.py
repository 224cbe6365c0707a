"""One home per kernel family (issue 30): each family module under fuzz/targets holds its targets and its
kernels' call signatures (``SIGNATURES``); the registry lists the families (``FAMILIES``) and the guard builds
its table from them. These tests fail when a family is left out of the registry, when a target's checked kernel
is not in the guard's table, or when importing a family (or the guard's table) loads a kernel library."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

from kvfuzz.contracts.calls.declaration import KernelDeclaration, KernelPath
from kvfuzz.fuzz.guard import flashinfer as fi_hooks
from kvfuzz.fuzz.guard import patching
from kvfuzz.fuzz.guard.signatures import PAGE_LIST_SIGNATURES, SIGNATURES, signature_of, table
from kvfuzz.fuzz.targets.registry import BUILTIN, FAMILIES, families
from kvfuzz.fuzz.targets.signature import KernelSignature, PageListSignature


def homeless(builtin: dict[str, str], homes: list[types.ModuleType]) -> list[str]:
    """What is wrong with ``builtin`` (target name -> "module:class") against the families ``homes``: a target
    whose module is not a family, or whose checked kernel is not in the table built from ``homes``."""
    kernels, page_lists = table(homes)
    known = {**kernels, **page_lists}
    names = {h.__name__ for h in homes}
    out = []
    for name, spec in builtin.items():
        module, _, cls_name = spec.partition(":")
        if module not in names:
            out.append(f"{name}: {module} is not a registered family")
            continue
        checked = getattr(importlib.import_module(module), cls_name).checked_kernel
        if checked is not None and known.get(checked.name) is not checked:
            out.append(f"{name}: its checked kernel {checked.name} is not in the guard's table")
    return out


def test_every_family_signature_is_in_the_guard_table():
    homes = families()
    assert [h.__name__ for h in homes] == list(FAMILIES)
    listed = [sig for h in homes for sig in h.SIGNATURES]
    assert listed and all(isinstance(s, (KernelSignature, PageListSignature)) for s in listed)
    assert {s.name for s in listed} == set(SIGNATURES) | set(PAGE_LIST_SIGNATURES)
    for sig in listed:
        assert (SIGNATURES if isinstance(sig, KernelSignature) else PAGE_LIST_SIGNATURES)[sig.name] is sig
    # what the guard intercepts comes from the same table: every function/op kernel, FlashInfer's classes
    assert {e.name for e in patching.KERNELS} == set(SIGNATURES)
    assert set(fi_hooks.WRAPPERS) == {"BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"}
    assert fi_hooks.APPENDS == ("append_paged_kv_cache",)


#: Targets whose kernel another family's home declares (one signature per kernel name): target -> that home.
REUSED_KERNEL_HOMES = {"vllm.triton_mla_decode": "kvfuzz.fuzz.targets.vllm_triton"}


def test_every_builtin_target_lives_in_a_family_and_its_checked_kernel_resolves():
    assert homeless(BUILTIN, families()) == []
    checked = {}
    for name in BUILTIN:
        module, _, cls_name = BUILTIN[name].partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        if cls.checked_kernel is not None:
            assert signature_of(cls.checked_kernel) is cls.checked_kernel
            # declared in its own home, or (a family calling another's kernel) in the home that declares it
            home = REUSED_KERNEL_HOMES.get(name, module)
            assert cls.checked_kernel in importlib.import_module(home).SIGNATURES
            checked[name] = cls.checked_kernel.name
    # the names stored in reports and reproducers stay as they were
    assert checked == {
        "vllm.chunked_prefill_paged_decode": "chunked_prefill_paged_decode",
        "vllm.context_attention_fwd": "context_attention_fwd", "vllm.unified_attention": "unified_attention",
        "vllm.decode_attention_fwd": "decode_attention_fwd", "vllm.triton_mla_decode": "decode_attention_fwd",
        "vllm.flash_attn_varlen": "flash_attn_varlen_func", "vllm.flashmla_decode": "flash_mla_with_kvcache",
        "vllm.flash_attn_varlen_fa2": "flash_attn_varlen_func", "vllm.flash_attn_varlen_fa4": "flash_attn_varlen_func",
        "vllm.cpu_attention": "cpu_attention_with_kv_cache",
        "sglang.extend_attention_fwd": "sglang.extend_attention_fwd",
        "sglang.decode_attention_fwd": "sglang.decode_attention_fwd",
        "flashinfer.batch_decode": "flashinfer.BatchDecodeWithPagedKVCacheWrapper",
        "flashinfer.batch_decode_tc": "flashinfer.BatchDecodeWithPagedKVCacheWrapper",
        "flashinfer.batch_prefill": "flashinfer.BatchPrefillWithPagedKVCacheWrapper",
        "flashinfer.append_paged_kv_cache": "flashinfer.append_paged_kv_cache",
    }


def test_a_family_left_out_of_the_registry_is_caught():
    homes = [h for h in families() if not h.__name__.endswith(".vllm_triton")]
    problems = homeless(BUILTIN, homes)
    # the Triton family's targets, and vllm.triton_mla_decode, whose kernel it declares; not the Hopper targets,
    # whose kernels their own homes declare, nor the merges (their own family, no paged-call signature)
    assert sorted(p.split(":")[0] for p in problems) == sorted(
        n for n in BUILTIN if n.startswith("vllm.") and "cpu" not in n and "reshape" not in n
        and "merge" not in n and not n.startswith("vllm.flash_attn_varlen") and n != "vllm.flashmla_decode")
    # a target whose module is not a family, and one naming a kernel no registered family declares
    cpu_home = importlib.import_module("kvfuzz.fuzz.targets.vllm_cpu")
    stray = types.ModuleType("stray_family")
    stray.SIGNATURES = ()
    stray.Target = type("T", (), {"checked_kernel": importlib.import_module(
        "kvfuzz.fuzz.targets.vllm_triton").UNIFIED_ATTENTION})
    assert homeless({"x": "stray_family:Target"}, [cpu_home]) == ["x: stray_family is not a registered family"]
    sys.modules["stray_family"] = stray
    try:
        assert homeless({"x": "stray_family:Target"}, [stray, cpu_home]) == [
            "x: its checked kernel unified_attention is not in the guard's table"]
    finally:
        del sys.modules["stray_family"]


def test_a_new_family_reaches_the_table_and_bad_ones_are_refused():
    def build(args, key=None, value=None):
        raise AssertionError("not called")

    sig = KernelSignature("mykernels.paged", build, "paged", ("mykernels.ops",),
                          takes_new_kv=True, declaration=KernelDeclaration(paths=(KernelPath("mine"),)))
    home = types.ModuleType("mykernels_family")
    home.SIGNATURES = (sig,)
    kernels, page_lists = table([*families(), home])
    assert kernels["mykernels.paged"] is sig and set(kernels) == set(SIGNATURES) | {"mykernels.paged"}
    assert page_lists == PAGE_LIST_SIGNATURES
    with pytest.raises(ValueError, match="mykernels_family has no SIGNATURES tuple"):
        table([types.ModuleType("mykernels_family")])
    twice = types.ModuleType("twice")
    twice.SIGNATURES = (SIGNATURES["unified_attention"],)
    with pytest.raises(ValueError, match="twice declares kernel 'unified_attention', which another family"):
        table([*families(), twice])
    odd = types.ModuleType("odd")
    odd.SIGNATURES = ("unified_attention",)
    with pytest.raises(ValueError, match="odd.SIGNATURES holds 'unified_attention', not a KernelSignature"):
        table([odd])
    with pytest.raises(KeyError, match="unknown kernel 'nope'; kvfuzz knows chunked_prefill_paged_decode"):
        signature_of("nope")
    assert signature_of("flashinfer.append_paged_kv_cache").kind == "append"


def test_importing_the_families_and_the_guard_table_loads_no_kernel_library():
    code = ("import sys, kvfuzz.fuzz.guard.signatures, kvfuzz.fuzz.guard.flashinfer, kvfuzz.fuzz.guard.patching\n"
            "from kvfuzz.fuzz.targets.registry import families\n"
            "families()\n"
            "print(sorted(m for m in ('vllm', 'sglang', 'flashinfer', 'triton') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_a_checked_kernel_given_by_name_resolves_to_its_signature():
    """An adapter written before the homes (``checked_kernel = "unified_attention"``) still gets the checks."""
    from kvfuzz.fuzz.harness.caller import checked_signature
    from kvfuzz.fuzz.targets.vllm_triton import UNIFIED_ATTENTION, VllmUnifiedAttention

    class ByName(VllmUnifiedAttention):
        name = "tests.unified_by_name"
        checked_kernel = "unified_attention"

    class Unchecked(VllmUnifiedAttention):
        name = "tests.unchecked"
        checked_kernel = None

    class Unknown(VllmUnifiedAttention):
        name = "tests.unknown_kernel"
        checked_kernel = "no_such_kernel"

    assert checked_signature(ByName()) is UNIFIED_ATTENTION
    assert checked_signature(VllmUnifiedAttention()) is UNIFIED_ATTENTION
    assert checked_signature(Unchecked()) is None
    with pytest.raises(KeyError, match="unknown kernel 'no_such_kernel'"):
        checked_signature(Unknown())


def unlisted_targets(home: types.ModuleType) -> list[str]:
    """Target classes a family module defines with a name of their own that its ``TARGETS`` leaves out (so
    ``kvfuzz fuzz`` would never see them)."""
    from kvfuzz.fuzz.targets.base import Target

    return [c.__name__ for c in vars(home).values() if isinstance(c, type) and issubclass(c, Target)
            and c.__module__ == home.__name__ and "name" in vars(c) and c not in home.TARGETS]


def test_builtin_is_every_familys_targets_and_a_new_target_goes_in_one_list(monkeypatch):
    from kvfuzz.fuzz.targets import registry

    homes = families()
    assert all(unlisted_targets(h) == [] for h in homes)
    assert list(BUILTIN) == [c.name for h in homes for c in h.TARGETS]
    assert all(BUILTIN[c.name] == f"{h.__name__}:{c.__name__}" for h in homes for c in h.TARGETS)
    # planted: a target left out of its family's TARGETS is named; two targets of one name are refused
    home = types.ModuleType("mykernels_family")

    class Mine(homes[0].VllmUnifiedAttention):
        name = "mykernels.mine"

    Mine.__module__ = home.__name__
    home.Mine, home.TARGETS, home.SIGNATURES = Mine, (), ()
    assert unlisted_targets(home) == ["Mine"]
    home.TARGETS = (Mine, Mine)
    monkeypatch.setattr(registry, "families", lambda: [*homes, home])
    with pytest.raises(ValueError, match="share the name 'mykernels.mine'"):
        list(registry._Builtin())
    home.TARGETS = (Mine,)
    assert list(registry._Builtin())[-1] == "mykernels.mine"


def test_a_triton_targets_class_and_instance_declare_the_same_dtypes_and_its_kernel_is_its_signatures(monkeypatch):
    """The dtypes a Triton target declares depend on where Triton runs; the class and its instances agree
    there (the instance used to rewrite them, leaving the class attribute wrong on CUDA)."""
    from kvfuzz.fuzz.targets import triton_runtime
    from kvfuzz.fuzz.targets.vllm_triton import UNIFIED_ATTENTION, VllmUnifiedAttention

    for cuda in (False, True):
        monkeypatch.setattr(triton_runtime, "on_cuda", lambda: cuda)
        want = VllmUnifiedAttention.cuda_dtypes if cuda else VllmUnifiedAttention.cpu_dtypes
        assert VllmUnifiedAttention.capabilities.dtypes == VllmUnifiedAttention().capabilities.dtypes == want
    assert VllmUnifiedAttention().kernel == (UNIFIED_ATTENTION.modules[0], "unified_attention")

    class ByName(VllmUnifiedAttention):
        name = "tests.unified_by_name_kernel"
        checked_kernel = "unified_attention"

    assert ByName().kernel == VllmUnifiedAttention().kernel


def test_torch_flexs_class_and_instance_declare_the_same_sizes_on_each_device(monkeypatch):
    """torch flex's head sizes depend on where it runs (eager on the CPU, compiled on CUDA); its GQA groups do not
    (any, on both); the class and its instances agree there (the instance used to rewrite them, as the Triton targets'
    dtypes did). Its page sizes are vLLM's FlexAttention backend's on both."""
    from kvfuzz.fuzz.targets import torch_flex
    from kvfuzz.fuzz.targets.torch_flex import TorchFlexPaged

    for cuda in (False, True):
        monkeypatch.setattr(torch_flex, "on_cuda", lambda: cuda)
        caps = TorchFlexPaged.capabilities
        assert caps == TorchFlexPaged().capabilities
        want = TorchFlexPaged.cuda_head_sizes if cuda else (16, 32, 48, 64, 80, 128, 256)
        assert (caps.head_sizes, caps.block_sizes) == (want, (16, 32, 64, 128))
        # any GQA group on both (groups past 16 passed compiled with vLLM's options: benchmarks/flex_gqa_probe.py)
        assert caps.gqa_ratios is None and caps.fp8_accepts_gqa("auto", 64) and caps.fp8_accepts_gqa("auto", 16)
        assert caps.shared_prefix_blocks and caps.features == {"sliding_window", "alibi", "softcap"}


def test_every_builtin_target_names_its_upstream_kernel_once():
    """ISSUE.md's upstream file and function come from each target (its checked kernel's defining module, or its
    own ``upstream`` where the signature does not place the kernel), not from a table of its own."""
    from kvfuzz.fuzz.campaign.store.issue import upstream
    from kvfuzz.fuzz.targets.registry import BUILTIN

    for name in BUILTIN:
        pkg, file, fn = upstream(name)
        assert file != "(the adapter's kernel)" and pkg in ("vllm", "vllm-cpu", "torch", "sglang", "flashinfer"), name
    assert upstream("vllm.context_attention_fwd") == ("vllm", "vllm/v1/attention/ops/prefix_prefill.py",
                                                      "context_attention_fwd")
    assert upstream("vllm.triton_mla_decode") == upstream("vllm.decode_attention_fwd")
    assert upstream("sglang.extend_attention_fwd") == (
        "sglang", "sglang/kernels/ops/attention/extend_attention.py", "extend_attention_fwd")
    assert upstream("mykernels.decode") == ("mykernels", "(the adapter's kernel)", "mykernels.decode")
