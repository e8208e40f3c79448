"""The replay of finished GRPO groups under bounded staleness (`grpo.max_trajectory_age`).

A group a step did not train although it carries a learning signal (dynamic sampling's `train_groups` took others,
or more groups finished than the step takes) is not thrown away: it waits here and is offered to the next step
ahead of that step's own groups (oldest first), with its age one version older per step that passed. A step keeps
its size: the groups offered to it take the places of its newest own groups, which wait in their turn, so the
trainer's rows (and their split over data-parallel ranks) and its memory stay those of a step without a replay. A group whose
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


def groups_of(prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor, group_size: int,
              groups) -> list[Waiting]:
    """The step's prompt-major groups of indices `groups`, each as a `Waiting` with its rows' ages."""
    ages, out = rollouts.row_ages, []
    for g in groups:
        rows = slice(g * group_size, (g + 1) * group_size)
        out.append(Waiting(prompts[rows], rollouts.outs[rows], rewards[rows], ages[rows]))
    return out


@dataclass
class Replay:
    """The groups waiting to be trained, oldest first."""

    groups: list[Waiting] = field(default_factory=list)

    def offer(self, prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor,
              group_size: int) -> tuple[list[list[int]], Rollouts, torch.Tensor]:
        """The step's prompts, rollouts and rewards with the waiting groups in front, each a version older than
        when it was left out (the step that left it out updated the policy once), as many groups as the step had:
        the step's own groups that no longer fit wait, as they are, for the next step."""
        if not self.groups:
            return prompts, rollouts, rewards
        own = groups_of(prompts, rollouts, rewards, group_size, range(len(prompts) // group_size))
        waiting = [dataclasses.replace(w, ages=[a + 1 for a in w.ages]) for w in self.groups]
        offered, self.groups = (waiting + own)[:len(own)], (waiting + own)[len(own):]
        older = [a for w in offered for a in w.ages]
        return ([p for w in offered for p in w.prompts],
                dataclasses.replace(rollouts, outs=[o for w in offered for o in w.outs], ages=older, lag=max(older)),
                torch.cat([w.rewards for w in offered]))

    def keep(self, prompts: list[list[int]], rollouts: Rollouts, rewards: torch.Tensor, group_size: int,
             groups: list[int]) -> None:
        """Let the groups `groups` (indices into the step's prompt-major groups) wait for a later step."""
        self.groups += groups_of(prompts, rollouts, rewards, group_size, groups)
        self.groups.sort(key=lambda w: -max(w.ages))  # oldest first (stable: among equals, in the order they came)

    def state_dict(self) -> dict:
        """The waiting groups, for a checkpoint: a resumed run trains them as the uninterrupted run would."""
        return {"groups": [dict(vars(w)) for w in self.groups]}  # not asdict: the completions stay objects

    def load_state_dict(self, state: dict) -> None:
        self.groups = [Waiting(**w) for w in state["groups"]]

    def __len__(self) -> int:
        return len(self.groups)
