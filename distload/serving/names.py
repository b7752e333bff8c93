"""A serving engine's param names per engine version, as data: configs/serving/<engine>.toml.

distload's family rules name params by their serving names (`...experts.w13_weight`); an engine release
may move a param (vLLM 0.32: `...experts.routed_experts.w13_weight`) or list one tensor under two names
(Qwen3-MoE's router, also `mlp.experts.gate.weight`). A profile says so per version range, by name
suffix, so a new release is a new table, not code. The engine's speculative-decoding draft of a checkpoint's
multi-token-prediction layers (vLLM's DeepSeekMTP) names those layers its own way: the file's [draft] table
(architectures, and regex renames applied before the suffix renames).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from importlib import metadata, resources

from ..errors import RuleError

PROFILE_KEYS = {"name", "from", "below", "rename", "alias", "sharded_state", "unfilled"}
SHARDED_STATE_KEYS = {"architectures", "aliased", "buffers"}
DRAFT_KEYS = {"architectures", "rename"}
FIRST_LAYER = "{first}"   # in a [draft] rename: the first MTP layer's index (config.json num_hidden_layers)


@dataclass(frozen=True)
class DraftNames:
    """How the engine names the MTP layers when it serves them as the draft model (configs/serving: [draft])."""
    architectures: tuple[str, ...] = ()          # the engine's architectures of the draft (loaded with mtp="only")
    rename: tuple[tuple[str, str], ...] = ()     # (regex on the engine name, distload's name; {first}: see above)
    first_layer: int | None = None               # set by NamingProfile.as_draft: the renames apply

    def distload_name(self, engine_name: str) -> str:
        if self.first_layer is None:
            return engine_name
        for pattern, replacement in self.rename:
            engine_name = re.sub(pattern, replacement.replace(FIRST_LAYER, str(self.first_layer)), engine_name)
        return engine_name


@dataclass(frozen=True)
class ShardedStateNames:
    """What an engine's own sharded format holds beyond the weights (configs/serving: [profile.sharded_state])."""
    architectures: tuple[str, ...] = ()          # whose state_dict names the export is known to match
    aliased: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (architecture, the `alias` suffixes its model holds)
    buffers: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (param suffix, sibling float32 1.0 scalars)


@dataclass(frozen=True)
class NamingProfile:
    """How one engine version names distload's params."""
    name: str
    source: str                                  # the file it came from, for messages
    rename: tuple[tuple[str, str], ...] = ()     # (engine suffix, distload suffix)
    alias: tuple[tuple[str, str], ...] = ()      # (engine suffix, suffix of the engine param it duplicates)
    sharded_state: ShardedStateNames = ShardedStateNames()
    draft: DraftNames = DraftNames()
    unfilled: tuple[str, ...] = ()               # engine param suffixes no checkpoint tensor fills: left as made

    def leaves(self, engine_name: str) -> bool:
        """Is this an engine param the engine's own loader leaves as it made it when the checkpoint has no tensor
        for it (vLLM's kv-cache quantization scales of a quantized model), so a plugin does not fill it either?"""
        return engine_name.endswith(self.unfilled) if self.unfilled else False

    def distload_name(self, engine_name: str) -> str:
        """distload's name for an engine param (itself when no rename applies)."""
        engine_name = self.draft.distload_name(engine_name)
        return _replace_suffix(engine_name, self.rename) or engine_name

    def is_draft(self, architectures) -> bool:
        """Is a model of these architectures the engine's draft of a checkpoint's MTP layers?"""
        return bool(set(architectures or ()) & set(self.draft.architectures))

    def as_draft(self, first_layer: int) -> NamingProfile:
        """This profile naming the draft model, whose MTP layers start at `first_layer`."""
        return replace(self, draft=replace(self.draft, first_layer=first_layer))

    def engine_name(self, distload_name: str) -> str:
        """The engine's name for a distload param (the inverse of distload_name)."""
        return _replace_suffix(distload_name, tuple((b, a) for a, b in self.rename)) or distload_name

    def aliases_of(self, engine_name: str, held: tuple[str, ...]) -> list[str]:
        """The other engine names of the same tensor among the alias suffixes `held` (those an architecture's
        model holds)."""
        return [name for alias, target in self.alias
                if alias in held and (name := _replace_suffix(engine_name, ((target, alias),)))]

    def alias_target(self, engine_name: str, present=None) -> str | None:
        """The engine param this one duplicates (the first candidate in `present` when given: one suffix may
        name different params in different architectures), or None when it is a param of its own."""
        for suffix, replacement in self.alias:
            if engine_name.endswith(suffix):
                target = engine_name[: -len(suffix)] + replacement
                if present is None or target in present:
                    return target
        return None


def _replace_suffix(name: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    for suffix, replacement in pairs:
        if name.endswith(suffix):
            return name[: -len(suffix)] + replacement
    return None


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0): the leading dotted numbers of a version string."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise RuleError(f"engine version {version!r} does not start with a number")
    return tuple(int(part) for part in match.group(0).split("."))


def profile_file(engine: str):
    """The shipped naming file of an engine: configs/serving/<engine>.toml."""
    return resources.files("distload.configs") / "serving" / f"{engine}.toml"


def installed_version(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of an engine's `distributions` installed here, without importing it (None: none)."""
    for dist in distributions:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def profile_versions(engine: str) -> list[str]:
    """The first version of each of the shipped profiles of `engine`, as three numbers ('0.32.0'), oldest first."""
    tables = tomllib.loads(profile_file(engine).read_text()).get("profile", [])
    return [".".join(map(str, (version_tuple(t["from"]) + (0, 0))[:3])) for t in tables if "from" in t]


def profile_for(engine: str, version: str, path=None) -> NamingProfile:
    """The profile of `engine` at `version` from `path` (default: the shipped file); RuleError naming the
    version and the file to extend when no profile's range holds it."""
    path = path if path is not None else profile_file(engine)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RuleError(f"{path}: cannot read {engine}'s naming profiles: {exc}") from None
    wanted = version_tuple(version)
    for table in data.get("profile", []):
        unknown = set(table) - PROFILE_KEYS
        if unknown or not {"name", "from", "below"} <= set(table):
            raise RuleError(f"{path}: each [[profile]] has name, from, below and optionally rename, alias, unfilled; "
                            f"got {sorted(table)}")
        if version_tuple(table["from"]) <= wanted < version_tuple(table["below"]):
            return NamingProfile(name=table["name"], source=str(path),
                                 rename=tuple(table.get("rename", {}).items()),
                                 alias=tuple((suffix, target) for suffix, targets in table.get("alias", {}).items()
                                             for target in ([targets] if isinstance(targets, str) else targets)),
                                 sharded_state=_sharded_state(table.get("sharded_state", {}), path),
                                 unfilled=tuple(table.get("unfilled", ())),
                                 draft=_draft(data.get("draft", {}), path))
    known = ", ".join(f"{t.get('name')} [{t.get('from')}, {t.get('below')})" for t in data.get("profile", []))
    raise RuleError(f"{engine} {version}: distload does not know this version's param names (profiles: {known}); "
                    f"add a [[profile]] for it to {path}")


def _sharded_state(table: dict, path) -> ShardedStateNames:
    unknown = set(table) - SHARDED_STATE_KEYS
    if unknown:
        raise RuleError(f"{path}: [profile.sharded_state] takes {sorted(SHARDED_STATE_KEYS)}; got {sorted(unknown)}")
    return ShardedStateNames(architectures=tuple(table.get("architectures", ())),
                             aliased=tuple((arch, tuple(suffixes)) for arch, suffixes in table.get("aliased", {}).items()),
                             buffers=tuple((k, tuple(v)) for k, v in table.get("buffers", {}).items()))


def _draft(table: dict, path) -> DraftNames:
    unknown = set(table) - DRAFT_KEYS
    if unknown:
        raise RuleError(f"{path}: [draft] takes {sorted(DRAFT_KEYS)}; got {sorted(unknown)}")
    for pattern in table.get("rename", {}):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise RuleError(f"{path}: [draft.rename] {pattern!r} is not a regular expression: {exc}") from None
    return DraftNames(architectures=tuple(table.get("architectures", ())), rename=tuple(table.get("rename", {}).items()))
