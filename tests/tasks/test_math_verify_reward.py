"""The math-verify reward and the parallel scorer: our reward equals math-verify's own verdict on crafted pairs
(boxed and unboxed, equal and unequal, integers, fractions, LaTeX, units), in-process and through worker
processes; a call that runs over its timeout scores 0 and is counted; a bad import path fails before scoring."""

import os
import time

import pytest

math_verify = pytest.importorskip("math_verify", reason="the `math` extra (math-verify) is not installed")

from megatron_spec.tasks.math_verify_reward import math_verify_reward  # noqa: E402
from megatron_spec.tasks.scoring import RewardScorer, resolve  # noqa: E402

PAIRS = [  # (reference answer, completion, equal by hand)
    ("72", "Natalia sold 48 + 24 = 72 clips. The answer is \\boxed{72}.", True),
    ("72", "So she sold \\boxed{73} clips.", False),
    ("72", "The answer is 72.", True),
    ("72", "#### 70", False),
    ("-5", "Subtracting gives \\boxed{-5}", True),
    ("-5", "\\boxed{5}", False),
    ("1000", "\\boxed{1,000}", True),
    ("3/4", "\\boxed{\\frac{3}{4}}", True),
    ("\\frac{3}{4}", "The probability is \\boxed{0.75}", True),
    ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}", False),
    ("\\frac{1}{2}", "so the result is $\\frac{2}{4}$", True),
    ("\\dfrac{5}{8}", "\\boxed{\\frac{5}{8}}", True),
    ("2/3", "\\boxed{0.6}", False),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", True),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", True),
    ("2\\sqrt{3}", "\\boxed{3\\sqrt{2}}", False),
    ("\\pi", "The area is \\boxed{\\pi}", True),
    ("2\\pi", "\\boxed{\\pi}", False),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", True),
    ("x^2+1", "\\boxed{(x+1)^2}", False),
    ("(1,2)", "The point is \\boxed{(1, 2)}", True),
    ("(1,2)", "\\boxed{(2, 1)}", False),
    ("5", "The side is \\boxed{5\\text{ cm}}", True),
    ("12", "It costs \\boxed{\\$12}", True),
    ("50\\%", "\\boxed{50\\%}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{1}{2}}", False),
    ("10", "I am not sure.", False),
    ("\\boxed{0}", "\\boxed{0}", True),
    ("$7$", "First 3, then 4, so \\boxed{7}", True),
]
REWARD = "megatron_spec.tasks.math_verify_reward:math_verify_reward"


def direct(gold: str, completion: str) -> float:
    """math-verify called as its README shows, the bare reference boxed so that its LaTeX parses as LaTeX."""
    if "\\boxed" not in gold and "$" not in gold:
        gold = "\\boxed{" + gold + "}"
    return float(math_verify.verify(math_verify.parse(gold), math_verify.parse(completion)))


def test_reward_equals_math_verify_on_crafted_pairs():
    """30 pairs, 19 equal and 11 not by hand; math-verify agrees with the hand labels, and our reward with it."""
    expected = [direct(g, c) for g, c, _ in PAIRS]
    assert expected == [float(e) for _, _, e in PAIRS]
    assert sum(expected) == 19
    assert [math_verify_reward(c, g) for g, c, _ in PAIRS] == expected


def test_unevaluated_arithmetic_is_not_an_answer():
    """math-verify scores a restated expression (`7 + 9` for 16) as equal; our reward gives it 0, while the same
    completions with the value computed, and final forms that contain an operator (a fraction, a root, a
    polynomial), keep math-verify's verdict."""
    restated = [("16", "What is 7 plus 9? 7 + 9"), ("16", "The answer is \\boxed{7+9}"),
                ("36", "It is $12 \\times 3$"), ("6", "4 - -2")]
    for gold, completion in restated:
        assert direct(gold, completion) == 1.0  # what the guard is for
        assert math_verify_reward(completion, gold) == 0.0
    computed = [("16", "What is 7 plus 9? 16"), ("16", "The answer is \\boxed{16}"), ("3/4", "\\boxed{3/4}"),
                ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"), ("x^2+2x+1", "\\boxed{(x+1)^2}"), ("-5", "\\boxed{-5}")]
    assert [math_verify_reward(c, g) for g, c in computed] == [1.0] * len(computed)


def test_parallel_scorer_equals_in_process_and_direct():
    """The same 30 through 2 spawned workers and in this process: identical rewards, no timeouts. The timer is not
    what is tested here (the slow-reward test below is), so it is far above any call: a fresh worker's first
    math-verify call also builds its parsers (2.7 s on a 2-core machine at load 12, over 10 s at load 19)."""
    texts, answers = [c for _, c, _ in PAIRS], [g for g, _, _ in PAIRS]
    expected = [direct(g, c) for g, c, _ in PAIRS]
    serial = RewardScorer(REWARD, workers=0, timeout_s=300)
    assert serial(texts, answers) == (expected, 0)
    pool = RewardScorer(REWARD, workers=2, timeout_s=300)
    try:
        assert pool(texts, answers) == (expected, 0)
    finally:
        pool.close()


def slow_reward(text: str, answer: str) -> float:
    """1.0 at once for "fast" (and for the answer itself, the warm-up), otherwise sleeps well past any timeout the
    tests set."""
    if text not in ("fast", answer):
        time.sleep(30)
    return 1.0


_BUILT: set[int] = set()


def cold_reward(text: str, answer: str) -> float:
    """1.0, after 2 s the first time in a process (as math-verify builds its parsers on its first call)."""
    if os.getpid() not in _BUILT:
        time.sleep(2.0)
        _BUILT.add(os.getpid())
    return 1.0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_functions_first_call_is_not_counted_against_a_completion(workers):
    """A reward function slow only on its first call in a process (2 s) under a 0.5 s timer: every completion
    scores 1, none timed out, because each process warms the function up on the answer against itself before
    timing a completion. Without the warm-up the first completion of each process would score 0 and count."""
    scorer = RewardScorer(f"{__name__}:cold_reward", workers=workers, timeout_s=0.5)
    try:
        assert scorer(["a", "b", "c", "d"], ["1"] * 4) == ([1.0] * 4, 0)
    finally:
        scorer.close()


def failing_reward(text: str, answer: str) -> float:
    raise ZeroDivisionError("bad reward")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_call_over_its_timeout_scores_zero_and_is_counted(workers):
    """Two of four calls would sleep 30 s and then score 1 under a 0.5 s timeout: they score 0 and are counted, the
    fast ones 1, so each slow call was stopped (a call let run to its end scores 1). With workers, the pool is the
    one that scored them: the batch's deadline (61.5 s here), the other way a call ends, replaces the pool, so
    the calls were stopped by their own timers. Nothing is timed: a bound on the batch's wall time would also count
    spawning the workers and importing this module, which a loaded machine slows without limit."""
    scorer = RewardScorer(f"{__name__}:slow_reward", workers=workers, timeout_s=0.5)
    try:
        assert scorer(["fast", "slow", "fast", "slow"], ["1"] * 4) == ([1.0, 0.0, 1.0, 0.0], 2)
        assert (scorer.pool is not None) == (workers > 0)
    finally:
        scorer.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_reward_is_reported_with_its_completion(workers):
    scorer = RewardScorer(f"{__name__}:failing_reward", workers=workers)
    try:
        with pytest.raises(RuntimeError, match="failing_reward failed on completion 'x = 1'"):
            scorer(["x = 1"], ["1"])
    finally:
        scorer.close()


def test_bad_reward_path_fails_before_scoring():
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("megatron_spec.tasks.no_such_module:f")
    with pytest.raises(ValueError, match="cannot be imported"):
        RewardScorer("megatron_spec.tasks.math_verify_reward:no_such_function")


def test_workers_do_not_rerun_a_script_without_a_main_guard(tmp_path):
    """Spawned workers import `__main__` by default: a training script without `if __name__ == "__main__"` would
    start the whole job again in each worker. The script below prints its marker once and scores with 2 workers
    (under a timer far above any call: a fresh worker's first math-verify call, which also builds its parsers, ran
    past the default 10 s at load 19 on a 2-core machine and scored 0)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text("print('JOB STARTED', flush=True)\n"
                      "from megatron_spec.tasks.scoring import RewardScorer\n"
                      f"s = RewardScorer({REWARD!r}, workers=2, timeout_s=300)\n"
                      "print(s(['\\\\boxed{1}', '2'], ['1', '1']), flush=True)\n"
                      "s.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300).stdout
    assert out.count("JOB STARTED") == 1 and "([1.0, 0.0], 0)" in out
