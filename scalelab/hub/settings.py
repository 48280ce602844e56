"""The course settings file: read (YAML or TOML), merged over the defaults, checked against the schema.

Every setting has a default in `hub_config/course_defaults.yaml`; a course file (`hub_config/course.yaml`, or
the file given to `scalelab hub --config`) overrides what it names. Relative paths are resolved against the
directory of the file that sets them, so a course file can live anywhere. A mistake is reported with the
setting's dotted path, the value found, what is expected and how to fix it.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Mapping

import yaml

from ..errors import ScalelabError
from ..paths import hub_config_dir
from .addresses import check_trusted_proxies

#: Environment variables `scalelab hub` uses to hand the settings to `jupyterhub_config.py`.
ENV_SETTINGS = "SCALELAB_HUB_SETTINGS"
ENV_OVERRIDES = "SCALELAB_HUB_OVERRIDES"

#: Settings holding a path that is resolved against the directory of the file setting it ("" and "auto" stay).
PATH_KEYS = (("hub", "state_dir"), ("hub", "config_d"), ("labs", "source"), ("slurm", "conf"),
             ("servers", "python_bin"), ("auth", "roster"), ("dashboard", "grades"), ("capstone", "inject_file"),
             ("capstone", "pseudonym_key_file"))


class SettingsError(ScalelabError, ValueError):
    """The course settings are wrong; the message names each bad setting and how to fix it."""


def default_settings_path() -> Path:
    """The course file used when none is given: `hub_config/course.yaml`."""
    return hub_config_dir() / "course.yaml"


def student_home(cfg: Mapping, name: str) -> Path | None:
    """A student's home as the hub makes it: their Unix account's (servers.run_as student-accounts; None before
    the account exists) or servers.home with {state_dir} and {username} filled in."""
    if cfg["servers"]["run_as"] == "student-accounts":
        import pwd
        try:
            return Path(pwd.getpwnam(name).pw_dir)
        except KeyError:
            return None
    return Path(cfg["servers"]["home"].replace("{state_dir}", cfg["hub"]["state_dir"]).format(username=name))


def read_settings_file(path: str | os.PathLike) -> dict:
    """One settings file as a dict (YAML for .yaml/.yml, TOML for .toml), relative paths made absolute."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"course settings file {str(path)!r} not found; pass an existing file with "
                            f"--config, or copy {default_settings_path()} and edit it")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise SettingsError(f"{path}: unknown settings format {path.suffix!r}; name the file *.yaml or *.toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: the top level must be a mapping of sections (mode, hub, slurm, ...), "
                            f"found {type(data).__name__}")
    return resolve_paths(data, path.parent)


def resolve_paths(data: dict, base: Path) -> dict:
    """A copy of `data` whose path settings (PATH_KEYS) are absolute, relative ones taken from `base`."""
    data = copy.deepcopy(data)
    for section, key in PATH_KEYS:
        sect = data.get(section)
        if isinstance(sect, dict) and isinstance(sect.get(key), str) and sect[key] not in ("", "auto"):
            value = os.path.expanduser(sect[key])
            sect[key] = os.path.normpath(value if os.path.isabs(value) else base / value)
    return data


def deep_merge(base: Mapping, over: Mapping) -> dict:
    """`over` merged into a copy of `base`: mappings merge key by key, everything else (lists too) replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_schema() -> dict:
    """The JSON schema of the settings (hub_config/course_settings.schema.json)."""
    return json.loads((hub_config_dir() / "course_settings.schema.json").read_text(encoding="utf-8"))


def load_settings(path: str | os.PathLike | None = None, overrides: Mapping | None = None) -> dict:
    """Defaults, then the course file (default hub_config/course.yaml), then `overrides`; validated, with
    servers.run_as 'auto' resolved for this hub's account (`posture.resolve_run_as`)."""
    cfg = read_settings_file(hub_config_dir() / "course_defaults.yaml")
    if path is not None or default_settings_path().is_file():
        course_file = Path(path if path is not None else default_settings_path())
        own = read_settings_file(course_file)
        cfg = deep_merge(cfg, own)
    if overrides:
        cfg = deep_merge(cfg, resolve_paths(dict(overrides), Path.cwd()))
    where = str(path) if path is not None else str(default_settings_path())
    validate_settings(cfg, where=where)
    if path is not None or default_settings_path().is_file():
        _refuse_readable_passwords(course_file, own)
    if cfg["auth"]["roster"]:  # the roster's names may sign in too
        names = list(read_roster(cfg["auth"]["roster"]))
        cfg["auth"]["allowed_users"] = list(dict.fromkeys([*cfg["auth"]["allowed_users"], *names]))
    from .posture import resolve_run_as
    return resolve_run_as(cfg)


def _refuse_readable_passwords(path: Path, own: Mapping) -> None:
    """A course file that sets a password must not be readable by other users: students could read the admin's
    password from it in a terminal (the checkout, hub_config/ included, stays readable for their servers)."""
    auth = own.get("auth") if isinstance(own.get("auth"), Mapping) else {}
    held = [f"auth.{k}" for k in ("password", "admin_password") if auth.get(k)]
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if held and mode & 0o004:
        raise SettingsError(f"{path} sets {' and '.join(held)} and other users can read it (mode {mode & 0o777:o}): "
                            f"chmod 600 {path}, or leave the password empty (generated into hub.state_dir, mode 600)")


ROSTER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")  # the hub's login names (config.USERNAME_PATTERN)


def read_roster(path: str | os.PathLike) -> dict[str, str | None]:
    """{name: own password or None} from a roster CSV ("name,password" per line; a header line "name,..." and
    blank lines are skipped). SettingsError naming the file and line for a bad name, a short password or a
    name listed twice."""
    import csv
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SettingsError(f"auth.roster: cannot read {path}: {e.strerror}; give a CSV of name,password lines")
    roster: dict[str, str | None] = {}
    for number, row in enumerate(csv.reader(text.splitlines()), 1):
        cells = [c.strip() for c in row]
        if not any(cells) or (number == 1 and cells[0].lower() == "name"):
            continue
        name, password = cells[0], (cells[1] if len(cells) > 1 and cells[1] else None)
        if not ROSTER_NAME.match(name):
            raise SettingsError(f"auth.roster: {path}, line {number}: {name[:40]!r} is not a login name (lower-case "
                                "letters, digits, - or _, starting with a letter, at most 32)")
        if name in roster:
            raise SettingsError(f"auth.roster: {path}, line {number}: {name!r} is listed twice")
        if password is not None and len(password) < 8:
            raise SettingsError(f"auth.roster: {path}, line {number}: the password of {name!r} is shorter than 8 "
                                "characters; give a longer one, or leave it empty for the shared password")
        roster[name] = password
    return roster


def load_settings_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The settings `scalelab hub` chose, handed over in SCALELAB_HUB_SETTINGS / SCALELAB_HUB_OVERRIDES."""
    environ = os.environ if environ is None else environ
    overrides = json.loads(environ[ENV_OVERRIDES]) if environ.get(ENV_OVERRIDES) else None
    return load_settings(environ.get(ENV_SETTINGS) or None, overrides)


def validate_settings(cfg: Mapping, where: str = "course settings") -> None:
    """Raise SettingsError listing every schema violation and cross-field mistake in `cfg`."""
    import jsonschema

    schema = load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    problems = [_explain(e, schema) for e in sorted(validator.iter_errors(cfg), key=lambda e: list(e.path))]
    if not problems:
        problems = cross_checks(cfg)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise SettingsError(f"{len(problems)} problem(s) in {where}:\n{listed}\n"
                            f"Every setting, with its default and meaning, is in {hub_config_dir()}/"
                            "course_defaults.yaml and course_settings.schema.json.")


def cross_checks(cfg: Mapping) -> list[str]:
    """Mistakes the schema cannot see: references between settings."""
    problems = []
    slurm = cfg.get("slurm", {})
    names = [p["name"] for p in slurm.get("profiles", [])]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"slurm.profiles: the name(s) {dupes} are used more than once; give each profile its own name")
    default = slurm.get("default_profile", "")
    if default and default not in names:
        problems.append(f"slurm.default_profile: {default!r} is not one of the profiles {names}; "
                        "set it to one of those names")
    auth = cfg.get("auth", {})
    if auth.get("password") and auth.get("password") == auth.get("admin_password"):
        problems.append("auth.admin_password: must differ from auth.password")
    if cfg.get("servers", {}).get("run_as") in ("hub-account", "auto") \
            and "{username}" not in cfg["servers"].get("home", ""):
        problems.append(f"servers.home: {cfg['servers'].get('home')!r} must contain {{username}} so that every "
                        "student gets their own directory, e.g. '{state_dir}/homes/{username}'")
    if cfg.get("slurm", {}).get("poll_max", 5) < cfg.get("slurm", {}).get("poll_min", 0.5):
        problems.append("slurm.poll_max: must be at least slurm.poll_min")
    problems += check_trusted_proxies(cfg.get("hub", {}).get("trusted_proxies", []))
    problems += capstone_checks(cfg)
    return problems


def capstone_checks(cfg: Mapping) -> list[str]:
    """The capstone's settings against the rest: a public board needs the dashboard, and no student may write the
    spool file or read the pseudonyms' secret (neither may be in the folder students' homes are made in)."""
    cap, problems = cfg.get("capstone", {}), []
    if cap.get("public") and not cfg.get("dashboard", {}).get("enabled", True):
        problems.append("capstone.public: true shows the board on the class dashboard, which is off "
                        "(dashboard.enabled: false); turn the dashboard on, or set capstone.public: false")
    homes = cfg.get("servers", {}).get("home", "").replace("{state_dir}", cfg.get("hub", {}).get("state_dir", ""))
    root = homes.split("{username}")[0].rstrip("/")
    for key in ("inject_file", "pseudonym_key_file"):
        value = cap.get(key) or ""
        if root and value and (value + "/").startswith(root + "/"):
            problems.append(f"capstone.{key}: {value!r} is inside the students' homes ({root}/, servers.home): a "
                            f"student could write or read it there; put it in a folder only the hub's account may "
                            f"write, e.g. /var/lib/scalelab/")
    return problems


def _dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _subschema(schema: dict, root: dict) -> dict:
    ref = schema.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return root["$defs"][ref.rsplit("/", 1)[1]]
    return schema


def _explain(error, root: dict) -> str:
    """One schema violation as 'where: what was found; what is expected (example)'."""
    where = _dotted(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed]
        hints = []
        for key in extra:
            close = difflib.get_close_matches(key, allowed, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"{where}: unknown setting {', '.join(hints)}; the settings here are {allowed}"
    if error.validator == "required":
        return f"{where}: {error.message}; add it"
    sub = _subschema(error.schema, root)
    expected = sub.get("description", "")
    if error.validator == "enum":
        expected = f"one of {error.validator_value}"
    elif error.validator == "type":
        expected = f"a value of type {error.validator_value}" + (f" ({expected})" if expected else "")
    elif error.validator in ("minimum", "maximum", "minItems", "minLength", "maxLength"):
        expected = f"{error.validator} {error.validator_value}" + (f" ({expected})" if expected else "")
    examples = sub.get("examples")
    example = f", e.g. {examples[0]!r}" if examples else ""
    return f"{where}: {error.instance!r} is not valid; expected {expected or error.message}{example}"

