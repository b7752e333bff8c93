"""Saves an engine serves as they are (`--save-sharded OUT --for ENGINE[==VERSION]`): per engine, the layout its
save format needs and the export that writes its files beside the saved ones. Engine-neutral: an engine is a row of
SAVES (its format in a module of its own: vllm_save.py for vLLM's load_format="sharded_state"); the loader and the
option checks (validate.check_save_for: the engines are the naming files of configs/serving/) name no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DistloadError, OptionError, RuleError
from ..validate import save_for_server
from . import vllm_save
from .names import installed_version, profile_for, profile_versions


@dataclass(frozen=True)
class SaveFormat:
    """What one engine's save format needs of the job, and who writes it."""
    world_is_tp: str        # non-empty: the format holds one file per tp rank (why, for the refusal)
    module: str             # the module of this folder whose export(save, out, version) writes it
    serves: str             # how the engine serves a save OUT of tp ranks: the line after the save's
    distributions: tuple[str, ...]   # the engine's installable names, whose version the installed one has


SAVES = {"vllm": SaveFormat(world_is_tp="vLLM's sharded_state reads one file per tp rank", module="vllm_save",
                            serves="vLLM {version} serves it as it is: LLM({out!r}, tensor_parallel_size={tp}, "
                                   "load_format='sharded_state')",
                            distributions=vllm_save.DISTRIBUTIONS)}


def serves_line(save_for: str, out: str, tp: int) -> str:
    engine, version = save_for_server(save_for)
    return SAVES[engine].serves.format(version=version or "", out=out, tp=tp)


def resolve_save_for(save_for: str | None) -> str | None:
    """--for ENGINE[==VERSION] as ENGINE==VERSION: the version named, else the installed engine's; refused by
    name, before anything is read, when neither is there or no naming profile of the engine holds the version."""
    if save_for is None:
        return None
    engine, version = save_for_server(save_for)
    if version is None:
        version = installed_version(SAVES[engine].distributions)
        if version is None:
            example = profile_versions(engine)[-1]
            raise OptionError(f"--for {save_for}: {engine} is not installed here ({', '.join(SAVES[engine].distributions)}), "
                              f"so which {engine} will serve the save is unknown; name it: --for {engine}==VERSION "
                              f"(e.g. --for {engine}=={example})")
    try:
        profile_for(engine, version)
    except RuleError as exc:
        raise OptionError(f"--for {engine}=={version}: {exc}") from None
    return f"{engine}=={version}"


def check_save_for_model(save_for: str | None, hf_config: dict) -> None:
    """The model (config.json) has the engine's save names at the version (resolve_save_for's), before a read."""
    if save_for is None:
        return
    engine, version = save_for_server(save_for)
    if SAVES[engine].module == "vllm_save":
        try:
            vllm_save.check_model(hf_config, version)
        except DistloadError as exc:   # the option that asked for the engine's names, named
            raise OptionError(f"--for {save_for}: {exc}") from None


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
    """Write what the engine of `save_for` (resolve_save_for's) reads beside the save in `out` (rank 0, once the
    save is complete)."""
    engine, version = save_for_server(save_for)
    if SAVES[engine].module == "vllm_save":
        vllm_save.export(out, out, version)
