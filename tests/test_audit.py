"""The full-size memory audit (`launchers/audit.py`, `--audit` on the at-scale recipes): parameter counts from the
model code on meta tensors against a hand count, the optimizer rules (Megatron-Core's expert data parallelism), the
refusals with their causes and fixes, and the JSON it writes."""

from __future__ import annotations

import json

import pytest

from launchers.audit import Split, audit, stage_params
from megatron_spec.models.presets import preset
from megatron_spec.rl.overrides import apply_overrides
from recipes import qwen3_235b_grpo_spec as r235
from recipes import qwen3_8b_grpo_spec as r8

# tiny-qwen3-moe by hand: hidden 128, 4 layers, 4 heads / 2 KV heads of 32, 8 experts of width 128, vocabulary 64.
ATTENTION = 128 * 128 + 2 * (128 * 64) + 128 * 128  # q, k, v, o projections: split over TP
REPLICATED = 2 * 32 + 2 * 128 + 128 * 8  # q/k norms, the two layer norms, the router
EXPERTS = 8 * 3 * 128 * 128  # gate, up, down of each expert
SHELL = 64 * 128 + 128 + 128 * 64  # embedding, final norm, output layer (untied)


def test_parameters_per_rank_are_the_hand_count():
    """TP2 EP4 ETP1 on 8 GPUs, one stage: attention, embedding and output layer halved, norms and router whole, the
    experts a quarter; DP = 8 / 2 = 4 but expert-DP = 8 / (EP4 x ETP1) = 2 (Megatron-Core's rule)."""
    split = Split(tp=2, pp=1, ep=4, etp=1, cp=1, train_gpus=8)
    assert (split.dp, split.expert_dp) == (4, 2)
    (stage,) = stage_params(preset("tiny-qwen3-moe"), split)
    assert stage == {"dense": 4 * (ATTENTION // 2 + REPLICATED) + 64 * 128 // 2 + 128 + 128 * 64 // 2,
                     "expert": 4 * EXPERTS // 4, "layers": 4}
    assert stage == {"dense": 112_000, "expert": 393_216, "layers": 4}
    two = stage_params(preset("tiny-qwen3-moe"), Split(tp=1, pp=2, ep=1, etp=1, cp=1, train_gpus=2))
    assert [s["dense"] for s in two] == [2 * (ATTENTION + REPLICATED) + 64 * 128, 2 * (ATTENTION + REPLICATED) + 128
                                         + 128 * 64]
    assert sum(s["dense"] + s["expert"] for s in two) == 4 * (ATTENTION + REPLICATED + EXPERTS) + SHELL


def tiny_audit(optimizer: str, prompts: int = 8):
    """tiny-qwen3-moe under the 8B recipe's settings, trainer TP2 EP4 on 8 GPUs beside one engine of TP1."""
    cfg = apply_overrides(r8.qwen3_8b_grpo_spec(), [f"backend.megatron.optimizer={optimizer}",
                                                   "backend.megatron.ep=4", f"grpo.prompts_per_step={prompts}"])
    layout = {"gpus": 9, "megatron": {}, "vllm": {"engines": 1, "tensor_parallel_size": 1},
              "ray": {"placement": "disaggregated"}}
    return audit(cfg, layout, preset("tiny-qwen3-moe"), prompt_tokens=256)


def test_optimizer_states_follow_the_optimizer_the_run_uses():
    """bf16 parameters (2 B), fp32 gradients (4 B); torch AdamW: fp32 masters and two moments (12 B) of every local
    parameter; the distributed optimizer: dense parameters' 12 B over DP 4, the experts' over expert-DP 2."""
    dense, expert = 112_000, 393_216
    torch_rank = tiny_audit("torch").ranks[0]
    dist_rank = tiny_audit("megatron").ranks[0]
    for r in (torch_rank, dist_rank):
        assert (r.parts["params"], r.parts["grads"]) == (2 * (dense + expert), 4 * (dense + expert))
        assert (r.sources["params"], r.sources["optimizer"]) == ("fake-tensor", "analytic")
    assert torch_rank.parts["optimizer"] == 12 * (dense + expert)
    assert dist_rank.parts["optimizer"] == 12 * dense // 4 + 12 * expert // 2


def test_rollouts_that_do_not_split_over_dp_or_expert_dp_are_refused():
    """16 rollouts a prompt: 8 prompts give 128 rollouts (DP 4 and expert-DP 2 divide them); 16 x 16 = 256 too; the
    8B recipe's group of 16 with 63 prompts over DP 16 does not split."""
    assert not [p for p in tiny_audit("megatron").problems if "rollouts" in p]
    cfg = apply_overrides(r8.qwen3_8b_grpo_spec(), ["grpo.prompts_per_step=63", "grpo.group_size=8",
                                                   "backend.megatron.optimizer=megatron"])
    found = audit(cfg, r8.SCALE.layout(cfg), preset("qwen3-8b"), prompt_tokens=256)
    assert found.problems == [
        "grpo.prompts_per_step x grpo.group_size = 63 x 8 = 504 rollouts do not split over the trainer's "
        "data-parallel ranks (DP = 16): choose grpo.prompts_per_step so the rollouts are a multiple of 16, or a "
        "layout whose DP divides 504",
        "grpo.prompts_per_step x grpo.group_size = 63 x 8 = 504 rollouts do not split over the trainer's expert "
        "data-parallel ranks (expert-DP = 32): choose grpo.prompts_per_step so the rollouts are a multiple of 32, or "
        "a layout whose expert-DP divides 504"]


def run_audit(recipe, name, argv, capsys, tmp_path):
    out = tmp_path / "audit.json"
    rc = recipe.main(["--audit", "--audit-json", str(out), *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, json.loads(out.read_text())


def test_the_8b_recipe_fits_with_the_distributed_optimizer_and_not_with_torch(capsys, tmp_path):
    """Qwen3-8B at TP2 DP16 on 80 GB: with the distributed optimizer a rank holds about 72 GB; with torch AdamW's
    unsharded 12 B a parameter (49 GB of it) it does not fit, and the fix is named."""
    rc, out, err, data = run_audit(r8, "qwen3_8b_grpo_spec", ["backend.megatron.optimizer=megatron"], capsys, tmp_path)
    assert rc == 0 and data["fits"] is True and data["problems"] == []
    trainer = data["ranks"][0]
    assert trainer["kind"] == "trainer stage 0 (36 layers)" and trainer["count"] == 32
    assert 60e9 < trainer["device_bytes"] < 80e9
    rc, out, err, data = run_audit(r8, "qwen3_8b_grpo_spec", ["backend.megatron.optimizer=torch"], capsys, tmp_path)
    assert rc == 1 and data["fits"] is False
    assert "set backend.megatron.optimizer=megatron" in err and "trainer stage 0 (36 layers)" in err


def test_audit_json_schema(capsys, tmp_path):
    """{"fits", "problems", "ranks": [{"kind", "count", "device_bytes", "host_bytes", "parts", "source"}]}: parts sum
    to device_bytes; the 235B recipe's kinds are its 8 stages (8 ranks each), 64 engine workers and the driver."""
    rc, out, err, data = run_audit(r235, "qwen3_235b_grpo_spec", [], capsys, tmp_path)
    assert {"fits", "problems", "ranks"} <= set(data) and isinstance(data["problems"], list)
    for r in data["ranks"]:
        assert {"kind": str, "count": int, "device_bytes": int, "host_bytes": int, "parts": dict,
                "source": str}.items() <= {k: type(v) for k, v in r.items()}.items()
        assert sum(r["parts"].values()) == r["device_bytes"]
    assert [(r["kind"].split(" (")[0], r["count"]) for r in data["ranks"]] == [
        *((f"trainer stage {s}", 8) for s in range(8)), ("engine worker", 64), ("driver", 1)]
    assert data["ranks"][0]["source"] == "fake-tensor: params, params_drafter; analytic: grads, optimizer, " \
                                         "activations, refit_buckets, runtime"
    assert "trainer stage 0 (12 layers)" in out and rc == 0 and data["fits"] is True


@pytest.mark.parametrize("argv, cause, fix", [
    (["backend.megatron.optimizer=torch"], "trainer stage 0 (12 layers)", "set backend.megatron.optimizer=megatron"),
    (["backend.megatron.pp=2", "backend.megatron.first_stage_layers=null",
      "backend.megatron.last_stage_layers=null"], "trainer stage 0 (47 layers)",
     "offload the optimizer's states to the host"),
    # the online EAGLE-3 head's inputs for every token of the step
    (["drafter_train.max_tokens=0"], "trainer stage 7 (10 layers)", "lower drafter_train.max_tokens"),
    # DP 4 splits any group of 16, so an odd group shows the refusal
    (["grpo.prompts_per_step=250", "grpo.group_size=5"], "250 x 5 = 1250 rollouts do not split over the trainer's "
     "data-parallel ranks (DP = 4)", "a multiple of 4"),
])
def test_the_235b_refusals_name_cause_and_fix(argv, cause, fix, capsys, tmp_path):
    rc, out, err, data = run_audit(r235, "qwen3_235b_grpo_spec", argv, capsys, tmp_path)
    assert rc == 1
    line = next(p for p in data["problems"] if cause in p)
    assert fix in line and line in err


def test_the_235b_recipe_fits_80gb_and_its_earlier_layout_does_not():
    """The recipe: 64 trainer GPUs at TP2 PP8 EP8 (expert-DP 1), the distributed optimizer and full recompute, the
    stages 12 / 12 x 6 / 10 layers: every stage within an 80 GB H100; 8 engines of TP8 serve the bf16 files (58.9 GB of
    weights a GPU). The layout before it, 96 trainer GPUs at EP4 beside 4 engines, does not fit even so: a 12-layer
    stage holds 7.25 B expert parameters."""
    cfg = r235.qwen3_235b_grpo_spec()
    found = audit(cfg, r235.SCALE.layout(cfg), preset("qwen3-235b-a22b"), prompt_tokens=1024)
    assert found.problems == [] and all(r.device_bytes <= r.device_limit for r in found.ranks)
    assert max(r.device_bytes for r in found.ranks) < 79.6 * 2 ** 30  # what an 80 GB H100 gives a process
    engine = next(r for r in found.ranks if r.kind.startswith("engine"))
    assert engine.count == 64 and 58.7e9 < engine.parts["params"] < 58.8e9  # 235.1 B x 2 bytes / 8
    old = apply_overrides(cfg, ["backend.megatron.ep=4", "backend.generators=4", "grpo.prompts_per_step=252",
                                "backend.megatron.first_stage_layers=11", "backend.megatron.last_stage_layers=11"])
    layout = r235.SCALE.layout(old)
    layout["vllm"]["engines"] = 4
    stale = audit(old, layout, preset("qwen3-235b-a22b"), prompt_tokens=1024)
    experts = stage_params(preset("qwen3-235b-a22b"), Split(tp=2, pp=8, ep=4, etp=1, cp=1, train_gpus=96,
                                                         first_stage_layers=11, last_stage_layers=11))[1]["expert"]
    assert experts == 12 * 128 * 3 * 4096 * 1536 // 4  # 7.25 B
    assert stale.problems and all("colocate trainer and engines" in p for p in stale.problems)


def test_host_memory_counts_the_saves_and_only_processes_that_load_the_whole_policy():
    """With the Megatron trainer no trainer rank loads the policy, and vLLM engines start from the files; our engine
    (not sharded) loads it in float32 in each engine actor: 235.1 B x 4 bytes, about 940 GB more an engine node. A
    trainer node holds, for each of its 8 ranks while it saves, the fp32 masters and moments of its part (12 B a
    parameter) and, with background saves, a copy of its bf16 weights (2 B): the largest stage's 4.37 B parameters x
    14 B, about 61 GB a rank; and the driver."""
    from launchers.audit import PROCESS_OVERHEAD_BYTES

    found = {}
    for generator in ("vllm", "embedded"):
        cfg = apply_overrides(r235.qwen3_235b_grpo_spec(), [f"backend.generator={generator}"])
        found[generator] = audit(cfg, r235.SCALE.layout(cfg), preset("qwen3-235b-a22b"), prompt_tokens=1024).nodes
    assert round((found["embedded"]["engine"] - found["vllm"]["engine"]) / 1e9, -1) == 940
    trainer = found["vllm"]["trainer rank 0's"]
    assert trainer == found["embedded"]["trainer rank 0's"]
    stage = max(r.parameters for r in audit(r235.qwen3_235b_grpo_spec(), r235.SCALE.layout(
        r235.qwen3_235b_grpo_spec()), preset("qwen3-235b-a22b"), prompt_tokens=1024).ranks if r.parameters)
    assert trainer == 8 * (PROCESS_OVERHEAD_BYTES + stage * 14) + PROCESS_OVERHEAD_BYTES
    assert 4.3e9 < stage < 4.4e9


def test_the_cpu_audit_is_within_15_percent_of_a_measured_run_rank_by_rank():
    """`research/megatron_memory` measured a random 0.74 B Qwen3-MoE, Megatron EP2 x PP2 on 4 gloo ranks, 2 GRPO steps
    with foreground saves, each rank's peak resident memory from outside (its record). The audit's CPU mode of the
    same run (the config its recipe sets, below) predicts each rank within 15 %: parameters, gradients and AdamW's
    moments (16 B a parameter in fp32), activations, refit buffers and the per-process overhead measured once. Rank 0
    also runs the loop (tokenizer, task, the generator's proxy), which the audit counts as the driver elsewhere: it
    is the furthest. The figures change with the code, so the prediction is recomputed here, against the record."""
    import json
    from pathlib import Path

    from launchers.checks import prompt_budget
    from megatron_spec.models import ModelConfig
    from megatron_spec.models.presets import TINY_VOCAB
    from megatron_spec.rl.backend_config import BackendSection, MegatronSection
    from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection

    record = json.loads((Path(__file__).parents[1] / "research/records/megatron_memory_1024x14.json").read_text())
    m = record["model"]
    model = ModelConfig(model_type="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=m["hidden"],
                        num_hidden_layers=m["layers"], num_attention_heads=16, num_key_value_heads=4,
                        head_dim=m["hidden"] // 16, intermediate_size=m["moe_ffn"], num_experts=m["experts"],
                        num_experts_per_tok=m["top_k"], moe_intermediate_size=m["moe_ffn"], norm_topk_prob=True,
                        rope_theta=10000.0, max_position_embeddings=512)
    cfg = RLConfig(model=ModelSection(policy="random", task="tiny"),
                   grpo=GRPOSection(prompts_per_step=2, group_size=2, max_tokens=8), spec=None,
                   run=RunSection(steps=2, save_every=1, eval_every=0, async_save=False),
                   backend=BackendSection(trainer="megatron", megatron=MegatronSection(ep=2, pp=2)))
    layout = {"gpus": 4, "megatron": {}, "vllm": {"engines": 1, "tensor_parallel_size": 1},
              "ray": {"placement": "inline"}}
    found = audit(cfg, layout, model, prompt_tokens=prompt_budget(cfg), gpu="cpu")
    assert [r.count for r in found.ranks] == [2, 2]  # PP2: ranks 0-1 hold stage 0, ranks 2-3 stage 1
    errors = [found.ranks[rank // 2].device_bytes / 2 ** 20 / record["outside_peak_mb"][str(rank)]["hwm"] - 1
              for rank in range(4)]
    assert all(abs(e) <= 0.15 for e in errors), errors
    assert max(range(4), key=lambda r: abs(errors[r])) == 0
