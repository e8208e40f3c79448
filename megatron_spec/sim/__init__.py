"""Performance simulator and tuner for GRPO steps with speculative-decoding rollouts on GPU clusters.

Start at `pipeline.simulate(SimConfig(...))`; docs/design/simulator.md derives the model of a step, and
`calibration.py` holds every constant it uses. `main_job.py` checks the step model, the online drafter's training
and the whole-step ratio against the main job measured on this project's CPU host (`hardware='cpu'`). Nothing
here imports torch: the package is arithmetic over a `ModelConfig` (torch still loads, because
`megatron_spec/models/__init__.py`, which runs before `models.config` and `models.presets`, imports the model
code). The operator-level CPU validation harness that models our eager embedded engine and trainer lives outside
the library, in `research/sim_cpu/`.
"""

from .calibration import GPU, Calibration
from .config import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload
from .hardware import GPU_PROFILES, Hardware, hardware
from .pipeline import STAGES, StepResult, simulate

__all__ = [
    "GPU", "Calibration", "GenParallel", "LengthDist", "SimConfig", "Speculation", "TrainParallel",
    "Workload", "GPU_PROFILES", "Hardware", "hardware", "STAGES", "StepResult", "simulate",
]
