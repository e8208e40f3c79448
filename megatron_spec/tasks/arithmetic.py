"""Chained integer arithmetic: the project's verifiable reference task.

A problem is a chain such as `12+7-30+5`; the worked solution folds it left to right, one step per line, and ends
with the answer after a fixed marker:

    prompt    12+7-30+5\\n
    solution  12+7=19\\n19-30=-11\\n-11+5=-6\\n=> -6

Why chained arithmetic rather than countdown: every problem has exactly one integer answer and one canonical
worked solution, so a tiny model can learn it from worked examples in minutes and a reward is a string compare.
Countdown needs search (several valid expressions, most paths dead ends), which a 1M-parameter model cannot do,
and its reward needs an expression checker. The chain also has the structure speculative decoding lives on:
each line copies the previous line's result and the next operand from the prompt (cheap for any drafter, even
n-gram), while the digits of each new result are the hard tokens where drafter and target disagree.

Difficulty is set by the number of terms, the operand range and the operators; `Difficulty()` is tuned so the tiny
dense model lands between 15 and 70 % greedy accuracy after the default pretraining (see `pretrain.py`).

A pretraining corpus can mix two writers (`generate`): a hurried one who drops carries (`slip_rate`), and a careful
one (`careful_rate`) who works each sum's units column before the result and never slips:

    hurried   47+38=75\n75+12=87\n=> 87          (the carry of 7+8 dropped)
    careful   47+38:7+8=15,85\n85+12:5+2=7,97\n=> 97

The careful text is longer and rarer, so RL that finds it changes what the policy writes, not only which digit it
picks: the shift that makes a drafter trained before RL go stale.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

ANSWER_MARKER = "=> "
"""Precedes the final answer on the last line of every worked solution."""

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    """One task instance; `prompt + solution` is the full worked example the tiny models are pretrained on."""

    prompt: str
    """What the model is given: the chain (parenthesised where a product follows a sum) and a newline."""
    solution: str
    """Worked solution: one `a op b = c` line per operator, then `=> answer`."""
    answer: str
    """Canonical integer answer (no sign for positives, no leading zeros), what rewards compare against."""

    def __post_init__(self) -> None:
        if not self.prompt or not self.solution:
            raise ValueError("a Problem needs a non-empty prompt and solution")
        try:
            canonical = str(int(self.answer))
        except ValueError:
            raise ValueError(f"Problem answer must be an integer string, got {self.answer!r}") from None
        if canonical != self.answer:
            raise ValueError(f"Problem answer {self.answer!r} is not canonical (expected {canonical!r})")


@dataclass(frozen=True)
class Difficulty:
    """The knob: how long the chain is, how big its operands are, which operators it uses."""

    min_terms: int = 2
    """Fewest operands in a chain (>= 2: one operator at least)."""
    max_terms: int = 4
    """Most operands in a chain; solution length grows by one line per extra term."""
    max_operand: int = 99
    """Operands are drawn uniformly from [0, max_operand]; results may go negative."""
    ops: str = "+-"
    """Operators to draw from; `*` multiplies by a single digit only, so results stay short."""
    terms_weights: tuple[float, ...] = ()
    """Relative chance of each chain length from `min_terms` to `max_terms` (one weight per length); empty: every
    length alike. RL rollouts are long-tailed, most answers short and a few long ones holding the batch open; weights
    that fall with the length give the tiny task that shape without leaving the lengths a checkpoint learned."""

    def __post_init__(self) -> None:
        if self.min_terms < 2:
            raise ValueError(f"min_terms must be >= 2, got {self.min_terms}")
        if self.max_terms < self.min_terms:
            raise ValueError(f"max_terms ({self.max_terms}) must be >= min_terms ({self.min_terms})")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or any(op not in _OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be a non-empty set of {''.join(_OPS)!r} without repeats, got {self.ops!r}")
        lengths = self.max_terms - self.min_terms + 1
        if self.terms_weights and (len(self.terms_weights) != lengths or min(self.terms_weights) < 0
                                   or not sum(self.terms_weights) > 0):
            raise ValueError(f"terms_weights needs {lengths} non-negative weights (one per chain length "
                             f"{self.min_terms}..{self.max_terms}) that do not all vanish, got {self.terms_weights}")


def carries(a: int, op: str, b: int) -> bool:
    """A sum of non-negatives whose units digits carry into the tens (the step a hurried writer gets wrong)."""
    return op == "+" and a >= 0 and b >= 0 and a % 10 + b % 10 >= 10


def check_rate(name: str, value: float) -> None:
    """A share of the corpus (`slip_rate`, `careful_rate`) must lie in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def solve(operands: list[int], ops: list[str], dropped: frozenset[int] = frozenset(),
          careful: bool = False) -> Problem:
    """The `Problem` for a chain, with its worked solution folded left to right (no operator precedence).

    `dropped` holds indices of solution lines whose carry the writer drops: such a line, where it `carries`, is
    written `a+b=c-10` and the fold goes on from the written value, so the solution and its `answer` are wrong in a
    way that is consistent from there on. This is the slip of the imperfect teacher behind a pretraining corpus
    (`generate`); a problem without dropped carries is always right.

    `careful` writes each sum of non-negatives as `a+b:u+v=s,c`, its units digits' sum `s` before the result `c`
    (the careful writer of the module docstring); such a writer drops no carries.
    """
    if len(operands) != len(ops) + 1 or not ops:
        raise ValueError("a chain needs n >= 2 operands and n - 1 operators")
    if careful and dropped:
        raise ValueError("a careful solution drops no carries")
    # The fold ignores precedence, so a product after a sum is written `(a+b)*c`: the prompt means what it says.
    expression = str(operands[0])
    for op, b in zip(ops, operands[1:]):
        if op == "*" and re.search(r"\d[+-]", expression):
            expression = f"({expression})"
        expression += f"{op}{b}"
    prompt = expression + "\n"
    lines, acc = [], operands[0]
    for i, (op, b) in enumerate(zip(ops, operands[1:])):
        result = _OPS[op](acc, b) - (10 if i in dropped and carries(acc, op, b) else 0)
        units = f":{acc % 10}+{b % 10}={acc % 10 + b % 10}," if careful and op == "+" and min(acc, b) >= 0 else "="
        lines.append(f"{acc}{op}{b}{units}{result}")
        acc = result
    lines.append(f"{ANSWER_MARKER}{acc}")
    return Problem(prompt=prompt, solution="\n".join(lines), answer=str(acc))


def generate(rng: random.Random, difficulty: Difficulty, slip_rate: float = 0.0,
             careful_rate: float = 0.0) -> Problem:
    """One random problem at `difficulty`, drawn from `rng`: written by the careful writer with `careful_rate`, else
    by the hurried one, who drops each line's carry with `slip_rate`."""
    if difficulty.terms_weights:
        n = rng.choices(range(difficulty.min_terms, difficulty.max_terms + 1), difficulty.terms_weights)[0]
    else:  # no weights keeps the draws every dataset made before they existed
        n = rng.randint(difficulty.min_terms, difficulty.max_terms)
    ops = [rng.choice(difficulty.ops) for _ in range(n - 1)]
    # A multiplier is one digit (and never the left-most operand's slot), so products stay a few digits long.
    operands = [rng.randint(0, difficulty.max_operand)]
    operands += [rng.randint(0, 9) if op == "*" else rng.randint(0, difficulty.max_operand) for op in ops]
    # No draws at rate 0, so clean datasets keep the streams they had before either writer existed.
    careful = bool(careful_rate) and rng.random() < careful_rate
    hurried = bool(slip_rate) and not careful
    dropped = frozenset(i for i in range(len(ops)) if rng.random() < slip_rate) if hurried else frozenset()
    return solve(operands, ops, dropped, careful)


@dataclass(frozen=True)
class ArithmeticDataset:
    """`size` problems, the i-th a pure function of (split, seed, i): a resumed run re-reads the same data.

    Each index gets its own generator seeded from the string `"{split}:{seed}:{index}"` (Python hashes string
    seeds with SHA-512, independent of PYTHONHASHSEED), so no state has to be saved to continue at a position,
    and train/eval splits never share a stream.
    """

    size: int
    """Number of problems; indices beyond it wrap around in `cycle`."""
    seed: int = 0
    """Seed of the whole dataset."""
    difficulty: Difficulty = Difficulty()
    """Problem generator knob."""
    split: str = "train"
    """Name mixed into every per-index seed: "train" and "eval" give disjoint random streams."""
    slip_rate: float = 0.0
    """Chance that a carrying line's carry is dropped (`solve`): a pretraining corpus written by an imperfect
    teacher. RL prompts and evaluation use 0, where every solution and answer is right."""
    careful_rate: float = 0.0
    """Share of problems written by the careful writer (`solve(careful=True)`), who never slips."""

    def __post_init__(self) -> None:
        check_rate("slip_rate", self.slip_rate)
        check_rate("careful_rate", self.careful_rate)
        if self.size < 1:
            raise ValueError(f"an arithmetic dataset needs at least one problem, got size={self.size}")
        if not self.split:
            raise ValueError("dataset split name must be non-empty")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Problem:
        if not 0 <= index < self.size:
            raise IndexError(f"problem index {index} out of range [0, {self.size})")
        rng = random.Random(f"{self.split}:{self.seed}:{index}")
        return generate(rng, self.difficulty, self.slip_rate, self.careful_rate)

    def __iter__(self) -> Iterator[Problem]:
        return (self[i] for i in range(self.size))

    def cycle(self, start: int = 0) -> Iterator[Problem]:
        """Endless stream from position `start` (wrapping every `size` problems): what an RL loop consumes."""
        if start < 0:
            raise ValueError(f"dataset position must be >= 0, got {start}")
        position = start
        while True:
            yield self[position % self.size]
            position += 1
