"""Post-load steps on each rank (DESIGN §2 step 6): what the transfer delivered -> what serving kernels want.

The plan gives each rank a list of steps (plan.types.Step, data); this module runs each by its op's name: the
quantization formats' ops (quant.OPS: requantize fused FP8 params to one scale, --quantize, --dequantize, ...,
each calling distload.kernels, Triton on CUDA, the torch references on CPU), `transpose` (plan/transpose.py)
and the rules' landing steps (plan/landing.py): rotary_halves (rows inside each head from rotary pairs to
halves) and neg_exp (-exp(x)).

Why steps run *during* the transfer: a step runs as soon as every one of its inputs has fully arrived
(the transfer calls `on_bucket_done` after each bucket), and its inputs are allocated on their first
write, not up front. So online quantization holds the high-precision copy of the params in flight —
about one layer, since checkpoints store a layer's tensors together — never the whole model's, and the
peak is counted here (`peak_input_bytes`) rather than guessed.

Reconciliation checks the final params, but the transfer recorded what it wrote into the staging ones;
`finish` carries that record over: a step's outputs count as written once when each of its inputs was
written exactly once, twice when one was written twice, and not at all when one is incomplete.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from . import quant
from .transfer import host_memory
from .dtypes import torch_dtype
from .reconcile import coverage
from .plan.shard import view2d
from .plan.buckets import transfer_order


def _rotary_halves(step, finals, weight):
    """Rows (0, 1), (2, 3), ... of each head of the first `rows` rows -> rows 0, 2, 4, ..., then 1, 3, 5, ..."""
    (rows, head_dim), = step.runs
    m = weight.view(view2d(tuple(weight.shape)))
    rows = rows or m.shape[0]
    heads = m[:rows].reshape(rows // head_dim, head_dim // 2, 2, m.shape[1])
    m[:rows] = heads.transpose(1, 2).reshape(rows, m.shape[1])   # the reshape copies: no overlap
    return (weight,)


OPS = {
    **quant.OPS,   # every format's ops by name (quant/: each format module names its own)
    "transpose": lambda step, finals, staged: (staged.transpose(-2, -1).contiguous(),),  # plan/transpose.py
    "rotary_halves": _rotary_halves,
    "neg_exp": lambda step, finals, x: (torch.exp(x).neg_(),),
}


class Staging(dict):
    """This rank's params by name; a post-load step's inputs are allocated on their first write."""

    def __init__(self, post: "PostProcess"):
        super().__init__()
        self._post = post

    def __missing__(self, name: str) -> torch.Tensor:
        return self._post._allocate(name)


class PostProcess:
    """Runs one rank's post-load steps as their inputs arrive; see the module docstring."""

    def __init__(self, plan, rank: int, device, huge: bool = False):
        self.huge = huge  # staged params in huge-page host memory (options.Tuning.hugepages)
        self.staging, self.final = plan.staging_specs(rank), plan.specs[rank]
        self.steps = plan.post[rank]
        self.device = torch.device(device)
        self.inputs = {n for step in self.steps for n in step.inputs}
        last: dict[str, int] = {}
        order = transfer_order(plan)   # as the transfer posts them: a step runs once its inputs' last bucket is in
        self.position = {bucket.index: at for at, bucket in enumerate(order)}
        for at, bucket in enumerate(order):
            for item in plan.items(bucket, rank):
                last[item.param] = at
        self.ready_at = [max(last.get(n, -1) for n in step.inputs) for step in self.steps]
        self.pending = deque(sorted(range(len(self.steps)), key=lambda i: self.ready_at[i]))
        self.done: set[str] = set()
        self.params: Staging | None = None
        self.into: dict | None = None
        self.live_bytes = self.peak_input_bytes = self.input_bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # the transfer's read-ahead thread may write params too

    # -- params ---------------------------------------------------------------------------------------

    def allocate(self, into: dict | None = None) -> Staging:
        """Every staging param but the steps' inputs, now (the caller's tensor where it is the final one)."""
        params = Staging(self)
        for name, spec in self.staging.items():
            if spec.alias_of or name in self.inputs:
                continue
            if into is not None:
                params[name] = into[name]
            else:
                params[name] = host_memory.empty(spec.local_shape, torch_dtype(spec.dtype), self.device, huge=self.huge)
        for name, spec in self.staging.items():
            if spec.alias_of:
                params[name] = params[spec.alias_of]
        self.params, self.into = params, into
        return params

    def _allocate(self, name: str) -> torch.Tensor:
        with self._lock:
            if dict.__contains__(self.params, name):
                return dict.__getitem__(self.params, name)
            if name not in self.inputs:
                raise KeyError(name)
            if name in self.done:
                raise RuntimeError(f"{name}: bytes arrived after its post-load step ran; the plan and the "
                                   f"transfer disagree (a bug: please report it)")
            spec = self.staging[name]
            t = host_memory.empty(spec.local_shape, torch_dtype(spec.dtype), self.device, huge=self.huge)
            dict.__setitem__(self.params, name, t)
            self.live_bytes += t.nbytes
            self.input_bytes += t.nbytes
            self.peak_input_bytes = max(self.peak_input_bytes, self.live_bytes)
            return t

    # -- running steps --------------------------------------------------------------------------------

    def on_bucket_done(self, bucket) -> None:
        """The transfer finished this rank's share of `bucket`: run every step whose inputs are all in."""
        while self.pending and self.ready_at[self.pending[0]] <= self.position[bucket.index]:
            self._run(self.steps[self.pending.popleft()])

    def _run(self, step) -> None:
        start = time.perf_counter()
        finals = [self.final[n] for n in step.outputs]
        outputs = OPS[step.op](step, finals, *(self.params[n] for n in step.inputs))
        with self._lock:
            for name in step.inputs:  # inputs are released (or become outputs below)
                self.done.add(name)
                self.live_bytes -= dict.pop(self.params, name).nbytes
            for name, spec, t in zip(step.outputs, finals, outputs):
                if tuple(t.shape) != tuple(spec.local_shape):
                    t = t.reshape(spec.local_shape)  # scales: 0-d / [1] / per expert, as the plan says
                if t.dtype != torch_dtype(spec.dtype):
                    raise RuntimeError(f"post-load step {step.op} made {name} {t.dtype}, the plan says {spec.dtype}")
                dict.__setitem__(self.params, name, t)
        self.seconds += time.perf_counter() - start

    def finish(self, written: dict) -> dict:
        """Run what is left; return the transfer's record of written rectangles, carried over to the final
        params (see the module docstring); copy into the caller's tensors where it gave some."""
        while self.pending:
            self._run(self.steps[self.pending.popleft()])
        out = {name: list(rects) for name, rects in written.items() if name not in self.inputs}
        for step in self.steps:
            state = {name: self._state(name, written) for name in step.inputs}
            for name in step.outputs:
                others = [s for n, s in state.items() if n != name]
                if name in state and all(s == "once" for s in others) and \
                        self.staging[name].local_shape == self.final[name].local_shape:
                    out[name] = list(written.get(name, []))  # rewritten in place: the transfer's own record
                    continue
                rows, cols = view2d(self.final[name].local_shape)
                whole = (0, rows, 0, cols)
                states = set(state.values())
                out[name] = [] if "short" in states else [whole, whole] if "twice" in states else [whole]
        if self.into is not None:
            for name, t in list(self.params.items()):
                if self.into[name] is not t:
                    self.into[name].copy_(t)
                    dict.__setitem__(self.params, name, self.into[name])
        return out

    def _state(self, name: str, written: dict) -> str:
        rows, cols = view2d(self.staging[name].local_shape)
        covered, twice = coverage(written.get(name, []), rows, cols)
        return "short" if covered < rows * cols else "twice" if twice else "once"

    def report(self) -> dict:
        """This rank's numbers for the load report."""
        return {"post_steps": len(self.steps), "post_seconds": round(self.seconds, 6),
                "post_input_bytes": self.input_bytes, "post_peak_input_bytes": self.peak_input_bytes}
