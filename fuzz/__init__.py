"""kvfuzz.fuzz: everything that runs kernels, in rooms that import only the rooms below them:

    cli       the ``kvfuzz`` command, one module per subcommand
    bench     kvfuzz's own benchmarks: the mutant zoo, detection against vLLM's test grids, throughput
    campaign  long runs: the engine, worker supervision, the example database, journals, reproducers, the gate
    harness   one example from cache to verdict: the attention and writer properties, caller faults,
              metamorphic relations, coverage
    guard     the runtime guard: the table of kernel signatures, interception, the pytest plugin
    targets   the kernel families, one home each: adapters from a batch to a real kernel call and the kernels'
              call signatures; the registry that finds them

docs/architecture.md follows one example through them.
"""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
