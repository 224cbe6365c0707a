"""kvfuzz.strategies.seeding: a seeded run draws the same examples whatever the process imported before it.

Hypothesis mixes the literals of every local module in ``sys.modules`` into its draws, so without
:func:`seed_only` a campaign's seed drew other examples after other imports (an order-dependent test,
tests/fuzz/bench/test_bugs.py's window-V-mask campaign). A planted module of constants changes a plain seeded
run's draws and leaves one under :func:`seed_only` as it was (a campaign chunk's: tests/fuzz/campaign/
test_seeded_draws.py)."""

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from support.planted_constants import plant

from kvfuzz.strategies.seeding import seed_only

#: A range no module of kvfuzz's has a literal in, wide enough that a uniform draw never hits the constants the
#: planted module holds there.
LOW, HIGH = 7_000_000_001, 7_999_999_999
PLANTED = range(7_123_456_000, 7_123_456_100)


def draws(strategy, n: int = 300) -> list:
    out = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @seed(0)
    @given(strategy)
    def run(x):
        out.append(x)

    run()
    return out


def test_a_planted_local_module_changes_plain_draws_and_not_seed_only_ones(tmp_path, monkeypatch):
    ints = st.integers(LOW, HIGH)
    plain, seeded = draws(ints), None
    with seed_only():
        seeded = draws(ints)
    plant(tmp_path, monkeypatch, PLANTED)
    after = draws(ints)
    assert not set(plain) & set(PLANTED) and not set(seeded) & set(PLANTED)
    assert set(after) & set(PLANTED)  # what seed_only takes out
    with seed_only():
        assert draws(ints) == seeded
    assert draws(ints) == after  # and gives back on exit: the plain run draws the plant again

