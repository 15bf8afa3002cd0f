"""Train the seed tutorial's kind of model with PyTorch Lightning's DDP on 2 CPU processes, on
the process-group backend named on the command line ("gloo" or "anyccl"), and save the initial
and the final weights (rank 0's, which Lightning hands back to this process). The torch-backend
tests run it on both and compare.

    python lightning_train.py BACKEND OUT_FILE

Each rank's process ends with os._exit once Lightning's wrapper has handed its results back.
Ending through the interpreter's shutdown lets gloo's worker thread free a finished Work while
the interpreter is finalizing: it must take the GIL to drop the Work's Python state, the thread
is ended there, and libstdc++ aborts ("terminate called without an active exception"; about 1
run in 15 with gloo on a 2-core machine). The ddp_train script ends its ranks the same way.
"""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.utils.data import DataLoader, TensorDataset


class _ExitWhenDone(_MultiProcessingLauncher):
    """Lightning's spawn launcher, whose ranks leave with os._exit(0) after their whole turn
    (training, and rank 0's results put on the queue, which writes them to the pipe at once)
    succeeded; a rank that raises leaves as before, through torch's wrapper, with exit code 1."""

    def _wrapping_function(self, *args, **kwargs) -> None:
        super()._wrapping_function(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class _Strategy(DDPStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = _ExitWhenDone(self, start_method=self._start_method)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    model = Regressor()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        strategy=_Strategy(process_group_backend=backend,
                                           start_method="spawn"))
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    torch.save({"initial": initial,
                "trained": {k: v.detach().clone() for k, v in model.state_dict().items()}}, out)


if __name__ == "__main__":
    main()
