"""`megatron-spec report` on synthetic runs whose numbers are chosen so the expected table values are exact:
gen-stage speedup 2.0, a plain seed-to-seed spread of 0.05, one spec run inside it and one a full spread outside."""

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from megatron_spec.rl import report
from megatron_spec.rl.report import lossless_table, load_runs, same_seed_pairs, speedups

STEPS = 12
PLOTS = ("reward_accuracy.png", "stage_times.png", "acceptance.png", "speedup.png", "lossless.png")


def write_run(path, *, spec, seed, reward, gen_s=10.0, online=True, greedy=False, loss=0.01, tau=2.5):
    """A run of STEPS steps with constant reward and 1000 generated tokens per step in `gen_s` seconds."""
    path.mkdir(parents=True)
    cfg = {"spec": {"method": "mtp", "num_speculative_tokens": 3} if spec else None,
           "drafter_train": {"online": online}, "grpo": {"temperature": 0.0 if greedy else 1.0},
           "run": {"seed": seed}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(STEPS):
            st = {"data": 0.1, "prepare": 0.5, "gen": gen_s, "logprob": 2.0, "train": 3.0}
            f.write(json.dumps({
                "step": step, "stages": st, "step_time": sum(st.values()), "gen_tokens": 1000,
                "tokens_per_s": 1000 / gen_s, "acceptance_length": tau if spec else None,
                "accepted_per_pos": [0.7, 0.5, 0.3] if spec else None, "reward_mean": reward,
                "accuracy": reward / 2, "eval_accuracy": reward if step == STEPS - 1 else None, "loss": loss,
                "kl": None, "clip_frac": 0.0, "grad_norm": 1.0, "logprob_mismatch": 0.0,
                "drafter_loss": 1.0 if spec else None, "response_len_mean": 10.0, "response_len_max": 20,
                "skipped": False}) + "\n")
    return path


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """Three plain seeds (rewards 0.50, 0.52, 0.55; 100, 125 and 80 gen tokens/s), spec online at 0.53 and 0.60
    (200 and 250 tokens/s: 2x their same-seed plain run), spec frozen at 0.50 (on the plain minimum), one report."""
    root = tmp_path_factory.mktemp("runs")
    dirs = [write_run(root / f"plain_s{s}", spec=False, seed=s, reward=r, gen_s=g)
            for s, r, g in ((0, 0.50, 10.0), (1, 0.52, 8.0), (2, 0.55, 12.5))]
    dirs.append(write_run(root / "spec_s0", spec=True, seed=0, reward=0.53, gen_s=5.0))
    dirs.append(write_run(root / "spec_s1", spec=True, seed=1, reward=0.60, gen_s=4.0))
    dirs.append(write_run(root / "frozen_s9", spec=True, seed=9, reward=0.50, gen_s=8.0, online=False, tau=2.0))
    out = report.write_report(dirs, root / "out" / "report.html")
    return dirs, out, out.read_text()


def _row(page, label):
    """The cells of the table row whose first cell starts with `label`."""
    m = re.search(r"<tr><td>" + re.escape(label) + r"[^<]*</td>(.*?)</tr>", page)
    assert m, f"no row for {label}"
    return re.findall(r"<td>(.*?)</td>", m.group(1))


def test_every_plot_is_written_and_linked(comparison):
    _, out, page = comparison
    for name in PLOTS:
        png = out.parent / "report_plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f'src="report_plots/{name}"' in page


def test_runs_are_labelled_from_their_config(comparison):
    runs = load_runs(comparison[0])
    assert [r.label for r in runs] == [
        "plain_s0 (plain)", "plain_s1 (plain)", "plain_s2 (plain)", "spec_s0 (spec: mtp k=3 online)",
        "spec_s1 (spec: mtp k=3 online)", "frozen_s9 (spec: mtp k=3 frozen)"]


def test_speedup_over_the_same_seed_plain_run_or_the_plain_mean(comparison):
    sp = speedups(load_runs(comparison[0]))
    assert sp["spec_s0"] == ("plain_s0", {s: 2.0 for s in range(STEPS)})  # 1000/5 over 1000/10
    assert sp["spec_s1"] == ("plain_s1", {s: 2.0 for s in range(STEPS)})  # 1000/4 over 1000/8
    # no plain run of seed 9: the mean of the plain runs' gen tokens/s is the baseline
    assert sp["frozen_s9"][0] == "mean of 3 plain runs"
    assert sp["frozen_s9"][1][3] == pytest.approx(125 / ((100 + 125 + 80) / 3))
    # summary columns: ... tokens/s, acceptance, gen speedup, reward (last 10), eval acc start -> final (no
    # `eval_accuracy_before` logged here: the start is the first eval)
    summary = comparison[2].split("<h2>Summary</h2>")[1]
    assert _row(summary, "spec_s0 (spec")[-5:] == ["200.0", "2.50", "2.00", "0.530", "0.530 -&gt; 0.530"]
    assert _row(summary, "plain_s0 (plain)")[-5:] == ["100.0", "-", "-", "0.500", "0.500 -&gt; 0.500"]


def test_losslessness_table_against_the_plain_spread(comparison):
    t = lossless_table(load_runs(comparison[0]))
    assert t["plain_spread"] == pytest.approx(0.05) and t["n_plain"] == 3
    assert t["spec"]["spec_s0"]["within"] and t["spec"]["frozen_s9"]["within"]  # the range includes its ends
    assert not t["spec"]["spec_s1"]["within"] and t["spec"]["spec_s1"]["outside"] == pytest.approx(1.0)
    page = comparison[2]
    assert _row(page, "plain seed-to-seed spread") == ["0.0500", "[0.5000, 0.5500]", ""]
    assert _row(page, "spec_s0 (spec")[:3] == ["0.5300", "yes", "0.00"]
    assert _row(page, "spec_s1 (spec")[:3] == ["0.6000", "no", "1.00"]
    assert "probability (n-1)/(n+1) = 50%" in page


def test_same_seed_pairs_sampled_differ(comparison):
    pairs = {p["spec"]: p for p in same_seed_pairs(load_runs(comparison[0]))}
    assert set(pairs) == {"spec_s0", "spec_s1"}  # frozen_s9 has no plain run of its seed
    assert not pairs["spec_s0"]["identical"] and pairs["spec_s0"]["reward_mean"] == pytest.approx(0.03)


def test_greedy_pair_is_identical_and_a_changed_loss_is_caught(tmp_path):
    plain = write_run(tmp_path / "plain", spec=False, seed=0, reward=0.5, greedy=True)
    same = write_run(tmp_path / "spec", spec=True, seed=0, reward=0.5, gen_s=5.0, greedy=True)
    off = write_run(tmp_path / "spec_off", spec=True, seed=0, reward=0.5, gen_s=5.0, greedy=True, loss=0.0100001)
    pairs = same_seed_pairs(load_runs([plain, same, off]))
    assert [(p["spec"], p["greedy"], p["identical"]) for p in pairs] == [("spec", True, True), ("spec_off", True, False)]
    page = report.write_report([plain, same], tmp_path / "r.html").read_text()
    assert _row(page, "spec") == ["plain", "greedy", str(STEPS), "0", "0", "0", "yes"]
    assert "spec (spec: mtp k=3 online, greedy)" in page
    assert "at least 2 sampled plain runs" in page  # greedy runs only: no band


def test_single_plain_run_report(tmp_path):
    run = write_run(tmp_path / "only", spec=False, seed=0, reward=0.5)
    page = report.write_report([run], run / "report.html").read_text()
    assert "No speculative run" in page and "Needs a plain run and a speculative run" in page
    assert (run / "report_plots" / "stage_times.png").is_file()
    assert not (run / "report_plots" / "acceptance.png").exists()


def test_duplicate_directory_names_get_their_parent(tmp_path):
    a = write_run(tmp_path / "sweepA" / "seed0", spec=False, seed=0, reward=0.5)
    b = write_run(tmp_path / "sweepB" / "seed0", spec=True, seed=0, reward=0.5)
    assert [r.name for r in load_runs([a, b])] == ["sweepA/seed0", "sweepB/seed0"]


def test_register_wiring(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a", spec=False, seed=0, reward=0.5)
    b = write_run(tmp_path / "b", spec=True, seed=0, reward=0.5, gen_s=5.0)
    parser = argparse.ArgumentParser()
    report.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(a), "--compare", str(b)])
    assert args.compare == [str(b)] and args.out == ""
    assert args.func(args) == 0
    assert (a / "report.html").is_file() and (a / "report_plots" / "speedup.png").is_file()
    assert "wrote" in capsys.readouterr().out
    # Both spellings of several comparisons, and --out; the rendering itself is covered above.
    calls = []
    monkeypatch.setattr(report, "write_report", lambda dirs, out: calls.append((dirs, out)) or out)
    for argv in (["--compare", "b", "c", "--out", "x/r.html"], ["--compare", "b", "--compare", "c", "--out", "x/r.html"]):
        args = parser.parse_args(["report", "a", *argv])
        args.func(args)
        assert calls.pop() == (["a", "b", "c"], Path("x/r.html"))


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        report.write_report([tmp_path], tmp_path / "r.html")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps"):
        report.write_report([tmp_path], tmp_path / "r.html")
