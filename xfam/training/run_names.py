"""Where the configs are, and how Hydra names a run's directory (the ``xfam_dirname`` resolver)."""

from __future__ import annotations

import hashlib
import re

from omegaconf import OmegaConf

from xfam.core.config_dir import CONFIG_DIR  # noqa: F401  (where train.py's config groups are; re-exported here)


def dirname(overrides: str) -> str:
    """A run directory name from Hydra's override_dirname (``pos=alibi+model=small``, the overrides as
    typed, sorted): ``pos:alibi+model:small``, only characters that a path can carry unquoted in a Hydra
    override; long values (paths) become a short hash, so every key stays readable; a bounded length.

    Two different command lines must never share a directory (``ckpt_path=auto`` would continue one's
    checkpoint with the other's config), so an item that had to be changed (characters replaced, e.g.
    ``data.paths=[x/ab]`` and ``data.paths=[x_ab]``) or that is not a plain ``key=value`` (a piece of a
    value holding ``+``) carries a hash of itself; names needing none of this are as they always were."""

    def _hash(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    items: list[str] = []
    for piece in overrides.split("+") if overrides else []:
        if items and not items[-1].strip("+"):  # "+key=value" (add a key): the "+" is part of the item
            piece = items.pop() + "+" + piece
        items.append(piece)
    names = []
    for item in items:
        rest = item.lstrip("+")
        key, sep, value = rest.partition("=")
        if len(value) > 24:
            value = "h" + _hash(value)
        plain = key + (":" if sep else "") + value
        name = re.sub(r"[^A-Za-z0-9_.\-:@%]", "_", plain)
        if name != plain or not sep or ":" in key:
            name += "-" + _hash(item)
        names.append(item[: len(item) - len(rest)] + name)
    name = "+".join(names) or "default"
    if len(name) > 160:
        name = name[:140] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return name


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("xfam_dirname"):
        OmegaConf.register_new_resolver("xfam_dirname", dirname)
