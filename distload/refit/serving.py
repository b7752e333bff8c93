"""A serving rank's side of a link: its plan from the trainers' holdings, made once; each step's bytes.

The plan is the one a load of a checkpoint with the update's tensors gets (one_source.update_plan: same
rules, same layout, quantization as loaded), so fused params (qkv, gate_up), vocab padding, EP experts and
PP stages come out as a load makes them; routes.py intersects its deliveries with the trainers' boxes.
Staged mode receives into zeroed buffers and swaps them in only after every rank of both jobs reported
success; in-place mode writes the live params (less memory; partly updated on a failure).
"""

from __future__ import annotations

import torch

from .. import faults
from ..dtypes import torch_dtype
from ..errors import PlanError
from ..plan import DEFAULT_STAGING_BYTES
from ..plan.shard import view2d
from ..postprocess import PostProcess
from ..transfer.buffers import TransferStats
from ..transfer.pieces import zero_padding
from .one_source import mismatches, update_plan
from .routes import message_order, serving_routes


class ServingSide:
    def __init__(self, params, current, layout, config, family, rank: int, *, quantize, dequantize, staged: bool,
                 staging_mib, partial: bool):
        self.params, self.current, self.layout, self.config, self.family = params, current, layout, config, family
        self.rank, self.quantize, self.dequantize, self.staged, self.partial = rank, quantize, dequantize, staged, partial
        self.cap = (staging_mib << 20) if staging_mib else DEFAULT_STAGING_BYTES
        self.plan = self.routes = None

    def plan_for(self, holdings: list[dict], expected: int):
        """The plan and this rank's routes for these holdings; PlanError (nothing moved) if they do not fit."""
        meta: dict = {}
        for t, held in enumerate(holdings):
            for name, h in held.items():
                seen = meta.setdefault(name, (h.dtype, tuple(h.shape), t))
                if seen[:2] != (h.dtype, tuple(h.shape)):
                    raise PlanError(f"refit refused before any byte moved: trainer ranks {seen[2]} and {t} hold "
                                    f"{name} as {seen[0]}{list(seen[1])} and {h.dtype}{list(h.shape)}")
        from dataclasses import replace

        layout = replace(self.layout, readers=(0,), owner_reads=False)   # nobody reads: the trainers send
        plan = update_plan({n: v[:2] for n, v in meta.items()}, self.config, self.family, layout, self.cap,
                            self.quantize, self.dequantize, self.partial)
        problems = mismatches(plan, self.rank, self.current, self.params)
        if problems:
            raise PlanError(f"refit refused before any byte moved ({len(problems)} param(s)): " + "; ".join(problems[:8]))
        routes = serving_routes(plan, self.rank, holdings, self.cap, expected)
        self.plan, self.routes = plan, routes
        return routes

    def own_shard_bytes(self) -> int:
        return sum(s.nbytes for s in self.plan.specs[self.rank].values() if not s.alias_of)

    def receive(self, group, trainers: int, servings: int, report: dict):
        """Every message of this step into the buffers; returns what `commit` swaps in (or None: in place)."""
        specs = self.plan.specs[self.rank]
        live = {n: self.params[n] for n in specs}
        device = next(iter(live.values())).device if live else torch.device("cpu")
        buffers = None
        if self.staged:
            buffers = {n: torch.zeros(s.local_shape, dtype=torch_dtype(s.dtype), device=device)
                       for n, s in specs.items() if not s.alias_of}
            buffers.update({n: buffers[s.alias_of] for n, s in specs.items() if s.alias_of})
        target = buffers if buffers is not None else live
        post = PostProcess(self.plan, self.rank, device) if any(self.plan.post) else None
        into = post.allocate(target) if post is not None else target
        order = sorted((message_order(t, self.rank, k, servings), t, msg)
                       for t, msgs in self.routes.messages.items() for k, msg in enumerate(msgs))
        biggest = max((sum(m.nbytes for m in msg) for _, _, msg in order), default=0)
        wire = torch.empty(biggest, dtype=torch.uint8)
        received = 0
        for _, t, msg in order:
            size = sum(m.nbytes for m in msg)
            faults.hit("refit-receive")
            try:
                group.recv(wire[:size], t)
            except Exception as exc:
                raise RuntimeError(f"receiving from trainer rank {t}: {exc}") from exc
            received += size
            _scatter(wire, msg, into)
        # Padding rows (vocab beyond the real one) as a load leaves them: an engine's receive buffers hold garbage.
        zero_padding(into, self.plan.staging_specs(self.rank), TransferStats())
        if post is not None:
            post.finish({})
        report.update(bytes_received=received, own_shard_bytes=self.own_shard_bytes(),
                      staging_bytes=biggest + sum(b.nbytes for n, b in (buffers or {}).items() if not specs[n].alias_of))
        return None if buffers is None else (buffers, live, specs)


def _scatter(wire: torch.Tensor, msg, into) -> None:
    at = 0
    for m in msg:
        rows, cols = m.rows[1] - m.rows[0], m.cols[1] - m.cols[0]
        n = m.nbytes
        chunk = wire[at:at + n]
        dtype = torch_dtype(m.dtype)
        if at % chunk.new_empty(0, dtype=dtype).element_size():
            chunk = chunk.clone()   # view(dtype) needs an aligned offset
        dst = into[m.param]
        dst.view(view2d(tuple(dst.shape)))[m.dst_row:m.dst_row + rows, m.dst_col:m.dst_col + cols].copy_(
            chunk.view(dtype).view(rows, cols))
        at += n


def commit(staged) -> None:
    """Swap the staged buffers in: copied into the live tensors, which the engine keeps references to."""
    if staged is None:
        return
    buffers, live, specs = staged
    for name, buf in buffers.items():
        if not specs[name].alias_of:
            live[name].copy_(buf)
