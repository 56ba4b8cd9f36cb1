"""A GAN on 2-D toy data with manual optimization: two optimizers, stepped by hand in `training_step`.

The target distribution is a ring of eight Gaussians (generated, no download). Each training batch
steps the discriminator (real vs. generated points), then the generator (fool the discriminator);
both losses are logged (``train/d_loss``, ``train/g_loss``). Validation measures how far the
generator's samples are from the target with the sliced Wasserstein distance ``val/swd`` (lower is
closer): it starts near the ring's radius and falls as the generator learns.

    ember fit -c configs/gan.yaml       # ~7 s on a 2-core CPU
    python -m examples.gan

With manual optimization every ``optimizer.step()`` is an optimizer step, so one batch counts two
steps in ``trainer.global_step`` (and in ``max_steps``).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember


def ring_of_gaussians(n: int, modes: int = 8, radius: float = 2.0, std: float = 0.05, seed: int = 0) -> Tensor:
    """`n` points of the 2-D mixture of `modes` Gaussians (std `std`) evenly spaced on a circle."""
    generator = torch.Generator().manual_seed(seed)
    mode = torch.randint(0, modes, (n,), generator=generator)
    angle = mode.float() * (2 * math.pi / modes)
    centres = radius * torch.stack([angle.cos(), angle.sin()], dim=1)
    return centres + std * torch.randn(n, 2, generator=generator)


def sliced_wasserstein(a: Tensor, b: Tensor, directions: Tensor) -> Tensor:
    """Sliced 1-Wasserstein distance between two equal-size point sets, over unit `directions` (k, d)."""
    pa, pb = (a @ directions.T).sort(dim=0).values, (b @ directions.T).sort(dim=0).values
    return (pa - pb).abs().mean()


def unit_directions(k: int, dim: int = 2, seed: int = 0) -> Tensor:
    """`k` fixed random unit vectors."""
    d = torch.randn(k, dim, generator=torch.Generator().manual_seed(seed))
    return d / d.norm(dim=1, keepdim=True)


class RingData(ember.DataModule):
    """Training and validation points of `ring_of_gaussians`; predict yields latent noise batches."""

    def __init__(
        self,
        n_train: int = 8192,
        n_val: int = 1024,
        batch_size: int = 128,
        latent_dim: int = 8,
        modes: int = 8,
        seed: int = 0,
    ) -> None:
        self.n_train, self.n_val = n_train, n_val
        self.batch_size = batch_size
        self.latent_dim = latent_dim
        self.modes = modes
        self.seed = seed

    def setup(self, stage: str) -> None:
        self.train_set = TensorDataset(ring_of_gaussians(self.n_train, self.modes, seed=self.seed))
        self.val_set = TensorDataset(ring_of_gaussians(self.n_val, self.modes, seed=self.seed + 1))

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.n_val)  # one batch: the distance is over all points

    def predict_dataloader(self) -> DataLoader:
        noise = torch.randn(self.n_val, self.latent_dim, generator=torch.Generator().manual_seed(self.seed + 2))
        return DataLoader(TensorDataset(noise), batch_size=256)


def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers with LeakyReLU between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.LeakyReLU(0.2))
    return nn.Sequential(*layers)


class GAN(ember.TrainingModule):
    """Generator and discriminator MLPs trained with manual optimization (two Adam optimizers).

    ``forward(z)`` maps (batch, latent_dim) noise to (batch, 2) points: the generator alone, which is
    what one exports.
    """

    directions: Tensor  # fixed projection directions of the validation distance (a buffer)

    def __init__(
        self,
        latent_dim: int = 8,
        hidden: int = 128,
        lr_g: float = 1e-3,
        lr_d: float = 1e-3,
        beta1: float = 0.5,
        n_directions: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = mlp([latent_dim, hidden, hidden, 2])
        self.discriminator = mlp([2, hidden, hidden, 1])
        self.register_buffer("directions", unit_directions(n_directions), persistent=False)
        self.example_input_array = torch.zeros(1, latent_dim)

    def forward(self, z: Tensor) -> Tensor:
        """Generated points for latent noise `z`."""
        return self.generator(z)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (real,) = batch
        optimizers = self.optimizers()
        assert isinstance(optimizers, list)
        opt_g, opt_d = optimizers  # in configure_optimizers' order
        fake = self(torch.randn(len(real), self.hparams.latent_dim, device=real.device))

        # Discriminator: real points -> 1, generated points -> 0 (the generator is not updated here).
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # Generator (non-saturating loss): make the updated discriminator call its points real.
        fake_logits = self.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

        self.log("train/d_loss", d_loss, prog_bar=True)
        self.log("train/g_loss", g_loss, prog_bar=True)

    def validation_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        (real,) = batch
        generator = torch.Generator(device=real.device).manual_seed(batch_idx)  # the same noise every time
        z = torch.randn(len(real), self.hparams.latent_dim, generator=generator, device=real.device)
        distance = sliced_wasserstein(self(z), real, self.directions)
        self.log("val/swd", distance, prog_bar=True)
        return distance

    def predict_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Generated points for each batch of latent noise."""
        return self(batch[0])

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (self.hparams.beta1, 0.999)
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr_g, betas=betas)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr_d, betas=betas)
        return [opt_g, opt_d]


def main() -> None:
    """Train for a few thousand steps and print the distance to the target."""
    ember.seed_everything(0)
    trainer = ember.Trainer(max_epochs=30)
    trainer.fit(GAN(), datamodule=RingData())
    print(f"val/swd {trainer.callback_metrics['val/swd']:.4f}")


if __name__ == "__main__":
    main()
