"""Recipe loading: Hydra composes the YAML, the dataclasses in `schema.py` type it.

    load_config(["--config-path", "recipes", "--config-name", "quickstart",
                 "trainer.max_steps=20", "parallel=tp2_ep2_sp"])

1. `--config-path` (relative to the cwd) and `--config-name` (with or without `.yaml`; a
   `sub/dir/name` is folded into the path so its `defaults:` resolve from the repo's groups).
2. Hydra's public compose API (`initialize_config_dir` + `compose`, version_base=None) builds the
   recipe, its `defaults:` list and the overrides. The repo's `configs/` dir is appended to the
   search path (`hydra.searchpath`, as Hydra documents), after the recipe's own dir.
   A dotted override `a.b=v` is passed as `++a.b=v` so keys the recipe does not spell out can be
   set; the schema, not the recipe, decides which keys exist.
3. The composed tree is assigned field by field onto `OmegaConf.structured(TrainConfig)`; every
   unknown key, wrong type and missing required field is collected into one `ConfigError`.
4. `OmegaConf.to_object` returns the `TrainConfig` dataclasses.
"""

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_sft.config.schema import SECTIONS, ConfigError, TrainConfig, field_help, format_errors

# Reusable Hydra groups (parallel/, optimizer/, ...) shipped at the repo root.
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

_YAML_SUFFIXES = (".yaml", ".yml")
_FLAGS = {"--config-path": "config_path", "-cp": "config_path", "--config-name": "config_name", "-cn": "config_name"}
# torch.distributed.launch (legacy) may append this; torchrun uses the LOCAL_RANK env var instead.
_IGNORED_FLAGS = ("--local-rank", "--local_rank")


@dataclasses.dataclass
class _Argv:
    config_dir: Path
    config_name: str
    overrides: list[str]


# ----------------------------------------------------------------------------- public API


def load_config(argv: Sequence[str]) -> TrainConfig:
    """Compose a recipe (`--config-path DIR --config-name NAME key=value ...`) into a TrainConfig.

    Raises ConfigError with a message naming the field, the value and the fix.
    """
    args = _parse_argv(list(argv))
    overrides = _rewrite_overrides(args.overrides, _group_names(args.config_dir))
    composed = _compose(args.config_dir, args.config_name, overrides)
    cli_keys = {o.lstrip("+").split("=", 1)[0] for o in args.overrides}
    return config_from_dict(composed, cli_keys=cli_keys)


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Convenience: `load_recipe("recipes/quickstart.yaml", ["trainer.max_steps=3"])`."""
    return load_config(["--config-name", str(path), *overrides])


def config_from_dict(data: Mapping[str, Any], cli_keys: set[str] | None = None) -> TrainConfig:
    """Type a plain nested dict (sections -> fields) into a TrainConfig, with the loader's checks."""
    errors: list[str] = []
    bad_keys: set[str] = set()  # keys already reported (wrong type), not to be re-reported as missing
    base = OmegaConf.structured(TrainConfig)
    for section, body in data.items():
        if section not in SECTIONS:
            errors.append(_unknown_section_msg(str(section)))
        elif not isinstance(body, Mapping):
            errors.append(
                f"section '{section}' must be a mapping of its fields, got {body!r}; "
                f"valid keys: {', '.join(_field_names(section))}"
            )
        else:
            bad_keys |= _assign_section(base, section, body, errors, cli_keys or set())
    for section, cls in SECTIONS.items():
        if OmegaConf.is_missing(base, section):
            base[section] = OmegaConf.structured(cls)
    errors.extend(_missing_msg(key) for key in _missing_keys(base) if key not in bad_keys)
    if errors:
        raise ConfigError(format_errors(errors))
    try:
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(format_errors([f"could not resolve '{key}': {_first_line(exc)}"])) from None


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict of a TrainConfig (sections -> fields), e.g. for logging."""
    return dataclasses.asdict(cfg)


def save_resolved_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically); `load_config` reads it back unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        "# moe-sft resolved config (all defaults and overrides applied).\n"
        f"# Re-run with: --config-path {path.parent} --config-name {path.stem}\n"
        + OmegaConf.to_yaml(OmegaConf.create(config_to_dict(cfg)))
    )
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- argv


def _parse_argv(argv: list[str]) -> _Argv:
    found: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag in _FLAGS:
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ConfigError(f"{flag} needs a value, e.g. {flag} recipes")
            found[_FLAGS[flag]] = value
        elif flag in _IGNORED_FLAGS:
            i += 0 if eq else 1
        elif arg.startswith("-"):
            raise ConfigError(
                f"unknown option '{arg}'; expected --config-path DIR --config-name NAME "
                "followed by key=value overrides (e.g. trainer.max_steps=20)"
            )
        else:
            overrides.append(arg)
        i += 1
    config_dir, config_name = _normalize_name(found.get("config_path"), found.get("config_name"))
    return _Argv(config_dir, config_name, overrides)


def _normalize_name(config_path: str | None, config_name: str | None) -> tuple[Path, str]:
    config_dir = Path(os.path.abspath(config_path or os.getcwd()))
    if not config_dir.is_dir():
        raise ConfigError(f"--config-path {config_path!r}: directory {config_dir} does not exist")
    if not config_name:
        raise ConfigError(f"missing --config-name; YAML files in {config_dir}: {_yaml_listing(config_dir)}")
    name = config_name
    for suffix in _YAML_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    # A `sub/name` primary config would resolve its `defaults:` relative to group `sub`;
    # fold the directory part into the search dir so `- parallel: single` finds configs/parallel.
    full = config_dir / name
    config_dir, name = full.parent, full.name
    if not config_dir.is_dir():
        raise ConfigError(f"--config-name {config_name!r}: directory {config_dir} does not exist")
    matches = [config_dir / (name + s) for s in _YAML_SUFFIXES if (config_dir / (name + s)).is_file()]
    if not matches:
        raise ConfigError(
            f"config file not found: {config_dir / (name + '.yaml')} (from --config-name "
            f"{config_name!r}); YAML files in {config_dir}: {_yaml_listing(config_dir)}"
        )
    if matches[0].suffix == ".yml":
        raise ConfigError(f"{matches[0]}: Hydra only reads '.yaml' files; rename it to {name}.yaml")
    return config_dir, name


def _yaml_listing(directory: Path) -> str:
    names = sorted(p.name for p in directory.iterdir() if p.suffix in _YAML_SUFFIXES and p.is_file())
    return ", ".join(names) if names else "(none)"


# ----------------------------------------------------------------------------- overrides


def _group_names(config_dir: Path) -> set[str]:
    """Config groups visible to a recipe: sub-directories of its dir and of configs/."""
    names: set[str] = set()
    for root in (config_dir, CONFIGS_DIR):
        if root.is_dir():
            names.update(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    return names


def _rewrite_overrides(overrides: list[str], groups: set[str]) -> list[str]:
    """Make `a.b=v` a force-add (`++a.b=v`); keep group choices and Hydra syntax as written."""
    out: list[str] = []
    errors: list[str] = []
    for ov in overrides:
        key, eq, value = ov.partition("=")
        bare = key.lstrip("+~")
        if not eq and not key.startswith("~"):
            errors.append(f"override {ov!r} is not key=value (e.g. trainer.max_steps=20)")
        elif key != bare or bare.split(".")[0] == "hydra" or "@" in bare or "/" in bare:
            out.append(ov)  # explicit Hydra syntax: +add, ++force, ~delete, group@pkg, hydra.*
        elif "." in bare:
            out.append(f"++{bare}={value}")
        elif bare in groups:
            out.append(ov)  # group choice, e.g. parallel=pp2
        elif bare in SECTIONS:
            out.append(f"++{bare}={value}")
        else:
            errors.append(_unknown_override_msg(bare, groups))
    if errors:
        raise ConfigError(format_errors(errors))
    return out


def _unknown_override_msg(key: str, groups: set[str]) -> str:
    options = sorted(set(SECTIONS) | groups)
    hint = _suggest(key, options)
    return (
        f"unknown override key '{key}' (set on the command line).{hint} "
        f"Use section.field=value (sections: {', '.join(SECTIONS)}) "
        f"or group=option (groups: {', '.join(sorted(groups)) or 'none'})"
    )


# ----------------------------------------------------------------------------- compose


def _compose(config_dir: Path, config_name: str, overrides: list[str]) -> dict[str, Any]:
    # Imported here so that `moe_sft.config` (schema/validate) does not pay for Hydra.
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    search = [f"file://{CONFIGS_DIR}"] if CONFIGS_DIR.is_dir() else []
    hydra_overrides = [f"hydra.searchpath=[{','.join(search)}]"] if search else []
    where = config_dir / f"{config_name}.yaml"
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None, job_name="moe_sft"):
            cfg = compose(config_name=config_name, overrides=hydra_overrides + overrides)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        cause = f" ({_first_line(exc.__cause__)})" if exc.__cause__ is not None else ""
        raise ConfigError(f"could not compose {where} with overrides {overrides}:\n{exc}{cause}") from None
    data = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(data, dict)
    return data


# ----------------------------------------------------------------------------- typing


def _assign_section(
    base: Any, section: str, body: Mapping[str, Any], errors: list[str], cli_keys: set[str]
) -> set[str]:
    """Assign each field (OmegaConf type-checks it); return the keys that failed."""
    bad: set[str] = set()
    if OmegaConf.is_missing(base, section):
        base[section] = OmegaConf.structured(SECTIONS[section])
    node = base[section]
    valid = _field_names(section)
    for key, value in body.items():
        full = f"{section}.{key}"
        origin = " (set on the command line)" if full in cli_keys else ""
        if key not in valid:
            errors.append(_unknown_key_msg(section, str(key), origin))
            continue
        try:
            node[key] = value
        except OmegaConfBaseException:
            bad.add(full)
            expected = _type_name(section, key)
            fix = "write a list, e.g. [a, b]" if expected.startswith("list") else "fix the value"
            errors.append(
                f"wrong type for {full}{origin}: got {value!r} ({type(value).__name__}), "
                f"expected {expected} ({field_help(section, key)}); {fix}"
            )
    return bad


def _missing_keys(base: Any) -> list[str]:
    """Required fields still '???' (checked per field: OmegaConf.missing_keys would resolve interpolations)."""
    return [
        f"{section}.{key}"
        for section in SECTIONS
        for key in _field_names(section)
        if OmegaConf.is_missing(base[section], key)
    ]


def _unknown_key_msg(section: str, key: str, origin: str) -> str:
    valid = _field_names(section)
    hint = _suggest(key, valid, prefix=f"{section}.")
    elsewhere = [s for s in SECTIONS if s != section and key in _field_names(s)]
    if elsewhere:
        hint += f" '{key}' is a key of section '{elsewhere[0]}': use {elsewhere[0]}.{key}."
    return (
        f"unknown key '{section}.{key}'{origin} in section '{section}'.{hint} "
        f"Valid keys of '{section}': {', '.join(valid)}"
    )


def _unknown_section_msg(section: str) -> str:
    hint = _suggest(section, list(SECTIONS))
    return f"unknown section '{section}'.{hint} Valid sections: {', '.join(SECTIONS)}"


def _missing_msg(full_key: str) -> str:
    section, _, key = full_key.partition(".")
    if not key:  # a whole section is missing (cannot happen after filling, kept for safety)
        return f"missing required section '{section}'"
    return (
        f"missing required field '{full_key}' ({_type_name(section, key)}: {field_help(section, key)}); "
        f"set it under '{section}:' in the recipe or pass {full_key}=<value>"
    )


def _suggest(word: str, options: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" Did you mean '{prefix}{close[0]}'?" if close else ""


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _type_name(section: str, key: str) -> str:
    hints = typing.get_type_hints(SECTIONS[section])
    return _describe_type(hints[key])


def _describe_type(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_describe_type(a) for a in inner) + " or null"
    if typing.get_origin(tp) is list:
        return f"list of {_describe_type(args[0])}" if args else "list"
    return getattr(tp, "__name__", str(tp))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
