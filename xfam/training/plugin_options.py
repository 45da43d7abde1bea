"""Hydra options for third-party components (``xfam.core.plugins``), generated from their signatures.

Hydra selects a component by a file, ``attention=gated`` reading ``attention/gated.yaml``; a plugin package
registers a class but ships no file in xfam's config folder. ``option_dir`` writes one per registered
component that has none (``name`` plus every user-settable parameter at its signature's default: the
signature is the one place defaults live, as for xfam's own components), into a folder of xfam's cache named
by the content, and ``prepare`` puts that folder on Hydra's config search path (a Hydra ``SearchPathPlugin``
registered in the process). So ``attention=gated attention.gate=0.5``, ``-m attention=vanilla,gated``, ``xfam train
--help`` and the pre-launch check's close matches all see plugin components like built-in ones.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

from xfam.core.config_dir import CONFIG_DIR
from xfam.core.plugins import KEY, load
from xfam.core.registry import defaults_of

log = logging.getLogger("xfam")


def plugin_modules(args: list[str]) -> list[str]:
    """The modules of ``+plugins=[...]`` (or ``++plugins=``) among Hydra overrides ``args`` (every value of a
    sweep over it); overrides Hydra cannot parse are left to the pre-launch check's grammar message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    modules: list[str] = []
    for arg in args:
        if not arg.lstrip("+").startswith(f"{KEY}="):
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except HydraException:
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            items = value if isinstance(value, list) else [value]
            modules += [str(m) for m in items if str(m) not in modules]
    return modules


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def option_text(slot: str, name: str, cls: type) -> str | None:
    """The YAML of ``<slot>/<name>.yaml`` as xfam writes its own (None: a default YAML cannot hold)."""
    try:
        return yaml.safe_dump({"name": name, **_plain(defaults_of(cls))}, sort_keys=False)
    except yaml.YAMLError as err:
        log.warning("%s=%s: no Hydra option generated (a default YAML cannot hold: %s)", slot, name, err)
        return None


def option_dir() -> Path | None:
    """A folder of generated options for the registered components without a YAML in ``CONFIG_DIR``; None when
    every component has one (no plugins)."""
    from xfam.config.slots import SLOTS
    from xfam.data.base import DATA
    from xfam.data.tokenize import cache_root

    files = {}
    for slot, registry in {**SLOTS, "data": DATA}.items():
        for name, cls in registry.items():
            if not (CONFIG_DIR / slot / f"{name}.yaml").is_file() and (text := option_text(slot, name, cls)):
                files[f"{slot}/{name}.yaml"] = text
    if not files:
        return None
    key = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16]
    root = cache_root() / "plugin-options" / key
    for rel, text in files.items():
        path = root / rel
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{key}.tmp")
            tmp.write_text(text)
            tmp.replace(path)  # (another process writing the same folder writes the same bytes)
    return root


#: The folder of generated options that ``SearchPath`` adds to Hydra's config search path in this process.
_FOLDER: list[Path] = []


def prepare(args: list[str]) -> Path | None:
    """Load the plugins of the environment and of ``args``' ``+plugins=[...]`` (ConfigError on a failure), write
    their options (``option_dir``) and put the folder on Hydra's search path from now on; the folder."""
    load(plugin_modules(args))
    folder = option_dir()
    _FOLDER[:] = [folder] if folder else []
    Plugins.instance().register(SearchPath)  # (idempotent)
    return folder


class SearchPath(SearchPathPlugin):
    """Hydra's hook for extra config folders: every search path Hydra builds in this process (the run's,
    ``--help``'s, the pre-launch check's) gets the generated options, after the user's own folders."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for folder in _FOLDER:
            search_path.append(provider="xfam-plugins", path=f"file://{folder}")
