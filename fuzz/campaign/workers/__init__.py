"""The processes that run a campaign's examples, and how they end: :mod:`.supervisor` (the
:class:`~.supervisor.Supervisor`: workers' lifecycle, scheduling, the pipe protocol, what it does when a worker
ends, state/status snapshots), :mod:`.worker` (the spawned worker process), :mod:`.bookkeeping` (the
supervisor's tasks, slots and per-target state), :mod:`.endings` (how a process running examples ended, and
what finding that makes), :mod:`.mps` (a private CUDA MPS daemon for workers sharing a GPU) and :mod:`.replay`
(a reproducer re-run in a child process, judged by the same endings). Import from the modules; the package
itself exports nothing."""

__all__: list[str] = []
