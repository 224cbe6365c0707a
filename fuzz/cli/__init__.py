"""The ``kvfuzz`` command: one module per subcommand, registered on :func:`main`.

Exit codes: 0 nothing failed (``fuzz --baseline``: nothing new), 1 something failed (a finding, or a replayed
case that still fails), 2 bad usage (unknown target or fault, an unavailable target named explicitly, a bad
option, a bad baseline), 3 the campaign could not run as asked, or the command was interrupted (Ctrl-C, SIGTERM,
SIGHUP: :class:`KvfuzzGroup`); docs/cli.md has each subcommand's table. Subcommand modules import torch only when
they run, so ``kvfuzz --help`` is fast.
"""

from __future__ import annotations

import os
import sys

import click
from rich.markup import escape

from kvfuzz.fuzz.cli import baseline, bench, check, fuzz, relations, replay, report, targets
from kvfuzz.fuzz.cli.common import (
    EXIT_INTERRUPTED,
    console,
    errors,
    interruption,
    set_verbosity,
    signals_interrupt,
    verbosity,
)
from kvfuzz.fuzz.cli.project import blame_config, project_defaults


class KvfuzzGroup(click.Group):
    """The ``kvfuzz`` group: every subcommand runs with SIGTERM and SIGHUP raised as :class:`Interrupted`
    (:func:`~kvfuzz.fuzz.cli.common.signals_interrupt`), and an interruption that reaches the top (Ctrl-C or a
    signal outside a campaign, which stops its workers itself and reports) ends the command with exit status 3 and
    one line, never click's "Aborted!" with status 1; so does a stdout whose reader went away (``| head``). A bad
    value that came from the project config
    (:mod:`~kvfuzz.fuzz.cli.project`) is reported with the file and the key it came from."""

    def invoke(self, ctx: click.Context):
        with signals_interrupt():
            try:
                return super().invoke(ctx)
            except click.UsageError as e:
                blame_config(e, ctx.meta.get(CONFIG))
                raise
            except KeyboardInterrupt as e:
                console.print(f"[yellow]interrupted ({escape(interruption(e))})[/]: stopped before it finished (exit "
                              f"{EXIT_INTERRUPTED})", highlight=False)
                ctx.exit(EXIT_INTERRUPTED)
            except BrokenPipeError:  # stdout's reader went away (`| head`): stopped, as SIGPIPE ends a Unix tool,
                devnull = os.open(os.devnull, os.O_WRONLY)  # but with 3, not 1 (which says "a failure")
                os.dup2(devnull, sys.stdout.fileno())
                ctx.exit(EXIT_INTERRUPTED)


#: Where the group keeps the project config (ctx.meta) for its subcommands' errors.
CONFIG = "kvfuzz.project_config"


@click.group(cls=KvfuzzGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "-V", "--version", package_name="kvfuzz", message="kvfuzz %(version)s")
@click.option("-v", "--verbose", count=True, help="Say more (repeatable): -v prints coverage in full.")
@click.option("-q", "--quiet", count=True,
              help="Say less (repeatable): -q no progress, start-up or coverage lines; -qq no summary table either "
                   "(problems, failures, the verdict and the next steps stay).")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: int) -> None:
    """Property-based fuzzing of paged KV-cache attention kernels and their callers' contracts.

    Project defaults come from [tool.kvfuzz] in the nearest pyproject.toml above the working directory (options
    by name: target, duration, workers, baseline, out, ...; [tool.kvfuzz.fuzz] for one command); the command line
    wins. Exit codes: 0 nothing failed, 1 a failure, 2 bad usage or input, 3 could not run as asked or interrupted
    (docs/cli.md has each command's table)."""
    set_verbosity(verbose - quiet)
    config = project_defaults(ctx.command)
    if config is None:
        return
    ctx.meta[CONFIG] = config
    ctx.default_map = config.default_map
    keys = config.keys(ctx.invoked_subcommand)
    if keys and verbosity() >= 0:  # as pytest's "configfile:" line; on stderr, so that --json output stays JSON
        errors.print(escape(f"config: {config.path} [tool.kvfuzz] ({', '.join(keys)})"), highlight=False)


main.add_command(targets.targets)
main.add_command(fuzz.fuzz)
main.add_command(replay.replay)
main.add_command(check.check)
main.add_command(report.report)
main.add_command(relations.relations)
main.add_command(bench.bench)
main.add_command(baseline.baseline)

__all__ = ["CONFIG", "KvfuzzGroup", "main"]
