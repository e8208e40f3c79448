"""The RL task as the loop sees it: prompts as token ids for a data position, and rewards for completions."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..tasks.arithmetic import ArithmeticDataset, Difficulty, Problem
from ..tasks.pretrain_config import TASK_FILE
from ..tasks.reward import reward


def trained_difficulty(policy_path: str, terms_weights: tuple[float, ...] = ()) -> Difficulty:
    """The task difficulty a tiny checkpoint was pretrained on (its `task.json`), so RL asks it the problems it
    learned to solve, its chain lengths drawn with `terms_weights`; the default difficulty for a checkpoint without
    one."""
    card = Path(policy_path) / TASK_FILE
    trained = json.loads(card.read_text()).get("difficulty", {}) if card.is_file() else {}
    return Difficulty(**{**trained, "terms_weights": tuple(terms_weights)})


def task_difficulty(kind: str, policy_path: str, terms_weights: tuple[float, ...] = ()) -> Difficulty:
    """The problems RL asks: the tiny checkpoint's trained difficulty, or the chat model's own for `natural`
    (SmolLM2-135M solves ~1/16 of the tiny task's two-digit chains); a ValueError for an unknown task or weights
    that do not fit its chain lengths, raised before anything is built."""
    if kind == "tiny":
        return trained_difficulty(policy_path, terms_weights)
    if kind == "natural":
        from ..tasks.natural import SMOLLM2_DIFFICULTY

        return replace(SMOLLM2_DIFFICULTY, terms_weights=tuple(terms_weights))
    raise ValueError(f"unknown task {kind!r}: use 'tiny' or 'natural'")


def build_tasks(cfg) -> tuple:
    """(training task, held-out task) of an RL config: the dataset of `data.path`, rendered by the policy's
    tokenizer and chat template, or the built-in synthetic task of `model.task`. Both have the same interface."""
    m = cfg.model
    if cfg.data.path is not None:
        from ..models.gguf import load_tokenizer
        from ..tasks.dataset import DatasetTask

        return DatasetTask.load(cfg.data, load_tokenizer(m.policy), cfg.run.seed, cfg.run.eval_prompts,
                                cfg.backend.placement)
    return (PromptTask.build(m.task, m.policy, cfg.run.dataset_size, cfg.run.seed, "train", m.terms_weights),
            PromptTask.build(m.task, m.policy, max(cfg.run.eval_prompts, 1), cfg.run.seed, "eval", m.terms_weights))


@dataclass
class PromptTask:
    kind: str
    """`tiny` (character-level arithmetic for the tiny models) or `natural` (chat prompts through an HF tokenizer)."""
    dataset: ArithmeticDataset
    """Problems; item i is a pure function of (seed, split, i), so a resumed run continues at the same place."""
    tokenizer: object
    """CharTokenizer for `tiny`, the model's HF tokenizer for `natural`."""

    @classmethod
    def build(cls, kind: str, policy_path: str, size: int, seed: int, split: str = "train",
              terms_weights: tuple[float, ...] = ()) -> "PromptTask":
        if size < 1:
            raise ValueError(f"the prompt dataset is empty (size={size}): RL needs at least one prompt")
        difficulty = task_difficulty(kind, policy_path, terms_weights)
        dataset = ArithmeticDataset(size=size, seed=seed, split=split, difficulty=difficulty)
        if kind == "tiny":
            from ..tasks.tokenizer import CharTokenizer

            return cls(kind, dataset, CharTokenizer())
        from ..models.gguf import load_tokenizer

        return cls(kind, dataset, load_tokenizer(policy_path))

    def problems(self, start: int, n: int) -> list[Problem]:
        return [self.dataset[(start + i) % len(self.dataset)] for i in range(n)]

    def encode(self, problem: Problem) -> list[int]:
        if self.kind == "tiny":
            return self.tokenizer.encode(problem.prompt, bos=True)
        from ..tasks.natural import from_problem

        text = self.tokenizer.apply_chat_template(from_problem(problem).messages(), add_generation_prompt=True,
                                                  tokenize=False)
        # The chat template already holds the special tokens; encode it verbatim.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        if self.kind == "tiny":
            return self.tokenizer.decode(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def rewards(self, token_ids: list[list[int]], problems: list[Problem]) -> list[float]:
        """`reward` of each completion, in order (the dataset task's interface; these checks are cheap)."""
        return [self.reward(t, p) for t, p in zip(token_ids, problems)]

    reward_stats = {}
    """Nothing to report: these rewards never time out (a dataset task reports its timeouts here)."""

    def close(self) -> None:
        pass

    def reward(self, token_ids: list[int], problem: Problem) -> float:
        """1.0 for the right final answer; a reward function that raises is a bug in it, reported with context."""
        text = self.decode(token_ids)
        try:
            return float(reward(text, problem.answer))
        except Exception as err:  # noqa: BLE001 - re-raised with the text that broke it
            raise RuntimeError(f"reward function failed on completion {text[:80]!r}: {err}") from err
