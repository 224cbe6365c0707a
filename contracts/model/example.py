"""One fuzz example: a batch plus the cache state it is run against."""

from __future__ import annotations

from typing import Any

import attrs

from .batch import Batch
from .poison import Poison


@attrs.frozen
class Example:
    """A batch and the poison that fills every cache slot the contract does not require.

    Everything a kernel call needs follows deterministically from these two values and the target.
    """

    batch: Batch
    poison: Poison = Poison.NAN

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch.to_dict(), "poison": self.poison.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Example":
        return cls(Batch.from_dict(d["batch"]), Poison(d["poison"]))


__all__ = ["Example"]
