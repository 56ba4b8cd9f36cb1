"""Proximal policy optimisation: trajectories generated inside the dataset, actor and critic stepped by hand.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/reinforce_learn_ppo.py:
an ``IterableDataset`` whose ``__iter__`` is the module's own generator of trajectory samples (rolled out with
``self.device`` and ``torch.no_grad()``), ``training_step(self, batch)`` without ``batch_idx`` under manual
optimization with ``optimizer_actor, optimizer_critic = self.optimizers()`` stepped in turn (no toggling),
epoch statistics logged with ``on_step=False, on_epoch=True``, ``configure_optimizers`` returning a tuple, and
the example's ``optimizer_step`` override that repeats ``super().optimizer_step`` (Lightning never calls it
under manual optimization). A drifting-target bandit with a categorical policy stands in for gym's CartPole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, IterableDataset


class Bandit:
    """Four observations, two actions; action 1 pays off when the first feature is positive."""

    observation_size, n_actions = 4, 2

    def reset(self) -> torch.Tensor:
        self.t = 0
        return torch.randn(self.observation_size)

    def step(self, state: torch.Tensor, action: int) -> tuple[torch.Tensor, float, bool]:
        self.t += 1
        reward = 1.0 if (action == 1) == bool(state[0] > 0) else 0.0
        return torch.randn(self.observation_size), reward, self.t >= 8


def create_mlp(input_size: int, n_actions: int, hidden_size: int = 16):
    return nn.Sequential(nn.Linear(input_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))


class ActorCategorical(nn.Module):
    def __init__(self, actor_net):
        super().__init__()
        self.actor_net = actor_net

    def forward(self, states):
        pi = Categorical(logits=self.actor_net(states))
        return pi, pi.sample()

    def get_log_prob(self, pi: Categorical, actions: torch.Tensor):
        return pi.log_prob(actions)


class ExperienceSourceDataset(IterableDataset):
    def __init__(self, generate_batch: Callable):
        self.generate_batch = generate_batch

    def __iter__(self) -> Iterator:
        return self.generate_batch()


class PPOLightning(LightningModule):
    def __init__(
        self,
        gamma: float = 0.9,
        lam: float = 0.95,
        lr_actor: float = 3e-3,
        lr_critic: float = 1e-2,
        batch_size: int = 8,
        steps_per_epoch: int = 32,
        nb_optim_iters: int = 1,
        clip_ratio: float = 0.2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.env = Bandit()
        self.critic = create_mlp(Bandit.observation_size, 1)
        self.actor = ActorCategorical(create_mlp(Bandit.observation_size, Bandit.n_actions))
        self.steps_per_epoch, self.batch_size, self.clip_ratio = steps_per_epoch, batch_size, clip_ratio
        self.gamma, self.lam, self.nb_optim_iters = gamma, lam, nb_optim_iters
        self.avg_reward = 0.0
        self.state = self.env.reset()

    def forward(self, x: torch.Tensor):
        pi, action = self.actor(x)
        return pi, action, self.critic(x)

    def discount_rewards(self, rewards: list[float], discount: float) -> list[float]:
        """Returns-to-go: each reward plus the discounted sum of those after it."""
        out, running = [0.0] * len(rewards), 0.0
        for i in range(len(rewards) - 1, -1, -1):
            running = rewards[i] + discount * running
            out[i] = running
        return out

    def generate_trajectory_samples(self):
        """Roll the current policy out for `steps_per_epoch` steps, then yield (state, action, log-prob, return,
        advantage) per step; the dataset's iterator is this generator."""
        rollout = []
        for _ in range(self.steps_per_epoch):
            self.state = self.state.to(device=self.device)
            with torch.no_grad():
                pi, action, value = self(self.state)
                log_prob = self.actor.get_log_prob(pi, action)
            next_state, reward, done = self.env.step(self.state, int(action))
            rollout.append((self.state, action, log_prob, reward, value.item()))
            self.state = self.env.reset() if done else next_state
        rewards = [step[3] for step in rollout]
        returns = self.discount_rewards(rewards, self.gamma)
        self.avg_reward = sum(rewards) / self.steps_per_epoch
        for (state, action, log_prob, _, value), ret in zip(rollout, returns, strict=True):
            yield state, action, log_prob, ret, ret - value

    def actor_loss(self, state, action, logp_old, adv) -> torch.Tensor:
        """The clipped surrogate: the policy may not move the probability ratio beyond 1 +- clip_ratio."""
        pi, _ = self.actor(state)
        ratio = (self.actor.get_log_prob(pi, action) - logp_old).exp()
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip_ratio, 1 + self.clip_ratio) * adv)
        return -surrogate.mean()

    def critic_loss(self, state, qval) -> torch.Tensor:
        return F.mse_loss(self.critic(state).squeeze(-1), qval)

    def training_step(self, batch):
        state, action, old_logp, qval, adv = batch
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        self.log("avg_reward", self.avg_reward, prog_bar=True, on_step=False, on_epoch=True)
        optimizer_actor, optimizer_critic = self.optimizers()
        losses = {}
        optimizer_actor.zero_grad()
        losses["loss_actor"] = self.actor_loss(state, action, old_logp, adv)
        self.manual_backward(losses["loss_actor"])
        optimizer_actor.step()
        optimizer_critic.zero_grad()
        losses["loss_critic"] = self.critic_loss(state, qval.float())
        self.manual_backward(losses["loss_critic"])
        optimizer_critic.step()
        self.log("loss_critic", losses["loss_critic"], on_step=False, on_epoch=True, prog_bar=False, logger=True)
        self.log("loss_actor", losses["loss_actor"], on_step=False, on_epoch=True, prog_bar=True, logger=True)

    def configure_optimizers(self) -> list[Optimizer]:
        optimizer_actor = torch.optim.Adam(self.actor.parameters(), lr=self.hparams.lr_actor)
        optimizer_critic = torch.optim.Adam(self.critic.parameters(), lr=self.hparams.lr_critic)
        return optimizer_actor, optimizer_critic

    def optimizer_step(self, *args, **kwargs):
        for _ in range(self.nb_optim_iters):
            super().optimizer_step(*args, **kwargs)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset=ExperienceSourceDataset(self.generate_trajectory_samples), batch_size=self.batch_size)


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(0)
    model = PPOLightning()
    trainer = Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        enable_checkpointing=False,
        callbacks=list(callbacks),
        **trainer_options,
    )
    trainer.fit(model)
    return {"trainer": trainer, "model": model}
