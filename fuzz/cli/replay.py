"""``kvfuzz replay``: re-run a reproducer directory, isolated, and say whether the failure still happens."""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from kvfuzz.fuzz.cli.common import console


@click.command()
@click.argument("directory")
@click.option("--target", "target_spec", default=None,
              help="The target to replay with: a registered name, path/to/file.py:CLASS or module:CLASS. Needed "
                   "for a case written by an adapter loaded from a file or module (kvfuzz does not import code "
                   "you did not name).")
@click.option("--trust-target", is_flag=True,
              help="Import the adapter named by the case's own target_spec (only for reproducers you trust).")
@click.option("--timeout", default=None, type=click.FloatRange(min=1),
              help="Seconds the kernel call may run before the replay reports a hang. Default: for a case "
                   "recorded as a hang, the campaign's --example-timeout (case.json details.timeout_s); else "
                   "300.")
def replay(directory: str, target_spec: str | None, trust_target: bool, timeout: float | None) -> None:
    """Re-run a reproducer directory in a child process. Exit 1 while it still fails (a crash or hang included),
    0 once it passes (for a configuration outside the target's declaration: rejected with an error, or computed
    right), 2 when the directory or its target cannot be used (the message says which file and field), 3 when
    the target cannot run on this machine (e.g. a CUDA-only kernel on a CPU machine: nothing was replayed)."""
    if target_spec is not None and trust_target:
        raise click.UsageError("--target names the adapter to replay with and --trust-target takes the case's own: "
                               "give one of them")
    from kvfuzz.contracts.checks.oracles import check_label
    from kvfuzz.fuzz.campaign.store.cases import BadReproducer
    from kvfuzz.fuzz.campaign.workers.replay import TargetUnavailable
    from kvfuzz.fuzz.campaign.workers.replay import replay as replay_case

    try:
        r = replay_case(directory, target_spec=target_spec, trust_target=trust_target, timeout=timeout)
    except BadReproducer as e:
        console.print(f"[red]bad reproducer[/]: {escape(str(e))}")
        sys.exit(2)
    except TargetUnavailable as e:
        console.print(f"[yellow]cannot replay here[/]: {escape(str(e))}")
        sys.exit(3)
    except ValueError as e:  # an untrusted or unloadable target: --target's when given, else the case's own
        if target_spec is not None:
            raise click.BadParameter(str(e), param_hint="--target") from None
        raise click.UsageError(str(e)) from None
    if r.inputs_match is False:
        console.print("[yellow]warning[/]: the seed's inputs differ from tensors.safetensors (written by a kvfuzz "
                      "that drew data differently): replayed on the stored ground truth")
    if r.got is None and r.outcome is not None:  # an undeclared configuration: an error is the expected answer
        if r.outcome.startswith("rejected"):
            how = "as recorded" if r.reproduced else f"(recorded: {r.expected[0]}, {r.expected[1]})"
            console.print(f"[green]rejected {escape(how)}[/]: {escape(r.message)}")
        else:
            console.print(f"[yellow]accepted now[/], computed right: {escape(r.message)}; the target's declaration "
                          "could be widened")
        sys.exit(0)
    if r.got is None:
        console.print(f"[green]passes now[/]: recorded {r.expected[0]} ({check_label(r.expected[1])}) no longer "
                      "reproduces")
        sys.exit(0)
    same = ("reproduced" if r.reproduced
            else f"fails differently (recorded {r.expected[0]} / {check_label(r.expected[1])})")
    console.print(f"[red]{same}[/]: {r.got[0]} ({escape(check_label(r.got[1]))})\n{escape(r.message)}")
    sys.exit(1)


__all__ = ["replay"]
