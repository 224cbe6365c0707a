"""Findings shared by campaigns on several hosts (docs/campaigns.md, "Several hosts"): each campaign of one
``--db`` (a Redis server, ``redis://host:port/N``, or a shared directory) claims every distinct failure it records
in that database, under the key ``kvfuzz-findings:<target>``; a campaign that records a failure another campaign
(another host, or another ``--out``) already claimed lists it as a known duplicate of that one instead of a new
failure, so the hosts of one search report each bug once.

"The same failure" is kvfuzz's dedup within a campaign: the target and the signature (failure kind, check). Each
claim is one JSON value: ``{"target", "kind", "check", "host", "out", "reproducer"}``. Two campaigns that record
the same failure within the same moment may both claim it (nothing locks the database): both then report it new.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from hypothesis.database import ExampleDatabase

#: The database key of a target's claims (bytes: Hypothesis's databases key by bytes).
LEDGER_PREFIX = b"kvfuzz-findings:"


def this_campaign(out: Path) -> dict:
    """Who claims: this host's name and the campaign's ``--out`` (absolute)."""
    return {"host": socket.gethostname(), "out": str(Path(out).resolve())}


def claims(db: ExampleDatabase, target: str) -> list[dict]:
    """Every claim of ``target``'s failures in ``db`` (unreadable values skipped)."""
    found = []
    for value in db.fetch(LEDGER_PREFIX + target.encode()):
        try:
            claim = json.loads(value)
        except ValueError:
            continue
        if isinstance(claim, dict):
            found.append(claim)
    return found


def claim(db: ExampleDatabase, out: Path, target: str, kind: str, check: str, reproducer: str | None) -> dict | None:
    """Claim failure ``(kind, check)`` of ``target`` for the campaign in ``out``; returns the claim of another
    campaign that recorded it first (then nothing is saved), or None (then this campaign's claim is saved, unless it has
    one). A claim of the same host and ``out`` (an earlier run of this campaign, resumed) is not another's."""
    me = this_campaign(out)
    mine = False
    for c in claims(db, target):
        if (c.get("kind"), c.get("check")) == (kind, check):
            if (c.get("host"), c.get("out")) != (me["host"], me["out"]):
                return c
            mine = True
    if mine:  # claimed by this campaign before (resumed): the first claim stands
        return None
    db.save(LEDGER_PREFIX + target.encode(), json.dumps(
        {"target": target, "kind": kind, "check": check, **me, "reproducer": reproducer}, sort_keys=True).encode())
    return None


def duplicate_note(other: dict) -> str:
    """How a failure another campaign claimed first is listed (its ``known``)."""
    return f"found first by {other.get('host')}:{other.get('out')} ({other.get('reproducer')})"


__all__ = ["LEDGER_PREFIX", "claim", "claims", "duplicate_note", "this_campaign"]
