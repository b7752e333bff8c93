"""`distload verify`: prove the loaded shards by the forward pass, against Hugging Face transformers.

Byte-equal shards prove only that we cut the way we think we cut; a layout that is *consistently* wrong (kv
head replication, fused qkv order, interleaved parts) shows up as wrong logits. So: load with distload, run
distload.models.forward over the shards this rank holds (it never re-reads the checkpoint), and on rank 0
compare with `AutoModelForCausalLM.from_pretrained` of the same checkpoint (or of `--reference`, the same
weights in an architecture transformers can build) in float32 on the CPU. The verdict is broadcast, so every
rank returns the same exit code. On failure the per-layer hidden states of both sides name the first layer
where they diverge (distload/models/divergence.py).

Error measure: max |ours - ref| / max |ref| over all logits (an elementwise ratio explodes on logits near
zero and says nothing about the output); plus whether the argmax token of every position agrees.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field

import torch

from . import topology
from .checkpoint.s3 import is_object_url
from .models.divergence import first_divergence
from .errors import DistloadError
from .loader import run_load
from .checkpoint.discover import read_config
from .models import check_reference, forward_for
from .rules import rules_for
from .models.pipeline import forward_over_stages
from .options import LoadOptions
from .transfer import broadcast_object
from .transfer.agreement import run_phase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Verdict:
    """The outcome, identical on every rank. compared=False: transformers is not installed."""
    compared: bool
    ok: bool
    max_abs: float | None = None
    max_rel: float | None = None
    argmax_same: bool | None = None
    message: str = ""
    diverging_layer: int | None = None  # on failure: the first layer whose hidden states differ (None: not found)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


@dataclass
class Verification:
    verdict: Verdict
    logits: torch.Tensor = field(repr=False)  # float32 [tokens, vocab_size] (padding removed), on every rank
    tp: int = 1
    ep: int = 1


def parse_input_ids(text: str) -> list[int]:
    """'1,17,42,7' -> [1, 17, 42, 7]."""
    try:
        ids = [int(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise DistloadError(f"--input-ids {text!r}: expected comma-separated token ids, e.g. 1,17,42,7") from None
    if not ids or min(ids) < 0:
        raise DistloadError(f"--input-ids {text!r}: expected one or more non-negative token ids, e.g. 1,17,42,7")
    return ids


def compute_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DistloadError(f"--dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def local_expert_ids(specs: dict) -> list[int] | None:
    """The global expert ids this rank hosts (the forward needs one list for every MoE layer)."""
    hosted = {spec.experts for spec in specs.values() if spec.style == "expert"}
    if not hosted:
        return None
    if len(hosted) > 1:
        raise DistloadError(f"expert params of one rank host different experts {sorted(hosted)}; the reference "
                            "forward needs the same experts in every MoE layer")
    return list(hosted.pop())


def compare(logits: torch.Tensor, ref: torch.Tensor, tolerance: float,
            hidden: tuple[dict, list] | None = None) -> Verdict:
    """max abs / max rel (over max |ref|) error and argmax agreement; NaN never passes. On failure, `hidden`
    (the forward's hidden states, transformers') names the first layer where they diverge."""
    diff = (logits.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    same = bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))
    ok = rel <= tolerance and same  # False for NaN
    layer = None
    if ok:
        message = f"OK: max rel err {rel:.3e} <= tolerance {tolerance:.1e}, argmax tokens agree"
    else:
        why = [f"max rel err {rel:.3e} > tolerance {tolerance:.1e}"] if not rel <= tolerance else []
        if not same:
            ours = logits.argmax(-1)
            where = (ours != ref.argmax(-1)).nonzero().flatten()
            # How much transformers prefers its own token over ours. Logits within tolerance and a gap below the
            # max abs error: a near tie that low-precision compute can flip, not a wrong layout.
            gap = (ref[where].max(-1).values - ref[where, ours[where]]).max().item()
            near_tie = rel <= tolerance and gap <= diff
            why.append(f"argmax differs at positions {where.tolist()} (transformers' logit for its token exceeds "
                       f"its logit for ours by up to {gap:.3e}; max abs err {diff:.3e}"
                       + (": a near tie)" if near_tie else ")"))
        if hidden is not None and hidden[0] and hidden[1]:
            layer, sentence = first_divergence(*hidden, tolerance)
            why.append(sentence)
        message = ("FAIL: " + "; ".join(why) + ": the loaded shards do not compute the checkpoint's model (check the "
                   "rules file: part order of fused params, kv head replication, per-part splits; and the expert "
                   "placement)")
    return Verdict(compared=True, ok=ok, max_abs=diff, max_rel=rel, argmax_same=same, message=message,
                   diverging_layer=layer)


def reference_outputs(path: str, input_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' float32 logits [tokens, vocab] for one sequence, and its hidden states (each [tokens, hidden],
    output_hidden_states' numbering), from the checkpoint on disk (offline)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise DistloadError(f"transformers cannot load {path} ({type(exc).__name__}: {exc}); verify compares against "
                            "a Hugging Face checkpoint directory (config.json + weights) transformers builds offline; "
                            "for an architecture it cannot build, pass --reference DIR: the same weights as one it "
                            "can (e.g. InternLM2 converted to Llama)") from exc
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0].float() for h in (out.hidden_states or ())]


def save_logits(path: str, logits: torch.Tensor, input_ids: list[int], source: str) -> None:
    """One tensor `logits` [tokens, vocab] float32; written under a temporary name, then renamed."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({"logits": logits.detach().to("cpu", torch.float32).contiguous()}, tmp,
              metadata={"input_ids": ",".join(map(str, input_ids)), "source": source})
    os.replace(tmp, path)


def _summary(logits: torch.Tensor) -> str:
    return (f"min {logits.min().item():.4f}, max {logits.max().item():.4f}, mean {logits.mean().item():.4f}, "
            f"argmax {logits.argmax(-1).tolist()}")


def _judge(path: str, reference: str, logits: torch.Tensor, hidden: dict | None, input_ids: list[int],
           tolerance: float, logits_file: str | None, header: str) -> Verdict:
    """Rank 0: save, compare with transformers (when installed), print; the verdict for every rank."""
    print(header, flush=True)
    print(f"  distload logits [{logits.shape[0]}, {logits.shape[1]}]: {_summary(logits)}", flush=True)
    if logits_file:
        save_logits(logits_file, logits, input_ids, path)
        print(f"  saved logits to {logits_file}", flush=True)
    if importlib.util.find_spec("transformers") is None:
        verdict = Verdict(compared=False, ok=True,
                          message="transformers is not installed: comparison skipped (pip install transformers)")
    else:
        ref, ref_hidden = reference_outputs(reference, input_ids)
        if ref.shape != logits.shape:
            raise DistloadError(f"transformers' logits have shape {list(ref.shape)}, distload's {list(logits.shape)}: "
                                "config.json vocab_size does not match the model transformers built")
        print(f"  transformers logits: {_summary(ref)}", flush=True)
        ours = {k: h.cpu() for k, h in hidden.items()} if hidden else None
        verdict = compare(logits.cpu(), ref, tolerance, hidden=(ours, ref_hidden) if ours else None)
        print(f"  max abs err {verdict.max_abs:.3e}, max rel err {verdict.max_rel:.3e} "
              f"(max |distload - transformers| / max |transformers|), argmax same: {verdict.argmax_same}", flush=True)
    print(f"distload verify: {verdict.message}", flush=True)
    return verdict


def verify(path: str, *, input_ids: list[int], dtype: str = "float32", tolerance: float = 2e-2,
           logits_file: str | None = None, reference: str | None = None, options: LoadOptions | None = None,
           **load_options) -> Verification:
    """Load `path`, run the TP forward on every rank, judge on rank 0; the same Verification on every rank.

    reference: the checkpoint transformers runs for the comparison (default `path`): the same model in an
    architecture transformers builds offline, for one it cannot (InternLM2's remote code).
    options (or load_options: keyword arguments as distload.load: tp, ep, readers, config, ...): the load's.
    Collective: every rank of the job calls it.
    """
    options = options.replace(**load_options) if options is not None else LoadOptions.from_kwargs(**load_options)
    torch_dt = compute_dtype(dtype)
    if options.quantize:
        raise DistloadError(f"verify --quantize {options.quantize}: the reference forward computes with the "
                            "checkpoint's weights, not fp8 ones and their scales; verify without --quantize")
    if is_object_url(path) and reference is None:   # before any rank waits for another
        raise DistloadError(f"verify {path}: transformers builds the reference from a local directory; pass "
                            f"--reference DIR, the same checkpoint on disk (distload loads it from {path})")
    # The forward splits each stage over its tp ranks; data-parallel replicas would need subgroups per replica.
    layout = topology.from_environment(options).layout
    if layout.tp * layout.pp != layout.world:
        stages = f" --pp {layout.pp}" if layout.pp > 1 else ""
        raise DistloadError(f"verify --tp {layout.tp}{stages} on {layout.world} ranks: verify runs one "
                            f"replica (world = tp x pp); launch {layout.tp * layout.pp} ranks (torchrun "
                            f"--nproc-per-node {layout.tp * layout.pp}) or pass --tp {layout.world // layout.pp}")
    refuse_without_reference(path, options)
    result = run_load(path, options)
    layout, rank, config = result.plan.layout, result.rank, result.config

    def run_forward():
        vocab = config["vocab_size"]
        if max(input_ids) >= vocab:
            raise DistloadError(f"--input-ids: token id {max(input_ids)} is outside the vocabulary "
                                f"(config.json vocab_size={vocab}); use ids in 0..{vocab - 1}")
        device = next(iter(result.params.values())).device
        run = forward_for(config)
        ids = torch.tensor(input_ids, device=device)
        experts = dict(local_expert_ids=local_expert_ids(result.specs), ep_size=layout.ep, dtype=torch_dt)
        if layout.pp > 1:
            return stage_by_stage(run, result.params, config, ids, rank, layout, experts)
        # The residual stream is whole on every rank after each all-reduce: rank 0's record is the model's.
        hidden = {} if "hidden_states" in inspect.signature(run).parameters else None
        logits = run(result.params, config, ids, tp_rank=layout.tp_rank(rank), tp_size=layout.tp, **experts,
                     **({} if hidden is None else {"hidden_states": hidden}))
        return logits, hidden

    logits, hidden = run_phase("forward", run_forward)

    def judge():
        if rank != 0:
            return None
        against = "" if reference in (None, path) else f", against {reference}"
        stages = f", pp {layout.pp}" if layout.pp > 1 else ""
        header = (f"distload verify: {path}: {len(input_ids)} tokens, vocab {config['vocab_size']}, "
                  f"world {layout.world} (tp {layout.tp}{stages}, ep {layout.ep}), forward in {dtype}{against}")
        return _judge(path, reference or path, logits, hidden, input_ids, tolerance, logits_file, header)

    verdict = broadcast_object(run_phase("compare", judge), src=0)
    return Verification(verdict=verdict, logits=logits, tp=layout.tp, ep=layout.ep)


def refuse_without_reference(path: str, options: LoadOptions) -> None:
    """A family the reference forward does not know is refused before any load (a local config.json: read here;
    elsewhere the load discovers it and forward_for refuses after it)."""
    root = options.hf_config or path
    if os.path.isdir(root):
        config = read_config(root)
        check_reference(config, rules_for(config, options.config).name if config else "?")


def stage_by_stage(run, params: dict, config: dict, ids: torch.Tensor, rank: int, layout, experts: dict):
    """(logits, hidden states) of the forward run stage after stage, each stage over its own layers."""
    if "layers" not in inspect.signature(run).parameters:
        raise DistloadError(f"verify --pp {layout.pp}: the reference forward of model_type "
                            f"{config.get('model_type')!r} runs without pipeline stages; verify it with --pp 1")
    layers = layout.stage_layers(layout.pp_rank(rank), sum(layout.pp_layers))  # the partition the plan used
    return forward_over_stages(run, params, config, ids, rank=rank, tp=layout.tp, pp=layout.pp, layers=layers,
                               **experts)
