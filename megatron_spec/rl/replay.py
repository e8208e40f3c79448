"""The replay of finished GRPO groups under bounded staleness (`grpo.max_trajectory_age`).

A group a step did not train although it carries a learning signal (dynamic sampling's `train_groups` took others,
or more groups finished than the step takes) is not thrown away: it waits here and is offered to the next step
ahead of that step's own groups (oldest first), with its age one version older per step that passed. A group whose
age exceeds the bound is dropped by that step's staleness check and counted there (`groups_dropped_stale`); groups
with uniform rewards never wait (their advantages are zero: nothing to learn). Each group keeps its own rewards,
so its advantages (group baseline and std) are what they were; its rows carry their behaviour log-probs, and the
step that trains them corrects them as off-policy (`Rollouts.lag`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..interfaces import Rollouts


@dataclass
class Waiting:
    """One group waiting for a later step: its rows' prompts and completions, their rewards and ages (policy
    versions between the weights that generated each row and the weights of the step that left it out)."""

    prompts: list[list[int]]
    outs: list
    rewards: torch.Tensor
    ages: list[int]


@dataclass
class Replay:
    """The groups waiting to be trained, oldest first."""

    groups: list[Waiting] = field(default_factory=list)

    def offer(self, prompts: list[list[int]], rollouts: Rollouts,
              rewards: torch.Tensor) -> tuple[list[list[int]], Rollouts, torch.Tensor]:
        """The step's prompts, rollouts and rewards with the waiting groups in front, each a version older than
        when it was left out (the step that left it out updated the policy once); the replay is then empty."""
        if not self.groups:
            return prompts, rollouts, rewards
        ages = rollouts.ages if rollouts.ages is not None else [rollouts.lag] * len(rollouts.outs)
        waiting, self.groups = self.groups, []
        older = [a + 1 for w in waiting for a in w.ages]
        return ([p for w in waiting for p in w.prompts] + prompts,
                dataclasses.replace(rollouts, outs=[o for w in waiting for o in w.outs] + rollouts.outs,
                                    ages=older + ages, lag=max(older + ages)),
                torch.cat([w.rewards for w in waiting] + [rewards]))

    def keep(self, prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor, group_size: int,
             groups: list[int]) -> None:
        """Let the groups `groups` (indices into the step's prompt-major groups) wait for a later step."""
        ages = rollouts.ages if rollouts.ages is not None else [rollouts.lag] * len(rollouts.outs)
        for g in groups:
            rows = slice(g * group_size, (g + 1) * group_size)
            self.groups.append(Waiting(prompts[rows], rollouts.outs[rows], rewards[rows], ages[rows]))

    def __len__(self) -> int:
        return len(self.groups)
