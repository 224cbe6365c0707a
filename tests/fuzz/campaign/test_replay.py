"""Replaying reproducers: isolated (a crash or hang is a verdict, not a dead replayer), corrupt files exit 2
naming the file and field, no code is imported that the user did not name, and nothing is ever unpickled."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, SUPPORT, kvfuzz

PLANTED = SUPPORT / "planted_endings.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Reproducers written by real campaigns: a segfault, a hang, a plain kernel mismatch of a user adapter."""
    root = tmp_path_factory.mktemp("cases")
    out = {}
    for cls in ("Segfaults", "Hangs", "RaisesRuntimeError"):
        r = kvfuzz("fuzz", "--target", f"{PLANTED}:{cls}", "--poison", "stale", "--max-examples", "20",
                   "--max-crashes", "1", "--example-timeout", "4", "--out", str(root / cls))
        assert r.returncode == 1, r.stdout + r.stderr
        (d,) = [p for p in (root / cls).iterdir() if p.name.startswith("planted.")]
        out[cls] = d
    return out


def test_replay_of_a_segfault_reports_a_kernel_crash_and_survives(cases):
    r = kvfuzz("replay", str(cases["Segfaults"]), "--target", f"{PLANTED}:Segfaults")
    assert r.returncode == 1 and "reproduced" in r.stdout and "kernel crash (SIGSEGV)" in r.stdout, r.stdout


@pytest.mark.cli_text
def test_replay_of_a_hang_reports_a_kernel_hang_after_the_timeout(cases):
    r = kvfuzz("replay", str(cases["Hangs"]), "--target", f"{PLANTED}:Hangs", "--timeout", "5")
    assert r.returncode == 1 and "kernel hang (timeout)" in r.stdout, r.stdout
    assert "after 5 s" in r.stdout, r.stdout


def test_replay_of_a_hang_waits_the_campaigns_own_example_timeout_by_default(cases):
    """The campaign ran with --example-timeout 4: case.json records it, and the replay times the kernel call
    against it instead of waiting 300 s."""
    assert json.loads((cases["Hangs"] / "case.json").read_text())["details"]["timeout_s"] == 4
    start = time.monotonic()
    r = kvfuzz("replay", str(cases["Hangs"]), "--target", f"{PLANTED}:Hangs", timeout=120)
    assert r.returncode == 1 and "kernel hang (timeout)" in r.stdout and "after 4 s" in r.stdout, r.stdout
    assert time.monotonic() - start < 100


def test_replay_passes_once_the_kernel_is_fixed(cases):
    """The same reproducer with the fixed kernel (the correct adapter under the same name) exits 0."""
    d = cases["RaisesRuntimeError"]
    fixed = d.parent / "fixed_adapter.py"
    fixed.write_text(f"import sys\nsys.path.insert(0, {str(SUPPORT)!r})\nfrom planted_endings import Correct\n\n"
                     "class RaisesRuntimeError(Correct):\n    name = 'planted.raises_runtime_error'\n")
    r = kvfuzz("replay", str(d), "--target", f"{fixed}:RaisesRuntimeError")
    assert r.returncode == 0 and "passes now" in r.stdout, r.stdout + r.stderr


def test_replay_does_not_import_code_the_case_names(cases, tmp_path):
    """case.json names an adapter by file: replay refuses to import it unless the user names it or trusts it."""
    d = tmp_path / "case"
    shutil.copytree(cases["RaisesRuntimeError"], d)
    marker = tmp_path / "imported"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\nfrom kvfuzz import Target\n")
    case = json.loads((d / "case.json").read_text())
    case["target"], case["target_spec"] = "evil.target", f"{evil}:Evil"
    (d / "case.json").write_text(json.dumps(case))
    r = kvfuzz("replay", str(d))
    assert r.returncode == 2 and "--trust-target" in r.stderr and "--target" in r.stderr, r.stdout + r.stderr
    assert not marker.exists(), "replay imported code the user did not name"
    r = kvfuzz("check", "--target", f"{PLANTED}:Correct", "--corpus", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and not marker.exists()
    kvfuzz("replay", str(d), "--trust-target")
    assert marker.exists()  # with consent it does


def test_the_case_records_how_the_adapter_was_loaded(cases):
    case = json.loads((cases["Segfaults"] / "case.json").read_text())
    assert case["target"] == "planted.segfaults" and case["target_spec"] == f"{PLANTED}:Segfaults"


def _mutate(cases, tmp_path, edit) -> Path:
    d = tmp_path / "case"
    shutil.copytree(cases["RaisesRuntimeError"], d)
    edit(d)
    return d


def _case(d: Path) -> dict:
    return json.loads((d / "case.json").read_text())


CORRUPTIONS = {
    "truncated tensors": (lambda d: (d / "tensors.safetensors").write_bytes((d / "tensors.safetensors")
                                                                            .read_bytes()[:100]),
                          "tensors.safetensors: is not a readable safetensors file"),
    "case is a list": (lambda d: (d / "case.json").write_text("[1, 2]"), "holds a JSON list"),
    "not JSON": (lambda d: (d / "case.json").write_text("{nope"), "case.json: is not valid JSON"),
    "missing example": (lambda d: (d / "case.json").write_text(json.dumps(
        {k: v for k, v in _case(d).items() if k != "example"})), "field 'example': is missing"),
    "wrong type": (lambda d: (d / "case.json").write_text(json.dumps(_case(d) | {"target": 7})),
                   "field 'target': is int"),
    "bad batch": (lambda d: (d / "case.json").write_text(json.dumps(
        _case(d) | {"example": {"batch": {"query_lens": "abc"}, "poison": "nan"}})),
        "field 'example.batch.query_lens': is 'abc'"),  # the innermost field (issue 48, 7)
    "unknown fault": (lambda d: (d / "case.json").write_text(json.dumps(_case(d) | {"caller_fault": "nope"})),
                      "field 'caller_fault': is 'nope', not a caller fault"),
    "unknown kind": (lambda d: (d / "case.json").write_text(json.dumps(_case(d) | {"kind": "oops"})),
                     "field 'kind'"),
}


@pytest.mark.cli_text
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_reproducers_exit_2_naming_file_and_field(cases, tmp_path, corruption):
    edit, message = CORRUPTIONS[corruption]
    d = _mutate(cases, tmp_path, edit)
    r = kvfuzz("replay", str(d), "--target", f"{PLANTED}:RaisesRuntimeError")
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stdout and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.cli_text
def test_a_pickled_tensors_file_is_rejected_and_never_unpickled(cases, tmp_path):
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = _mutate(cases, tmp_path, lambda d: (d / "tensors.safetensors").write_bytes(pickle.dumps(Boom())))
    r = kvfuzz("replay", str(d), "--target", f"{PLANTED}:RaisesRuntimeError")
    assert r.returncode == 2 and "never reads pickles" in r.stdout, r.stdout
    assert not marker.exists()


def test_check_over_a_corpus_with_crash_and_hang_cases_writes_the_table_and_junit(cases, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for c in ("Segfaults", "Hangs"):
        shutil.copytree(cases[c], corpus / cases[c].name)
    junit = tmp_path / "junit.xml"
    r = kvfuzz("check", "--target", f"{PLANTED}:Correct", "--corpus", str(corpus), "--trust-targets",
               "--junit-xml", str(junit), "--out", str(tmp_path / "o"), timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "kernel crash (SIGSEGV)" in r.stdout and "kernel hang (timeout)" in r.stdout and junit.exists()
    assert 'failures="2"' in junit.read_text()


def test_case_json_holds_no_bare_nan(cases):
    for d in cases.values():
        json.loads((d / "case.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in case.json"))


def test_the_reproducers_test_case_fails_while_it_reproduces_and_passes_when_fixed(cases, tmp_path):
    d = tmp_path / "repro"
    shutil.copytree(cases["RaisesRuntimeError"], d)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d / "test_case.py")]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "raised RuntimeError" in r.stdout, r.stdout
    # fix the kernel: point the case at a correct adapter of the same name (what a user's fix amounts to)
    fixed = tmp_path / "fixed.py"
    fixed.write_text(f"import sys\nsys.path.insert(0, {str(SUPPORT)!r})\nfrom planted_endings import Correct\n\n"
                     "class RaisesRuntimeError(Correct):\n    name = 'planted.raises_runtime_error'\n")
    case = json.loads((d / "case.json").read_text())
    (d / "case.json").write_text(json.dumps(case | {"target_spec": f"{fixed}:RaisesRuntimeError"}))
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout


VARIANTS = '''"""A user's variants of a base adapter that lives beside them (imported as a sibling module)."""
from sdpa_paged_target import SdpaPaged

BUG = True


class Scaled(SdpaPaged):
    name = "user.scaled"
    description = "SDPA whose head-size-64 output is 1.5x too large (until fixed)"

    def run(self, call):
        out = super().run(call)
        if BUG and call.kwargs["query"].shape[-1] == 64:
            out.mul_(1.5)
        return out
'''


def test_an_adapter_importing_a_sibling_module_fuzzes_replays_and_its_test_passes_once_fixed(tmp_path):
    """Issue 15 §3: a user splits a base adapter from its variants; the campaign finds the bug, the reproducer
    replays by the recorded spec, and the reproducer's test_case.py passes after the user fixes the kernel file
    in place (no edit of the reproducer)."""
    folder = tmp_path / "my_kernels"
    folder.mkdir()
    shutil.copy(ROOT / "examples" / "sdpa_paged_target.py", folder / "sdpa_paged_target.py")
    (folder / "variants.py").write_text(VARIANTS)
    spec = f"{folder / 'variants.py'}:Scaled"
    r = kvfuzz("fuzz", "--target", spec, "--poison", "stale", "--max-examples", "60", "--out", str(tmp_path / "o"))
    assert r.returncode == 1, r.stdout + r.stderr
    (d,) = [p for p in (tmp_path / "o").iterdir() if p.name.startswith("user.scaled")]
    case = json.loads((d / "case.json").read_text())
    assert case["target_spec"] == spec and case["example"]["batch"]["head_size"] == 64
    r = kvfuzz("replay", str(d), "--trust-target")
    assert r.returncode == 1 and "reproduced" in r.stdout, r.stdout + r.stderr
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d / "test_case.py")]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "kernel mismatch" in r.stdout, r.stdout
    (folder / "variants.py").write_text(VARIANTS.replace("BUG = True", "BUG = False"))
    r = kvfuzz("replay", str(d), "--target", spec)
    assert r.returncode == 0 and "passes now" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout


def test_a_case_written_before_the_generator_changed_replays_on_its_stored_ground_truth(monkeypatch):
    """regressions/ was written when a seed drew its data with torch.randn; the seed draws other data now (issue
    21's counter-based generator), so the replay runs on the stored query, keys and values."""
    import torch
    from safetensors.torch import load_file

    from kvfuzz.contracts.model.data import make_batch_data
    from kvfuzz.fuzz.campaign.store.cases import load_case
    from kvfuzz.fuzz.campaign.workers.replay import replay_here, resolve_target, stored_data
    from kvfuzz.fuzz.harness import attention

    (d,) = (ROOT / "regressions").glob("vllm.chunked_prefill_paged_decode-kernel-mismatch-agreement-8c5acb6640")
    case, stored = load_case(d), load_file(str(d / "tensors.safetensors"))
    data = stored_data(case.example, stored)
    assert case.example.batch.fp8_dtype is not None and case.example.batch.sinks  # codes and sinks rebuilt too
    assert torch.equal(data.query, stored["query"]) and torch.equal(data.values, stored["values_ground_truth"])
    assert torch.equal(data.cache_keys.float() * case.example.batch.k_scale, stored["keys_ground_truth"].float())
    assert not torch.equal(make_batch_data(case.example.batch).keys, data.keys)
    assert stored_data(case.example, {k: v for k, v in stored.items() if k != "sinks"}) is None
    assert stored_data(case.example, {**stored, "query": stored["query"][1:]}) is None  # not this batch's shape
    assert stored_data(case.example, {**stored, "values_ground_truth": stored["values_ground_truth"].double()}) is None
    off = stored["keys_ground_truth"].clone()
    off.view(-1)[torch.argmax(off.abs())] *= 1.001  # no longer an fp8 code times k_scale
    assert stored_data(case.example, {**stored, "keys_ground_truth": off}) is None
    seen, real = [], attention.prepare
    monkeypatch.setattr(attention, "prepare", lambda *a, data=None, **k: seen.append(data) or real(*a, data=data, **k))
    r = replay_here(case, resolve_target(case, None, trust_target=True))
    assert r.inputs_match is False and r.got is None, r.message
    assert seen[0] is None and torch.equal(seen[-1].keys, stored["keys_ground_truth"])


def stored_import_problems(paths: list[Path]) -> list[str]:
    """What is wrong with the kvfuzz imports of stored test_case.py files: a module or name kvfuzz does not have,
    or a module inside the campaign room instead of its face (``kvfuzz.fuzz.campaign``), which the room may move."""
    import ast
    import importlib

    problems = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvfuzz")):
                continue
            if node.module.startswith("kvfuzz.fuzz.campaign."):
                problems.append(f"{path.name}: {node.module} (import from kvfuzz.fuzz.campaign)")
                continue
            module = importlib.import_module(node.module)
            problems += [f"{path.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    return problems


def test_stored_test_cases_import_the_campaign_rooms_face_not_its_modules(tmp_path):
    """A reproducer's test_case.py is stored data (regressions/, benchmarks/repro/, every campaign's reproducers):
    it imports replay from kvfuzz.fuzz.campaign, never a module path inside the room, so moving the room's modules
    leaves stored cases runnable. (tests/fuzz/guard/test_flashinfer_regression.py checks the template writes the
    same.)"""
    root = ROOT
    stored = sorted(root.glob("regressions/*/test_case.py")) + sorted(root.glob("benchmarks/repro/*/test_case.py"))
    assert len(stored) >= 2 and stored_import_problems(stored) == []
    old = tmp_path / "test_case.py"  # as written before the room was arranged by purpose
    old.write_text("from kvfuzz.fuzz.campaign.reproducers import TargetUnavailable, replay\n"
                   "from kvfuzz.fuzz.campaign import replay, no_such_name\n")
    assert stored_import_problems([old]) == [
        "test_case.py: kvfuzz.fuzz.campaign.reproducers (import from kvfuzz.fuzz.campaign)",
        "test_case.py: kvfuzz.fuzz.campaign.no_such_name"]


def test_a_replay_whose_kernel_compiles_past_the_timeout_waits_for_it(cases, tmp_path, monkeypatch):
    """A replay on a machine with a cold JIT cache compiles first (FlashInfer's ninja/nvcc): a 4 s 'ninja' against
    --timeout 2 is compiling, not hung; the fixed kernel then passes."""
    fixed = tmp_path / "compiling_adapter.py"
    fixed.write_text(f"import sys\nsys.path.insert(0, {str(SUPPORT)!r})\nfrom planted_endings import CompilesSlowly\n\n"
                     "class Hangs(CompilesSlowly):\n    name = 'planted.hangs'\n")
    monkeypatch.setenv("KVFUZZ_PLANTED_COMPILE_S", "4")
    r = kvfuzz("replay", str(cases["Hangs"]), "--target", f"{fixed}:Hangs", "--timeout", "2")
    assert r.returncode == 0 and "passes now" in r.stdout, r.stdout + r.stderr


def test_a_replays_check_is_not_held_to_the_kernel_calls_deadline():
    """The kernel call's --timeout times the kernel call alone: a check that starts 1.9 s into a 2 s call's budget
    has the whole replay's time (a busy CI machine had a replay's check called "hung in check" 2 s in); a compile
    wait gives the call its timeout again and moves the replay's end past it."""
    from kvfuzz.fuzz.campaign.workers.replay import REPLAY_TIMEOUT, _Deadlines

    clock = _Deadlines(0.0, 2.0)
    assert clock.deadline == REPLAY_TIMEOUT
    clock.enter("kernel", 1.0)
    assert clock.deadline == 3.0
    clock.enter("check", 2.9)
    assert clock.deadline == REPLAY_TIMEOUT
    clock.enter("kernel", REPLAY_TIMEOUT - 1)  # a kernel call's deadline never passes the replay's end
    assert clock.deadline == REPLAY_TIMEOUT
    clock.wait_again(REPLAY_TIMEOUT)  # compiling at the end: the call, and so the replay, get 2 s more
    assert clock.deadline == clock.end == REPLAY_TIMEOUT + 2
    clock.enter("check", REPLAY_TIMEOUT + 1)
    assert clock.deadline == REPLAY_TIMEOUT + 2
    long = _Deadlines(10.0, REPLAY_TIMEOUT * 2)  # a hang case's own timeout past REPLAY_TIMEOUT
    assert long.end == 10.0 + REPLAY_TIMEOUT * 2
