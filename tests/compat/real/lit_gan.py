"""A GAN under manual optimization, two optimizers toggled in turn.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/generative_adversarial_net.py:
``training_step(self, batch)`` without ``batch_idx``, ``self.optimizers()`` unpacked, ``toggle_optimizer`` /
``untoggle_optimizer`` around each update, ``self.log_dict``, a fixed latent batch drawn in ``__init__``, and
the loggers' back ends (``logger.experiment``) written from ``on_train_epoch_end``. Synthetic 1x8x8
"images" stand in for MNIST; each optimizer has a scheduler, stepped by hand at epoch end.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(n: int = 64, shape: tuple[int, int, int] = (1, 8, 8)) -> TensorDataset:
    """Images made of two bright squares on noise, in [-1, 1] like a Tanh output."""
    images = torch.rand(n, *shape) * 0.2 - 1.0
    images[:, :, 1:4, 1:4] = 0.9
    images[:, :, 5:7, 4:7] = 0.5
    return TensorDataset(images, torch.zeros(n, dtype=torch.long))


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple[int, int, int], width: int = 32):
        super().__init__()
        self.img_shape = img_shape
        layers: list[nn.Module] = [nn.Linear(latent_dim, width), nn.LeakyReLU(0.2)]
        for _ in range(2):
            layers += [nn.Linear(width, width * 2), nn.BatchNorm1d(width * 2, 0.8), nn.LeakyReLU(0.2)]
            width *= 2
        layers += [nn.Linear(width, math.prod(img_shape)), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, z):
        return self.model(z).view(z.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, int, int], width: int = 64):
        super().__init__()
        self.model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(img_shape), width),
            nn.LeakyReLU(0.2),
            nn.Linear(width, width // 2),
            nn.LeakyReLU(0.2),
            nn.Linear(width // 2, 1),
        )

    def forward(self, img):
        return self.model(img)


class GAN(pl.LightningModule):
    def __init__(self, img_shape=(1, 8, 8), lr: float = 2e-3, b1: float = 0.5, b2: float = 0.999, latent_dim: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim, tuple(img_shape))
        self.discriminator = Discriminator(tuple(img_shape))
        self.validation_z = torch.randn(6, latent_dim)
        self.example_input_array = torch.zeros(2, latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(logits, target):
        return F.binary_cross_entropy_with_logits(logits, target)

    def training_step(self, batch):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.hparams.latent_dim).type_as(real)
        ones = torch.ones(real.size(0), 1).type_as(real)
        zeros = torch.zeros(real.size(0), 1).type_as(real)

        # generator: make the discriminator call fakes real
        self.toggle_optimizer(opt_g)
        fake = self(z)
        g_loss = self.adversarial_loss(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # discriminator: tell real from (detached) fake
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(real), ones)
        fake_loss = self.adversarial_loss(self.discriminator(fake.detach()), zeros)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        lr, betas = self.hparams.lr, (self.hparams.b1, self.hparams.b2)
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=betas)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=betas)
        sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.9)
        sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.8)
        return [opt_g, opt_d], [sched_g, sched_d]

    def on_train_epoch_end(self):
        for scheduler in self.lr_schedulers():
            scheduler.step()
        samples = self(self.validation_z.type_as(self.generator.model[0].weight))
        for logger in self.loggers:
            logger.experiment.add_histogram("generated_pixels", samples, self.current_epoch)


def main(root_dir: str, callbacks=(), **trainer_options):
    pl.seed_everything(1234)
    model = GAN()
    loader = DataLoader(blobs(), batch_size=16, shuffle=True)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=TensorBoardLogger(root_dir),
        enable_checkpointing=False,
        callbacks=list(callbacks),
        **trainer_options,
    )
    trainer.fit(model, loader)
    return {"trainer": trainer, "model": model}
