"""Saves an engine serves as they are (`--save-sharded OUT --for ENGINE[==VERSION]`): per engine, the layout its
save format needs and the export that writes its files beside the saved ones. Engine-neutral: an engine is a row of
SAVES (its format in a module of its own: vllm_save.py for vLLM's load_format="sharded_state"); the loader and the
option checks (validate.check_save_for: the engines are the naming files of configs/serving/) name no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError
from ..validate import save_for_server


@dataclass(frozen=True)
class SaveFormat:
    """What one engine's save format needs of the job, and who writes it."""
    world_is_tp: str        # non-empty: the format holds one file per tp rank (why, for the refusal)
    module: str             # the module of this folder whose export(save, out, version) writes it


SAVES = {"vllm": SaveFormat(world_is_tp="vLLM's sharded_state reads one file per tp rank", module="vllm_save")}


def check_save_for_layout(save_for: str | None, world: int, tp: int) -> None:
    """The job's layout against the save format of `save_for` (known once planned, before a byte moves)."""
    if save_for is None:
        return
    engine, _ = save_for_server(save_for)
    needs = SAVES[engine].world_is_tp
    if needs and world != tp:
        raise OptionError(f"--for {save_for}: {needs}, but this job has {world} ranks at tp {tp}; run it on {tp} "
                          f"ranks, or save without --for")


def export(save_for: str, out: str) -> None:
    """Write what the engine of `save_for` reads beside the save in `out` (rank 0, once the save is complete)."""
    engine, version = save_for_server(save_for)
    if SAVES[engine].module == "vllm_save":
        from .vllm_save import export

        export(out, out, version)
