"""Train a Transformer assembled from one component per slot: `python train.py --help`.

python train.py                                   # the main job (tiny decoder, embedded corpus)
python train.py attention=vanilla pos=alibi model=small data=listops
python train.py -m pos=none,sinusoidal,learned,rope,alibi   # a sweep
python train.py ckpt_path=auto                    # continue the run in this run directory
"""

import hydra
from omegaconf import DictConfig

from xfam.training.hydra_app import main, run_job


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def train(cfg: DictConfig) -> float | None:
    return run_job(cfg)


if __name__ == "__main__":
    main(train)
