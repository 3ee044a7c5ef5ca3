"""mmfeatd's flags and environment as a user meets them.

Each setting is described once, in config.py (HELP and the Settings fields): its flag's help text and
the default it shows come from there. MMFEAT_* variables that nothing reads are reported, so that a
typo is not ignored without a word.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, Mapping

from mmfeat.protos.env import READ_OUTSIDE_SETTINGS

from .config import ENV_PREFIX, HELP, Settings

# Defaults that depend on the machine or its environment: shown as the rule, not as this machine's value.
_DEFAULT_RULES = {
    "runtime_dir": "$MMFEAT_RUNTIME_DIR, else $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/mmfeat, else /tmp/mmfeat-<uid>",
}


def shown_default(name: str) -> str:
    """A setting's default as its flag's help shows it."""
    if name in _DEFAULT_RULES:
        return _DEFAULT_RULES[name]
    value: Any = Settings.model_fields[name].get_default(call_default_factory=True)
    if name == "socket_mode":
        return f"{value:04o}"
    if value is None or value == "" or value == []:
        return "none"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flag_help(name: str) -> str:
    text = HELP[name]
    if "default:" not in text:  # some help texts already say their default in words
        text = f"{text} (default: {shown_default(name)})"
    return text.replace("%", "%%")  # argparse formats help with %


class SettingsParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags for settings take their help from config.py. The flags' own default
    stays None: a flag not given must leave the file's and the environment's value in place."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        dest = kwargs.get("dest") or (args[0].lstrip("-").replace("-", "_") if args else "")
        if dest in HELP and "help" not in kwargs:
            kwargs["help"] = flag_help(dest)
        return super().add_argument(*args, **kwargs)


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One line per MMFEAT_* variable that neither mmfeatd's settings nor its clients read."""
    known = {ENV_PREFIX + name.upper() for name in HELP} | READ_OUTSIDE_SETTINGS
    lines = []
    for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        lines.append(f"{var} is set but neither mmfeatd nor its clients read it; {hint}"
                     f"a setting's variable is {ENV_PREFIX} and its name in capitals, e.g. {ENV_PREFIX}POOL_MB")
    return lines
