"""How an option's value is read from the environment: its ``HVDLITE_`` variable, else
the first of Horovod's variables that sets it (converted by ``hvdlite.horovod_env``),
else an old hvdlite name, with the warnings each case calls for; and a value given in
code, checked as its variable's text would be. The table of options is config.py's.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional

from hvdlite import horovod_env
from hvdlite.config_values import Option
from hvdlite.errors import ConfigError

_log = logging.getLogger("hvdlite")


def from_environment(option: Option, environ: Mapping[str, str]) -> Any:
    """``option``'s value from HVDLITE_*, else from the first of Horovod's variables
    that sets it, else from an old hvdlite name (``deprecated``, with a warning); None
    if none does. Both set to different values: the HVDLITE_ one, with a warning
    naming both."""
    _warn_deprecated(option, environ)
    if option.env not in environ:
        found = _from_horovod(option, environ)
        if found is None:
            old = next((name for name in option.deprecated if name in environ), None)
            return None if old is None else _parse(option, environ[old], old)
        return found[1]
    value = _parse(option, environ[option.env], option.env)
    try:
        found = _from_horovod(option, environ)
    except ConfigError:       # not used, but not the same value either
        found = next((name, None) for name in option.aliases if name in environ)
    if found is not None and found[1] != value:
        _log.warning("%s=%r and %s=%r are both set; hvdlite uses %s", option.env,
                     environ[option.env], found[0], environ[found[0]], option.env)
    return value


def _warn_deprecated(option: Option, environ: Mapping[str, str]) -> None:
    for old in (name for name in option.deprecated if name in environ):
        _log.warning("%s is deprecated; set %s instead%s", old, option.env,
                     " (both are set: hvdlite uses it)" if option.env in environ else
                     f" (read as {option.env}={environ[old]!r} until then)")


def _from_horovod(option: Option, environ: Mapping[str, str]) -> Optional[tuple[str, Any]]:
    """(variable, value) of the first of Horovod's variables for ``option`` that sets
    it (HOROVOD_STALL_CHECK_DISABLE=0 sets nothing); None if none does."""
    for name in option.aliases:
        if name not in environ:
            continue
        try:
            text = horovod_env.convert(name, environ[name])
        except ValueError as exc:
            raise ConfigError(f"{name}={environ[name]!r} is invalid: {exc}. "
                              f"It sets {option.env}: {option.doc}") from None
        if text is not None:
            return name, _parse(option, text, name, environ[name])
    return None


def _parse(option: Option, text: str, variable: str, raw: Optional[str] = None) -> Any:
    """``text`` parsed for ``option``; an error names ``variable`` and the value it
    holds (``raw``, where Horovod's value was converted to ``text``)."""
    try:
        return option.parse(text)
    except ValueError as exc:
        shown = text if raw is None else raw
        sets = "" if variable == option.env else f" It sets {option.env}:"
        raise ConfigError(f"{variable}={shown!r} is invalid: {exc}.{sets} {option.doc}") from None


def checked(option: Option, value: Any) -> Any:
    """A value given in code (init's and reconfigure's keywords), refused where its
    variable's text would be: ``allreduce="rign"`` fails here, not in the engine."""
    if value is None or option.parse is str:
        return value
    try:
        return option.parse(str(value))
    except ValueError as exc:
        raise ConfigError(f"{option.field}={value!r} is invalid: {exc}. {option.doc}") from None


def warn_unknown(environ: Mapping[str, str], options: Iterable[Option]) -> None:
    """A warning for each HVDLITE_ variable that no option reads: a misspelt one
    would otherwise be silently ignored."""
    options = tuple(options)
    known = {option.env for option in options}
    read = known | {name for option in options for name in option.deprecated}
    for name in environ:
        if name.startswith("HVDLITE_") and name not in read:
            _log.warning("ignoring unknown environment variable %s; known: %s",
                         name, ", ".join(sorted(known)))
