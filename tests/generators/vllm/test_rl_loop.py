"""The RL loop on vLLM: `backend.generator=vllm` runs the tiny GRPO job (the README's) with its online MTP drafter
refit into vLLM every step (the generator is built by `VLLMGenerator.from_rl`)."""

import json

from megatron_spec.rl.config import RLConfig

from .common import vllm_only

pytestmark = vllm_only


def test_tiny_grpo_on_vllm(tmp_path):
    """Two steps of the tiny job, speculating on both (the whole-step gate off: it would start with plain steps):
    every step's acceptance length (our step metric) is above 2, i.e. the exported MTP drafter drafts in vLLM after
    each refit; the engine's behaviour log-probs match the trainer's recompute within 1e-4 (`logprob_mismatch`:
    fp32 on both sides, different kernels; measured ~1e-5)."""
    from megatron_spec.rl.loop import Trainer, run

    cfg = RLConfig()
    cfg.run.steps, cfg.run.out_dir, cfg.run.eval_every, cfg.run.report = 2, str(tmp_path), 0, False
    cfg.run.resume, cfg.run.save_every = False, 100
    cfg.backend.generator, cfg.drafter_train.gate = "vllm", False
    made = []

    def make(c):
        made.append(Trainer(c))
        return made[-1]

    try:
        run(cfg, make)
    finally:
        if made:
            made[0].generator.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["acceptance_length"] > 2, r
        assert r["logprob_mismatch"] < 1e-4, r
