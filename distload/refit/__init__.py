"""Refits (live weight updates): `distload.refit(...)` from one source rank inside the serving job
(one_source.py), and `distload.join_refit(...)`: a trainer job and a serving job joined once, each byte moving
once from the trainer rank that holds it to the serving rank that keeps it (link.py; README "Refit from a
trainer job").

    one_source.py  the single-source refit of today (`distload.refit(result, tensors, src=0)`)
    holdings.py    what a trainer rank holds: DTensors, Pieces, full tensors -> boxes of checkpoint tensors
    routes.py      pure: the serving plan's deliveries intersected with the trainers' boxes, cut into messages
    group.py       the joined transfer group: a TCPStore on serving rank 0, a gloo / NCCL group over it
    link.py        join_refit and the Link: send / receive steps, planned once and replayed
    example.py     `python -m distload.refit.example`: the two-terminal trainer + serving example
"""

from __future__ import annotations

import sys
import types

from .one_source import MemoryReader, Refit, RefitFailed, refit
from .holdings import Piece


def join_refit(address: str, role: str, **options):
    """Join the transfer group at `address` (tcp://HOST:PORT) as a "trainer" or "serving" rank (link.join: its
    arguments); returns the Link whose send() / receive() run one refit step."""
    from .link import join

    return join(address, role, **options)


class _CallableModule(types.ModuleType):
    """`distload.refit(result, tensors, src=0)` keeps working though distload.refit is now a package."""

    def __call__(self, *args, **kwargs):
        return refit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = ["refit", "join_refit", "Refit", "RefitFailed", "Piece", "MemoryReader"]
