"""A variational autoencoder whose reparameterised samples draw from the global RNG in every step.

Follows the idioms of Lightning-Universe/lightning-bolts,
src/pl_bolts/models/autoencoders/basic_vae/basic_vae_module.py:
``save_hyperparameters()`` of plain values, ``torch.distributions.Normal(...).rsample()`` for the latent, one
``step(batch, batch_idx)`` returning the loss and a dict of parts, ``self.log_dict({f"train_{k}": v ...},
on_step=True, on_epoch=False)`` and ``self.log_dict({f"val_{k}": v ...})``, Adam from ``configure_optimizers``,
and ``VAE.load_from_checkpoint(path, strict=False)`` as its ``from_pretrained`` does. A CSV logger's writer is
reached through ``logger.experiment`` to record the KL weight. Small MLPs on 1x8x8 images stand in for the
ResNet encoder and decoder on CIFAR-10.
"""

from __future__ import annotations

import torch
from lightning import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class VAE(LightningModule):
    def __init__(
        self,
        input_height: int = 8,
        enc_out_dim: int = 32,
        kl_coeff: float = 0.1,
        latent_dim: int = 4,
        lr: float = 3e-3,
        **kwargs,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.kl_coeff = kl_coeff
        self.enc_out_dim = enc_out_dim
        self.latent_dim = latent_dim
        self.input_height = input_height
        pixels = input_height * input_height
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(pixels, enc_out_dim), nn.ReLU())
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, enc_out_dim), nn.ReLU(), nn.Linear(enc_out_dim, pixels), nn.Sigmoid()
        )
        self.fc_mu = nn.Linear(self.enc_out_dim, self.latent_dim)
        self.fc_var = nn.Linear(self.enc_out_dim, self.latent_dim)

    def forward(self, x):
        return self._run_step(x)[1]

    def _run_step(self, x):
        """Encode, draw a latent by the reparameterisation trick, decode: (z, x_hat, prior, posterior)."""
        hidden = self.encoder(x)
        prior, posterior, z = self.sample(self.fc_mu(hidden), self.fc_var(hidden))
        return z, self.decoder(z).view_as(x), prior, posterior

    def sample(self, mu, log_var):
        posterior = torch.distributions.Normal(mu, (0.5 * log_var).exp())
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        return prior, posterior, posterior.rsample()

    def step(self, batch, batch_idx):
        images = batch[0]
        _, reconstruction, prior, posterior = self._run_step(images)
        parts = {
            "recon_loss": F.mse_loss(reconstruction, images),
            "kl": self.kl_coeff * torch.distributions.kl_divergence(posterior, prior).mean(),
        }
        parts["loss"] = parts["kl"] + parts["recon_loss"]
        return parts["loss"], parts

    def training_step(self, batch, batch_idx):
        loss, logs = self.step(batch, batch_idx)
        self.log_dict({f"train_{k}": v for k, v in logs.items()}, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logs = self.step(batch, batch_idx)
        self.log_dict({f"val_{k}": v for k, v in logs.items()})
        return loss

    def on_validation_epoch_end(self):
        for logger in self.loggers:
            if isinstance(logger, CSVLogger):
                logger.experiment.log_metrics({"kl_coeff": self.kl_coeff}, step=self.global_step)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(0, 1, 8).expand(8, 8)
    x = (base * torch.rand(n, 1, 1, 1, generator=g) + 0.1 * torch.rand(n, 1, 8, 8, generator=g)).clamp(0, 1)
    return TensorDataset(x, torch.zeros(n))


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(7)
    model = VAE(input_height=8)
    checkpoint = ModelCheckpoint(monitor="val_loss")
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=CSVLogger(root_dir),
        callbacks=[checkpoint, *callbacks],
        **trainer_options,
    )
    trainer.fit(
        model,
        DataLoader(images(64, seed=0), batch_size=16, shuffle=True),
        DataLoader(images(32, seed=1), batch_size=16),
    )
    pretrained = VAE.load_from_checkpoint(checkpoint.best_model_path, strict=False)
    return {"trainer": trainer, "model": model, "reloaded": pretrained}
