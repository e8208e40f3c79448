"""The live refit at Megatron PP 2 x EP 2 (four gloo ranks as Ray actors, the tiny MoE) into a vLLM engine of
tensor parallel size 2, disaggregated and colocated: two senders, one per pipeline stage, each gathering and
sending only its own stage's weights, reach both engine workers, and the engine then serves the trainer's weights
exactly (greedy tokens of another model after a refit; log-probs of every synchronous step)."""

import pytest

from megatron_spec.interfaces import SamplingParams
from megatron_spec.placement.driver import RayTrainer
from megatron_spec.placement.groups import TrainerGroup
from tests.generators.vllm.common import perturbed, vllm_only
from tests.placement.test_driver import moe_policy, ray_cfg  # noqa: F401  (fixture)
from megatron_spec.rl.task import PromptTask
from tests.rl.test_loop import ckpts  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, *vllm_only]

PP, EP, TP = 2, 2, 2
STEPS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def other_moe(moe_policy, tmp_path_factory):  # noqa: F811
    """The tiny MoE with N(0, 0.05^2) noise on every weight: the model the trainer holds, which the engine (started
    from the tiny MoE's files) serves only once a refit brought it."""
    from megatron_spec.models import from_pretrained, save_pretrained

    root = tmp_path_factory.mktemp("other_moe") / "policy"
    save_pretrained(perturbed(from_pretrained(str(moe_policy)), seed=7, scale=0.05), root)
    return root


@pytest.fixture
def parity_reward(monkeypatch):
    """Reward 1 for a rollout whose token ids sum to an odd number: random tiny models never solve the task, and
    this reward differs within a group often enough that the policy-gradient term moves the weights every few
    steps (not only the MoE load-balancing term), so each refit carries weights the engine has not served."""
    monkeypatch.setattr(PromptTask, "reward", lambda self, ids, problem: float(sum(ids) % 2))


def stage_of(name: str, layers: int) -> int:
    """The pipeline stage (of PP, layers split evenly) an HF tensor belongs to: the embedding on the first stage,
    the final norm and the output head on the last, each decoder layer on the stage holding its index."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) * PP // layers
    return 0 if name.startswith("model.embed_tokens.") else PP - 1


def stage_bytes(policy_dir) -> list[dict]:
    """Per stage, from the checkpoint's own tensors: all bytes, the experts' bytes, and the bytes of the tensors
    vLLM keeps whole on every TP rank (the RMS norms and the routers' gates; with as many kv heads as TP ranks,
    k / v split), which the sharded refit sends to each of the engine's TP ranks (fp32: the engine serves the
    checkpoint's dtype, and the refit streams in it)."""
    from megatron_spec.models import from_pretrained

    model = from_pretrained(str(policy_dir))
    layers = model.config.num_hidden_layers
    assert model.config.num_key_value_heads % TP == 0  # k / v are then cut, not replicated
    out = [{"all": 0, "experts": 0, "replicated": 0} for _ in range(PP)]
    for name, t in model.state_dict().items():
        s, n = stage_of(name, layers), t.numel() * 4
        out[s]["all"] += n
        if ".mlp.experts." in name:
            out[s]["experts"] += n
        if "norm." in name or name.endswith(".mlp.gate.weight"):
            out[s]["replicated"] += n
    return out


def split_trainer(cfg, trainer_policy):
    """A RayTrainer whose trainer ranks load `trainer_policy` while its engine starts from `cfg.model.policy`'s files:
    the engine serves the trainer's model only once a refit has carried it there. Only the trainer group is handed
    the other config (the driver builds it through `TrainerGroup.of`)."""
    import dataclasses

    import megatron_spec.placement.driver as driver

    trainer_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, policy=str(trainer_policy)))

    class OtherPolicy(TrainerGroup):
        @classmethod
        def of(cls, _cfg, placement, pg):
            return TrainerGroup.of(trainer_cfg, placement, pg)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "TrainerGroup", OtherPolicy)
        return RayTrainer(cfg)


def greedy_of(policy_dir, prompts) -> list[list[int]]:
    """Our embedded engine's greedy tokens on the model in `policy_dir` (the reference the vLLM engine must equal)."""
    from megatron_spec.engine import LLMEngine
    from megatron_spec.models import from_pretrained

    return [o.token_ids for o in LLMEngine(from_pretrained(str(policy_dir))).generate(prompts, GREEDY)]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def run(request, ray_cluster, ckpts, moe_policy, other_moe, tmp_path_factory):  # noqa: F811
    """One PP2 x EP2 trainer holding `other_moe` and one vLLM engine of TP 2 started from `moe_policy`, per
    placement. Before anything else it records the engine's greedy tokens on a few prompts before and after the
    first refit (so the greedy test does not depend on the steps having run or not), then yields the trainer."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    cfg = ray_cfg(ckpts, tmp_path_factory.mktemp(request.param), request.param, steps=STEPS)
    cfg.model.policy, cfg.model.drafter, cfg.spec = str(moe_policy), None, None
    cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.max_tokens = 2, 2, 8
    cfg.backend.trainer, cfg.backend.generator = "megatron", "vllm"
    cfg.backend.megatron.pp, cfg.backend.megatron.ep = PP, EP
    cfg.backend.vllm.tensor_parallel_size, cfg.backend.vllm.max_model_len = TP, 128
    trainer = split_trainer(cfg, other_moe)
    try:
        prompts = [trainer.task.encode(p) for p in trainer.task.problems(0, 4)]
        before = [o.token_ids for o in trainer.generator.generate(prompts, GREEDY)]
        trainer.refit()
        after = [o.token_ids for o in trainer.generator.generate(prompts, GREEDY)]
        yield trainer, {"prompts": prompts, "before": before, "after": after}
    finally:
        trainer.close()


def test_refit_with_another_model_serves_its_greedy_tokens(run, moe_policy, other_moe):  # noqa: F811
    """Before the first refit the engine's greedy tokens are our engine's on the tiny MoE it started from; after a
    refit from the trainer (which holds the perturbed copy, whose greedy tokens differ) they are our engine's on the
    perturbed copy, token for token: every tensor of both stages, experts of both EP ranks included, reached both
    TP workers and was sharded there as vLLM's loader does (a missing stage, expert or shard changes the tokens).
    Colocated, the engine (its actor, whose processes are its two workers) shares bundle 0 with trainer ranks 0
    and 1, ranks 2 and 3 taking a bundle each; disaggregated, every rank and the engine have bundles of their own.
    Both refit over gloo (CPUs)."""
    trainer, seen = run
    placement = trainer.placement
    ranks = [placement.trainer(r).bundle for r in range(PP * EP)]
    if placement.kind == "colocated":
        assert (ranks, placement.generator(0).bundle, len(placement.bundles)) == ([0, 0, 1, 2], 0, 3)
    else:
        assert (ranks, placement.generator(0).bundle, len(placement.bundles)) == ([0, 1, 2, 3], 4, 5)
    start, other = greedy_of(moe_policy, seen["prompts"]), greedy_of(other_moe, seen["prompts"])
    assert start != other
    assert seen["before"] == start
    assert seen["after"] == other
    assert placement.engine_tp == TP and trainer.transport.backend == "gloo"


def test_each_stage_sends_its_own_share_and_engine_logprobs_match(run, other_moe, parity_reward):  # noqa: F811
    """Three synchronous steps. Every refit has exactly 2 senders (one per pipeline stage), the busiest sending
    exactly its stage's bytes, its replicated tensors once more for the engine's second TP rank (the sharded
    refit: each TP rank's group takes its part of every split tensor and the replicated ones whole); the most any trainer rank received while gathering is exactly half the
    larger stage's expert bytes (the stage sender takes its EP peer's experts, nothing else: TP 1, dense weights
    replicated), which is below one stage's bytes, where a rank that received another stage's weights would exceed
    them; and the engine's log-prob of every sampled token is the trainer's within 1e-4 (both fp32), so each
    step's updated weights arrived whole; and they did move: rewards differ within the step and the gradient's
    norm is above 1 (3.9 to 9.2 here; about 0.01 when every reward is equal and only the MoE load-balancing term
    pulls). Colocated, the trainer offloads before each refit (its metrics logged), disaggregated never. All
    figures come from the checkpoint's tensors and the even stage split."""
    trainer, _ = run
    stages = stage_bytes(other_moe)
    largest = max(s["all"] for s in stages)
    busiest = max(s["all"] + (TP - 1) * s["replicated"] for s in stages)
    for step in range(STEPS):
        m = trainer.step(step)
        assert m["weight_sync_senders"] == PP, (step, m)
        assert m["weight_sync_sender_bytes_max"] == busiest, (step, m["weight_sync_sender_bytes_max"], stages)
        assert m["weight_sync_received_bytes_max"] <= largest
        assert m["weight_sync_received_bytes_max"] == max(s["experts"] for s in stages) // EP
        assert m["weight_sync_bytes"] == sum(s["all"] + (TP - 1) * s["replicated"] for s in stages)
        assert m["logprob_mismatch"] < 1e-4, (step, m["logprob_mismatch"])
        assert m["policy_lag"] == 0 and m["gen_tokens"] > 0
        assert 0 < m["reward_mean"] < 1 and m["grad_norm"] > 1, (step, m["reward_mean"], m["grad_norm"])
        assert ("trainer_offload" in m) == (trainer.placement.kind == "colocated")  # room made before each refit
