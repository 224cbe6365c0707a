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
