"""`TorchLoader` under Lightning's `Trainer` (the `readers` extra): each epoch of `fit`
is the loader's epoch of that number (a new order), every sample once per epoch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
lightning = pytest.importorskip("lightning")

from framework_cases import BATCH, FEATURES, N, env_fixture, zarr_spec  # noqa: E402

import dmdask  # noqa: E402
from dmdask.integrations.torch import TorchLoader  # noqa: E402

env = env_fixture("lightningdata")
EPOCHS = 3


class Recorder(lightning.LightningModule):
    """A linear model that records the sample ids of every batch it trains on, by epoch."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(FEATURES, 2)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch["index"].tolist())
        return torch.nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fit_moves_the_loader_through_its_epochs(env):
    spec = zarr_spec(env, seed=3)
    loader = TorchLoader(env["client"], spec)
    module = Recorder()
    trainer = lightning.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    assert sorted(module.seen) == list(range(EPOCHS))
    for epoch, ids in module.seen.items():
        assert sorted(ids) == list(range(N)), epoch  # every sample once
        want = np.concatenate([b["index"] for b in dmdask.batches(env["client"], spec, epoch=epoch)])
        assert ids == want.tolist(), epoch  # that epoch's order, as dmdask.batches deals it
    assert len({tuple(ids) for ids in module.seen.values()}) == EPOCHS  # a new order each epoch
    assert loader.epoch == EPOCHS - 1
    assert len(loader.sampler) == -(-N // BATCH) * BATCH
