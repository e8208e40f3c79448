"""`megatron-spec report RUN --compare-sim h100:32`: a run's measured stage times beside the simulator's prediction
for the same configuration, so a cluster user sees where the model and the machine disagree.

The run directory gives the configuration (`config.yaml`: model, GRPO batch, speculation, backend layout) and the
measurements (`metrics.jsonl`: stage times, response lengths, acceptance length per step, averaged over the steps
after the first, which pays one-off warm-up). The workload's response lengths are the log-normal whose quantiles
have the run's mean and longest response (`LengthDist.fit`); the acceptance length is the run's measured mean.
The hardware and GPU count are not in a run's config, so the caller names them. Below the stages, the run's
measured memory peaks (per trainer rank and generator process, `metrics.jsonl`'s `memory`) sit beside the
simulator's memory per GPU for the same layout. The simulator describes GPU
clusters only: an embedded CPU run is predicted by the validation harness in `research/sim_cpu` instead.
"""

from __future__ import annotations

from pathlib import Path

from ..drafters.registry import drafter_method
from .config import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload, resolve_model
from .pipeline import STAGES, simulate


def parse_target(text: str) -> tuple[str, int]:
    """'h100:32' -> ('h100', 32)."""
    name, _, gpus = text.partition(":")
    if not gpus.isdigit() or int(gpus) < 1:
        raise ValueError(f"--compare-sim wants HARDWARE:GPUS (e.g. h100:32), got {text!r}")
    return name, int(gpus)


def _model(policy: str):
    try:
        return resolve_model(policy)
    except ValueError:
        return resolve_model(Path(policy).name.lower())  # "Qwen/Qwen3-8B" -> the qwen3-8b preset


def measured(run_dir: str | Path) -> tuple[dict, dict[str, float], dict[str, float]]:
    """(config, mean stage seconds, mean per-step figures) of a run, steps after the first."""
    run = Path(run_dir)
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    from ..metrics import read_metrics  # torch-free; the last record of a re-run step wins

    rows = [r for r in read_metrics(run) if isinstance(r.get("stages"), dict)]
    if not rows:
        raise ValueError(f"{run}: metrics.jsonl has no steps")
    steady = rows[1:] or rows
    stages = {s: sum(r["stages"].get(s, 0.0) for r in steady) / len(steady) for s in STAGES}
    taus = [r["acceptance_length"] for r in steady if r.get("acceptance_length")]
    figures = {"mean": sum(r["response_len_mean"] for r in steady) / len(steady),
               "longest": sum(r["response_len_max"] for r in steady) / len(steady),
               "tau": sum(taus) / len(taus) if taus else 0.0}
    return cfg, stages, figures


def config_for_run(cfg: dict, figures: dict[str, float], hardware: str, gpus: int, prompt_len: int) -> SimConfig:
    """The SimConfig of a run's configuration on `gpus` GPUs of `hardware`."""
    g, b, spec = cfg["grpo"], cfg["backend"], cfg.get("spec")
    m = b["megatron"]
    n = g["prompts_per_step"] * g["group_size"]
    response = LengthDist.fit(max(figures["mean"], 1.0), figures["longest"], n, g["max_tokens"])
    colocated = b["placement"] != "disaggregated"
    gen_gpus = gpus if colocated else gpus // 2
    train_gpus = gpus if colocated else gpus - gen_gpus
    per = m["tp"] * m["pp"] * m["cp"]
    if train_gpus % per:
        raise ValueError(f"the run's trainer layout tp*pp*cp={per} does not divide {train_gpus} training GPUs")
    gen_tp = max(gen_gpus // max(b.get("generators", 1), 1), 1)
    sim_spec = None
    if spec and spec.get("num_speculative_tokens", 0) > 0 and figures["tau"] > 0:
        d = cfg.get("drafter_train") or {}
        # The embedded trainer replays and splits into minibatches; the Megatron trainer updates the drafter once
        # a step, over its drafts (MTP in the policy's backward, EAGLE-3's unrolled steps).
        replayed = d.get("replay", 1) * d.get("updates", 1) if b["trainer"] == "embedded" else 1
        sim_spec = Speculation(k=spec["num_speculative_tokens"], acceptance_length=figures["tau"],
                               drafter=drafter_method(spec["method"]).sim_label,
                               adaptive=bool(spec.get("adaptive")), online_drafter_training=bool(d.get("online")),
                               drafter_passes=d.get("drafts", 1) * replayed,
                               drafter_optimizer_steps=replayed * (d.get("minibatches", 1)
                                                                   if b["trainer"] == "embedded" else 1))
    return SimConfig(model=_model(cfg["model"]["policy"]), hardware=hardware, gpus=gpus,
                     workload=Workload(g["prompts_per_step"], g["group_size"], prompt_len, response),
                     train=TrainParallel(tp=m["tp"], pp=m["pp"], ep=m["ep"], cp=m["cp"], dp=train_gpus // per),
                     gen=GenParallel(tp=gen_tp), colocated=colocated, gen_gpus=0 if colocated else gen_gpus,
                     spec=sim_spec, policy_lag=b.get("async_lag", 0), fold_logprob=bool(g.get("fold_logprob")),
                     recompute=m.get("recompute") or "selective")


def measured_memory(run_dir: str | Path) -> dict[str, list[float]]:
    """The largest per-step peak (MB) of each memory figure a run's steps logged (`memory.py`: the loop's, each
    trainer rank's, each generator process's); per-rank and per-process figures keep one value each."""
    from ..metrics import read_metrics

    peaks: dict[str, list[float]] = {}
    for row in read_metrics(Path(run_dir)):
        for key, value in (row.get("memory") or {}).items():
            values = [float(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
            old = peaks.get(key, [])
            peaks[key] = [max(a, b) for a, b in zip(old, values)] + values[len(old):] if old else values
    return peaks


def memory_lines(run_dir: str | Path, cfg: dict, result, hardware: str, gpus: int) -> list[str]:
    """Measured per-rank peaks beside the simulator's memory per GPU for the run's layout on `gpus` x `hardware`:
    the trainer's weights + gradients, optimizer states and activations (for the run's `params_dtype`), the
    engine's weights and workspace with the KV cache it would get. Measured figures are what the run's processes
    held (host RSS on a CPU run, CUDA peaks on a GPU one); the simulated ones are device memory on the named GPUs."""
    from .memory import with_params_dtype

    MB = 2 ** 20
    peaks = measured_memory(run_dir)
    m = with_params_dtype(result.memory, cfg["backend"]["megatron"].get("params_dtype", "bfloat16"))

    def logged(*names: tuple[str, str]) -> str:
        return "; ".join(f"{name} {' / '.join(f'{v:.0f}' for v in peaks[key])}"
                         for key, name in names if key in peaks) or "not logged"

    lines = [f"memory (MB)  measured peak per rank / process, beside simulated per GPU ({hardware} x {gpus})"]
    trainer = logged(("trainer_peak_rss_mb", "RSS"), ("trainer_cuda_peak_allocated_mb", "CUDA allocated"),
                     ("trainer_cuda_peak_reserved_mb", "CUDA reserved"))
    lines.append(f"  trainer    measured: {trainer}")
    lines.append(f"             simulated: {m.train_total / MB:.0f} = weights+grads {m.train_weights / MB:.0f} + "
                 f"optimizer {m.train_optimizer / MB:.0f} + activations {m.train_activations / MB:.0f}")
    loop = logged(("loop_peak_rss_mb", "loop RSS"), ("children_peak_rss_mb", "generator processes RSS"),
                  ("cuda_peak_allocated_mb", "loop CUDA allocated"))
    lines.append(f"  generator  measured: {loop}")
    lines.append(f"             simulated: engine weights {m.engine_weights / MB:.0f} + workspace "
                 f"{m.engine_workspace / MB:.0f}, KV cache {max(m.kv_bytes, 0) / MB:.0f}")
    return lines


def compare_run(run_dir: str | Path, target: str, prompt_len: int = 200) -> str:
    """A table: stage, measured seconds, predicted seconds, predicted / measured; then the measured memory peaks
    beside the simulated memory per GPU (`memory_lines`)."""
    hardware, gpus = parse_target(target)
    cfg, stages, figures = measured(run_dir)
    if cfg["backend"]["trainer"] == "embedded" and cfg["backend"]["generator"] == "embedded":
        raise ValueError("this run used the embedded CPU stack, which the GPU simulator does not describe; its "
                         "model is the validation harness: python -m research.sim_cpu measured --help")
    result = simulate(config_for_run(cfg, figures, hardware, gpus, prompt_len))
    lines = [f"{'stage':8} {'measured_s':>10} {'predicted_s':>11} {'ratio':>6}   ({hardware} x {gpus})"]
    for s in (*STAGES, "step"):
        got = sum(stages.values()) if s == "step" else stages[s]
        want = result.step_s if s == "step" else result.stages[s]
        ratio = f"{want / got:6.2f}" if got else "     -"
        lines.append(f"{s:8} {got:10.3f} {want:11.3f} {ratio}")
    return "\n".join(lines + memory_lines(run_dir, cfg, result, hardware, gpus))
