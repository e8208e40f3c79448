"""Every calibration constant of the simulator, in one place, one set per GPU family.

A hardware profile is a spec sheet; these factors say how much of it real software reaches. There are two sets:
`GPU` for Blackwell (B200, GB200), read off public figures plus one constant set on the reference paper's GB200
runs, and `HOPPER` for H100 and H200, which replaces five of them with values fitted on NeMo-RL's published H100
GRPO step times (`fit.py`; docs/design/simulator-calibration.md). `calibration_for` picks the set of a profile.
Nothing is fitted per case: changing a number here moves every prediction of that family, which is what the tests
in `tests/sim` guard (test_reference_paper.py for Blackwell, test_published.py for Hopper).

Where each Blackwell value comes from:

- `mem_eff` 0.80: decode kernels stream weights and KV at ~80 % of the HBM spec (STREAM-like copies reach 85-90 %
  on H100; GEMV-shaped decode kernels a little less).
- `gemm_eff` 0.60: skinny decode / verify GEMMs (64-2048 rows) reach ~60 % of the dense peak; large square GEMMs
  reach 70-80 %.
- `train_mfu` 0.40: Megatron-scale pretraining reports 40-50 % MFU; RL training with ragged sequence lengths,
  recomputation and a separate logprob pass sits at the low end. MoE models use the same value.
- `link_eff` 0.70: bus bandwidth NCCL all-reduce / all-to-all reach relative to the link spec.
- `collective_latency_s` 10 us: a small NCCL all-reduce inside an NVLink domain; 30 us across domains.
- `forward_overhead_s` 1.5 ms: what one engine forward pass costs beyond its kernels (scheduler, input
  preparation, sampler and logprob bookkeeping, host-device synchronisation), paid by every target *and every
  draft* forward. Set once so that the reference paper's RL-Zero k=3 gen time comes out right; the RL-Think
  column and the k sweep are predicted with the same value.
- `decode_eff` 1.0: the reference paper's GB200 runs need no loss beyond `mem_eff` / `gemm_eff`.
- `refit_eff` 0.25 and `engine_wake_s` 1.0: a bucketed weight refit reaches about a quarter of the link (gathers,
  name mapping, per-bucket synchronisation); waking a sleeping engine (KV re-allocation, CUDA-graph reuse) costs
  about a second.
- `offload_eff` 0.5: host copies of many tensors (optimizer states, engine weights, reference weights) reach about
  half of the host link (pinned copies over PCIe Gen5 reach ~50 of 64 GB/s, pageable ones about half that).
- `fp8_train_gain` 0.3: FP8 training realises 0.3 of the sheet's extra 100 %, i.e. 1.3x (public Transformer
  Engine figures for dense models: 1.2-1.4x).

Hopper replaces `decode_eff`, `forward_overhead_s`, `train_mfu` and `train_mfu_moe` with `HOPPER_FIT`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import Hardware

# Fitted by `fit.fit_calibration` on the FIT_ROWS of `fit.py` from the Blackwell set's values, rounded to three
# digits (docs/design/simulator-calibration.md argues each against public figures).
HOPPER_FIT = {"decode_eff": 0.543, "forward_overhead_s": 1.23e-3, "train_mfu": 0.416, "train_mfu_moe": 0.122}


@dataclass(frozen=True)
class Calibration:
    mem_eff: float
    """Fraction of the memory bandwidth decode kernels reach."""
    gemm_eff: float
    """Fraction of the dense matmul peak decode / verify / prefill GEMMs and attention reach."""
    train_mfu: float
    """Fraction of the dense peak the training and logprob passes reach (model FLOPs utilisation)."""
    link_eff: float
    """Fraction of the link bandwidth collectives reach."""
    collective_latency_s: float
    """Fixed cost of one collective call, seconds."""
    forward_overhead_s: float
    """Fixed cost of one engine forward beyond its kernels, seconds."""
    refit_eff: float
    """Fraction of the link bandwidth a bucketed weight refit reaches."""
    engine_wake_s: float
    """Fixed cost of waking a sleeping generation engine, seconds."""
    data_s_per_rollout: float = 5e-5
    """Host time per rollout for the `data` stage (batching prompts, scoring rewards), seconds."""
    decode_eff: float = 1.0
    """Share of the kernel roofline (`mem_eff`, `gemm_eff`) the serving engine reaches over a whole generation:
    scheduling gaps between steps, small unfused kernels, MoE routing imbalance. Divides an engine forward's
    kernel time (not its fixed `forward_overhead_s`)."""
    train_mfu_moe: float = 0.0
    """Training MFU of mixture-of-experts models (token dispatch, grouped GEMMs over few tokens per expert);
    0: the same as `train_mfu`."""
    offload_eff: float = 0.5
    """Fraction of the host link (`Hardware.host_bw`) offload, onload and reference-weight swaps reach."""
    net_collective_latency_s: float = 30e-6
    """Fixed cost of one collective whose group spans scale-up domains (an engine wider than a node): NCCL's
    small-message all-reduce over InfiniBand between two HGX nodes takes a few tens of microseconds, against ~10
    inside NVLink."""
    train_call_s: float = 0.0
    """Host cost of one eager training call of the online drafter beyond its arithmetic (a minibatch's forward,
    backward and optimizer step launch hundreds of small operators), paid once per drafter optimizer step; 0 on
    GPUs, where a drafter's minibatch is large and its kernels queue behind each other."""
    fp8_train_gain: float = 0.3
    """Share of the spec sheet's extra FP8 throughput (`Hardware.fp8_speedup` - 1) that FP8 training realises end
    to end: 0.3 of the sheet's +100 % is 1.3x (public Transformer Engine figures for dense models: 1.2-1.4x)."""

    def __post_init__(self) -> None:
        for name in ("mem_eff", "gemm_eff", "train_mfu", "link_eff", "refit_eff", "decode_eff", "offload_eff",
                     "fp8_train_gain"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Calibration.{name} must be in (0, 1], got {value}")
        for name in ("collective_latency_s", "forward_overhead_s", "engine_wake_s", "data_s_per_rollout",
                     "net_collective_latency_s", "train_call_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Calibration.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.train_mfu_moe <= 1:
            raise ValueError(f"Calibration.train_mfu_moe must be in [0, 1] (0: train_mfu), got {self.train_mfu_moe}")

    def latency(self, hw: Hardware, group: int) -> float:
        """Fixed cost of one collective over `group` devices: inside one scale-up domain or across domains."""
        return self.collective_latency_s if group <= hw.domain_size else self.net_collective_latency_s

    def mfu(self, moe: bool) -> float:
        """Training MFU for a dense or a mixture-of-experts model."""
        return self.train_mfu_moe if moe and self.train_mfu_moe else self.train_mfu


GPU = Calibration(
    mem_eff=0.80, gemm_eff=0.60, train_mfu=0.40, link_eff=0.70, collective_latency_s=10e-6,
    forward_overhead_s=1.5e-3, refit_eff=0.25, engine_wake_s=1.0,
)
"""Blackwell (B200, GB200): the spec-sheet set above, with `forward_overhead_s` set on the reference paper's
GB200 run; its validation (tests/sim/test_reference_paper.py) runs on it."""

HOPPER = replace(
    GPU, decode_eff=HOPPER_FIT["decode_eff"], forward_overhead_s=HOPPER_FIT["forward_overhead_s"],
    train_mfu=HOPPER_FIT["train_mfu"], train_mfu_moe=HOPPER_FIT["train_mfu_moe"],
)
"""H100 and H200: the same spec-sheet kernel factors, with the engine's decode efficiency and per-forward
overhead and the training MFU of dense and MoE models fitted on NeMo-RL's published H100 GRPO step times
(`fit.py`; rows, values and their argument in docs/design/simulator-calibration.md). H200 shares it: the same
Hopper die and software, so the same fractions of its own spec sheet."""

CPU_HOST = Calibration(
    mem_eff=1.0, gemm_eff=1.0, train_mfu=1.0, link_eff=1.0, collective_latency_s=0.0, forward_overhead_s=1.3e-3,
    refit_eff=1.0, engine_wake_s=0.0, data_s_per_rollout=5e-6, train_call_s=4.9e-3,
)
"""The CPU host (`hardware.CPU_PROFILES['cpu']`): its figures are used as measured (efficiencies 1; the refit's
gloo figure already is an end-to-end rate). `forward_overhead_s`: the embedded engine's eager forward of the tiny
deep policy at one thread costs ~1.3 ms beyond its arithmetic (a plain main-job gen stage of 0.14-0.19 s over its
~100-130 decode steps), paid by every target and draft forward alike, which is why a draft forward there costs
about what a decode step does. `data_s_per_rollout`: 0.3 ms of prompt batching for 64 rollouts. `train_call_s`:
fitted on one profiled main job (the shipped online MTP training, 27 minibatch calls a step, within 6 quiet steps)
as the drafter's training beyond its FLOPs and AdamW traffic per call, in this profile's units (the policy's
training at its rates is the yardstick); the other settings and runs are checked against it
(tests/sim/test_main_job.py)."""

CALIBRATIONS = {"h100": HOPPER, "h200": HOPPER, "b200": GPU, "gb200": GPU, "cpu": CPU_HOST}


def calibration_for(hw_name: str) -> Calibration:
    """The calibration set of a GPU profile or the CPU host (a profile built elsewhere, e.g. the CPU harness's,
    gets `GPU`)."""
    return CALIBRATIONS.get(str(hw_name).lower(), GPU)
