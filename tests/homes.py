"""Item names whose rendezvous home is a given worker (scheduler/rendezvous.py): a test that needs an item to land
on a particular encoder (or a conversation on a particular decoder) picks it by name."""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.rendezvous import Ring


def homed_on(names: Sequence[str], name: str, count: int = 1, prefix: str = "img") -> list[str]:
    """`count` names (`prefix` and a number) whose home among `names` is `name`."""
    ring = Ring(names)
    found = [h for h in (f"{prefix}{i}" for i in range(100_000)) if ring.home(h) == name][:count]
    assert len(found) == count, f"no {count} keys homed on {name}"
    return found


def one_each(names: Sequence[str], prefix: str = "img") -> list[str]:
    """One name homed on each of `names`, in their order."""
    return [homed_on(names, n, 1, prefix)[0] for n in names]
