"""The one layout validator (`megatron_spec.layout`): Megatron-Core's rules, uneven first/last pipeline stages, and
the three callers (Megatron backend checks, simulator layouts, recipe Scale) giving the same verdicts."""

from __future__ import annotations

import pytest

from megatron_spec.layout import Layout, check_layout, layout_problems, stage_layers, suggest_split, world_problems
from megatron_spec.models import ModelConfig
from megatron_spec.models.presets import preset


def moe(**kw) -> ModelConfig:
    d = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=0, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32)
    d.update(kw)
    return ModelConfig(**d)


def test_even_and_uneven_stage_splits_are_megatrons():
    assert stage_layers(8, 4) == [2, 2, 2, 2]
    assert stage_layers(94, 8, 11, 11) == [11, 12, 12, 12, 12, 12, 12, 11]
    assert stage_layers(10, 3, first=2) == [2, 4, 4]  # only the first set: the rest split evenly
    assert stage_layers(10, 3, last=4) == [3, 3, 4]
    assert stage_layers(5, 2, 3, 2) == [3, 2]
    assert stage_layers(7, 1) == [7]


@pytest.mark.parametrize("layers, pp, first, last, message", [
    (94, 8, None, None, r"pp=8 does not divide the 94 layer\(s\).*accepts first/last stage layers \(11, 11\)"),
    (94, 8, 10, 10, "pp=8 does not divide the 74 layer"),
    (4, 5, None, None, "pp=5 exceeds num_hidden_layers=4"),
    (5, 2, 3, 3, "leaves -1 of num_hidden_layers=5"),
    (5, 2, 3, 1, "exactly none left over"),
    (4, 1, 2, None, "pp=1 has one stage"),
])
def test_bad_stage_splits_say_why(layers, pp, first, last, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(layers, pp, first, last)


@pytest.mark.parametrize("layers", range(1, 40))
def test_suggested_split_is_accepted_for_every_pp_up_to_the_layers(layers):
    """The simulator allows any pp <= layers by asking for this split: Megatron must accept each, and its largest
    stage must be the smallest any Megatron split (first f, last l, equal middle stages m) can have, found here by
    enumerating every (f, m)."""
    for pp in range(1, layers + 1):
        first, last = suggest_split(layers, pp)
        split = stage_layers(layers, pp, first, last)
        assert sum(split) == layers and min(split) >= 1 and len(split) == pp
        if pp <= 2:
            best = -(-layers // pp)
        else:
            best = min(max(f, m, layers - f - m * (pp - 2)) for m in range(1, layers) for f in range(1, layers)
                       if layers - f - m * (pp - 2) >= 1)
        assert max(split) == best, (layers, pp, split)


def test_model_rules_list_every_problem():
    problems = layout_problems(moe(), Layout(tp=3, ep=3, etp=3, pp=3))
    assert problems == [
        "tp=3 does not divide num_attention_heads=4",
        "tp=3 does not divide the query groups (num_key_value_heads=2); Megatron-Core keeps each query group on one rank",
        "ep=3 does not divide num_experts=8",
        "etp=3 does not divide moe_intermediate_size=32",
        "pp=3 does not divide the 4 layer(s) left for 3 evenly split stage(s) (num_hidden_layers=4); Megatron-Core "
        "accepts first/last stage layers (2, 1)",
    ]
    assert layout_problems(moe(), Layout(tp=2, ep=8, etp=1, pp=3, first_stage_layers=1, last_stage_layers=1)) == []


def test_kv_heads_split_for_training_may_replicate_for_generation():
    m = moe(num_key_value_heads=2)
    assert layout_problems(m, Layout(tp=4)) != []  # Megatron: 2 query groups over 4 ranks is refused
    assert layout_problems(m, Layout(tp=4), kv_replication=True) == []  # vLLM replicates KV heads
    assert "one must divide the other" in layout_problems(moe(num_attention_heads=12, num_key_value_heads=4),
                                                          Layout(tp=6, etp=1), kv_replication=True)[0]


def test_dense_models_refuse_ep_and_check_their_ffn():
    dense = moe(model_type="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, intermediate_size=90,
                num_key_value_heads=4)
    assert layout_problems(dense, Layout(ep=2)) == ["ep=2 needs an MoE model (qwen3 is dense)"]
    assert layout_problems(dense, Layout(tp=4), who="train") == [
        "train tp=4 does not divide intermediate_size=90"]


def test_world_grids():
    assert world_problems(128, Layout(tp=2, pp=8, cp=2, ep=16, etp=1)) == []
    assert world_problems(8, Layout(tp=3, etp=1)) == ["TP*PP*CP = 3 does not divide the 8 devices"]
    assert len(world_problems(8, Layout(tp=3))) == 2  # ETP defaults to TP: the expert grid fails as well
    assert "EP*PP = 16 (x ETP 1)" in world_problems(8, Layout(pp=2, ep=8, etp=1))[0]


def test_the_235b_recipe_layout_is_one_megatron_accepts():
    """TP2 PP8 CP1 EP8 on the recipe's 64 trainer GPUs with 12 layers on the first stage, 10 on the last and 12 on
    the six others, a layout the trainer runs."""
    import importlib

    mod = importlib.import_module("recipes.qwen3_235b_grpo_spec")
    section = mod.qwen3_235b_grpo_spec().backend.megatron
    lay = section.layout()
    s = mod.SCALE
    assert (lay.tp, lay.pp, lay.cp, lay.ep) == (s.parallel.tp, s.parallel.pp, s.parallel.cp, s.parallel.ep)
    check_layout(preset("qwen3-235b-a22b"), lay, s.nodes * s.gpus_per_node, runnable=True)
    assert stage_layers(94, 8, lay.first_stage_layers, lay.last_stage_layers) == [12, *[12] * 6, 10]
    with pytest.raises(ValueError, match="pp=8 does not divide the 94"):  # without the uneven split
        check_layout(preset("qwen3-235b-a22b"), Layout(tp=2, pp=8, cp=1, ep=16, etp=1), 128)


def test_the_three_callers_agree():
    """Backend checks, simulator and recipe Scale reject the same bad layout with the same sentence."""
    from megatron_spec.trainers.megatron.checks import Parallelism, check_parallelism
    from megatron_spec.sim.config import LengthDist, SimConfig, TrainParallel, Workload
    from recipes._common import Scale

    work = Workload(prompts_per_step=8, group_size=8, prompt_len=200, response=LengthDist(mean=500, max_tokens=1024))

    m = preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=128"):
        check_parallelism(m, Parallelism(ep=3, etp=1))
    with pytest.raises(ValueError, match="train ep=3 does not divide num_experts=128"):
        SimConfig(model=m, hardware="h100", gpus=3, workload=work, train=TrainParallel(ep=3, dp=3))
    with pytest.raises(ValueError, match=r"EP\*PP = 3 \(x ETP 1\) does not divide the 8 devices"):
        Scale(nodes=1, gpus_per_node=8, parallel=Layout(ep=3, etp=1, engine=Layout()))
    with pytest.raises(ValueError, match=r"EP\*PP = 3 \(x ETP 1\) does not divide the 8 devices"):
        check_parallelism(m, Parallelism(ep=3, etp=1, cp=1), world_size=8)


def test_context_parallelism_is_refused_where_a_layout_is_chosen_or_accepted():
    """Megatron-Core takes CP2 and the grids fit, but the trainer does not run it: the shared rule names the fix; the
    config section, the recipe Scale and the backend check refuse it before anything loads; the simulator may still
    predict it; the tuner never picks it and counts why (cp=2 at tp 1 and tp 2: two layouts)."""
    from megatron_spec.trainers.megatron.checks import Parallelism, check_parallelism
    from megatron_spec.layout import support_problems
    from megatron_spec.rl.backend_config import MegatronSection
    from megatron_spec.sim import LengthDist, SimConfig, Speculation, TrainParallel, Workload
    from megatron_spec.sim.tune import TuneSpace, search
    from recipes._common import Scale

    lay = Layout(tp=2, pp=8, cp=2, ep=16, etp=1, first_stage_layers=11, last_stage_layers=11)
    m = preset("qwen3-235b-a22b")
    check_layout(m, lay, 128)  # Megatron-Core's rules alone accept it
    assert support_problems(lay, who="train") == [
        "train cp=2: context parallelism is not implemented in the Megatron trainer (a run would stop after loading "
        "the model); use cp=1 and put those GPUs into tp, pp or data parallelism"]
    with pytest.raises(ValueError, match="cp=2: context parallelism is not implemented"):
        check_layout(m, lay, 128, runnable=True)
    with pytest.raises(ValueError, match="backend.megatron.cp=2: context parallelism is not implemented"):
        MegatronSection(tp=2, pp=8, ep=16, cp=2, first_stage_layers=11, last_stage_layers=11)
    with pytest.raises(ValueError, match="use cp=1"):
        Scale(nodes=16, gpus_per_node=8, parallel=Layout(tp=2, pp=8, cp=2, ep=16, etp=1, engine=Layout()))
    with pytest.raises(ValueError, match="cp=2: context parallelism"):
        check_parallelism(m, Parallelism(tp=2, pp=8, cp=2, ep=16, etp=1, first_stage_layers=11, last_stage_layers=11))
    work = Workload(prompts_per_step=64, group_size=8, prompt_len=200, response=LengthDist(mean=1500, max_tokens=8192))
    SimConfig(model=m, hardware="h100", gpus=128, workload=work,
              train=TrainParallel(tp=2, pp=8, cp=2, ep=16, dp=4))  # a prediction of it is still allowed
    base = SimConfig(model="qwen3-8b", hardware="h100", gpus=8, workload=work, train=TrainParallel(dp=8),
                     spec=Speculation(k=3, acceptance_length=2.8))
    result = search(base, TuneSpace(gen_tp=(1,), train_tp=(1, 2), train_pp=(1,), train_cp=(1, 2), ks=(3,),
                                    adaptive=("off",)))
    assert result.ranked and all(c.cfg.train.cp == 1 for c in result.ranked)
    cp_keys = [k for k in result.rejected if "context parallelism" in k]
    assert len(cp_keys) == 1 and result.rejected[cp_keys[0]] == 2
    assert result.rejected.example[cp_keys[0]].startswith("train cp=2: context parallelism is not implemented")


SP_FIX = "set backend.megatron.sequence_parallel=true"


def test_moe_under_tensor_parallelism_needs_sequence_parallelism():
    """Megatron-Core's MoE layer raises at the first training forward when TP > 1 and sequence parallelism is off:
    the shared rule refuses exactly that case (an MoE model, TP 2, SP off) and names the fix; TP 1, SP on, or a
    dense model pass. The backend check refuses it before any rank builds a parameter, and so does the local run's
    check, before any model is built."""
    from megatron_spec.trainers.megatron.checks import Parallelism, check_parallelism
    from megatron_spec.layout import sequence_parallel_problems
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import check_inputs

    assert sequence_parallel_problems(moe(), Layout(tp=2), False, who="train") == [
        "train tp=2 on an MoE model needs sequence parallelism (Megatron-Core refuses to train MoE layers under "
        "tensor parallelism without it): set backend.megatron.sequence_parallel=true"]
    assert sequence_parallel_problems(moe(), Layout(tp=2), True) == []
    assert sequence_parallel_problems(moe(), Layout(tp=1, ep=2), False) == []
    dense = ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128)
    assert sequence_parallel_problems(dense, Layout(tp=2), False) == []
    with pytest.raises(ValueError, match=SP_FIX):
        check_parallelism(moe(), Parallelism(tp=2), 2, sequence_parallel=False)
    check_parallelism(moe(), Parallelism(tp=2), 2)  # building alone (export, logprobs) does not train: allowed
    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter, cfg.spec = "checkpoints/tiny-qwen3-moe", None, None
    cfg.backend.trainer, cfg.backend.megatron.tp = "megatron", 2
    with pytest.raises(ValueError, match=SP_FIX):
        check_inputs(cfg)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU rule; this machine has CUDA")
def test_sequence_parallelism_on_cpus_is_refused():
    """Megatron's torch norms (used without Transformer Engine or Apex, which need CUDA) assert that sequence
    parallelism is off: an in-process Megatron run on the CPU with it on is refused before any model is built,
    naming the switch; the rule on GPUs and with SP off is silent."""
    from megatron_spec.layout import sequence_parallel_problems
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import check_inputs

    assert sequence_parallel_problems(moe(), Layout(tp=2), True, on_gpus=False) == [
        "sequence parallelism on CPUs: Megatron-Core's torch norms refuse it without Transformer Engine or Apex, "
        "which need CUDA; set backend.megatron.sequence_parallel=false (an MoE model then needs tp=1)"]
    assert sequence_parallel_problems(moe(), Layout(tp=2), True, on_gpus=True) == []
    assert sequence_parallel_problems(moe(), Layout(tp=1), False, on_gpus=False) == []
    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter, cfg.spec = "checkpoints/tiny-qwen3", None, None
    cfg.backend.trainer, cfg.backend.megatron.tp, cfg.backend.megatron.sequence_parallel = "megatron", 2, True
    with pytest.raises(ValueError, match="sequence parallelism on CPUs.*sequence_parallel=false"):
        check_inputs(cfg)


def test_colocated_engines_share_one_node_each():
    """The Ray placement's rule, shared with the tuner and the launch checks: colocated on GPUs, engines of any vLLM
    TP run (a trainer rank and an engine worker on every GPU), as long as one engine's GPUs fit on one node; with
    the GPUs per node unknown, or on CPU bundles, or disaggregated, nothing is refused."""
    from megatron_spec.layout import colocation_problems

    assert colocation_problems(True, 8) == colocation_problems(True, 8, gpus_per_node=8) == []
    assert colocation_problems(True, 8, gpus_per_node=4) == [
        "colocated vLLM engines with tensor_parallel_size=8 on nodes of 4 GPUs: an engine's workers must share one "
        "node, so tensor_parallel_size must divide the GPUs per node; use a tensor_parallel_size that does, or "
        "backend.placement=disaggregated"]
    assert colocation_problems(False, 8, gpus_per_node=4) == colocation_problems(True, 1, gpus_per_node=4) == []
    assert colocation_problems(True, 8, on_gpus=False, gpus_per_node=4) == []


def test_virtual_pipeline_rules():
    """Interleaved stages: vp must divide every stage's layers, uneven first / last stages included (Megatron-Core's
    rule), and the trainer runs them only over pp > 1, without MTP layers, an online EAGLE-3 head or Megatron's
    optimizer; each refusal names `virtual_pipeline` and the fix, at config time."""
    from megatron_spec.layout import online_eagle3_problems, support_problems
    from megatron_spec.rl.backend_config import MegatronSection

    four = ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128)
    assert layout_problems(four, Layout(pp=2, vp=2)) == []
    assert layout_problems(four, Layout(pp=2, vp=4)) == [
        "virtual_pipeline=4 does not divide the stages' layers [2, 2] (num_hidden_layers=4; each stage's chunks hold "
        "equal runs of layers): pick virtual_pipeline (and first / last stage layers) so that it divides every "
        "stage's, or virtual_pipeline=1"]
    assert layout_problems(four, Layout(pp=2, vp=2, first_stage_layers=3)) == [
        "virtual_pipeline=2 does not divide the stages' layers [3, 1] (num_hidden_layers=4; each stage's chunks hold "
        "equal runs of layers): pick virtual_pipeline (and first / last stage layers) so that it divides every "
        "stage's, or virtual_pipeline=1"]
    assert layout_problems(four, Layout(pp=2, vp=2, first_stage_layers=2, last_stage_layers=2)) == [
        "virtual_pipeline=2 with both first and last stage layers set over pp=2: Megatron-Core's interleaved layer "
        "offsets need a stage that takes the even share; set only first_stage_layers (the last stage takes the "
        "rest), or virtual_pipeline=1"]
    qwen235 = moe(num_hidden_layers=94, num_experts=128, num_attention_heads=64, num_key_value_heads=4)
    assert layout_problems(qwen235, Layout(pp=8, vp=2, first_stage_layers=12, last_stage_layers=10)) == []
    assert layout_problems(qwen235, Layout(pp=8, vp=4, first_stage_layers=12, last_stage_layers=10))[0].startswith(
        "virtual_pipeline=4 does not divide the stages' layers [12, 12, 12, 12, 12, 12, 12, 10]")
    assert support_problems(Layout(pp=2, vp=2)) == []
    with pytest.raises(ValueError, match=r"^virtual_pipeline=2 interleaves pipeline stages: it needs pp > 1 \(or set "
                       r"virtual_pipeline=1\)$"):
        Layout(vp=2)
    assert MegatronSection(pp=2, virtual_pipeline=2).layout() == Layout(pp=2, vp=2)
    assert MegatronSection(pp=2, virtual_pipeline=2, first_stage_layers=4, last_stage_layers=2).layout().vp == 2
    assert Layout(pp=2, vp=2).describe() == "TP=1 PP=2 EP=1 ETP=1 CP=1 VP=2"
    for kw, match in [(dict(virtual_pipeline=2), "needs pp > 1"),
                      (dict(pp=2, virtual_pipeline=2, mtp_num_layers=1), "set virtual_pipeline=1 or mtp_num_layers=0"),
                      (dict(pp=2, virtual_pipeline=2, optimizer="megatron"), "use optimizer=torch"),
                      (dict(pp=2, virtual_pipeline=0), "virtual_pipeline must be >= 1, got 0")]:
        with pytest.raises(ValueError, match=f"backend.megatron.*{match}"):
            MegatronSection(**kw)
    assert online_eagle3_problems(0, 2) == [
        "spec.method=eagle3 trains an EAGLE-3 head online, which does not run with "
        "backend.megatron.virtual_pipeline=2: set virtual_pipeline=1"]
    assert online_eagle3_problems(0, 1) == []
