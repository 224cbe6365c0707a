"""The ``kvfuzz`` command: one module per subcommand, registered on :func:`main`.

Exit codes: 0 nothing failed (``fuzz --baseline``: nothing new), 1 something failed (a finding, or a replayed
case that still fails), 2 bad usage (unknown target or fault, an unavailable target named explicitly, a bad
option, a bad baseline), 3 the campaign could not run as asked. Subcommand modules
import torch only when they run, so ``kvfuzz --help`` is fast.
"""

from __future__ import annotations

import click

from kvfuzz.fuzz.cli import baseline, bench, check, fuzz, relations, replay, report, targets


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvfuzz")
def main() -> None:
    """Property-based fuzzing of paged KV-cache attention kernels and their callers' contracts."""


main.add_command(targets.targets)
main.add_command(fuzz.fuzz)
main.add_command(replay.replay)
main.add_command(check.check)
main.add_command(report.report)
main.add_command(relations.relations)
main.add_command(bench.bench)
main.add_command(baseline.baseline)

__all__ = ["main"]
