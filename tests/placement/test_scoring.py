"""Rewards scored by Ray actors (`placement/scoring.py`) on the local Ray cluster: the same rewards as the
in-process scorer, the per-item timeout with its count, and the dataset task choosing them for a Ray placement."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.ray

SLOW = "tests.placement.test_scoring:slow_reward"


def slow_reward(text: str, answer: str) -> float:
    """1.0 for an exact match; the answer `spin` runs a Python loop for 60 s (the timer interrupts it)."""
    if answer == "spin":
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
    return float(text.strip() == answer)


def pairs() -> tuple[list[str], list[str]]:
    """Boxed and plain answers, fractions and LaTeX, equal and not (math-verify's verdicts differ across them)."""
    texts = ["The answer is \\boxed{42}.", "so \\boxed{\\frac{3}{4}}", "It is 0.75", "\\boxed{2\\sqrt{2}}",
             "The answer is 7.", "\\boxed{9/2}", "x = -3", "\\boxed{1000}"]
    answers = ["42", "3/4", "\\frac{3}{4}", "\\sqrt{8}", "8", "4.5", "-3", "1024"]
    return texts, answers


def test_ray_actors_score_what_the_process_scorer_scores(ray_cluster):
    """math-verify through 2 actors gives, item for item, the in-process scorer's rewards (and some are 1, some 0,
    so a scorer returning a constant fails); nothing times out. The timers are far above any call (the runaway
    test below is the timer's): an actor's first math-verify call also builds its parsers, which took over 10 s on
    a 2-core machine at load 19."""
    pytest.importorskip("math_verify", reason="the `math` extra (math-verify) is not installed")
    from megatron_spec.placement.scoring import RayRewardScorer
    from megatron_spec.tasks.scoring import RewardScorer

    texts, answers = pairs()
    path = "megatron_spec.tasks.math_verify_reward:math_verify_reward"
    expected, _ = RewardScorer(path, workers=0, timeout_s=300)(texts, answers)
    scorer = RayRewardScorer(path, workers=2, timeout_s=300)
    try:
        assert scorer(texts, answers) == (expected, 0)
    finally:
        scorer.close()
    assert 0 < sum(expected) < len(expected)


def test_a_runaway_item_scores_zero_and_is_counted(ray_cluster):
    """One item spins for 60 s under a 1 s timer: it scores 0 and counts as one timeout (a spin let run to its end
    would score 0 uncounted), the others score as the function says, and the actors that scored them are kept and
    go on scoring: the batch's deadline (63 s here), the other way an item ends, kills and replaces the actors, so
    the timer interrupted the spin in the actor's main thread. Nothing is timed: a bound on the batch's wall time
    would also count starting the actors, which a loaded machine slows without limit."""
    from megatron_spec.placement.scoring import RayRewardScorer

    scorer = RayRewardScorer(SLOW, workers=2, timeout_s=1.0)
    try:
        rewards, timeouts = scorer(["a", "b", "x", "c"], ["a", "spin", "y", "c"])
        assert (rewards, timeouts) == ([1.0, 0.0, 0.0, 1.0], 1)
        actors = scorer.actors
        assert len(actors) == 2
        assert scorer(["d"], ["d"]) == ([1.0], 0)
        assert scorer.actors is actors  # the same actors go on scoring
    finally:
        scorer.close()


def test_a_ray_placement_scores_its_dataset_on_ray(tmp_path):
    """The dataset task of a run placed on Ray gets the Ray scorer, an inline run the process scorer, and 0 workers
    score in the driver either way (built without starting anything)."""
    pytest.importorskip("ray", reason="needs Ray: pip install 'megatron-spec[ray]'")
    from megatron_spec.placement.scoring import RayRewardScorer
    from megatron_spec.rl.data_config import DataSection
    from megatron_spec.tasks.dataset import make_scorer
    from megatron_spec.tasks.scoring import RewardScorer

    data = DataSection(path="x.jsonl", reward=SLOW, reward_workers=3, reward_timeout_s=2.0)
    on_ray = make_scorer(data, "colocated")
    assert isinstance(on_ray, RayRewardScorer) and (on_ray.workers, on_ray.timeout_s) == (3, 2.0)
    assert isinstance(make_scorer(data, "disaggregated"), RayRewardScorer)
    assert type(make_scorer(data, "inline")) is RewardScorer
    inline = make_scorer(DataSection(path="x.jsonl", reward=SLOW, reward_workers=0), "colocated")
    assert type(inline) is RewardScorer and inline.workers == 0
