"""``xfam train``: the job of the repository's ``train.py``, from any directory, with the configs that ship in
the package (``xfam.core.config_dir.CONFIG_DIR``).

The words after ``train`` are Hydra's: overrides (``attention=performer pos=alibi``), ``-m`` for a sweep,
``--config-dir DIR`` for a folder of the user's own configs, ``--help``/``--hydra-help``, ``--cfg job``. Runs go
to ``runs/`` under the current directory, as with ``python train.py``.
"""

from __future__ import annotations

import sys
from typing import Any

from xfam.cli.grammar import Args


def run(args: Args) -> None:
    import hydra
    from omegaconf import DictConfig

    from xfam.core.config_dir import CONFIG_DIR
    from xfam.training.hydra_app import main, run_job

    program, words = sys.argv[0], list(args.words)

    def train(cfg: DictConfig) -> Any:
        # Hydra has read its words; a launcher that starts ranks by re-running the command line (Lightning's
        # ddp under Hydra: sys.argv[0] plus sys.argv[1:]) must see ``xfam train ...`` again.
        sys.argv = [program, "train", *words]
        return run_job(cfg)

    sys.argv = [program, *words]  # what Hydra and the pre-launch check read
    main(hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")(train))
