"""Rewards scored by Ray actors, for runs placed on a Ray cluster: the same contract as `tasks.scoring.RewardScorer`
(a reward function by import path, a timer of `timeout_s` on every call, 0 and a count for a call that runs over)
with the work spread over the cluster instead of the driver's processes.

Each actor scores one completion per call in its main thread (`tasks.scoring.score_one`, whose timer needs it), so
a runaway comparison is interrupted where it runs. A call the timer cannot reach (stuck in native code) is caught
by a deadline on the whole batch; its actors are then killed and replaced, and the items they had not finished
score 0 and are counted. The actors ask for no CPU of their own (`num_cpus=0`): they must not wait behind the
trainer's and the generators' reserved bundles, and scoring is short next to a step.
"""

from __future__ import annotations

import math

from ..tasks.scoring import resolve, score_one


def _ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError("scoring rewards on Ray needs Ray: pip install 'megatron-spec[ray]'") from err
    return ray


class _Scorer:
    """One scoring actor: `score_one` on the actor's main thread."""

    def score(self, path: str, text: str, answer: str, timeout_s: float) -> tuple[float, bool]:
        return score_one(path, text, answer, timeout_s)


class RayRewardScorer:
    """Scores (text, answer) pairs with the reward function at `path` in `workers` Ray actors (at least one), each
    call under a timer of `timeout_s`; needs a running Ray cluster (`ray.init` made by the caller)."""

    def __init__(self, path: str, workers: int = 2, timeout_s: float = 10.0):
        resolve(path)  # a bad path fails here, before any actor starts
        self.path, self.workers, self.timeout_s = path, max(workers, 1), timeout_s
        self.actors = []

    def _start(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("RayRewardScorer needs a running Ray cluster (ray.init)")
        cls = ray.remote(num_cpus=0)(_Scorer)
        self.actors = [cls.remote() for _ in range(self.workers)]

    def __call__(self, texts: list[str], answers: list[str]) -> tuple[list[float], int]:
        """(rewards, how many timed out). A reward function that raises is a bug in it: re-raised with the text."""
        if not texts:
            return [], 0
        ray = _ray()
        if not self.actors:
            self._start()
        refs = [self.actors[i % len(self.actors)].score.remote(self.path, t, a, self.timeout_s)
                for i, (t, a) in enumerate(zip(texts, answers))]
        # Every call is bounded by its own timer; this deadline only catches an actor the timer cannot interrupt.
        deadline = self.timeout_s * (math.ceil(len(refs) / len(self.actors)) + 1) + 60
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline)
        finished = set(done)
        results = []
        for ref, text in zip(refs, texts):
            if ref not in finished:
                results.append((0.0, True))
                continue
            try:
                results.append(tuple(ray.get(ref)))
            except Exception as err:  # noqa: BLE001 - re-raised with the completion that broke it
                raise RuntimeError(f"reward function {self.path} failed on completion {text[:80]!r}: {err}") from err
        if len(finished) < len(refs):
            self.close()
        return [float(r) for r, _ in results], sum(bool(t) for _, t in results)

    def close(self) -> None:
        """Stop the actors (a later call starts new ones)."""
        if self.actors:
            ray = _ray()
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
