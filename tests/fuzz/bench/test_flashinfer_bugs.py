"""FlashInfer's re-injected bugs (kvfuzz.fuzz.bench.bugs, ``flashinfer-*``) and the patched package copy they run.

On a CPU: the patches apply to the pinned flashinfer-python 0.7.2.post1 wheel's files (unzipped from the device
cache; skipped with the reason when the wheel is absent), the wheel's JIT still reads its sources and workspace
where the copy puts them, a patched copy is isolated (its own workspace, the installed files untouched, the
process's sys.path and environment restored) and refuses to share a process with another flashinfer, and
``kvfuzz bench bugs`` lists the bugs as unreachable with the reason; the bug's target runs its copy's module (a
stand-in of FlashInfer's contract). Running them needs CUDA: benchmarks/gpu_flashinfer_bugs.sh.
"""

import json
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
from support import ROOT, kvfuzz
from support.flashinfer_standin import install_standin, standin_flashinfer

from kvfuzz.contracts.checks.failures import KernelMismatch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench import bugs as bugs_mod
from kvfuzz.fuzz.bench.bugs import BUGS, PATCHES, get_bug, smallest_trigger
from kvfuzz.fuzz.bench.bugs.benchmark import bench_bugs, in_own_process
from kvfuzz.fuzz.bench.bugs.package_copy import MARK, CopyConflict, PackageCopy, build_copy, import_copy
from kvfuzz.fuzz.bench.bugs.patching import PatchDoesNotApply, parse_patches
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets.flashinfer import PATCHED_COPY_ATTR, FlashInferBatchDecode, FlashInferBatchPrefill

FLASHINFER_BUGS = sorted(n for n, b in BUGS.items() if b.package == "flashinfer")
#: The pinned wheel (benchmarks/flashinfer_bundle.sh downloads it there); KVFUZZ_FLASHINFER_WHEEL overrides.
WHEEL_GLOB = "flashinfer_python-0.7.2.post1-*.whl"
#: What the copy relies on in the wheel's flashinfer/jit/env.py (read once, at import).
ENV_LINES = (
    'os.getenv("FLASHINFER_WORKSPACE_BASE", pathlib.Path.home().as_posix())',
    "_package_root: pathlib.Path = pathlib.Path(__file__).resolve().parents[1]",
    'FLASHINFER_INCLUDE_DIR: pathlib.Path = _package_root / "data" / "include"',
    'FLASHINFER_AOT_DIR: pathlib.Path = _package_root / "data" / "aot"',
)


def _wheel() -> Path | None:
    if os.environ.get("KVFUZZ_FLASHINFER_WHEEL"):
        return Path(os.environ["KVFUZZ_FLASHINFER_WHEEL"])
    found = sorted((ROOT / ".venv" / "share" / "kvfuzz" / "device-cache").glob(WHEEL_GLOB))
    return found[0] if found else None


@pytest.fixture(scope="module")
def wheel_tree(tmp_path_factory) -> Path:
    """The wheel's files the patches edit (and jit/env.py, _build_meta.py), unzipped: ``<tree>/flashinfer/...``."""
    wheel = _wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip(f"the pinned wheel ({WHEEL_GLOB}) is not in .venv/share/kvfuzz/device-cache (bash "
                    "benchmarks/flashinfer_bundle.sh downloads it) and KVFUZZ_FLASHINFER_WHEEL is not set")
    paths = {"flashinfer/jit/env.py", "flashinfer/_build_meta.py", "flashinfer/__init__.py"}
    for f in list(PATCHES.glob("flashinfer-*.patch")) + list((PATCHES.parent / "prepared").glob("flashinfer-*")):
        paths |= {p.path for p in parse_patches(f.read_text(), f.name)}
    tree = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as z:
        for p in sorted(paths):
            z.extract(p, tree)
    return tree


def test_registry_and_unreachable_here():
    assert FLASHINFER_BUGS == ["bug.flashinfer-1416", "bug.flashinfer-350", "bug.flashinfer-4401"]
    bases = {"bug.flashinfer-1416": "flashinfer.batch_prefill", "bug.flashinfer-350": "flashinfer.batch_decode",
             "bug.flashinfer-4401": "flashinfer.batch_decode"}
    for name in FLASHINFER_BUGS:
        bug = BUGS[name]
        header = bug.patches()[0].header
        assert bug.upstream in header and "The fix" in header and "Undoing it:" in header, name
        assert bug.base.name == bases[name] and not bug.cpu and bug.smallest().head_size == 64
        target = get_bug(name)
        assert target.name == name and target.capabilities == bug.base.capabilities
        if not target.installed().ok:  # this CPU: listed with the reason, never dropped
            assert bug.unreachable() == target.installed().reason
            a = target.availability()
            assert not a.ok and a.reason == bug.unreachable()
    # 4401: reachable since the "shifted" value range (issue 53), so a default campaign is expected to find it
    assert BUGS["bug.flashinfer-4401"].why_missed is None and BUGS["bug.flashinfer-350"].why_missed is None
    assert BUGS["bug.flashinfer-4401"].smallest().value_range == "shifted"


def test_patches_apply_to_the_pinned_wheel(wheel_tree):
    env = (wheel_tree / "flashinfer/jit/env.py").read_text()
    for line in ENV_LINES:
        assert line in env, f"flashinfer/jit/env.py no longer has {line!r}: re-check how the JIT finds its sources"
    installed = wheel_tree / "flashinfer"
    for name in FLASHINFER_BUGS:
        copy = BUGS[name].package_copy()
        patched = copy.patched_sources(installed)
        assert set(patched) == {p.path for p in copy.patches}
        for path, text in patched.items():
            assert text != (wheel_tree / path).read_text(), (name, path)
    # 4401 undoes the whole fix: the finite sentinel and the clamps (the first head, B, only the clamps)
    a = BUGS["bug.flashinfer-4401"].package_copy().patched_sources(installed)
    assert "constexpr float inf = 5e4;" in a["flashinfer/data/include/flashinfer/math.cuh"]
    b = parse_patches((PATCHES.parent / "prepared/flashinfer-4401-B.patch").read_text(), "B")
    assert {p.path for p in b} == set(a) - {"flashinfer/data/include/flashinfer/math.cuh"}
    for p in b:
        assert p.apply((wheel_tree / p.path).read_text()) != (wheel_tree / p.path).read_text()


def test_a_copy_of_the_wheel_is_isolated(wheel_tree, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUZZ_BUG_COPIES", str(tmp_path / "copies"))
    installed = wheel_tree / "flashinfer"
    before = {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()}
    copy = BUGS["bug.flashinfer-350"].package_copy()
    folder = build_copy(copy, installed)
    assert build_copy(copy, installed) == folder  # built once
    (rel,) = [p.path for p in copy.patches]
    assert (folder / "site" / rel).read_text() == copy.patched_sources(installed)[rel]
    assert (folder / "site/flashinfer/jit/env.py").read_bytes() == (installed / "jit/env.py").read_bytes()
    assert {p: p.read_bytes() for p in installed.rglob("*") if p.is_file()} == before  # the wheel untouched
    assert (folder / "jit").is_dir() and json.loads((folder / "COPY.json").read_text())["patched"] == [rel]
    other = BUGS["bug.flashinfer-4401"].package_copy()
    assert other.folder(installed) != folder  # each bug its own copy and JIT workspace


def _fake_package(site: Path, name: str) -> Path:
    """A package that finds its sources and workspace as flashinfer/jit/env.py does."""
    pkg = site / name
    (pkg / "jit").mkdir(parents=True)
    (pkg / "data/include").mkdir(parents=True)
    (pkg / "data/aot").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .jit import env\n")
    (pkg / "jit/__init__.py").write_text("")
    (pkg / "jit/env.py").write_text(
        "import os\nimport pathlib\n"
        "BASE = pathlib.Path(os.getenv('FAKE_WS', pathlib.Path.home().as_posix()))\n"
        "_package_root = pathlib.Path(__file__).resolve().parents[1]\n"
        "INCLUDE = _package_root / 'data' / 'include'\n")
    (pkg / "data/include/k.cuh").write_text("x = 1;\n")
    (pkg / "data/aot/m.so").write_text("prebuilt from the unpatched sources\n")
    return pkg


def _copy(name: str, bug: str, old: str = "x = 1;", new: str = "x = 2;") -> PackageCopy:
    text = f"--- a/{name}/data/include/k.cuh\n+++ b/{name}/data/include/k.cuh\n@@ -1 +1 @@\n-{old}\n+{new}\n"
    return PackageCopy(bug, name, parse_patches(text, f"{bug}.patch"), "FAKE_WS", ("data/aot",))


def test_the_copy_is_imported_with_its_own_workspace_and_nothing_else_changes(tmp_path, monkeypatch):
    name = "kvfuzz_fake_fi"
    pkg = _fake_package(tmp_path / "site", name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVFUZZ_BUG_COPIES", str(tmp_path / "copies"))
    monkeypatch.setenv("FAKE_WS", str(tmp_path / "default-ws"))
    for m in [m for m in sys.modules if m.startswith(name)]:
        monkeypatch.delitem(sys.modules, m)
    copy = _copy(name, "fake-1")
    path_before = list(sys.path)
    try:
        module = import_copy(copy)
        folder = copy.folder(pkg)
        assert module.env.BASE == folder / "jit" != tmp_path / "default-ws"  # its own JIT workspace
        assert (module.env.INCLUDE / "k.cuh").read_text() == "x = 2;\n"  # what a JIT would compile: patched
        assert not (module.env.INCLUDE.parent / "aot").exists()  # no prebuilt module to win over the JIT
        assert (pkg / "data/include/k.cuh").read_text() == "x = 1;\n"  # the installed package untouched
        assert os.environ["FAKE_WS"] == str(tmp_path / "default-ws") and sys.path == path_before
        assert getattr(module, MARK).startswith("fake-1 ") and import_copy(copy) is module
        # planted: another bug's copy, or the installed package, in the same process is refused
        with pytest.raises(CopyConflict, match="already imported in this process"):
            import_copy(_copy(name, "fake-2", new="x = 3;"))
    finally:
        for m in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[m]
    import importlib

    importlib.import_module(name)  # the installed one
    try:
        with pytest.raises(CopyConflict, match="the installed package"):
            import_copy(copy)
    finally:
        for m in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[m]


def test_a_patch_that_no_longer_applies_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    name = "kvfuzz_fake_fi2"
    pkg = _fake_package(tmp_path / "site", name)
    monkeypatch.setenv("KVFUZZ_BUG_COPIES", str(tmp_path / "copies"))
    with pytest.raises(PatchDoesNotApply, match=r"fake-3\.patch no longer applies to .*k\.cuh"):
        build_copy(_copy(name, "fake-3", old="x = 7;"), pkg)
    assert not (tmp_path / "copies").exists() or not any((tmp_path / "copies").iterdir())


def test_the_installed_targets_refuse_a_patched_copy(monkeypatch):
    fake = types.ModuleType("flashinfer")
    setattr(fake, PATCHED_COPY_ATTR, "flashinfer-350 (/tmp/x)")
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    with pytest.raises(RuntimeError, match="patched copy of flashinfer-350"):
        FlashInferBatchDecode().flashinfer()
    assert PATCHED_COPY_ATTR == MARK


def test_several_flashinfer_bugs_run_in_child_processes(monkeypatch):
    assert in_own_process(["bug.flashinfer-350", "bug.vllm-47305"]) == []
    assert in_own_process(["bug.flashinfer-350", "bug.flashinfer-1416"]) == ["bug.flashinfer-350",
                                                                            "bug.flashinfer-1416"]
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))  # the installed one
    assert in_own_process(["bug.flashinfer-350"]) == ["bug.flashinfer-350"]
    mine = types.ModuleType("flashinfer")
    setattr(mine, MARK, "flashinfer-350 (/tmp/x)")
    monkeypatch.setitem(sys.modules, "flashinfer", mine)
    assert in_own_process(["bug.flashinfer-350"]) == []


@pytest.mark.cli_text
def test_cli_lists_them_as_unreachable_with_the_reason(tmp_path):
    if all(BUGS[n].unreachable() is None for n in FLASHINFER_BUGS):
        pytest.skip("this machine can run FlashInfer's bugs (benchmarks/gpu_flashinfer_bugs.sh)")
    doc = bench_bugs(FLASHINFER_BUGS, seeds=1, duration=1.0)
    assert doc["skipped"] == FLASHINFER_BUGS and not doc["missed"]
    for e in doc["bugs"]:
        assert e["skipped"] == f"not reachable on this machine: {BUGS[e['bug']].unreachable()}" and e["runs"] == []
        assert e["patched_files"] and e["smallest_trigger"]["seqs"] == 1
    out = tmp_path / "bugs.json"
    p = kvfuzz("bench", "bugs", "--bug", "flashinfer-350", "--seeds", "1", "--json", out)
    assert p.returncode == 0, p.stderr
    assert "bug.flashinfer-350 skipped: not reachable on this machine:" in " ".join(p.stdout.split())
    doc = json.loads(out.read_text())
    assert doc["skipped"] == ["bug.flashinfer-350"]
    assert doc["bugs"][0]["skipped"] == f"not reachable on this machine: {BUGS['bug.flashinfer-350'].unreachable()}"


def test_the_bug_target_runs_its_copy_and_1416s_smallest_trigger_shows_it(monkeypatch):
    """The bug's target runs the module its copy imports, not the installed one: with FlashInfer's documented
    contract standing in for both (tests/support/flashinfer_standin.py, NOT FlashInfer) and the copy's prefill run
    dropping ``v_scale`` as flashinfer#1416's re-injection does, the smallest trigger passes on the installed
    package's target and is a kernel mismatch on the bug's."""
    install_standin(monkeypatch)
    copy = standin_flashinfer(compute=True)
    run = copy.BatchPrefillWithPagedKVCacheWrapper.run
    copy.BatchPrefillWithPagedKVCacheWrapper.run = (
        lambda self, q, kv, *a, v_scale=None, **kw: run(self, q, kv, *a, **kw))
    setattr(copy, MARK, "flashinfer-1416 (stand-in)")
    monkeypatch.setattr(bugs_mod, "import_copy", lambda c: copy if c.name == "flashinfer-1416" else None)
    example = Example(smallest_trigger("flashinfer-1416"), Poison.NAN)
    assert example.batch.v_scale == 0.5 and example.batch.kv_cache_dtype == "fp8_e4m3"
    properties.check(FlashInferBatchPrefill(), example)
    with pytest.raises(KernelMismatch):
        properties.check(get_bug("flashinfer-1416"), example)
