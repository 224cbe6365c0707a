"""``kvfuzz baseline``: the findings baseline ``kvfuzz fuzz --baseline`` reads (kvfuzz.fuzz.campaign.store.baseline).

``kvfuzz baseline add DIR`` turns a reproducer directory into a ``[[known]]`` entry of the baseline file. Exit 0
when the entry was written, 2 when the reproducer or the baseline cannot be used, or the entry cannot be written
(the message names the file, the field and the fix), 3 when the disk is full (the file is kept whole).
"""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from kvfuzz.fuzz.cli.common import console, nonempty_option, writable_file_option


@click.group()
def baseline() -> None:
    """Manage a findings baseline: failures accepted as known (kvfuzz fuzz --baseline FILE)."""


@baseline.command("add")
@click.argument("directory")
@click.option("--baseline", "baseline_file", default="kvfuzz-baseline.toml", show_default=True,
              type=click.Path(dir_okay=False), callback=writable_file_option,
              help="The baseline file to append to (created if missing).")
@click.option("--id", "entry_id", required=True, callback=nonempty_option,
              help='A unique name for the entry, e.g. "finding-1".')
@click.option("--reason", required=True, callback=nonempty_option, help="Why the finding is accepted.")
@click.option("--reference", required=True, callback=nonempty_option,
              help="Where it is documented: an upstream issue, a findings page entry.")
@click.option("--slots", type=click.Choice(["tail", "unwritten", "freed"]), default="tail", show_default=True,
              help="A non-finite output: where the poison it reads sits. tail: from seq_len to the next multiple "
                   "of --tail-tokens and of the block size; unwritten: any slot the contract leaves unwritten; "
                   "freed: the null block that a batch with freed window blocks points its out-of-window columns at.")
@click.option("--tail-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="--slots tail: the kernel's token group.")
@click.option("--max-ratio", default=None, type=click.FloatRange(min=1.0),
              help="A kernel mismatch: the largest |out - ref| / bound accepted. Default: 10 times the "
                   "reproducer's own.")
@click.option("--heads", type=click.Choice(["any", "equal"]), default="any", show_default=True,
              help="equal: the entry covers batches with num_heads == num_kv_heads only (an MHA-path bug).")
def add(directory, baseline_file, entry_id, reason, reference, slots, tail_tokens, max_ratio, heads) -> None:
    """Append an entry for the reproducer in DIRECTORY (its case.json: target, kind, check, poison, error, invalid
    accesses) to the baseline. Only non-finite output, kernel mismatch and memory safety reproducers can be
    accepted (a memory safety entry takes the source lines and kernels of the reproducer's invalid accesses)."""
    from kvfuzz.fuzz.campaign.store.baseline import BaselineError
    from kvfuzz.fuzz.campaign.store.baseline_add import append_entry, entry_from_case
    from kvfuzz.fuzz.campaign.store.cases import BadReproducer, load_case

    try:
        case = load_case(directory)
        entry = entry_from_case(case, entry_id, reason, reference, slots=slots, tail_tokens=tail_tokens,
                                max_ratio=max_ratio, heads=heads)
        append_entry(baseline_file, entry)
    except (BadReproducer, BaselineError) as e:
        console.print(f"[red]cannot add[/]: {escape(str(e))}")
        sys.exit(2)
    except OSError as e:  # the old file is kept whole (append_entry writes atomically)
        from kvfuzz.fuzz.campaign.store.journal import disk_full

        console.print(f"[red]cannot add[/]: writing {escape(baseline_file)} failed ({escape(e.strerror or str(e))}); "
                      + ("free some space" if disk_full(e) else "name a writable file"))
        sys.exit(3 if disk_full(e) else 2)
    console.print(f"added {escape(entry.id)} to {escape(baseline_file)}:\n{escape(entry.to_toml())}")


__all__ = ["baseline"]
