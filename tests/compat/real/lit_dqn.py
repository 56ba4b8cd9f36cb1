"""Deep Q-learning from a replay buffer streamed through an IterableDataset.

Follows the idioms of Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/reinforce_learn_Qnet.py:
an agent that plays epsilon-greedy steps in ``training_step`` and fills a replay buffer, an ``IterableDataset``
that samples the buffer (Python's ``random``), a target network synced every ``sync_rate`` steps on
``self.global_step``, the device read with ``self.on_gpu``, a ``training_step`` that returns an ``OrderedDict``
with ``loss``, ``log`` and ``progress_bar``, and ``configure_optimizers`` returning ``[optimizer]``. A
deterministic corridor walk stands in for gym's CartPole.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque, namedtuple
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.optim as optim
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.dataset import IterableDataset


class Corridor:
    """Walk left or right on a line of `length` cells; reward 1 at the right end, which ends the episode."""

    def __init__(self, length: int = 6, max_steps: int = 20):
        self.length, self.max_steps = length, max_steps
        self.observation_size, self.n_actions = 4, 2
        self.reset()

    def _obs(self) -> list[float]:
        x = self.position / (self.length - 1)
        return [x, 1.0 - x, float(self.position == 0), self.steps / self.max_steps]

    def reset(self) -> list[float]:
        self.position, self.steps = 0, 0
        return self._obs()

    def step(self, action: int) -> tuple[list[float], float, bool]:
        self.position = min(max(self.position + (1 if action == 1 else -1), 0), self.length - 1)
        self.steps += 1
        reached = self.position == self.length - 1
        return self._obs(), (1.0 if reached else -0.05), reached or self.steps >= self.max_steps

    def sample_action(self) -> int:
        return random.randrange(self.n_actions)


class DQN(nn.Module):
    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x):
        return self.net(x.float())


Transition = namedtuple("Transition", ["obs", "action", "reward", "terminal", "next_obs"])


class ReplayMemory:
    """The last `capacity` transitions; `draw` picks `count` of them without replacement (Python's random)."""

    def __init__(self, capacity: int) -> None:
        self.memory: deque[Transition] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.memory)

    def push(self, transition: Transition) -> None:
        self.memory.append(transition)

    def draw(self, count: int) -> list[Transition]:
        return [self.memory[i] for i in random.sample(range(len(self.memory)), count)]


class ReplayStream(IterableDataset):
    """One pass yields `sample_size` transitions drawn afresh from the memory, as tensors."""

    def __init__(self, memory: ReplayMemory, sample_size: int = 32) -> None:
        self.memory = memory
        self.sample_size = sample_size

    def __iter__(self) -> Iterator:
        for t in self.memory.draw(self.sample_size):
            yield (
                torch.tensor(t.obs),
                torch.tensor(t.action),
                torch.tensor(t.reward, dtype=torch.float32),
                torch.tensor(t.terminal),
                torch.tensor(t.next_obs),
            )


class Walker:
    """Acts in the corridor, epsilon-greedy on a Q-network, and remembers what happened."""

    def __init__(self, env: Corridor, memory: ReplayMemory) -> None:
        self.env, self.memory = env, memory
        self.obs = env.reset()

    def choose(self, q_net: nn.Module, epsilon: float, device) -> int:
        explore = random.random() < epsilon
        if explore:
            return self.env.sample_action()
        obs = torch.tensor([self.obs], device=None if device == "cpu" else device)
        return int(q_net(obs).argmax(dim=1).item())

    @torch.no_grad()
    def act(self, q_net: nn.Module, epsilon: float = 0.0, device="cpu") -> tuple[float, bool]:
        action = self.choose(q_net, epsilon, device)
        next_obs, reward, done = self.env.step(action)
        self.memory.push(Transition(self.obs, action, reward, done, next_obs))
        self.obs = self.env.reset() if done else next_obs
        return reward, done


class DQNLightning(LightningModule):
    def __init__(
        self,
        replay_size: int = 200,
        warm_start_steps: int = 64,
        gamma: float = 0.9,
        eps_start: float = 1.0,
        eps_end: float = 0.05,
        eps_last_frame: int = 40,
        sync_rate: int = 5,
        lr: float = 1e-2,
        episode_length: int = 32,
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.replay_size = replay_size
        self.warm_start_steps = warm_start_steps
        self.gamma = gamma
        self.eps_start = eps_start
        self.eps_end = eps_end
        self.eps_last_frame = eps_last_frame
        self.sync_rate = sync_rate
        self.lr = lr
        self.episode_length = episode_length
        self.batch_size = batch_size

        self.env = Corridor()
        self.net = DQN(self.env.observation_size, self.env.n_actions)
        self.target_net = DQN(self.env.observation_size, self.env.n_actions)
        self.memory = ReplayMemory(self.replay_size)
        self.walker = Walker(self.env, self.memory)
        self.total_reward = 0.0
        self.episode_reward = 0.0
        self.populate(self.warm_start_steps)

    def populate(self, steps: int) -> None:
        """Random moves until the memory holds `steps` transitions to learn from."""
        while len(self.memory) < steps:
            self.walker.act(self.net, epsilon=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def td_loss(self, batch) -> torch.Tensor:
        """Squared temporal-difference error against the target network's greedy value."""
        obs, actions, rewards, terminal, next_obs = batch
        q_taken = self.net(obs).gather(1, actions.view(-1, 1)).view(-1)
        with torch.no_grad():
            bootstrap = self.target_net(next_obs).max(dim=1).values.masked_fill(terminal, 0.0)
        return nn.functional.mse_loss(q_taken, rewards + self.gamma * bootstrap)

    def training_step(self, batch, nb_batch) -> OrderedDict:
        device = self.get_device(batch)
        epsilon = max(self.eps_end, self.eps_start - (self.global_step + 1) / self.eps_last_frame)
        reward, done = self.walker.act(self.net, epsilon, device)
        self.episode_reward += reward
        if done:
            self.total_reward, self.episode_reward = self.episode_reward, 0.0
        loss = self.td_loss(batch)
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        log = {
            "total_reward": torch.tensor(self.total_reward).to(device),
            "reward": torch.tensor(reward).to(device),
            "steps": torch.tensor(self.global_step).to(device),
        }
        self.log("total_reward", log["total_reward"], prog_bar=True)
        self.log("steps", log["steps"].float(), logger=False)
        return OrderedDict({"loss": loss, "log": log, "progress_bar": log})

    def configure_optimizers(self) -> list[Optimizer]:
        return [optim.Adam(self.net.parameters(), lr=self.lr)]

    def __dataloader(self) -> DataLoader:
        dataset = ReplayStream(self.memory, self.episode_length)
        return DataLoader(dataset=dataset, batch_size=self.batch_size, sampler=None)

    def train_dataloader(self) -> DataLoader:
        return self.__dataloader()

    def get_device(self, batch) -> str:
        return batch[0].device.index if self.on_gpu else "cpu"


def main(root_dir: str, callbacks=(), **trainer_options):
    seed_everything(0)
    model = DQNLightning()
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
