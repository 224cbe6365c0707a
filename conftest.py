"""Project-wide pytest setup: Hypothesis profiles and the fixtures every room's tests use (the helpers
themselves live in tests/support).

Profiles (select with ``pytest --hypothesis-profile NAME``): ``dev`` (default; derandomized, so ``make test``
is reproducible), ``ci`` (derandomized, no example database; used automatically when CI is set), ``fuzz``
(random, many examples, for long local runs and HypoFuzz). Their max_examples is the
budget of the contract properties in tests/fuzz/harness/test_properties.py (real kernels: keep dev/ci small); tests that
need another budget set it explicitly.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, max_examples=10, derandomize=True)
settings.register_profile("ci", deadline=None, max_examples=10, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

#: The quick run (``make test``: ``pytest -m quick``, about 5 minutes on 2 cores): these modules and tests (node-id
#: prefixes) get the ``quick`` marker. Every room of tests/ has some, and the harness's property runs on every real
#: target here (tests/test_test_suite.py checks both, and that each entry still names a test). CI runs the rest
#: (``-m "not quick"``) after ``make test``: the full suite, each test once. Add an entry only for a test of a few
#: seconds that the room has no quicker stand-in for.
QUICK = (
    # contracts: the model of one call, the reference, the checks against ground truth (no kernel)
    "tests/contracts/test_batch.py", "tests/contracts/test_counter_rng.py", "tests/contracts/test_invariants.py",
    "tests/contracts/test_materialize.py", "tests/contracts/test_reference.py",
    # strategies: kernel configurations and their rotation (not the shrink across them: 4-80 s)
    "tests/strategies/test_configs.py::test_a_pinned_example_replays_unchanged_in_the_free_strategy",
    "tests/strategies/test_configs.py::test_one_round_of_configurations_covers_every_declared_value",
    "tests/strategies/test_configs.py::test_bad_pins_are_rejected",
    # targets: the families' declarations on real kernels, a short campaign on each real target
    "tests/fuzz/targets/test_declarations.py", "tests/fuzz/targets/test_flashinfer.py",
    "tests/fuzz/targets/test_targets.py", "tests/fuzz/targets/test_vllm_triton.py",
    # harness: the contract property on every real target (vLLM Triton interpreted, vLLM's CPU op, SGLang, flex)
    "tests/fuzz/harness/test_coverage.py", "tests/fuzz/harness/test_properties.py",
    "tests/fuzz/harness/test_user_traceback.py",
    # guard: each check fires on a real kernel entry and is quiet on a near miss; the pytest plugin end to end
    "tests/fuzz/guard/test_guard.py::test_check_fires_on_the_real_kernel_entry_before_the_kernel_runs",
    "tests/fuzz/guard/test_guard.py::test_check_is_quiet_on_a_near_miss_and_the_kernel_runs",
    "tests/fuzz/guard/test_guard.py::test_decode_invariant_names_sequence_position_block_slot_and_fix",
    "tests/fuzz/guard/test_guard.py::test_seeds_scenario_fails_under_the_plugin_and_its_fix_passes",
    # campaign: two supervised workers share one budget; a corpus read without writing it; a torn earlier reproducer
    # in --out does not stop a campaign started again there
    "tests/fuzz/campaign/test_supervisor.py::test_the_budget_is_global_and_the_counts_add_up",
    "tests/fuzz/campaign/test_database.py::test_check_reads_a_corpus_without_writing_it",
    "tests/fuzz/campaign/test_found_before.py::test_a_corrupt_or_unreadable_earlier_case_is_named_in_a_warning_and_the"
    "_start_goes_on",
    # cli: bad usage exits 2 naming the problem; a clean run exits 0; kvfuzz targets
    "tests/fuzz/cli/test_cli.py::test_bad_usage_exits_2_with_the_problem_named",
    "tests/fuzz/cli/test_cli.py::test_clean_run_exits_0",
    "tests/fuzz/cli/test_cli.py::test_targets_lists_both_with_availability",
    # bench: the mutant zoo's registry, the upstream table
    "tests/fuzz/bench/test_mutants.py::test_registry", "tests/fuzz/bench/test_upstream_table.py",
    # the whole package: layering, docs against code, the families, the suite's own rules
    "tests/test_docs.py", "tests/test_docs_drift.py", "tests/test_families.py", "tests/test_layers.py",
    "tests/test_style.py", "tests/test_test_suite.py",
)


def is_quick(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/x/test_y.py::test_z[param]``, from the repository root) is one of
    :data:`QUICK`: a listed module, or a listed test with any parameters."""
    return any(nodeid == q or nodeid.startswith((q + "::", q + "[")) for q in QUICK)


def pytest_collection_modifyitems(config, items):
    for item in items:  # node ids are relative to the repository root (pyproject.toml), wherever pytest starts
        if is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def make_batch():
    """Build a Batch with a contiguous block table from per-sequence (query_len, ctx_len) pairs."""
    from support import batch_of

    def build(lens, *, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, spare=1, dtype="float32",
              seed=0, reverse=False):
        return batch_of(lens, block_size=block_size, spare=spare, reverse=reverse, pad_columns=1,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, seed=seed)

    return build


@pytest.fixture(scope="module")
def one_torch_thread():
    """vLLM's CPU op runs an OpenMP region per call: ~8 ms per call with 2 threads on a busy 2-core machine,
    ~0.05 ms with 1. Modules that call it many times use this fixture."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
