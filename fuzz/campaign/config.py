"""What a campaign is configured with: :class:`CampaignConfig` (one target's budgets, strategy and database,
the same in every worker), its picklable form for a worker (:func:`config_to_dict`, :func:`config_from_dict`),
and the supervisor's own settings (:class:`WorkerPool`: how many workers and what each gets;
:class:`CrashPolicy`: when an example hangs and when a target gets no more work), with their defaults
(:func:`gpu_count`, :func:`usable_cpus`, :func:`default_workers`)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
from hypothesis.database import ExampleDatabase

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.store.baseline import Baseline
from kvfuzz.fuzz.campaign.store.database import open_database, read_only_view
from kvfuzz.fuzz.harness.faults import CallerFault, get_fault
from kvfuzz.strategies.limits import Limits


@attrs.define
class CampaignConfig:
    """Budgets are per target: at most ``max_examples`` examples and ``duration`` seconds (None: no limit).
    ``poisons``: what may fill the slots the contract leaves unwritten (strictness: NaN and inf catch any read
    of them that reaches the output, stale finite values catch reads that change the answer)."""

    out: Path
    max_examples: int = 30
    duration: float | None = None
    seed: int = 0
    fault: CallerFault | None = None
    limits: Limits = Limits()
    poisons: tuple[Poison, ...] = tuple(Poison)
    #: Examples per chunk (the unit of work a worker gets, and the examples one kernel configuration gets
    #: when pinned); None: :data:`~kvfuzz.fuzz.campaign.chunks.CHUNK_EXAMPLES` (free) or
    #: :data:`~kvfuzz.fuzz.campaign.chunks.PINNED_CHUNK_EXAMPLES` (pinned).
    chunk_examples: int | None = None
    database: ExampleDatabase | None = None
    #: Stop exploring after the first distinct failure no baseline entry accepts is shrunk (benchmarks of
    #: time-to-first-failure; a known failure, ``baseline``, does not stop it).
    stop_at_first_failure: bool = False
    #: Hypothesis database: None for ``out/hypothesis-db``, a directory path, or ``redis://host:port/db``.
    db_spec: str | None = None
    #: The pre-merge gate: its database is in memory (plus a read-only view of ``db_spec`` when given), and each
    #: target draws only its ``gate_poisons`` and ``gate_value_ranges`` (a documented kernel limitation the gate
    #: does not re-report).
    gate: bool = False
    #: Run calls whose arguments could make a kernel read out of bounds (isolated worker processes only).
    run_unsafe: bool = False
    #: The database was checked when the campaign started (a worker's config, :func:`config_from_dict`): a Redis
    #: server that stopped answering since then is tolerated (kvfuzz.fuzz.campaign.store.database.Tolerant)
    #: instead of ending the worker.
    db_checked: bool = False
    #: Draw configurations the target does not declare (kvfuzz.fuzz.harness.properties.check_undeclared).
    undeclared: bool = False
    #: Place every batch's blocks past 2**31 elements of a multi-GiB cache (big_cache_examples).
    big_cache: bool = False
    #: Size tiers the chunks rotate through (kvfuzz.strategies.tiers: "small", "long", "wide", "big-cache"; a chunk
    #: draws from one, :func:`~kvfuzz.strategies.tiers.tier_of_chunk`), each kept to those the target declares
    #: (``Target.size_tiers``); "auto": every declared tier for a target on CUDA, "small" on CPU. None: "small"
    #: (the default: the mix is not yet measured on a GPU). ``big_cache`` stands for ("big-cache",).
    tiers: tuple[str, ...] | None = None
    #: Steer each chunk's tier and the bin its draws aim at by what the campaign has not covered, its near misses
    #: and its failures (kvfuzz.fuzz.campaign.steering); False: the fixed split of chunks between tiers
    #: (:func:`~kvfuzz.strategies.tiers.tier_of_chunk`), every draw free. Never in the gate.
    steer: bool = True
    #: Each chunk stays inside one kernel configuration (compile-aware generation; kvfuzz.fuzz.campaign.engine).
    #: False: every example draws its own (each one a new compile on a GPU). None: pinned for targets that
    #: run on CUDA (compiled kernels), free on CPU (nothing to amortize, and a free draw varies the
    #: configuration at every example).
    pin_configs: bool | None = None
    #: Pinned targets: before the campaign proper, run :data:`~kvfuzz.fuzz.campaign.chunks.WARMUP_EXAMPLES`
    #: examples in each of the first ``warmup`` configurations it visits, spread over the workers, so their
    #: kernels compile in parallel into the shared Triton cache (chunk ``-1 - i`` warms configuration ``i``).
    warmup: int = 0
    #: Seconds the structural shrink (kvfuzz.fuzz.campaign.reduce) may spend on each new distinct failure after
    #: Hypothesis's shrinker (0: off). Not with ``undeclared`` or ``big_cache``.
    structural_shrink: float = 60.0
    #: Share (0..1) of examples re-run under compute-sanitizer memcheck in a child process with exact-size
    #: allocations (``kvfuzz fuzz --sanitize``; kvfuzz.fuzz.harness.sanitizer): an invalid access is a "memory
    #: safety" failure. CUDA targets only; 0: off.
    sanitize: float = 0.0
    #: Share (0..1) of each worker's time spent on sanitized runs, whichever examples come when it is due
    #: (``kvfuzz fuzz --sanitize auto``, the default on CUDA: kvfuzz.fuzz.harness.sanitizer.AUTO_TIME_SHARE); a
    #: bound on the oracle's cost whatever one run costs. 0: off. Adds to ``sanitize``'s examples.
    sanitize_time_share: float = 0.0
    #: Accepted findings (``kvfuzz fuzz --baseline``, kvfuzz.fuzz.campaign.store.baseline): a failure matching one is
    #: counted and listed as known, never shrunk; anything else stays new. None: every failure is new.
    baseline: Baseline | None = None

    def db(self) -> ExampleDatabase:
        """The example database (opened once). Raises DatabaseError when it cannot be used."""
        if self.database is None:
            self.database = (read_only_view(self.db_spec) if self.gate
                             else open_database(self.db_spec, self.out, ping=not self.db_checked))
        return self.database


def config_to_dict(config: CampaignConfig) -> dict:
    """The picklable values of a CampaignConfig (the fault by name; no open database)."""
    d = {f.name: getattr(config, f.name) for f in attrs.fields(type(config)) if f.name != "database"}
    d["fault"] = config.fault.name if config.fault else None
    d["poisons"] = [p.value for p in config.poisons]
    d["limits"] = attrs.asdict(config.limits)
    d["out"] = str(config.out)
    return d


def config_from_dict(d: dict) -> CampaignConfig:
    """The CampaignConfig a worker runs (:func:`config_to_dict`'s values), allowed to run unsafe calls."""
    d = dict(d)
    d["fault"] = get_fault(d["fault"]) if d["fault"] else None
    d["poisons"] = tuple(Poison(p) for p in d["poisons"])
    d["limits"] = Limits(**d["limits"])
    d["out"] = Path(d["out"])
    if d.get("tiers") is not None:
        d["tiers"] = tuple(d["tiers"])
    d["run_unsafe"] = True  # a worker is isolated: calls that may read out of bounds run (and may crash it)
    d["db_checked"] = True  # the supervisor checked the database at start: a Redis outage since then is tolerated
    return CampaignConfig(**d)


@attrs.frozen
class WorkerPool:
    """The supervisor's workers: how many (``workers``), torch CPU threads each (``threads``), GPUs to spread
    them over with CUDA_VISIBLE_DEVICES (``gpus``; 0: none), and whether each writes Hypothesis observations to
    OUT/observed/ (``observe``)."""

    workers: int = 1
    threads: int = 1
    gpus: int = 0
    observe: bool = False


@attrs.frozen
class CrashPolicy:
    """When the supervisor calls an example hung (``example_timeout`` seconds in flight) and when a target gets
    no more work (``max_crashes`` crashes and hangs)."""

    example_timeout: float = 300.0
    max_crashes: int = 10


def gpu_count() -> int:
    """CUDA devices visible here (0 without torch's CUDA). Imports torch: only when a campaign starts."""
    try:
        import torch  # here, not at the top: `kvfuzz --help` and the CLI's option parsing stay free of torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


#: Workers per GPU at most by default: Triton compiles on the CPU, one worker at a time per process, while the
#: GPU runs the small fuzz batches of several workers with room to spare.
MAX_WORKERS_PER_GPU = 8
#: Under CUDA MPS (kvfuzz.fuzz.campaign.workers.mps) the workers' kernels run concurrently, so more of them help:
#: per GPU its share of the CPU cores less two (the supervisor, Triton's compiles), at most this many. The rate follows
#: the CPU cores, not the GPUs (the harness is Python; a GPU runs these small batches in microseconds). Measured on
#: an H100 with 16 cores: 14 workers under MPS 296 examples/s against 8 without 161/s and 16 without 187/s; on
#: one H200 of a 32-core host, warm: 14 workers 943/s, 28 workers 1,353/s (two H200s with 14 each: 1,127/s;
#: benchmarks/results/gpu-multi-h200x2.log).
MAX_WORKERS_PER_GPU_MPS = 28
#: Workers at most by default on a machine without CUDA: each holds its own torch and kernel libraries and
#: keeps the memory it freed (0.4-0.7 GiB resident per vllm.cpu_attention worker).
MAX_CPU_WORKERS = 8


#: Workers per usable CPU core at most, whatever ``--workers`` asks: each worker is a process with its own torch,
#: Python harness and (on CUDA) context; past a few per core they only take turns, and hundreds never got their
#: imports done (``--workers 500`` on 2 cores: 0 examples in 120 s).
MAX_WORKERS_PER_CORE = 4
#: Workers per GPU at most, whatever ``--workers`` asks: twice the MPS default's ceiling.
MAX_WORKERS_PER_GPU_CAP = 2 * MAX_WORKERS_PER_GPU_MPS


def cap_workers(requested: int, budget: int | None, cpus: int, gpus: int = 0) -> tuple[int, list[str]]:
    """``requested`` workers capped where more cannot help: at most ``budget`` (the campaign's examples in all,
    ``--max-examples`` times the targets; None: no example budget), :data:`MAX_WORKERS_PER_CORE` per CPU core
    (``cpus``) and, on CUDA, :data:`MAX_WORKERS_PER_GPU_CAP` per GPU (``gpus``). Returns the count (at least 1)
    and, for each cap that applied, why (a sentence for the console)."""
    n, why = requested, []
    if budget is not None and n > budget:
        n = max(1, budget)
        why.append(f"the campaign has {budget} example(s) in all (--max-examples times the targets)")
    if n > MAX_WORKERS_PER_CORE * cpus:
        n = MAX_WORKERS_PER_CORE * cpus
        why.append(f"{cpus} CPU core(s) run at most {MAX_WORKERS_PER_CORE} workers each usefully")
    if gpus and n > MAX_WORKERS_PER_GPU_CAP * gpus:
        n = MAX_WORKERS_PER_GPU_CAP * gpus
        why.append(f"{gpus} GPU(s) take at most {MAX_WORKERS_PER_GPU_CAP} workers each")
    return max(1, n), why


def usable_cpus() -> int:
    """CPU cores this process may run on: the size of its affinity mask (``os.sched_getaffinity``; a container
    or ``taskset`` may allow fewer than the machine has), or ``os.cpu_count()`` where there is none; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_workers(gpus: int, cpus: int | None = None, mps: bool = False) -> int:
    """Workers when --workers is not given: on CUDA, per GPU half the CPU cores it has (``cpus``, default
    :func:`usable_cpus`: a ``taskset`` or container's affinity mask, not the machine's cores; at most
    :data:`MAX_WORKERS_PER_GPU`, at least 1), or under MPS (``mps``) its share of
    the cores less two for the host (at most :data:`MAX_WORKERS_PER_GPU_MPS`; 14 on a 16-core host with one
    GPU, 28 on a 32-core host with one, 30 with two: the two cores were taken per GPU, 28); on CPU, one per usable core
    (``cpus``, default :func:`usable_cpus`), at most :data:`MAX_CPU_WORKERS`: a worker runs one torch thread
    (``--threads``) and its examples are mostly Python, so each core runs a worker (vllm.cpu_attention on 2 cores: 140
    examples/s with 1 worker, 290 with 2)."""
    if not gpus:
        return max(1, min(MAX_CPU_WORKERS, cpus or usable_cpus()))
    cpus = cpus or usable_cpus()
    if mps:  # the two cores of the supervisor and Triton's compiles are the host's, not each GPU's
        return gpus * max(1, min(MAX_WORKERS_PER_GPU_MPS, (cpus - 2) // gpus))
    return gpus * max(1, min(MAX_WORKERS_PER_GPU, cpus // gpus // 2))


__all__ = ["MAX_CPU_WORKERS", "MAX_WORKERS_PER_CORE", "MAX_WORKERS_PER_GPU", "MAX_WORKERS_PER_GPU_CAP",
           "MAX_WORKERS_PER_GPU_MPS", "CampaignConfig", "CrashPolicy", "WorkerPool", "cap_workers", "config_from_dict",
           "config_to_dict", "default_workers", "gpu_count", "usable_cpus"]
