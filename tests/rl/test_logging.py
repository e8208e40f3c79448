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


def test_a_resumed_run_leaves_each_step_in_the_file_once(tmp_path):
    """Resumed from step 0's checkpoint after steps 1-2 were logged (a job killed after a later save was lost): the
    logger opened with purge_step=1 drops their records, so the raw file, not only `read_metrics`, holds each step
    once, the re-run ones as re-run."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(_metrics(s)) + "\n" for s in range(3)))
    with StepLogger(tmp_path, 3, tensorboard=False, stream=io.StringIO(), purge_step=1) as log:
        log.log(_metrics(1, reward_mean=0.9))
        log.log(_metrics(2, reward_mean=0.8))
    raw = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["reward_mean"]) for m in raw] == [(0, _metrics(0)["reward_mean"]), (1, 0.9), (2, 0.8)]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


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


def _read_wandb_history(run_file) -> list[dict]:
    """The history rows of an offline wandb run file: a 7-byte file header, then records of a 7-byte header
    (checksum, length, type) and a `Record` protobuf each (one 32 KiB block suffices for these few steps). wandb's
    writer process may still be flushing when `finish()` returns: read until its `exit` record is there (for up to
    120 s: a wait that ends once the record is written, not a bound on speed, so it is long enough for a loaded
    machine to be slow in scheduling the writer)."""
    import struct
    import time

    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + 120
    while True:
        data, pos, rows, ended = run_file.read_bytes(), 7, [], False
        assert data.startswith(b":W&B") and len(data) < 32768
        while pos + 7 <= len(data):
            _, n, _ = struct.unpack("<IHB", data[pos : pos + 7])
            if n == 0 or pos + 7 + n > len(data):
                break
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data[pos + 7 : pos + 7 + n])
            pos += 7 + n
            kind = record.WhichOneof("record_type")
            ended |= kind == "exit"
            if kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
        if ended or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_wandb_offline_receives_every_scalar(tmp_path, monkeypatch):
    """Offline wandb (its own file format, read back here record by record): each step's row holds exactly the
    TensorBoard scalars of that step, at that step; the run id is kept for a resumed run."""
    pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = [_metrics(0), _metrics(1, reward_mean=0.625), _metrics(2, spec=False, accuracy=0.5)]
    with StepLogger(tmp_path / "run", 3, loggers=("wandb",), stream=io.StringIO(), config={"grpo": {"lr": 1e-5}}) as log:
        for m in records:
            log.log(m)
    assert not (tmp_path / "run" / "tensorboard").exists()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _read_wandb_history(run_file)
    assert [r["_step"] for r in rows] == [0, 1, 2]
    for row, m in zip(rows, records):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(dict(scalars(m)))
    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    assert run_id in run_file.name


def test_mlflow_file_store_receives_every_scalar(tmp_path, monkeypatch):
    """MLflow with a local file store: every scalar's history per step as logged, the config as parameters, the
    run ended; a second logger on the same run directory (a resume) continues the same MLflow run."""
    pytest.importorskip("mlflow", reason="the `mlflow` extra is not installed")
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    records = [_metrics(0), _metrics(1, reward_mean=0.625)]
    with StepLogger(tmp_path / "run", 3, loggers=("tensorboard", "mlflow"), stream=io.StringIO(),
                    config={"grpo": {"lr": 1e-5}}, project="exp") as log:
        log.log(records[0])
    with StepLogger(tmp_path / "run", 3, loggers=("mlflow",), stream=io.StringIO(), project="exp") as log:
        log.log(records[1])
    client = mlflow.tracking.MlflowClient()
    run = client.get_run((tmp_path / "run" / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.data.params == {"grpo.lr": "1e-05"}
    for tag, _ in scalars(records[0]):
        history = client.get_metric_history(run.info.run_id, tag)
        assert [h.step for h in history] == list(range(len(records)))
        assert [h.value for h in history] == pytest.approx([dict(scalars(m))[tag] for m in records])
    assert len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1


def test_unknown_or_missing_logger_fails_before_a_run(tmp_path, monkeypatch):
    """An unknown name, and a tracker that is not installed (hidden here), are refused with the extra to install."""
    from megatron_spec.rl.config import RunSection

    with pytest.raises(ValueError, match="unknown logger 'neptune'"):
        StepLogger(tmp_path, 1, loggers=("neptune",), stream=io.StringIO())
    with pytest.raises(ValueError, match="run.loggers: unknown"):
        RunSection(loggers=("tensorboard", "neptune"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'megatron-spec\[wandb\]'"):
        rl_logging.check_loggers(("tensorboard", "wandb"))
    with pytest.raises(ImportError, match=r"pip install 'megatron-spec\[mlflow\]'"):
        StepLogger(tmp_path, 1, loggers=("mlflow",), stream=io.StringIO())
