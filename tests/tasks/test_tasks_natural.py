"""Natural-language variant: same problems and answers as the tiny task, checked by the same extractor."""

import itertools

import pytest

from megatron_spec.tasks.arithmetic import ArithmeticDataset, Difficulty
from megatron_spec.tasks.natural import (
    INSTRUCTION,
    SMOLLM2_DIFFICULTY,
    NaturalDataset,
    NaturalProblem,
    from_problem,
    natural_reward,
)
from megatron_spec.tasks.reward import extract_answer


def test_known_wording():
    p = NaturalDataset(1, seed=0, difficulty=Difficulty())[0]  # the tiny task's 28-42+20+51
    assert p.question == f"What is 28 - 42 + 20 + 51? {INSTRUCTION}"
    assert p.solution == "28 - 42 = -14\n-14 + 20 = 6\n6 + 51 = 57\nThe answer is 57."
    assert p.answer == "57"
    assert p.messages() == [{"role": "user", "content": p.question}]
    assert p.messages("Be brief.")[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("ops", ["+-", "+-*"])
def test_same_problems_and_answers_as_the_tiny_task(ops):
    difficulty = Difficulty(max_terms=5, ops=ops)
    tiny = ArithmeticDataset(200, seed=5, difficulty=difficulty, split="eval")
    natural = NaturalDataset(200, seed=5, difficulty=difficulty, split="eval")
    for t, n in zip(tiny, natural):
        assert n.answer == t.answer
        # The spoken expression evaluates to the answer under normal precedence.
        expression = n.question.removeprefix("What is ").split("?")[0]
        assert eval(expression.replace("×", "*")) == int(t.answer)  # noqa: S307 - our own digits and operators
        # The reference solution passes the shared extractor and reward.
        assert extract_answer(n.solution) == t.answer and natural_reward(n.solution, n) == 1.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("28 - 42 = -14\n-14 + 20 = 6\n6 + 51 = 57\nThe answer is 57.", 1.0),
        ("Let me compute.\n28 - 42 + 20 + 51 = **57**.", 1.0),
        ("Let me compute.\n**57**", 1.0),
        ("so the total is 57", 0.0),  # no cue and no bare final number: not a conclusion the extractor trusts
        ("The answer is $\\boxed{57}$", 1.0),
        ("The answer is 56.", 0.0),
        ("28 - 42 = -14\n-14 + 20 = 6", 0.0),  # stopped before concluding
        ("I cannot help with that.", 0.0),
    ],
)
def test_chat_model_answers_are_checked_by_the_shared_extractor(completion, expected):
    assert natural_reward(completion, NaturalDataset(1, seed=0, difficulty=Difficulty())[0]) == expected


def test_default_difficulty_suits_a_135m_chat_model():
    p = NaturalDataset(1, seed=0)[0]
    assert p.question.startswith("What is 3 + 5 + 2?") and p.answer == "10"


def test_cycle_stays_aligned_with_the_tiny_dataset():
    tiny = ArithmeticDataset(4, seed=1, difficulty=SMOLLM2_DIFFICULTY)
    natural = NaturalDataset(4, seed=1)
    assert [p.answer for p in itertools.islice(natural.cycle(2), 5)] == [tiny[i % 4].answer for i in range(2, 7)]
    assert natural[3] == from_problem(tiny[3])


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="at least one problem, got size=0"):
        NaturalDataset(0)
    with pytest.raises(ValueError, match="needs a question, a solution and an answer"):
        NaturalProblem("What is 1 + 1?", "", "2")
