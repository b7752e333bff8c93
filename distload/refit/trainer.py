"""A trainer rank's side of a link: describe its holdings each step; send the bytes its routes ask for."""

from __future__ import annotations

import torch

from .. import faults
from .holdings import describe, local_view, named_tensors
from .routes import holdings_digest, message_order


class TrainerSide:
    def __init__(self, rank: int):
        self.rank = rank
        self.messages: dict[int, list] = {}   # serving rank -> its messages from this rank (routes.Move lists)
        # One message buffer kept across steps: a fresh one per step came back from the heap at a new address
        # (glibc raises its mmap threshold after the first free), so two were resident at once.
        self.wire = torch.empty(0, dtype=torch.uint8)

    def describe(self, tensors):
        tensors = named_tensors(tensors)
        held = describe(tensors)
        return tensors, held, holdings_digest(self.rank, held)

    def release(self) -> None:
        """Free the message buffer (the link is closed)."""
        self.wire = torch.empty(0, dtype=torch.uint8)

    def send(self, group, tensors: dict, servings: int, report: dict) -> None:
        views: dict[str, torch.Tensor] = {}
        order = sorted((message_order(self.rank, s, k, servings), s, msg)
                       for s, msgs in self.messages.items() for k, msg in enumerate(msgs))
        biggest = max((sum(m.nbytes for m in msg) for _, _, msg in order), default=0)
        if self.wire.numel() < biggest:
            self.release()   # the old one freed before the new one is made
            self.wire = torch.empty(biggest, dtype=torch.uint8)
        wire = self.wire
        sent = 0
        for _, s, msg in order:
            at = 0
            for m in msg:
                if m.source not in views:
                    views[m.source] = local_view(tensors[m.source])
                region = views[m.source][m.rows[0]:m.rows[1], m.cols[0]:m.cols[1]]
                # gloo needs contiguous bytes (and has no float8): every region goes as raw uint8
                _pack(region, wire[at:at + m.nbytes])
                at += m.nbytes
            faults.hit("refit-send")
            try:
                group.send(wire[:at], group.serving_rank(s))
            except Exception as exc:
                raise RuntimeError(f"sending to serving rank {s}: {exc}") from exc
            sent += at
        report.update(bytes_sent=sent, staging_bytes=biggest)


def _pack(region: torch.Tensor, into: torch.Tensor) -> None:
    """The region's bytes into `into` (uint8), copied straight from its strides: no contiguous temporary (one per
    message grew the trainer's heap past its staging). A region at an offset its dtype cannot view: the plain way."""
    if into.storage_offset() % region.element_size() == 0:
        into.view(region.dtype).view(region.shape).copy_(region)
    else:
        into.copy_(region.contiguous().view(-1).view(torch.uint8))
