"""Long runs of one or more targets, in rooms by what they hold (each importing only those below it; the
import-linter contract "campaign's rooms" in pyproject.toml):

    gate, relation_runs   what the commands run: the pre-merge gate (``kvfuzz check``), metamorphic relations
                          as Hypothesis properties (``kvfuzz relations``)
    workers/              the processes that run examples and how they end: the supervisor and its workers,
                          their bookkeeping, the endings, CUDA MPS, a reproducer's isolated replay
    engine                one target's Hypothesis campaign, a chunk at a time (:class:`~.engine.Campaign`)
    runner                one example from Hypothesis's body to its verdict (:class:`~.runner.ExampleRunner`)
    chunks, reduce,       chunk arithmetic (seeds, pinned configurations, sizes, a chunk's tier), the structural
    observability,        shrink, Hypothesis observability output, the failure signatures a campaign process
    failure_ledger        keeps (:class:`~.failure_ledger.FailureLedger`)
    config, records       what a campaign is configured with, and what it counts and reports
    stages                where a campaign's time goes (the stage table)
    store/                what a campaign keeps on disk and reads back: the example database, the journal
                          (state, locks, atomic writes, a full disk), reproducers and cases, the findings
                          baseline, the report

Names load lazily from their modules. ``replay`` and ``TargetUnavailable`` are what every reproducer's
test_case.py imports from here: keep them, so stored cases do not depend on where the room keeps them."""

from kvfuzz.contracts.lazy import lazy_exports

_EXPORTS = {
    "CampaignConfig": "config", "CrashPolicy": "config", "WorkerPool": "config",
    "Campaign": "engine", "fuzz_target": "engine",
    "Supervisor": "workers.supervisor", "SupervisorResult": "workers.bookkeeping",
    "ReplayResult": "workers.replay", "TargetUnavailable": "workers.replay", "replay": "workers.replay",
    "BadReproducer": "store.cases", "load_case": "store.cases", "write_reproducer": "store.reproducers",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
