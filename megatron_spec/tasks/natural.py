"""The arithmetic task in natural language, for chat models such as SmolLM2-135M-Instruct.

Same problems, same answers, same extractor as the tiny task; only the wording changes. The user message asks for
step-by-step work ending in "The answer is N", and `reference_solution` writes such a solution (for SFT warm-up or
for training a drafter on in-domain text). Strings only: an HF tokenizer and its chat template turn these into ids
elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from .arithmetic import ANSWER_MARKER, ArithmeticDataset, Difficulty, Problem
from .reward import reward

INSTRUCTION = 'Solve it step by step, one operation per line, and finish with "The answer is N." where N is the result.'
"""Appended to every question; names the closing phrase the extractor looks for."""

SMOLLM2_DIFFICULTY = Difficulty(min_terms=2, max_terms=3, max_operand=9)
"""Default for chat models: SmolLM2-135M-Instruct (the Q4_1 GGUF, dequantised; greedy, 32 eval problems) solved
7/32 of these, 12/32 with two terms only, and 1/16 at the tiny models' `Difficulty()` (two-digit operands): RL
needs a start well above 0."""


@dataclass(frozen=True)
class NaturalProblem:
    """A `Problem` worded for a chat model."""

    question: str
    """The user message: the expression with spaced operators, then `INSTRUCTION`."""
    solution: str
    """A reference assistant answer in the requested format."""
    answer: str
    """Canonical integer answer, identical to the underlying `Problem.answer`."""

    def __post_init__(self) -> None:
        if not self.question or not self.solution or not self.answer:
            raise ValueError("a NaturalProblem needs a question, a solution and an answer")

    def messages(self, system: str | None = None) -> list[dict[str, str]]:
        """Chat messages for `tokenizer.apply_chat_template(..., add_generation_prompt=True)`."""
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": self.question}]


def _spaced(expression: str) -> str:
    """`-11+5*2=-1` -> `-11 + 5 × 2 = -1`: an operator right after a digit is binary and gets spaces, a sign does
    not; spaced operators also make subword tokenizers split numbers from operators consistently."""
    spaced = re.sub(r"(?<=[\d)])([+\-*])", r" \1 ", expression).replace("=", " = ")
    return spaced.replace("*", "×")


def from_problem(problem: Problem) -> NaturalProblem:
    """Word one tiny-task problem for a chat model."""
    expression = problem.prompt.strip()
    question = f"What is {_spaced(expression)}? {INSTRUCTION}"
    steps = [line for line in problem.solution.splitlines() if not line.startswith(ANSWER_MARKER)]
    worked = [_spaced(line) for line in steps]
    solution = "\n".join(worked + [f"The answer is {problem.answer}."])
    return NaturalProblem(question=question, solution=solution, answer=problem.answer)


@dataclass(frozen=True)
class NaturalDataset:
    """The natural-language view of an `ArithmeticDataset`: problem i here is problem i there (same seed, split and
    difficulty), reworded."""

    size: int
    """Number of problems."""
    seed: int = 0
    """Seed of the whole dataset (same meaning as `ArithmeticDataset.seed`)."""
    difficulty: Difficulty = SMOLLM2_DIFFICULTY
    """Problem generator knob; easier by default than the tiny task's (see `SMOLLM2_DIFFICULTY`)."""
    split: str = "train"
    """Random stream name ("train", "eval", ...)."""

    def __post_init__(self) -> None:
        # Validation (size >= 1, split non-empty) is the underlying dataset's; building it here raises early.
        self._source()

    def _source(self) -> ArithmeticDataset:
        return ArithmeticDataset(self.size, self.seed, self.difficulty, self.split)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> NaturalProblem:
        return from_problem(self._source()[index])

    def __iter__(self) -> Iterator[NaturalProblem]:
        return (self[i] for i in range(self.size))

    def cycle(self, start: int = 0) -> Iterator[NaturalProblem]:
        """Endless stream from position `start`, aligned with `ArithmeticDataset.cycle`."""
        return map(from_problem, self._source().cycle(start))


def natural_reward(completion_text: str, problem: NaturalProblem) -> float:
    """1.0 if the chat model's completion reaches `problem.answer`, else 0.0 (the tiny task's extractor)."""
    return reward(completion_text, problem.answer)
