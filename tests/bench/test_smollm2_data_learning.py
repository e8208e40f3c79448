"""`benchmarks/smollm2_data_learning.py`: the files it writes are the natural arithmetic task's problems (train and
test from different random streams), and its run config is one the loop accepts for the Megatron trainer with vLLM
(checked before any model is built: the run itself is long and not part of the suite)."""

import json

from benchmarks import smollm2_data_learning as bench
from megatron_spec.tasks.natural import NaturalDataset


def test_the_data_files_hold_the_natural_task(tmp_path):
    out = bench.write_data(tmp_path, train=12, test=5, seed=3)
    rows = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}
    assert [len(rows["train"]), len(rows["test"])] == [12, 5]
    expected = [{"question": p.question, "answer": p.answer} for p in NaturalDataset(12, 3, split="train")]
    assert rows["train"] == expected and all(r["answer"].lstrip("-").isdigit() for r in rows["test"])
    assert {r["question"] for r in rows["test"]} != {r["question"] for r in rows["train"][:5]}


def test_the_run_config_passes_the_loops_checks(tmp_path):
    """The recipe's config with the benchmark's overrides: Megatron trainer, vLLM generator, EAGLE-3 online from the
    shipped SmolLM2 head, the jsonl directory in the custom format; `check_inputs` (the loop's checks before any
    model is built: Megatron's drafter settings, the EAGLE-3 rules, files, reward) finds nothing to refuse."""
    from megatron_spec.rl.loop import check_inputs
    from megatron_spec.rl.overrides import apply_overrides
    from recipes.smollm2_grpo_spec import smollm2_grpo_spec

    data = bench.write_data(tmp_path / "data", train=8, test=4, seed=0)
    cfg = apply_overrides(smollm2_grpo_spec(), [*bench.RUN, f"data.path={data}", "run.steps=30"])
    assert (cfg.backend.trainer, cfg.backend.generator, cfg.spec.method) == ("megatron", "vllm", "eagle3")
    assert (cfg.data.format, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.eval_split) == (
        "custom", "question", "answer", "test")
    assert cfg.drafter_train.online and cfg.grpo.max_tokens <= cfg.backend.vllm.max_model_len
    check_inputs(cfg)
