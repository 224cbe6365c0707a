"""The public surface: what ``import kvfuzz`` offers (api/__init__.py) is an explicit list, every name of it
resolves, a user's Hypothesis test runs a real kernel through it alone (and fails on a broken one), every module
of the package says what it exports (``__all__``), and no module of kvfuzz imports another module's private
(``_name``) names."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from hypothesis import given

import kvfuzz

ROOT = Path(__file__).resolve().parents[1]

#: The public API, spelled out: adding or removing a name of ``kvfuzz`` is a deliberate change to this list.
PUBLIC = {
    "__version__",
    # the model of one call, its data and its cache
    "Batch", "contiguous_batch", "BatchData", "Example", "Poison", "Capabilities", "Contract",
    "CacheLayout", "NHDLayout", "VllmPagedLayout", "LayoutError", "CacheState",
    # what a check finds
    "Check", "Violation", "FailureKind", "Finding",
    # the Hypothesis strategies
    "Limits", "batches", "examples",
    # the Target API and the registry; the CSR lists of SGLang- and FlashInfer-style kernels
    "Target", "KernelCall", "Availability", "get_target", "registered", "token_slot_lists", "page_lists",
    # the property: one example against a target, what it returns and raises, the caller faults it can plant
    "check_example", "Run", "CallerContractViolation", "KernelCrash", "KernelMismatch", "NonFiniteOutput",
    "CallerFault", "get_fault",
    # the runtime guard
    "guard", "Guard", "GuardRecord", "CallerContractError", "KvfuzzGuardWarning",
}


def test_the_public_names_are_the_listed_ones():
    assert set(kvfuzz.__all__) == PUBLIC, (
        f"added: {sorted(set(kvfuzz.__all__) - PUBLIC)}, removed: {sorted(PUBLIC - set(kvfuzz.__all__))}")
    assert len(kvfuzz.__all__) == len(set(kvfuzz.__all__))
    assert set(dir(kvfuzz)) >= PUBLIC - {"__version__"}


def test_every_public_name_resolves_to_kvfuzz_code():
    for name in kvfuzz.__all__:
        obj = getattr(kvfuzz, name)
        assert obj is not None, name
        if name != "__version__":
            assert obj.__module__.startswith("kvfuzz."), (name, obj.__module__)
    assert kvfuzz.Contract.WRITER.value == "writer"
    assert issubclass(kvfuzz.CallerContractError, kvfuzz.Finding)
    with pytest.raises(AttributeError):
        kvfuzz.no_such_name  # noqa: B018


def test_import_kvfuzz_is_lazy():
    """``import kvfuzz`` loads neither torch nor any room: a name loads its module when first used."""
    code = "import sys, kvfuzz; print('torch' in sys.modules, any(m.startswith('kvfuzz.fuzz') for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


# ---- a user's property test, through ``import kvfuzz`` alone ------------------------------------------------
def public_target(name: str) -> kvfuzz.Target:
    """The built-in target ``name`` (``kvfuzz.get_target``), or skip, naming why it cannot run here."""
    target = kvfuzz.get_target(name)
    availability = target.availability()
    if not availability.ok:
        pytest.skip(f"{name} unavailable: {availability.reason}")
    return target


class PagedSdpa(kvfuzz.Target):
    """examples/sdpa_paged_target.py, written here against the public names: torch SDPA over K/V gathered from
    a paged NHD cache through the block table. ``drops_newest_key``: the planted bug of :class:`DropsNewestKey`."""

    name = "test.paged_sdpa"
    description = "torch SDPA on K/V gathered from a paged NHD cache"
    capabilities = kvfuzz.Capabilities(contract=kvfuzz.Contract.UNIFIED, devices=("cpu",), dtypes=("float32",),
                                       head_sizes=(32,), block_sizes=(16,))
    drops_newest_key = False

    def availability(self):
        return kvfuzz.Availability(True, "torch", "cpu")

    def layout(self, batch):
        return kvfuzz.NHDLayout()

    def build_call(self, batch, data, cache):
        import torch

        out = torch.empty((batch.num_tokens, batch.num_heads, batch.head_size), dtype=batch.torch_dtype)
        kwargs = dict(query=data.query.cpu(), key_cache=cache.key_cache, value_cache=cache.value_cache,
                      block_table=batch.block_table_tensor("cpu"), seq_lens=batch.seq_lens_tensor("cpu"),
                      query_start_loc=batch.query_start_loc_tensor("cpu"), scale=batch.sm_scale, output=out)
        return kvfuzz.KernelCall(kwargs, cache.layout, cache.key_cache, cache.value_cache, out)

    def run(self, call):
        import torch
        import torch.nn.functional as F

        a = call.kwargs
        bs = a["key_cache"].shape[1]
        qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
        for i, seq_len in enumerate(seq_lens):
            read = seq_len - 1 if self.drops_newest_key and seq_len > 1 else seq_len
            pos = torch.arange(read)
            slots = a["block_table"][i, pos // bs].long() * bs + pos % bs
            k = a["key_cache"][slots // bs, slots % bs].transpose(0, 1)  # [Hkv, S, D]
            v = a["value_cache"][slots // bs, slots % bs].transpose(0, 1)
            q = a["query"][qsl[i]:qsl[i + 1]].transpose(0, 1)  # [H, Q, D]
            ql = q.shape[1]
            mask = pos[None, :] <= (seq_len - ql + torch.arange(ql))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a["scale"], enable_gqa=True)
            a["output"][qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
        return a["output"]


class DropsNewestKey(PagedSdpa):
    """The planted off-by-one: it reads ``seq_len - 1`` keys of a sequence longer than one token, so the newest
    token (a decode's own key) is never attended to."""

    name = "test.drops_newest_key"
    drops_newest_key = True


@pytest.mark.kernel
def test_a_users_property_test_passes_with_all_defaults():
    """The simple case, all defaults: ``@given(kvfuzz.examples(capabilities))`` and ``kvfuzz.check_example``;
    every example returns a Run holding the output and the fp64 reference, ``[num_tokens, num_heads,
    head_size]`` each."""
    target = PagedSdpa()
    seen = []

    @given(kvfuzz.examples(PagedSdpa.capabilities))
    def test_paged_sdpa(example):
        run = kvfuzz.check_example(target, example)
        assert isinstance(run, kvfuzz.Run)
        batch = example.batch
        assert run.output.shape == run.reference.shape == (batch.num_tokens, batch.num_heads, batch.head_size)
        seen.append(example.poison)

    test_paged_sdpa()
    assert kvfuzz.Poison.NAN in seen, seen


@pytest.mark.kernel
@pytest.mark.parametrize("name", ["vllm.cpu_attention", "torch.flex_paged"])
def test_real_kernels_pass_the_public_property(name, one_torch_thread):
    """vLLM's CPU paged-attention op and torch's paged flex_attention, found by name and checked through the
    public names. Both let NaN in unused V slots reach the output (known defects, ``Target.gate_poisons``), so
    their examples draw the finite poisons the pre-merge gate uses, and the value ranges it uses (the CPU op's
    softcap overflows at "extreme" values: docs/findings.md, Finding 11)."""
    target = public_target(name)
    assert target.gate_poisons and kvfuzz.Poison.NAN not in target.gate_poisons
    limits = kvfuzz.Limits(max_num_seqs=2, max_ctx_len=40, max_query_len=8,
                           **({"value_ranges": target.gate_value_ranges} if target.gate_value_ranges else {}))

    @given(kvfuzz.examples(target.capabilities, limits, poisons=target.gate_poisons))
    def test_real_kernel(example):
        run = kvfuzz.check_example(target, example)
        assert run.output.shape == (example.batch.num_tokens, example.batch.num_heads, example.batch.head_size)

    test_real_kernel()


@pytest.mark.kernel
def test_a_broken_kernel_fails_the_public_property():
    """The same test around a kernel with a planted bug raises a Finding: Hypothesis finds the failing example,
    shrinks it and re-raises the kernel's mismatch against the reference."""
    target = DropsNewestKey()

    @given(kvfuzz.examples(DropsNewestKey.capabilities, kvfuzz.Limits(max_num_seqs=2, max_ctx_len=40)))
    def test_broken(example):
        kvfuzz.check_example(target, example)

    with pytest.raises(kvfuzz.Finding) as info:
        test_broken()
    assert not PagedSdpa.drops_newest_key  # the same test passes on the correct kernel (above)
    assert info.value.kind is kvfuzz.FailureKind.KERNEL_MISMATCH, info.value
    assert isinstance(info.value, kvfuzz.KernelMismatch)


@pytest.mark.kernel
def test_a_planted_caller_fault_is_the_callers_finding(one_torch_thread):
    """``fault=``: a caller that leaves a decode's current token out of the cache (``decode-ctx-only``) is
    reported as a caller contract violation, on a correct kernel."""
    target = public_target("vllm.cpu_attention")
    batch = kvfuzz.Batch(query_lens=[1], ctx_lens=[20], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                         num_blocks=3, block_table=[[0, 1]], dtype="float32", seed=0)
    example = kvfuzz.Example(batch, kvfuzz.Poison.ZEROS)  # not NaN: the op's known defect (above)
    kvfuzz.check_example(target, example)  # the correct caller passes
    with pytest.raises(kvfuzz.CallerContractViolation) as info:
        kvfuzz.check_example(target, example, fault=kvfuzz.get_fault("decode-ctx-only"))
    assert info.value.kind.blame == "caller"
    with pytest.raises(TypeError):
        kvfuzz.check_example(target, example, kvfuzz.get_fault("decode-ctx-only"))  # fault is keyword-only


# ---- no private name imported across modules ---------------------------------------------------------------
#: The folders scanned and the package each installs as (setup.py).
ROOMS = {"api": "kvfuzz", "contracts": "kvfuzz.contracts", "strategies": "kvfuzz.strategies", "fuzz": "kvfuzz.fuzz"}

#: Private names fuzz/targets/ still imports from another module, as (importing file, module, name). To be
#: fixed by making the shared helper a public name of a module of its own; then this list is emptied (a fixed
#: entry left here fails the test, so the list only shrinks).
TARGETS_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()  # fuzz/targets/triton_runtime.py made them public


def module_name(path: Path) -> tuple[str, bool]:
    """``fuzz/campaign/engine.py`` -> ("kvfuzz.fuzz.campaign.engine", False); a package's ``__init__.py`` ->
    (the package, True)."""
    parts = path.with_suffix("").parts
    names = ROOMS[parts[0]].split(".") + list(parts[1:])
    is_package = names[-1] == "__init__"
    return ".".join(names[:-1] if is_package else names), is_package


def private_imports(source: str, module: str, is_package: bool) -> list[tuple[str, str]]:
    """(module, name) of every ``from M import _name`` (absolute or relative) in ``source`` where M is not the
    importing module itself. Dunder names (``__version__``) are public."""
    found = []
    for source_module, name in from_imports(source, module, is_package):
        private = name.startswith("_") and not name.startswith("__")
        if private and source_module != module:
            found.append((source_module, name))
    return found


def from_imports(source: str, module: str, is_package: bool) -> list[tuple[str, str]]:
    """(module, name) of every ``from M import name`` in ``source``, relative imports resolved against
    ``module`` (a package's own ``__init__`` when ``is_package``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = package[: len(package) - node.level + 1]
            source_module = ".".join(base + ([node.module] if node.module else []))
        else:
            source_module = node.module
        found += [(source_module, alias.name) for alias in node.names]
    return found


def test_the_scanner_finds_private_imports():
    """The check below is not vacuous: absolute and relative imports of a private name are found, public names,
    dunders and a module's own names are not."""
    src = textwrap.dedent("""
        from kvfuzz.fuzz.targets.vllm_triton import _on_cuda, on_cuda
        from .journal import _helper, __doc__
        from ..harness import _x
        from . import _sibling
    """)
    assert private_imports(src, "kvfuzz.fuzz.campaign.engine", False) == [
        ("kvfuzz.fuzz.targets.vllm_triton", "_on_cuda"), ("kvfuzz.fuzz.campaign.journal", "_helper"),
        ("kvfuzz.fuzz.harness", "_x"), ("kvfuzz.fuzz.campaign", "_sibling")]
    assert private_imports("from .engine import _own\n", "kvfuzz.fuzz.campaign.engine", False) == []
    assert private_imports("from .engine import _x\n", "kvfuzz.fuzz.campaign", True) == [
        ("kvfuzz.fuzz.campaign.engine", "_x")]


def test_no_private_name_is_imported_across_modules():
    found = set()
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            rel = path.relative_to(ROOT)
            module, is_package = module_name(rel)
            for source_module, name in private_imports(path.read_text(), module, is_package):
                found.add((rel.as_posix(), source_module, name))
    new = sorted(found - TARGETS_PRIVATE_IMPORTS)
    assert not new, ("private names imported across modules (make the shared name public, in a module of its "
                     f"own if several modules share it): {new}")
    fixed = sorted(TARGETS_PRIVATE_IMPORTS - found)
    assert not fixed, f"fixed: remove them from TARGETS_PRIVATE_IMPORTS: {fixed}"


# ---- every module says what it exports (``__all__``) ---------------------------------------------------------
def package_files() -> dict[str, Path]:
    """Every module of the package (``kvfuzz.fuzz.campaign.engine``, packages by their own name) -> its file."""
    return {module_name(path.relative_to(ROOT))[0]: path
            for room in ROOMS for path in sorted((ROOT / room).rglob("*.py"))}


#: Every module whose ``__all__`` is checked: all of them but ``python -m`` entry points, which run on import.
MODULES = sorted(m for m in package_files() if not m.endswith(".__main__"))


def export_problems(module: types.ModuleType) -> list[str]:
    """What is wrong with ``module.__all__``: missing, not a list or tuple of strings, a private name, a name
    listed twice, a name the module does not have, or a class or function of another kvfuzz module (a
    re-export) that its home module does not list."""
    where = module.__name__
    if not hasattr(module, "__all__"):
        return [f"{where} defines no __all__ (list the names other modules and users import from it)"]
    names = module.__all__
    if not isinstance(names, (list, tuple)):
        return [f"{where}.__all__ is a {type(names).__name__}, not a list"]
    problems = [f"{where}.__all__ lists {n!r} twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for name in names:
        if not isinstance(name, str):
            problems.append(f"{where}.__all__ holds {name!r}, not a name")
        elif name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            problems.append(f"{where}.__all__ lists the private name {name}")
        elif not hasattr(module, name):
            problems.append(f"{where}.__all__ lists {name}, which {where} does not have")
        else:
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not home or not home.startswith("kvfuzz.") \
                    or home == where:
                continue
            listed = getattr(importlib.import_module(home), "__all__", None)  # None: its own case says so
            if listed is not None and obj.__name__ not in listed:
                problems.append(f"{where} exports {name}, which its home {home} does not list in __all__")
    return problems


def unexported_imports(files: dict[str, Path], exports) -> list[str]:
    """Names one module of ``files`` imports from another (``from M import name``) that M's ``__all__``
    (``exports(M)``, None where M has none) does not list; a submodule imported by name is not a name of M's.
    Private names are :func:`test_no_private_name_is_imported_across_modules`'s."""
    problems = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for source, name in from_imports(path.read_text(), module, is_package):
            if source not in files or source == module or name.startswith("_") or f"{source}.{name}" in files:
                continue
            listed = exports(source)
            if listed is not None and name not in listed:  # no __all__ at all: the test above says so
                problems.append(f"{module} imports {name} from {source}, whose __all__ does not list it")
    return sorted(set(problems))


@pytest.mark.parametrize("name", MODULES)
def test_every_module_declares_its_exports(name):
    assert export_problems(importlib.import_module(name)) == []


def test_every_name_imported_across_modules_is_exported():
    problems = unexported_imports(package_files(), lambda m: getattr(importlib.import_module(m), "__all__", None))
    assert not problems, "add these names to their module's __all__:\n" + "\n".join(problems)


def test_the_export_checks_find_planted_problems():
    """Neither check above is vacuous: a module without ``__all__``, one listing a missing, private, repeated
    or non-string name, one re-exporting a function its home keeps private, and an import of a name its module
    does not export are each reported; a clean module and an import of a submodule are not."""
    def planted(**attrs) -> types.ModuleType:
        module = types.ModuleType("kvfuzz.planted")
        module.__dict__.update(attrs)
        return module

    assert export_problems(planted(f=len)) == ["kvfuzz.planted defines no __all__ (list the names other modules "
                                              "and users import from it)"]
    assert export_problems(planted(__all__=["f", "g"], f=len, g=1)) == []
    problems = export_problems(planted(__all__=["f", "f", "_g", "missing", 3], f=len, _g=1))
    assert problems == ["kvfuzz.planted.__all__ lists 'f' twice", "kvfuzz.planted.__all__ lists the private name _g",
                        "kvfuzz.planted.__all__ lists missing, which kvfuzz.planted does not have",
                        "kvfuzz.planted.__all__ holds 3, not a name"]
    assert export_problems(planted(__all__=("x",), x=None)) == []
    assert export_problems(planted(__all__="f", f=len)) == ["kvfuzz.planted.__all__ is a str, not a list"]
    from kvfuzz.fuzz.harness import faults

    private_home = planted(__all__=["ctx_only", "get_fault"], ctx_only=faults._decode_ctx_only,
                           get_fault=faults.get_fault)
    assert export_problems(private_home) == [
        "kvfuzz.planted exports ctx_only, which its home kvfuzz.fuzz.harness.faults does not list in __all__"]

    def files(tmp: dict[str, str]) -> dict[str, Path]:
        return {m: FakeFile(src, m.endswith("pkg")) for m, src in tmp.items()}

    fake = files({"kvfuzz.a": "from kvfuzz.b import shown, hidden\nfrom kvfuzz.pkg import sub\nfrom os import sep\n"
                              "from kvfuzz.c import anything\n",
                  "kvfuzz.b": "", "kvfuzz.c": "", "kvfuzz.pkg": "from .sub import thing\n", "kvfuzz.pkg.sub": ""})
    exported = {"kvfuzz.b": ["shown"], "kvfuzz.c": None, "kvfuzz.pkg": [], "kvfuzz.pkg.sub": []}
    assert unexported_imports(fake, exported.get) == [
        "kvfuzz.a imports hidden from kvfuzz.b, whose __all__ does not list it",
        "kvfuzz.pkg imports thing from kvfuzz.pkg.sub, whose __all__ does not list it"]


class FakeFile:
    """A stand-in for a module's Path in :func:`unexported_imports`: its source, and whether it is a package."""

    def __init__(self, source: str, is_package: bool):
        self.source, self.name = source, "__init__.py" if is_package else "module.py"

    def read_text(self) -> str:
        return self.source
