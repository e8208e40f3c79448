"""What a run shows while it trains, and what it leaves behind for `megatron-spec report`.

Per RL step, `StepLogger.log(metrics)`:
  - appends one JSON line to `RUN_DIR/metrics.jsonl` and flushes it, so a crash loses at most the step in flight;
  - writes the numeric fields as TensorBoard scalars (when tensorboard is installed; otherwise a one-time note),
    and the same scalars to Weights & Biases and MLflow when `run.loggers` names them (`LOGGERS`);
  - prints one compact line: step, stage times, tokens/s, acceptance length, reward, accuracy, loss.

`read_metrics(run_dir)` reads the file back. A process killed mid-write leaves a truncated last line, which is
ignored; a resumed run first removes the records of the steps after its checkpoint (it re-runs them), so the file
holds each step once.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterable

from ..metrics import METRICS_FILE, read_metrics  # noqa: F401  (the file this logger writes)

STAGES = ("data", "prepare", "gen", "logprob", "train")
NO_PROGRESS_ENV = "MEGATRON_SPEC_NO_PROGRESS"

# TensorBoard groups scalars by the prefix before "/"; these put related curves on one dashboard row.
_TB_GROUP = {
    "reward_mean": "reward", "accuracy": "reward", "eval_accuracy": "reward", "eval_accuracy_before": "reward",
    "gen_tokens": "gen", "tokens_per_s": "gen", "acceptance_length": "gen", "accepted_per_pos": "gen",
    "response_len_mean": "gen", "response_len_max": "gen",
    "loss": "train", "kl": "train", "clip_frac": "train", "grad_norm": "train", "logprob_mismatch": "train",
    "drafter_loss": "train", "skipped": "train", "drafter_agreement": "gen",
    "step_time": "time",
}

_tensorboard_note_printed = False


class StepLogger:
    """One run's metrics sink. Use as a context manager or call `close()`; both are idempotent."""

    def __init__(self, run_dir: str | os.PathLike, total_steps: int, tensorboard: bool = True,
                 stream=None, purge_step: int | None = None, loggers: Iterable[str] | None = None,
                 config: dict | None = None, project: str = "megatron-spec"):
        # stream: where step lines go (stdout by default); purge_step: on resume, the first step being re-run,
        # so TensorBoard drops the events a crashed attempt wrote for it and later steps. loggers: `LOGGERS` to
        # write to (None: TensorBoard when `tensorboard`); config: the run's config, recorded by wandb / MLflow.
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self._bar = None
        path = self.run_dir / METRICS_FILE
        _drop_partial_line(path)
        if purge_step is not None:
            _drop_steps_from(path, purge_step)
        self._file = open(path, "a", encoding="utf-8")
        loggers = tuple(loggers) if loggers is not None else (("tensorboard",) if tensorboard else ())
        check_loggers(loggers)
        self._writer = _summary_writer(self.run_dir, purge_step) if "tensorboard" in loggers else None
        self._sinks = [SINKS[name](self.run_dir, project, config or {}) for name in loggers if name in SINKS]

    # -- per step ---------------------------------------------------------------------------------------------

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._writer is not None:
            self._write_scalars(metrics)
        if self._sinks:
            self._write_sinks(metrics)
        line = format_line(metrics, self.total_steps)
        if self._bar is not None and not self._bar.disable:
            # tqdm.write clears the bar, prints the line above it and redraws the bar, so the two never interleave.
            self._bar.write(line, file=self.stream)
            self._bar.set_postfix_str(_postfix(metrics), refresh=False)
        else:
            print(line, file=self.stream, flush=True)

    def progress(self, iterable: Iterable | int, desc: str = "RL steps", **tqdm_kwargs):
        """A tqdm bar over `iterable` (or, given an int, a bar of that total advanced by `.update()`).

        Silent when the terminal is not a TTY (logs, CI) or `MEGATRON_SPEC_NO_PROGRESS=1`."""
        from tqdm import tqdm

        disable = os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0") or not _isatty(sys.stderr)
        if isinstance(iterable, int):
            bar = tqdm(total=iterable, desc=desc, disable=disable, dynamic_ncols=True, **tqdm_kwargs)
        else:
            bar = tqdm(iterable, desc=desc, disable=disable, dynamic_ncols=True, **tqdm_kwargs)
        self._bar = bar
        return bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> "StepLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- TensorBoard ------------------------------------------------------------------------------------------

    def _write_scalars(self, metrics: dict) -> None:
        step = int(metrics.get("step", 0))
        try:
            for tag, value in scalars(metrics):
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()
        except Exception as err:  # a full disk or a broken writer must not stop training; the JSONL still has it
            print(f"note: TensorBoard logging stopped ({type(err).__name__}: {err}); metrics.jsonl is unaffected",
                  file=sys.stderr)
            self._writer = None


    def _write_sinks(self, metrics: dict) -> None:
        step, values = int(metrics.get("step", 0)), dict(scalars(metrics))
        for sink in list(self._sinks):
            try:
                sink.log(values, step)
            except Exception as err:  # as with TensorBoard: the run goes on, metrics.jsonl has everything
                print(f"note: {type(sink).__name__} logging stopped ({type(err).__name__}: {err}); "
                      f"metrics.jsonl is unaffected", file=sys.stderr)
                self._sinks.remove(sink)


# -- optional experiment trackers -----------------------------------------------------------------------------

LOGGERS = ("tensorboard", "wandb", "mlflow")
"""What `run.loggers` may name. TensorBoard event files go to RUN_DIR/tensorboard; wandb and MLflow follow their own
environment (WANDB_MODE=offline, WANDB_DIR, MLFLOW_TRACKING_URI, credentials) and get the same scalars."""


def _tracker(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"run.loggers names {extra}, which needs the `{extra}` extra: "
                          f"pip install 'megatron-spec[{extra}]'") from err


def check_loggers(loggers: Iterable[str]) -> None:
    """Unknown names and trackers that are not installed fail here, before a run computes anything."""
    for name in loggers:
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}: use any of {LOGGERS}")
        if name == "wandb":
            _tracker("wandb", "wandb")
        elif name == "mlflow":
            _tracker("mlflow", "mlflow")


class WandbSink:
    """One wandb run per run directory: its id is kept in RUN_DIR/wandb_run_id, so a resumed run continues it."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        wandb = _tracker("wandb", "wandb")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", config=config,
                              dir=os.environ.get("WANDB_DIR", str(run_dir)))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run per run directory (experiment `project`): its id is kept in RUN_DIR/mlflow_run_id, so a
    resumed run continues it."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        mlflow = _tracker("mlflow", "mlflow")
        self.client = mlflow.tracking.MlflowClient()
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self.run_id)
            flat = _flatten(config)
            for i in range(0, len(flat), 100):  # MLflow takes at most 100 params per call
                params = [mlflow.entities.Param(k, str(v)[:500]) for k, v in list(flat.items())[i : i + 100]]
                self.client.log_batch(self.run_id, params=params)
        self.client.update_run(self.run_id, "RUNNING")
        self._metric = mlflow.entities.Metric

    def log(self, values: dict, step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def scalars(metrics: dict) -> list[tuple[str, float]]:
    """The TensorBoard (tag, value) pairs of one step: every number, grouped; None and non-numbers skipped."""
    out = []
    for key, value in metrics.items():
        if key == "step":
            continue
        if key == "stages" and isinstance(value, dict):
            out += [(f"time/{stage}", float(v)) for stage, v in value.items() if _is_number(v)]
        elif key == "memory" and isinstance(value, dict):  # peaks in MB; per-rank lists get one curve per rank
            for name, v in value.items():
                values = v if isinstance(v, list) else [v]
                suffix = (lambda i: f"_{i}") if isinstance(v, list) else (lambda i: "")
                out += [(f"memory/{name}{suffix(i)}", float(x)) for i, x in enumerate(values) if _is_number(x)]
        elif isinstance(value, list):
            # accepted_per_pos: fraction of drafts accepted at each draft position, one curve per position.
            out += [(f"{_TB_GROUP.get(key, 'misc')}/{key}_{i}", float(v)) for i, v in enumerate(value) if _is_number(v)]
        elif isinstance(value, bool) or _is_number(value):  # `skipped` becomes a 0/1 curve
            out.append((f"{_TB_GROUP.get(key, 'misc')}/{key}", float(value)))
    return out


def format_line(m: dict, total_steps: int | None = None) -> str:
    """The compact per-step line, e.g.
    `step 3/30 | data 10ms prep 200ms gen 3.10s logp 520ms train 1.20s | 512 tok/s | tau 2.41 agree 0.83 | reward 0.450
    acc 0.38 | loss 0.0123`."""
    step = f"step {m.get('step', '?')}" + (f"/{total_steps}" if total_steps else "")
    st = m.get("stages") or {}
    short = {"data": "data", "prepare": "prep", "gen": "gen", "logprob": "logp", "train": "train"}
    times = " ".join(f"{short[s]} {_seconds(st[s])}" for s in STAGES if _is_number(st.get(s)))
    parts = [step, times, f"{_fmt(m.get('tokens_per_s'), '.0f')} tok/s"]
    agree = m.get("drafter_agreement") or [None]
    if m.get("acceptance_length") is not None or agree[0] is not None:
        # tau as measured in this step's rollouts ("-" when none speculated), then the drafter's agreement with the
        # policy on the train batch: the chance its first draft is accepted, measured whether or not it drafted
        parts.append(f"tau {_fmt(m.get('acceptance_length'), '.2f')}"
                     + (f" agree {agree[0]:.2f}" if agree[0] is not None else ""))
    parts.append(f"reward {_fmt(m.get('reward_mean'), '.3f')} acc {_fmt(m.get('accuracy'), '.2f')}"
                 + (f" eval {_fmt(m['eval_accuracy'], '.2f')}" if m.get("eval_accuracy") is not None else ""))
    parts.append(f"loss {_fmt(m.get('loss'), '.4f')}" + (" SKIPPED" if m.get("skipped") else ""))
    return " | ".join(parts)


# -- helpers ------------------------------------------------------------------------------------------------------

def _summary_writer(run_dir: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        _note_once("tensorboard is not installed, so no TensorBoard events are written "
              "(pip install 'megatron-spec[report]'); metrics.jsonl has everything")
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)


def _drop_partial_line(path: Path) -> None:
    """Cut a half-written last record (a crash mid-write) so the next append starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def _drop_steps_from(path: Path, step: int) -> None:
    """Remove the records of `step` and later (a run resumed from an earlier checkpoint re-runs them), so the file
    holds each step once; rewritten beside and moved into place, so a crash here leaves the old file whole."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if (at := _step_of(line)) is None or at < step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return int(record["step"]) if isinstance(record, dict) and "step" in record else None


def _note_once(msg: str) -> None:
    global _tensorboard_note_printed
    if not _tensorboard_note_printed:
        _tensorboard_note_printed = True
        print(f"note: {msg}", file=sys.stderr)


def _postfix(m: dict) -> str:
    tau = m.get("acceptance_length")
    return f"reward={_fmt(m.get('reward_mean'), '.3f')}" + (f" tau={tau:.2f}" if _is_number(tau) else "")


def _seconds(x: float) -> str:
    # Tiny CPU runs have millisecond stages and real runs minutes; both stay readable in a fixed few characters.
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def _fmt(value, spec: str) -> str:
    return format(value, spec) if _is_number(value) else "-"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
