"""`megatron-spec simulate` / `tune` end to end through cli.main."""

import json

from megatron_spec.cli import main


def test_simulate_prints_stages(capsys):
    rc = main(["simulate", "--model", "qwen3-8b", "--hardware", "h100", "--gpus", "8", "--dp", "8", "--k", "3",
               "--acceptance", "2.8", "--mean-len", "1500", "--max-tokens", "8192", "--prompts", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    for stage in ("data", "prepare", "gen", "logprob", "train", "step", "tokens trained"):
        assert stage in out


def test_simulate_json_and_async(capsys):
    rc = main(["simulate", "--model", "qwen3-8b", "--hardware", "gb200", "--gpus", "16", "--gen-gpus", "8",
               "--lag", "1", "--prompts", "64", "--mean-len", "1500", "--max-tokens", "8192", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["step_s"] > 0 and data["exposed_gen_s"] >= 0


def test_bad_input_is_one_clean_line(capsys):
    """cli.main turns the ValueError into a single stderr line naming the constraint (exit code 2)."""
    rc = main(["simulate", "--model", "qwen3-8b", "--gpus", "3", "--tp", "3", "--dp", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "does not divide num_attention_heads" in err
    rc = main(["simulate", "--k", "3", "--acceptance", "5"])
    assert rc == 2 and "exceeds k+1" in capsys.readouterr().err


def test_tune_json(capsys):
    rc = main(["tune", "--model", "qwen3-8b", "--hardware", "h100", "--gpus", "8", "--prompts", "64",
               "--mean-len", "1500", "--max-tokens", "8192", "--k", "3", "--acceptance", "2.8", "--ks", "0", "3",
               "--top", "3", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(rows) == 3 and rows[0]["tokens_per_s_per_gpu"] >= rows[-1]["tokens_per_s_per_gpu"]
