"""Verifiable tasks: chained arithmetic for the tiny models and in natural language for chat models, the shared
answer extractor and reward, the character tokenizer and the `pretrain` command for the tiny reference models.

Only torch-free modules are re-exported here; `tokenizer`, `pretrain` import the model package (and torch).
"""

from .arithmetic import ANSWER_MARKER, ArithmeticDataset, Difficulty, Problem
from .natural import NaturalDataset, NaturalProblem, natural_reward
from .reward import extract_answer, reward

__all__ = [
    "ANSWER_MARKER", "ArithmeticDataset", "Difficulty", "Problem", "NaturalDataset", "NaturalProblem",
    "natural_reward", "extract_answer", "reward",
]
