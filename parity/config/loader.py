"""Load the one run config from its sources, print it, and hand it to child processes.

Precedence, lowest first (each layer names keys as `section.field`):
  1. the field defaults (parity/config/*.py, one definition each);
  2. TOML files: `--config run.toml` (repeat it to layer files: a later file wins), or else the path
     in `PARITY_CONFIG` (how `parity run` hands the effective config to its children);
  3. environment variables `PARITY_<SECTION>_<FIELD>` (`PARITY_TRAINER_LR=1e-4`), how compose and
     Kubernetes configure a container. Only a variable that names a key is config: others
     (`PARITY_TRAINER_GPU`, `PARITY_RUN_NAME`: deployment wiring) are left alone, and
     `--print-config` lists them, with a suggestion where one looks like a misspelt key;
  4. flags: `--section.field value` (`--trainer.lr 1e-4`, `--rollout.prefix-caching`); a bare
     `--field` resolves as parity/config/cli.py says (the command's shorthands, then its own
     section, then the one section that has the key; several sections: an error).
An unknown section or key, in a file or a flag, is a `ConfigError` naming it and where it came from.
Secret fields (auth tokens) are taken from the environment only: a flag or a config file that sets
one is refused. They are never printed or written, nor is a password inside a URL (a Redis URL with
credentials is masked); children get those through their environment.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError

from parity.config.base import ConfigError, is_secret
from parity.config.cli import check_flag_allowed, resolve_flag
from parity.config.schema import SECTIONS, ParityConfig
from parity.url_secrets import redact_url, url_password

# URLs that may carry a password: refused on the command line when they do (they would show in `ps`)
URL_KEYS = frozenset({("run", "redis_url"), ("observability", "otlp_endpoint")})

CONFIG_FILE_ENV = "PARITY_CONFIG"
NOT_CONFIG_ENV = frozenset({CONFIG_FILE_ENV, "PARITY_HOME", "PARITY_DEVICE", "PARITY_RUN_MARKER"})
ENV_PREFIX = "PARITY_"


class HelpRequested(Exception):
    """`--help` (full=False) or `--help-all` (full=True) was given."""

    def __init__(self, full: bool) -> None:
        super().__init__("--help-all" if full else "--help")
        self.full = full


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config, where each non-default value came from, and PARITY_* variables ignored."""

    config: ParityConfig
    sources: dict[str, str] = field(default_factory=dict)
    print_config: bool = False
    ignored_env: dict[str, str] = field(default_factory=dict)  # variable -> suggestion ("" if none)

    def to_toml(self) -> str:
        text = to_toml(self.config, self.sources)
        if not self.ignored_env:
            return text
        notes = [
            f"#   {key}" + (f" (did you mean {hint}?)" if hint else "")
            for key, hint in sorted(self.ignored_env.items())
        ]
        header, _, body = text.partition("\n\n")
        ignored = "# PARITY_* variables that name no config key, ignored:\n" + "\n".join(notes)
        return f"{header}\n{ignored}\n\n{body}"

    def sources_key(self, env_key: str) -> tuple[str, str]:
        """(section, field) that the environment variable `env_key` set."""
        (key,) = [k for k, origin in self.sources.items() if origin == f"env {env_key}"]
        section, _, name = key.partition(".")
        return section, name


def env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section}_{name}".upper()


def _fields(section: str) -> dict:
    return SECTIONS[section].model_fields


def _unknown_key(section: str, name: str, origin: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(_fields(section)), n=1)
    hint = f"; did you mean {section}.{close[0]}?" if close else ""
    return ConfigError(f"{section}.{name}: unknown key (from {origin}){hint}")


def _unknown_section(section: str, origin: str) -> ConfigError:
    return ConfigError(f"{section}: unknown section (from {origin}); sections: {', '.join(SECTIONS)}")


def _secret_refused(section: str, name: str, where: str, why: str) -> ConfigError:
    return ConfigError(
        f"{section}.{name}: a secret is never taken from {where} ({why}); "
        f"set {env_name(section, name)} in the environment"
    )


def _put(values: dict, sources: dict, section: str, name: str, value: object, origin: str) -> None:
    if section not in SECTIONS:
        raise _unknown_section(section, origin)
    if name not in _fields(section):
        raise _unknown_key(section, name, origin)
    values.setdefault(section, {})[name] = value
    sources[f"{section}.{name}"] = origin


def _from_file(path: str, values: dict, sources: dict) -> None:
    try:
        document = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text (TOML files are UTF-8)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML ({exc})") from None
    for section, body in document.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: expected a [{section}] table in {path}, got a value")
        for name, value in body.items():
            if section in SECTIONS and name in _fields(section) and is_secret(SECTIONS[section], name):
                raise _secret_refused(section, name, f"a config file ({path})", "files get copied and shared")
            if section in SECTIONS and name in _fields(section):
                _check_toml_kind(section, name, value, path)
            _put(values, sources, section, name, value, path)


def _check_toml_kind(section: str, name: str, value: object, path: str) -> None:
    """TOML has real booleans: one for a number (`steps = true`, read as 1) or a number for a switch
    (`skip_preflight = 1`) is a mistake in the file, not a value to convert."""
    is_switch = _fields(section)[name].annotation is bool
    if isinstance(value, bool) != is_switch:
        wanted = "true or false" if is_switch else "a value of its own type, not true/false"
        raise ConfigError(f"{section}.{name}: expected {wanted} (got {json.dumps(value)}; from {path})")


def _env_key(key: str) -> tuple[str, str] | None:
    """(section, field) when the variable `key` names a config key, else None."""
    if not key.startswith(ENV_PREFIX) or key in NOT_CONFIG_ENV:
        return None
    section, _, name = key[len(ENV_PREFIX) :].lower().partition("_")
    if section in SECTIONS and name in _fields(section):
        return section, name
    return None


def _from_env(environ: Mapping[str, str], values: dict, sources: dict) -> None:
    for key in sorted(config_env_keys(environ)):
        if key != CONFIG_FILE_ENV:
            section, name = _env_key(key)  # type: ignore[misc]
            _put(values, sources, section, name, environ[key], f"env {key}")


def config_env_keys(environ: Mapping[str, str]) -> list[str]:
    """The environment variables that `load` reads as config (PARITY_CONFIG included)."""
    keys = [CONFIG_FILE_ENV] if CONFIG_FILE_ENV in environ else []
    return keys + [key for key in environ if _env_key(key) is not None]


def ignored_env_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """PARITY_<SECTION>_* variables that name no key (deployment wiring, or a typo): variable ->
    the config variable it most resembles ("" when none is close)."""
    ignored = {}
    for key in environ:
        if key in NOT_CONFIG_ENV or _env_key(key) is not None or not key.startswith(ENV_PREFIX):
            continue
        section, _, name = key[len(ENV_PREFIX) :].lower().partition("_")
        if section in SECTIONS and name:
            close = difflib.get_close_matches(name, list(_fields(section)), n=1, cutoff=0.8)
            ignored[key] = env_name(section, close[0]) if close else ""
        elif close := difflib.get_close_matches(key, _all_env_names(), n=1, cutoff=0.85):
            ignored[key] = close[0]  # a misspelt section (PARITY_TRAINR_LR) or none (PARITY_STEPS)
    return ignored


def _all_env_names() -> list[str]:
    return [env_name(section, name) for section in SECTIONS for name in _fields(section)]


def _from_flags(
    argv: Sequence[str], home: str | None, values: dict, sources: dict, as_command: bool = False
) -> tuple[list[str], bool]:
    """Apply flags; return (the config files named by --config, in order; whether --print-config)."""
    config_files: list[str] = []
    print_config = False
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token in ("-h", "--help", "--help-all", "--help_all"):
            raise HelpRequested(full=token.startswith("--help-") or token == "--help_all")
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: options look like --section.field VALUE")
        flag, has_value, value = token[2:].partition("=")
        if flag.replace("-", "_") == "print_config":
            print_config = True
            continue
        if flag == "config":
            if not has_value:
                if i >= len(tokens) or tokens[i].startswith("--"):
                    raise ConfigError("--config: expected a TOML file path")
                value, i = tokens[i], i + 1
            if not value.strip():
                raise ConfigError("--config: expected a TOML file path, got an empty one")
            config_files.append(value)
            continue
        section, name = resolve_flag(flag, home)
        if section not in SECTIONS:
            raise _unknown_section(section, f"--{flag}")
        if name not in _fields(section):
            raise _unknown_key(section, name, f"--{flag}")
        if is_secret(SECTIONS[section], name):
            raise _secret_refused(
                section, name, "the command line", "it would show in `ps` and shell history"
            )
        if as_command:
            check_flag_allowed(section, name, home)
        if not has_value:
            is_bool = _fields(section)[name].annotation is bool
            if is_bool and (i >= len(tokens) or tokens[i].startswith("--")):
                value = "true"
            elif i >= len(tokens):
                raise ConfigError(f"--{flag}: expected a value")
            else:
                value, i = tokens[i], i + 1
        if (section, name) == ("run", "resume") and not str(value).strip():
            # `--resume "$DIR"` with DIR unset would otherwise start a new run from scratch
            raise ConfigError("run.resume: empty; name the run directory to resume")
        if (section, name) in URL_KEYS and url_password(str(value)):
            raise _secret_refused(
                section, name, "the command line", "the URL holds a password, which would show in `ps`"
            )
        _put(values, sources, section, name, value, f"--{flag}")
    return config_files, print_config


def _error(exc: ValidationError, sources: Mapping[str, str]) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        message = str(err["msg"]).removeprefix("Value error, ")
        field_error = len(loc) == 2
        if err["type"] == "extra_forbidden":
            message = "unknown section" if len(loc) == 1 else "unknown key"
        elif len(loc) <= 1 and ":" in message:  # a model validator: "field: why" or "section.field: why"
            name, _, message = message.partition(":")
            loc = [*loc, name.strip()] if "." not in name else [name.strip()]
            message = message.strip()
        key = ".".join(loc) or "<config>"
        where = f"; from {sources[key]}" if key in sources else ""
        got = f" (got {err['input']!r}{where})" if field_error and "input" in err else ""
        lines.append(f"{key}: {message}{got}")
    return ConfigError("; ".join(lines))


def load(
    argv: Sequence[str] = (),
    *,
    home: str | None = None,
    environ: Mapping[str, str] | None = None,
    as_command: bool = False,
) -> LoadedConfig:
    """Build the run config from defaults, TOML files, the environment and flags (see module doc).

    `as_command`: `argv` is a command's own command line (parity/config/entry.py), so flags for the
    keys that command sets itself are refused (parity/config/cli.py)."""
    environ = os.environ if environ is None else environ
    flag_values: dict = {}
    flag_sources: dict[str, str] = {}
    config_files, print_config = _from_flags(argv, home, flag_values, flag_sources, as_command)
    values: dict = {}
    sources: dict[str, str] = {}
    if not config_files and environ.get(CONFIG_FILE_ENV):
        config_files = [environ[CONFIG_FILE_ENV]]
    for path in config_files:  # in order: a later file's value wins
        _from_file(path, values, sources)
    _from_env(environ, values, sources)
    for section, body in flag_values.items():
        values.setdefault(section, {}).update(body)
    sources.update(flag_sources)
    try:
        config = ParityConfig.model_validate(values)
    except ValidationError as exc:
        raise _error(exc, sources) from None
    return LoadedConfig(config, sources, print_config, ignored_env_keys(environ))


# --- writing ----------------------------------------------------------------------------------


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(redact_url(str(value)))


def to_toml(config: ParityConfig, sources: Mapping[str, str] | None = None) -> str:
    """The config as TOML, secrets left out; with `sources`, each line says where its value came from."""
    lines = [
        "# Parity run config. Defaults are defined once, in parity/config/ (see each line's comment);",
        "# load with --config FILE, override with PARITY_<SECTION>_<FIELD> or --section.field VALUE.",
    ]
    for section, model in config:
        assert isinstance(model, BaseModel)
        lines += ["", f"[{section}]"]
        for name in type(model).model_fields:
            key = f"{section}.{name}"
            if is_secret(type(model), name):
                if sources is not None:
                    state = "set" if getattr(model, name) else "unset"
                    lines.append(f"# {name}: secret, {state}; environment only ({env_name(section, name)})")
                continue
            line = f"{name} = {_toml_value(getattr(model, name))}"
            if sources is not None:
                line += f"  # {sources.get(key, 'default')}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def write_config(config: ParityConfig, path: Path) -> Path:
    """Write the effective config (no secrets) where a child finds it through PARITY_CONFIG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_toml(config))
    tmp.replace(path)
    return path


def env_for(section: str, **values: object) -> dict[str, str]:
    """Environment entries that set `section.<name>` for one child (its instance values, secrets)."""
    out = {}
    for name, value in values.items():
        if name not in _fields(section):
            raise _unknown_key(section, name, "env_for")
        out[env_name(section, name)] = value if isinstance(value, str) else _toml_value(value).strip('"')
    return out
