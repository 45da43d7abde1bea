"""Where train.yaml and the config groups are: ``CONFIG_DIR``.

An installed wheel ships them inside the package (``xfam/configs``: pyproject.toml maps the repository's top-level
``configs/`` there, as it maps ``kernels/``); a source checkout has them at its top, beside ``xfam/``.
"""

from __future__ import annotations

from pathlib import Path


def _config_dir() -> Path:
    package = Path(__file__).resolve().parents[1]
    shipped = package / "configs"
    return shipped if (shipped / "train.yaml").is_file() else package.parent / "configs"


#: The configs' folder (the package's ``xfam.configs`` as a folder).
CONFIG_DIR = _config_dir()
