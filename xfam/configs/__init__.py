"""The Hydra configs, importable as the package ``xfam.configs``.

They live in the repository's top-level ``configs/`` folder (train.yaml and one folder per config group);
a wheel ships them inside the package as ``xfam/configs/`` (pyproject.toml maps the folder, as it maps
``kernels/``), so ``xfam train`` works from any directory of an installed xfam. In a source checkout this
module points the package at the top-level folder instead. ``xfam.core.config_dir.CONFIG_DIR`` is the
folder in either case.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "configs")]
