"""Third-party components: packages that register components in xfam's registries without editing xfam.

Two ways in, both importing a module for its ``@REGISTRY.register("name")`` side effects:

* an entry point of the group ``xfam.components`` in the package's metadata (pyproject.toml)::

      [project.entry-points."xfam.components"]
      mypkg = "mypkg.attention"          # the module that registers the components

  loaded by ``load_entry_points`` in every process that validates, builds or lists components;
* ``+plugins=[mypkg.attention]`` on the command line (the config's top-level ``plugins``: module paths,
  importable or a ``.py`` file's name in the current directory), loaded by ``load_modules``; the list is in
  the run's config, so its checkpoints load with the same modules.

A plugin that fails to import, or registers a name a slot already has, is one ``ConfigError`` naming the
package, the entry point and the fix. Nothing here knows the slots: the registries report a second name
(``DuplicateComponent``) and this module says whose plugin it was.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable

from xfam.core.errors import ConfigError

#: The entry-point group a package registers its components under.
GROUP = "xfam.components"
#: The config key of ``+plugins=[module, ...]``.
KEY = "plugins"


class DuplicateComponent(RuntimeError):
    """A name registered twice in one slot (raised by ``Registry.register``)."""

    def __init__(self, slot: str, name: str, existing: type, new: type):
        self.slot, self.name, self.existing, self.new = slot, name, existing, new
        super().__init__(
            f"{slot} component {name!r} registered twice: by {existing.__module__}.{existing.__qualname__} and by "
            f"{new.__module__}.{new.__qualname__}"
        )


def _why(err: BaseException) -> str:
    if isinstance(err, DuplicateComponent):
        return (
            f"it registers {err.slot} {err.name!r}, which {err.existing.__module__} already registered. "
            f"Fix: give the component another name in its @REGISTRY.register(...) (and its YAML), or uninstall one"
        )
    return f"importing it failed: {type(err).__name__}: {err}. Fix: install what it needs"


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=GROUP), key=lambda ep: (ep.name, ep.value))


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Import every ``xfam.components`` entry point (once per process); the modules it imported. Raises one
    ``ConfigError`` listing each plugin that failed, with its distribution and entry point."""
    problems, loaded = [], []
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
        try:
            importlib.import_module(ep.value.partition(":")[0])
        except Exception as err:  # a third party's import: any failure is reported the same way
            problems.append(
                f"plugin {dist} (entry point {GROUP}: {ep.name} = {ep.value}): {_why(err)}, or uninstall the "
                f"plugin (pip uninstall {dist})."
            )
            continue
        loaded.append(ep.value)
    if problems:
        load_entry_points.cache_clear()  # (a later call reports them again instead of passing silently)
        raise ConfigError(problems)
    return tuple(loaded)


def module_problems(modules: object) -> list[str]:
    """Why ``plugins`` (the config's list of module paths) is not one; [] when it is."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) and m for m in modules):
        return [
            f"{KEY}={modules!r}: must be a list of module paths. Fix: +{KEY}=[mypkg.attention] (a module that "
            f"registers components; a file my_attention.py in this directory is +{KEY}=[my_attention])."
        ]
    return []


def load_modules(modules: Iterable[str]) -> list[str]:
    """Import the modules of ``+plugins=[...]`` (the current directory is searched too, as ``python -m`` does);
    the problems, one per module that failed."""
    problems = []
    for module in modules:
        if module in sys.modules:
            continue
        cwd = os.getcwd()
        added = cwd not in sys.path
        if added:
            sys.path.append(cwd)
        try:
            importlib.import_module(module)
        except Exception as err:  # a third party's import
            if isinstance(err, ModuleNotFoundError) and err.name == module.split(".")[0]:
                why = (
                    f"no module named {err.name!r} here (looked in the current directory and sys.path). Fix: "
                    f"the dotted path of an importable module, or pip install -e your package"
                )
            else:
                why = _why(err)
            problems.append(f"{KEY}: module {module!r}: {why}.")
        finally:
            if added and cwd in sys.path and module not in sys.modules:
                sys.path.remove(cwd)
    return problems


def load(modules: object = ()) -> None:
    """Entry points, then the config's ``plugins``: one ``ConfigError`` with every problem."""
    load_entry_points()
    if problems := module_problems(modules):
        raise ConfigError(problems)
    if problems := load_modules(modules):  # type: ignore[arg-type]  # (a list of str: module_problems said so)
        raise ConfigError(problems)


def is_builtin(cls: type) -> bool:
    """Whether a component is xfam's own (defined in the xfam package), not a plugin's or a test double's."""
    return cls.__module__ == "xfam" or cls.__module__.startswith("xfam.")


def origin(cls: type) -> str | None:
    """Who provides a component: None for xfam's own, else its distribution (or module) name."""
    if is_builtin(cls):
        return None
    module = cls.__module__
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top)
    return dists[0] if dists else module
