"""``trainer.matmul_precision``: torch's fp32 matmul precision during the run's steps, restored after it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from xfam.training.lit.callbacks import MatmulPrecision


class _Probe(L.LightningModule):
    """One linear layer that records the precision its training and validation steps ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.seen = torch.nn.Linear(4, 1), []

    def training_step(self, batch, _):  # noqa: ANN001, ANN202
        self.seen.append(("train", torch.get_float32_matmul_precision()))
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, _):  # noqa: ANN001, ANN202
        self.seen.append(("val", torch.get_float32_matmul_precision()))

    def configure_optimizers(self):  # noqa: ANN202
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_the_steps_run_under_the_chosen_precision_and_it_is_restored(tmp_path, precision) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    probe = _Probe()
    trainer = L.Trainer(
        max_steps=2, callbacks=[MatmulPrecision(precision)], default_root_dir=tmp_path, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    assert torch.get_float32_matmul_precision() == "highest"
    trainer.fit(probe, loader, loader)  # 2 training steps, then a validation
    trainer.validate(probe, loader, verbose=False)
    assert probe.seen == [("train", precision)] * 2 + [("val", precision)] * 4
    assert torch.get_float32_matmul_precision() == "highest"  # nothing leaks into the next run or test
