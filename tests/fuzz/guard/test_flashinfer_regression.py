"""The group-size-7 case (issue 20): a configuration outside flashinfer.batch_decode's declaration, recorded as a
refused one under regressions/. On a GPU its replay checks that the refusal stays a clear error; on this CPU
machine replay says the target cannot run here (exit 3), its test_case.py skips and `kvfuzz check` skips it. The
undeclared replay's three answers are tested with the stand-in flashinfer (tests/support/flashinfer_standin.py)."""

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
from support import ROOT, kvfuzz
from support.flashinfer_regression_case import CHECK, TARGET, group_size_7_example, write_group_size_7_case
from support.flashinfer_standin import install_standin

from kvfuzz.contracts.checks.failures import FailureKind
from kvfuzz.fuzz.campaign.store.cases import load_case
from kvfuzz.fuzz.campaign.workers.replay import ReplayResult, TargetUnavailable, replay, replay_here
from kvfuzz.fuzz.targets.flashinfer import FlashInferBatchDecode

(CASE,) = [d for d in (ROOT / "regressions").iterdir() if d.name.startswith(f"{TARGET}-config-rejected-")]
FIELDS = ("format", "target", "target_spec", "contract", "kind", "blame", "check", "message", "details",
          "caller_fault", "example")
#: FlashInfer's error for group size 7 (flashinfer/data/include/flashinfer/exception.h FLASHINFER_ERROR from
#: csrc/batch_decode.cu's plan), as the JIT module raises it
ERROR = ("Error in function 'operator()' at /tmp/fi-ws/.cache/flashinfer/0.7.2.post1/90a/generated/batch_decode_with_"
         "kv_cache_dtype_q_f16_dtype_kv_f16_dtype_o_f16_dtype_idx_i32_head_dim_qk_128_head_dim_vo_128_posenc_0_use_"
         "swa_False_use_logits_cap_False/batch_decode.cu:63: Unsupported group_size: 7")


def test_the_committed_case_is_what_its_generator_writes(tmp_path):
    d = write_group_size_7_case(tmp_path)
    assert d.name == CASE.name
    new, old = json.loads((d / "case.json").read_text()), json.loads((CASE / "case.json").read_text())
    assert {k: new[k] for k in FIELDS} == {k: old[k] for k in FIELDS}
    case = load_case(CASE)
    assert (case.kind, case.check) == (FailureKind.CONFIG_REJECTED.value, CHECK)
    assert FlashInferBatchDecode.capabilities.outside(case.example.batch) == ["GQA group size 7"]
    assert (CASE / "test_case.py").read_text() == (d / "test_case.py").read_text()


@pytest.mark.cli_text
def test_replay_on_a_machine_without_cuda_says_what_it_needs_and_exits_3():
    r = kvfuzz("replay", CASE)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot replay here" in r.stdout and "CUDA only" in r.stdout and TARGET in r.stdout, r.stdout
    with pytest.raises(TargetUnavailable, match="cannot run on this machine"):
        replay(CASE)


def test_its_test_case_skips_and_the_gate_skips_it(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        str(CASE / "test_case.py")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and "1 skipped" in p.stdout and "CUDA only" in p.stdout, p.stdout + p.stderr
    from kvfuzz.fuzz.campaign.gate import check_corpus, write_junit

    corpus = tmp_path / "corpus"
    shutil.copytree(CASE, corpus / CASE.name)
    (r,) = check_corpus(corpus)
    assert r.failure is None and not r.bad_input and "CUDA only" in r.skipped
    write_junit([r], tmp_path / "junit.xml")
    (skipped,) = ET.parse(tmp_path / "junit.xml").getroot().iter("skipped")
    assert "CUDA only" in skipped.get("message")


def test_an_adapter_that_only_loading_finds_unusable_is_unavailable_too(tmp_path):
    """installed() says yes, availability() (asked in the replay's child) says no: still TargetUnavailable."""
    adapter = tmp_path / "looks_installed.py"
    adapter.write_text(
        "from kvfuzz.fuzz.targets.base import Availability\n"
        "from kvfuzz.fuzz.targets.flashinfer import FlashInferBatchDecode\n\n"
        "class LooksInstalled(FlashInferBatchDecode):\n"
        "    name = 'flashinfer.batch_decode'\n"
        "    def installed(self):\n        return Availability(True, 'installed, not loaded')\n"
        "    def availability(self):\n"
        "        return Availability(False, 'importing flashinfer failed: nvcc missing')\n")
    with pytest.raises(TargetUnavailable, match="nvcc missing"):
        replay(CASE, target_spec=f"{adapter}:LooksInstalled")


@pytest.fixture
def decode(monkeypatch):
    """flashinfer.batch_decode over the stand-in, and a switch for what its plan() does with group size 7."""
    fi = install_standin(monkeypatch)
    cls = fi.BatchDecodeWithPagedKVCacheWrapper
    plan, run = cls.plan, cls.run

    def refusing_plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, *a, **kw):
        if num_qo_heads // num_kv_heads not in (1, 2, 3, 4, 6, 8, 16):
            raise RuntimeError(ERROR)
        return plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, *a, **kw)

    def modes(mode):
        monkeypatch.setattr(cls, "plan", refusing_plan if mode == "refuses" else plan)
        monkeypatch.setattr(cls, "run",
                            (lambda self, q, *a, **kw: run(self, q, *a, **kw) * 0) if mode == "wrong" else run)
        return FlashInferBatchDecode()

    return modes


def test_replayed_where_it_runs_a_refusal_is_the_expected_answer(decode):
    r = replay_here(load_case(CASE), decode("refuses"))
    assert r.got is None and r.reproduced
    assert r.outcome == f"rejected: RuntimeError: Error in function 'operator()' at batch_decode.cu:63: {CHECK}"
    assert "GQA group size 7" in r.message


def test_replayed_where_the_kernel_computes_it_right_it_passes_and_says_so(decode):
    r = replay_here(load_case(CASE), decode("computes"))
    assert r.got is None and r.outcome == "accepted, correct" and not r.reproduced


def test_replayed_where_the_kernel_computes_it_wrongly_it_fails(decode):
    r = replay_here(load_case(CASE), decode("wrong"))
    assert r.got is not None and r.got[0] == FailureKind.SILENT_UNSUPPORTED.value, r


@pytest.mark.cli_text
@pytest.mark.parametrize("outcome, words", [
    (f"rejected: RuntimeError: ... {CHECK}", "rejected as recorded"),
    ("rejected: RuntimeError: out of memory", "rejected (recorded: configuration rejected, " + CHECK + ")"),
    ("accepted, correct", "accepted now"),
])
def test_the_replay_command_reports_an_undeclared_answer_and_exits_0(monkeypatch, outcome, words):
    from click.testing import CliRunner

    from kvfuzz.fuzz.campaign.workers import replay as replay_module
    from kvfuzz.fuzz.cli.replay import replay as replay_command

    result = ReplayResult(CASE, (FailureKind.CONFIG_REJECTED.value, CHECK), None, f"an undeclared configuration "
                          f"(GQA group size 7): {outcome}", None, outcome)
    monkeypatch.setattr(replay_module, "replay", lambda *a, **kw: result)
    r = CliRunner().invoke(replay_command, [str(CASE)])
    assert r.exit_code == 0 and words in " ".join(r.output.split()), r.output


def test_the_example_is_a_decode_of_group_size_7():
    b = group_size_7_example().batch
    assert b.gqa_ratio == 7 and all(q == 1 for q in b.query_lens)
