"""Statements in docs and docstrings that name parts of the code, checked against the code so they cannot drift:
the guard's list of intercepted kernels (fuzz/guard/patching.py) against the families' signatures; the
production states of docs/targets.md against the registry (``PRODUCTION_STATES``) and the built-in targets'
declarations; the third-party packages docs/architecture.md says contracts/ imports; every
``:func:``/``:class:``/... cross-reference to a ``kvfuzz.`` name in the package's source resolves. Each checker
is also fed a planted drift. No kernel runs here (the targets' declarations are read without their libraries)."""

from __future__ import annotations

import ast
import importlib
import re
import sys

from support import ROOT

from kvfuzz.contracts.model.states import PRODUCTION_STATES
from kvfuzz.fuzz.guard import patching
from kvfuzz.fuzz.guard.signatures import SIGNATURES
from kvfuzz.fuzz.targets.registry import BUILTIN, get_target

TARGETS_DOC = (ROOT / "docs" / "targets.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
#: folder -> import name of the package's rooms (setup.py)
ROOMS = {"api": "kvfuzz", "contracts": "kvfuzz.contracts", "strategies": "kvfuzz.strategies", "fuzz": "kvfuzz.fuzz"}


def missing_kernels(doc: str) -> list[str]:
    """The intercepted kernels (function or op name) that ``doc``'s "What is intercepted" part does not name."""
    part = doc[doc.index("What is intercepted"):doc.index("Not intercepted")]
    return [s.name for s in SIGNATURES.values() if f"``{s.attr}``" not in part
            and f"``torch.ops.{s.op_namespace}.{s.attr}``" not in part]


def test_the_guard_docstring_names_every_intercepted_kernel():
    assert missing_kernels(patching.__doc__) == []
    planted = patching.__doc__.replace("``flash_mla_with_kvcache_fp8``", "FlashMLA's fp8 kernel")
    assert missing_kernels(planted) == ["flash_mla_with_kvcache_fp8"]


def documented_states(doc: str) -> dict[str, set[str]]:
    """docs/targets.md's production states: each bullet's state -> the targets its "Declared by:" names."""
    part = doc[doc.index("### Production cache states"):]
    part = part[:part.index("\n### ", 1)]
    out = {}
    for bullet in re.split(r"\n- ", part)[1:]:
        state = re.match(r"`(\w+)`", bullet).group(1)
        names = re.match(r"\s*((?:`[^`]+`(?:,\s*)?)+)", bullet.split("Declared by:", 1)[1]).group(1)
        out[state] = set(re.findall(r"`([^`]+)`", names))
    return out


def declared_states() -> dict[str, set[str]]:
    """Each registered production state -> the built-in targets whose Capabilities declare it."""
    caps = {name: get_target(name).capabilities for name in BUILTIN}
    return {s: {n for n, c in caps.items() if getattr(c, s) != state.off} for s, state in PRODUCTION_STATES.items()}


def test_the_states_list_in_the_docs_is_the_codes():
    assert documented_states(TARGETS_DOC) == declared_states()
    planted = TARGETS_DOC.replace("`vllm.triton_mla_decode`, `sglang.decode_attention_fwd`.",
                                  "`vllm.triton_mla_decode`.")
    assert documented_states(planted) != declared_states()


def third_party_imports(folder: str) -> set[str]:
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "kvfuzz"}


def test_architecture_names_what_contracts_imports():
    line = next(ln for ln in ARCHITECTURE.splitlines() if ln.startswith("contracts/"))
    named = set(re.search(r"third-party imports: ([\w, ]+)\)", line).group(1).replace(" ", "").split(","))
    assert named == third_party_imports("contracts")


def resolves(name: str) -> bool:
    """Whether the dotted ``kvfuzz.`` name is a module, or an attribute (or annotated field) of one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            if not hasattr(obj, p):
                return p in getattr(obj, "__annotations__", {})
            obj = getattr(obj, p)
        return True
    return False


XREF = re.compile(r":(?:func|data|class|mod|meth|attr|exc):`~?(kvfuzz\.[\w.]+)`")


def broken_references(text: str) -> list[str]:
    return [m.group(1) for m in XREF.finditer(text) if not resolves(m.group(1))]


def test_every_cross_reference_in_the_package_resolves():
    bad = [f"{p.relative_to(ROOT)}: {name}" for folder in ROOMS for p in sorted((ROOT / folder).rglob("*.py"))
           for name in broken_references(p.read_text(encoding="utf-8"))]
    assert bad == []
    assert broken_references("(:func:`kvfuzz.fuzz.targets.registry.family_signatures`)") == [
        "kvfuzz.fuzz.targets.registry.family_signatures"]
