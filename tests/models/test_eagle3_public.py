"""Public EAGLE-3 heads: checkpoints in the vLLM speculators and the SpecForge layouts (written here with those
projects' names and configs) load into our head, draft what the head they were made from drafts, go back to disk
in their own layout bit for bit, and after one online update carry exactly the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launchers.checks import drafter_kind, drafter_vocab
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head
from megatron_spec.drafters.eagle3.public import SPECFORGE, SPECULATORS, load_public_eagle3, save_public_eagle3
from megatron_spec.drafters.config import SpecConfig

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [3, 4], [20, 21, 20, 21, 20], [40] * 6, [33, 34]]


@pytest.fixture(scope="module")
def target():
    return from_pretrained(ROOT / "checkpoints" / "tiny-qwen3")


def layer_config(cfg) -> dict:
    """The draft layer's config as both projects write it (a one-layer model of the target's family)."""
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "intermediate_size": None,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False}


def write_public(head: Eagle3Head, out: Path, layout: str, dtype=torch.bfloat16, mapping: bool = True) -> Path:
    """`head` written as the speculators or SpecForge project would: the layer under `layers.0.` / `midlayer.`, one
    fc block per distinct auxiliary layer (vLLM's ids: our capture layer + 1), `d2t` as offsets, `t2d` as a mask
    (`mapping=False`: a full-vocabulary head without them). A speculators head with other than three auxiliary
    layers says how many in its layer config (`num_aux_hidden_states`, which vLLM reads there)."""
    cfg, ec, H = head.target_config, head.eagle_config, head.target_config.hidden_size
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    distinct = sorted(set(ec.capture_layers))
    blocks = state["fc.weight"].split(H, dim=1)
    fc = torch.cat([sum(b for b, c in zip(blocks, ec.capture_layers) if c == d) for d in distinct], dim=1)
    prefix = "layers.0." if layout == SPECULATORS else "midlayer."
    tensors = {prefix + k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")}
    tensors.update({"fc.weight": fc, "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]})
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    V = cfg.vocab_size
    draft = state["d2t"] if ec.draft_vocab_size else torch.arange(V)
    if mapping or ec.draft_vocab_size:
        tensors["d2t"] = draft - torch.arange(draft.numel())
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[draft] = True
        tensors["t2d"] = t2d
    layer = {**layer_config(cfg), "intermediate_size": ec.intermediate_size}
    if head.midlayer.self_attn.q_norm is None:  # a Llama-type draft layer (no query / key norms)
        layer["model_type"] = "llama"
    if layout == SPECULATORS and len(distinct) != 3:
        layer["num_aux_hidden_states"] = len(distinct)
    aux = [d + 1 for d in distinct]
    if layout == SPECULATORS:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.2.0", "transformer_layer_config": layer,
                  "draft_vocab_size": draft.numel(), "norm_before_residual": False, "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                               "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                         "verifier": {"name_or_path": "checkpoints/tiny-qwen3",
                                                      "architectures": ["Qwen3ForCausalLM"]}}}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft.numel(),
                  "torch_dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def distinct_head(target, draft_vocab: int = 48, qk_norm: bool | None = None) -> Eagle3Head:
    """A head fusing three different layers over a 48-token draft vocabulary (its ids spread over the 64)."""
    torch.manual_seed(3)
    d2t = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values
    config = Eagle3Config(target.config.num_hidden_layers, (0, 1, 2), qk_norm=qk_norm)
    head = Eagle3Head.from_target(target, config, d2t=d2t)
    head.reset_parameters(std=0.1)
    with torch.no_grad():  # bf16-representable, so the public copy in bf16 is the same head
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head.eval()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (not only equal values: -0.0 and 0.0 differ here)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def generate(target, head):
    outs = LLMEngine(target, max_num_seqs=4, spec=SpecConfig("eagle3", 3), drafter=head).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return [o.token_ids for o in outs], [o.spec for o in outs]


@pytest.mark.parametrize("layout", [SPECULATORS, SPECFORGE])
def test_a_public_head_drafts_what_its_source_drafts(tmp_path, target, layout):
    """Three distinct fused layers and a reduced vocabulary: the loaded head's logits equal the source head's bit for
    bit on the same input (same weights, same fc blocks, the d2t offsets turned back into target ids), and the engine
    emits the same tokens with the same drafted and accepted counts per sequence."""
    src = distinct_head(target)
    path = write_public(src, tmp_path / layout, layout)
    assert drafter_kind(str(path)) == "eagle3" and drafter_vocab(str(path)) == 64  # what the launch check reads
    head = load_drafter(path, target.config)  # the drafter loader dispatches on the layout
    assert head.public["layout"] == layout and head.eagle_config.capture_layers == (0, 1, 2)
    assert torch.equal(head.d2t, src.d2t) and head.eagle_config.draft_vocab_size == 48
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(2, 5, 128, generator=g), torch.randint(0, 64, (2, 5), generator=g)
    with torch.no_grad():
        assert torch.equal(head(hidden, ids, None, target.embed)[1], src(hidden, ids, None, target.embed)[1])
    assert generate(target, head) == generate(target, src)


@pytest.mark.parametrize("layout", [SPECULATORS, SPECFORGE])
def test_the_shipped_head_in_a_public_layout_drafts_alike_and_round_trips(tmp_path, target, layout):
    """checkpoints/tiny-qwen3-eagle3 fuses layer 1 three times over the full vocabulary: public layouts hold that as
    one fc block of auxiliary layer 2 (the three summed), d2t all zero and t2d all set. Loaded, it drafts like the
    original (same tokens, same per-sequence drafted/accepted counts: the fused map is the same up to the order of
    one sum, far below what would flip a greedy draft), accepts more than one token per step, and written back its
    config and every tensor (names, dtypes, bits) are the file's."""
    original = load_drafter(ROOT / "checkpoints" / "tiny-qwen3-eagle3", target.config)
    path = write_public(original, tmp_path / layout, layout, dtype=torch.float32)
    head = load_public_eagle3(path, target.config, target_embed=target.model.embed_tokens.weight)
    assert head.eagle_config.capture_layers == (1, 1, 1) and head.d2t is None
    tokens, stats = generate(target, head)
    assert (tokens, stats) == generate(target, original)
    acceptance_length = 1 + sum(s["accepted"] for s in stats) / sum(s["verify_steps"] for s in stats)
    assert acceptance_length > 1.5  # the shipped head on the tiny target: 2.34 on these prompts
    out = save_public_eagle3(head, tmp_path / f"{layout}-out")
    assert json.loads((out / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and same_bits(before[name], after[name]), name


@pytest.mark.parametrize("layout", [SPECULATORS, SPECFORGE])
def test_bf16_round_trip_is_bit_for_bit(tmp_path, target, layout):
    """A bf16 checkpoint with a reduced vocabulary, loaded in fp32 and written back untouched: identical bytes per
    tensor (bf16 -> fp32 -> bf16 is exact) and the same config."""
    path = write_public(distinct_head(target), tmp_path / layout, layout)
    out = save_public_eagle3(load_public_eagle3(path, target.config), tmp_path / "out")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and same_bits(before[k], after[k]), k
    assert (out / "config.json").read_bytes() == (path / "config.json").read_bytes()


@pytest.mark.parametrize("layout", [SPECULATORS, SPECFORGE])
def test_one_online_update_then_export_carries_the_trained_weights(tmp_path, target, layout):
    """One step of the embedded trainer's online drafter update (`EmbeddedPolicy.train_step`) on a loaded public
    head, then export: same names, dtypes and config as the file; the layer, fc, norm and lm_head tensors moved
    (AdamW's first step moves every entry with a nonzero gradient by ~lr), d2t and t2d unchanged; loading the export
    gives the trained head's weights exactly (fp32 file, so no rounding)."""
    from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
    from megatron_spec.interfaces import Batch
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    path = write_public(distinct_head(target), tmp_path / layout, layout, dtype=torch.float32)
    head = load_public_eagle3(path, target.config)
    import copy

    policy_model = copy.deepcopy(target)
    policy = EmbeddedPolicy(policy_model, GRPOSection(lr=1e-4), dict(temperature=1.0, top_k=0, top_p=1.0), head,
                            "eagle3", DrafterTrainSection(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (8, 24), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    metrics = policy.train_step(Batch(ids, mask, advantages=torch.randn(8, generator=g)))
    assert any("drafter" in k for k in metrics)
    out = save_public_eagle3(head, tmp_path / "trained")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after) and all(before[k].dtype == after[k].dtype for k in before)
    assert json.loads((out / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    prefix = "layers.0." if layout == SPECULATORS else "midlayer."
    assert {"fc.weight", "lm_head.weight", f"{prefix}self_attn.q_proj.weight", f"{prefix}mlp.down_proj.weight"} <= set(
        moved)
    assert torch.equal(before["d2t"], after["d2t"]) and torch.equal(before["t2d"], after["t2d"])
    again = load_public_eagle3(out, target.config)
    trained = head.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in again.state_dict().items())


def test_a_public_head_that_does_not_fit_the_target_is_refused(tmp_path, target):
    """A draft layer with 8 attention heads against the target's 4, and an embedding other than the target's: each
    named before any weight is used."""
    path = write_public(distinct_head(target), tmp_path / "s", SPECULATORS)
    cfg = json.loads((path / "config.json").read_text())
    cfg["transformer_layer_config"]["num_attention_heads"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_attention_heads: checkpoint 8 vs target 4"):
        load_public_eagle3(path, target.config)
    other = write_public(distinct_head(target), tmp_path / "e", SPECFORGE)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens differ from the target's embedding"):
        load_public_eagle3(other, target.config, target_embed=target.model.embed_tokens.weight)


def test_norm_before_residual_as_each_layout_defaults_it(tmp_path, target):
    """A speculators config without `norm_before_residual` means true (vLLM's reading), a SpecForge one false; with
    it the layer's residual is hidden_norm(hidden): checked against the layer computed by hand."""
    src = distinct_head(target)
    for layout, expected in ((SPECULATORS, True), (SPECFORGE, False)):
        path = write_public(src, tmp_path / layout, layout)
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("norm_before_residual", None)
        (path / "config.json").write_text(json.dumps(cfg))
        assert load_public_eagle3(path, target.config).eagle_config.norm_before_residual is expected
    head = load_public_eagle3(tmp_path / SPECULATORS, target.config)
    layer = head.midlayer
    g = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(1, 4, 128, generator=g), torch.randint(0, 64, (1, 4), generator=g)
    with torch.no_grad():
        state = head.state(hidden, ids, None, target.embed)
        from megatron_spec.models.layers import rotary

        cos, sin = rotary(torch.arange(4).expand(1, 4), target.config.head_dim, target.config.rope_theta, hidden.dtype,
                          None)
        h = layer.hidden_norm(hidden) + layer.self_attn(layer.attention_input(hidden, target.embed(ids)), cos, sin, None)
        assert torch.allclose(state, h + layer.mlp(layer.post_attention_layernorm(h)), atol=1e-6, rtol=0)
        head.midlayer.norm_before_residual = False  # the other placement gives another state
        assert not torch.allclose(head.state(hidden, ids, None, target.embed), state, atol=1e-3)


@pytest.mark.parametrize("layout", [SPECULATORS, SPECFORGE])
def test_a_llama_type_layer_on_a_qwen3_target(tmp_path, target, layout):
    """Public heads for Qwen3 targets often have a Llama-type draft layer (no query / key norms): it loads as such
    (no q_norm tensors expected), drafts what its source drafts and round-trips bit for bit; our vLLM export of it
    names vLLM's Llama EAGLE-3 class."""
    from megatron_spec.drafters.eagle3.export import export_eagle3

    src = distinct_head(target, qk_norm=False)
    assert src.midlayer.self_attn.q_norm is None and target.config.qk_norm
    path = write_public(src, tmp_path / layout, layout)
    head = load_public_eagle3(path, target.config)
    assert head.eagle_config.qk_norm is False and head.midlayer.self_attn.q_norm is None
    assert generate(target, head) == generate(target, src)
    out = save_public_eagle3(head, tmp_path / "out")
    before, after = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after) and all(same_bits(before[k], after[k]) for k in before)
    vllm_dir = export_eagle3(head, tmp_path / "vllm")
    assert json.loads((vllm_dir / "config.json").read_text())["architectures"] == ["Eagle3LlamaForCausalLM"]



def check_run_export(source: Path, out: Path, trained: dict, layout: str, dtype: torch.dtype, target) -> None:
    """`out` (a run checkpoint's `drafter/`) is `source`'s public layout with the trained head: the same config
    bytes, tensor names and dtypes; d2t and t2d unchanged; the trained tensors moved (AdamW's first step moves every
    entry with a gradient by ~lr) and are exactly `trained` (the head as the run checkpoint saved it) rounded to the
    file's dtype."""
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    before, after = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after) and all(before[k].dtype == after[k].dtype for k in before)
    assert torch.equal(before["d2t"], after["d2t"]) and torch.equal(before["t2d"], after["t2d"])
    prefix = "layers.0." if layout == SPECULATORS else "midlayer."
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"fc.weight", "lm_head.weight", f"{prefix}self_attn.q_proj.weight", f"{prefix}mlp.down_proj.weight"} <= moved
    again = load_public_eagle3(out, target.config)
    assert set(again.state_dict()) == set(trained)
    for k, v in again.state_dict().items():
        assert same_bits(v, trained[k].to(dtype).to(v.dtype) if v.is_floating_point() else trained[k]), k


@pytest.mark.parametrize("layout, dtype", [(SPECULATORS, torch.bfloat16), (SPECFORGE, torch.float32)])
def test_a_run_checkpoints_its_online_head_in_the_layout_it_came_in(tmp_path, layout, dtype):
    """The RL loop (embedded trainer, one step, EAGLE-3 online from a public checkpoint) writes `drafter/` beside its
    run checkpoint in the starting checkpoint's layout (`check_run_export`): bf16 for the speculators case, fp32
    for SpecForge (there no rounding at all)."""
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.rl.loop import Trainer, run
    from megatron_spec.rl.overrides import apply_overrides

    target = from_pretrained(ROOT / "checkpoints" / "tiny-qwen3")
    path = write_public(distinct_head(target), tmp_path / layout, layout, dtype=dtype)
    cfg = apply_overrides(RLConfig(), [
        f"model.policy={ROOT / 'checkpoints' / 'tiny-qwen3'}", f"model.drafter={path}", "spec.method=eagle3",
        f"spec.model={path}", "spec.adaptive=false", "grpo.prompts_per_step=2", "grpo.group_size=4",
        "grpo.max_tokens=24", "drafter_train.lr=1e-2", "run.steps=1", "run.eval_every=0", "run.report=false",
        "run.loggers=[]", "run.resume=false", "run.save_every=1", f"run.out_dir={tmp_path / 'run'}"])
    run(cfg, Trainer)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000000"
    trained = torch.load(ckpt / "state.pt", weights_only=False)["state"]["drafter"]
    check_run_export(path, ckpt / "drafter", trained, layout, dtype, target)
