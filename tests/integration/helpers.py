"""Helpers for end-to-end tests: composed configs and subprocess runs of the real commands."""

from __future__ import annotations

import copy
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from xfam.training.run_names import CONFIG_DIR, register_resolvers

ROOT = CONFIG_DIR.parent

#: Small enough that a run takes seconds on one thread.
TINY = [
    "model.dim=32",
    "model.layers=2",
    "model.heads=2",
    "model.max_len=64",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1",
    "optim.warmup_steps=2",
    "callbacks.every_n_steps=3",
    "callbacks.progress_bar=none",
]


def text_data(corpus: Path) -> list[str]:
    return [
        f"data.paths=[{corpus}]",
        "data.extensions=[.txt]",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.val_fraction=0.2",
        "data.test_fraction=0.2",
    ]


def compose_cfg(overrides: list[str]) -> dict:
    """The plain config ``python train.py <overrides>`` would run (no Hydra runtime)."""
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    return copy.deepcopy(OmegaConf.to_container(cfg, resolve=True))


def run_cli(args: list[str], cwd: Path | None = None, timeout: int = 300, env: dict | None = None):
    """Run ``python <args>`` from the repository root with single-threaded, offline settings (and
    ``XFAM_DEBUG`` only when ``env`` sets it)."""
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "XFAM_DEBUG"},
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def flip_a_tensor_bit(path: Path) -> None:
    """Flip one bit inside the largest tensor's bytes (a bad disk or copy): the zip stores tensors
    uncompressed and torch.load checks no checksum, so the file still loads, with one wrong value."""
    with zipfile.ZipFile(path) as z:
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26 : entry.header_offset + 30])
    raw[entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2] ^= 0x08
    path.write_bytes(raw)
