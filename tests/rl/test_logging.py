"""StepLogger and read_metrics: the JSONL is the run's record, so it must survive crashes and resumes; TensorBoard
and the progress bar are extras that must never stop a run."""

import io
import json
import sys
import warnings

import pytest

from megatron_spec.rl import logging as rl_logging
from megatron_spec.rl.logging import StepLogger, format_line, read_metrics, scalars


def _metrics(step, spec=True, **over):
    m = {"step": step, "stages": {"data": 0.01, "prepare": 0.2, "gen": 2.0, "logprob": 0.5, "train": 1.25},
         "step_time": 3.96, "gen_tokens": 1024, "tokens_per_s": 512.0,
         "acceptance_length": 2.41 if spec else None, "accepted_per_pos": [0.8, 0.5, 0.25] if spec else None,
         "reward_mean": 0.45, "accuracy": 0.375, "eval_accuracy": None, "loss": 0.0123, "kl": None,
         "clip_frac": 0.01, "grad_norm": 0.7, "logprob_mismatch": 1e-3, "drafter_loss": 1.5 if spec else None,
         "response_len_mean": 16.0, "response_len_max": 40, "skipped": False}
    m.update(over)
    return m


def test_jsonl_round_trips(tmp_path):
    records = [_metrics(0), _metrics(1, eval_accuracy=0.5), _metrics(2, spec=False, loss=float("nan"), skipped=True)]
    with StepLogger(tmp_path, 3, tensorboard=False, stream=io.StringIO()) as log:
        for m in records:
            log.log(m)
            # flushed per step: a reader sees the line before the logger is closed
            assert read_metrics(tmp_path)[-1]["step"] == m["step"]
    back = read_metrics(tmp_path)
    assert back[:2] == records[:2]
    assert back[2]["skipped"] is True and back[2]["loss"] != back[2]["loss"]  # NaN survives


def test_truncated_last_line_is_ignored(tmp_path):
    lines = [json.dumps(_metrics(0)), json.dumps(_metrics(1)), json.dumps(_metrics(2))[:37]]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a crash's half line is expected, not worth a warning
        assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1]


def test_resume_after_crash_appends_cleanly_and_last_record_wins(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_metrics(0)) + "\n" + json.dumps(_metrics(1))
                                            + "\n" + json.dumps(_metrics(2))[:20])
    with StepLogger(tmp_path, 3, tensorboard=False, stream=io.StringIO()) as log:
        log.log(_metrics(1, reward_mean=0.9))  # the step after the checkpoint, re-run
        log.log(_metrics(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the half line was cut, not left in the middle of the file
        back = read_metrics(tmp_path)
    assert [m["step"] for m in back] == [0, 1, 2]
    assert back[1]["reward_mean"] == 0.9


def test_corrupt_middle_line_warns(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_metrics(0)) + "\n{oops\n" + json.dumps(_metrics(1)) + "\n")
    with pytest.warns(UserWarning, match="metrics.jsonl:2"):
        assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1]


def test_missing_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_step_line():
    line = format_line(_metrics(3, eval_accuracy=0.5), 30)
    assert line == ("step 3/30 | data 10ms prep 200ms gen 2.00s logp 500ms train 1.25s | 512 tok/s | tau 2.41 | "
                    "reward 0.450 acc 0.38 eval 0.50 | loss 0.0123")
    plain = format_line(_metrics(4, spec=False, skipped=True), 30)
    assert "tau" not in plain and plain.endswith("SKIPPED")


def test_log_prints_one_line_per_step(tmp_path):
    out = io.StringIO()
    with StepLogger(tmp_path, 2, tensorboard=False, stream=out) as log:
        log.log(_metrics(0))
        log.log(_metrics(1))
    assert [ln.split(" |")[0] for ln in out.getvalue().splitlines()] == ["step 0/2", "step 1/2"]


def test_scalars_flatten_and_skip_nulls():
    tags = dict(scalars(_metrics(5, spec=False, skipped=True)))
    assert tags["time/gen"] == 2.0 and tags["reward/reward_mean"] == 0.45 and tags["train/skipped"] == 1.0
    assert "gen/acceptance_length" not in tags and "train/kl" not in tags and "step" not in tags
    spec = dict(scalars(_metrics(5)))
    assert spec["gen/accepted_per_pos_2"] == 0.25 and spec["gen/acceptance_length"] == 2.41


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with StepLogger(tmp_path, 2, stream=io.StringIO()) as log:
        log.log(_metrics(0, reward_mean=0.25))
        log.log(_metrics(1, reward_mean=0.5))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/reward_mean")] == [(0, 0.25), (1, 0.5)]


def test_missing_tensorboard_is_a_note_not_a_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import raise ImportError
    monkeypatch.setattr(rl_logging, "_tensorboard_note_printed", False)
    for sub in ("a", "b"):
        with StepLogger(tmp_path / sub, 1, stream=io.StringIO()) as log:
            log.log(_metrics(0))
        assert read_metrics(tmp_path / sub)[0]["step"] == 0
    assert capsys.readouterr().err.count("tensorboard is not installed") == 1
    assert not (tmp_path / "a" / "tensorboard").exists()


def test_progress_bar_on_a_tty_and_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr(rl_logging, "_isatty", lambda stream: True)
    monkeypatch.delenv(rl_logging.NO_PROGRESS_ENV, raising=False)
    out = io.StringIO()
    with StepLogger(tmp_path, 3, tensorboard=False, stream=out) as log:
        bar = log.progress(range(3))
        assert not bar.disable and bar.total == 3
        for step in bar:
            log.log(_metrics(step))  # goes through tqdm.write, still one line per step
        assert out.getvalue().count("step ") == 3
        monkeypatch.setenv(rl_logging.NO_PROGRESS_ENV, "1")
        assert log.progress(5).disable
    monkeypatch.setattr(rl_logging, "_isatty", lambda stream: False)
    monkeypatch.delenv(rl_logging.NO_PROGRESS_ENV)
    with StepLogger(tmp_path, 3, tensorboard=False, stream=io.StringIO()) as log:
        assert list(log.progress(range(2))) == [0, 1]
        assert log._bar.disable
