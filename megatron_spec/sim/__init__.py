"""Performance simulator and tuner for GRPO steps with speculative-decoding rollouts.

Start at `pipeline.simulate(SimConfig(...))`; README.md in this folder derives the model of a step, and
`calibration.py` holds every constant it uses (`eager.py` the operator counts of our code). No module here imports
torch at import time (only `cpu_profile.measure`, `cpu_eager`, `cpu_check` and `op_census` do, inside their
functions); torch still loads today because
`megatron_spec/models/__init__.py`, which runs before `models.config` and `models.presets`, imports the model code.
"""

from .calibration import CPU, GPU, Calibration
from .config import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload
from .hardware import GPU_PROFILES, Hardware, hardware
from .pipeline import STAGES, StepResult, simulate

__all__ = [
    "CPU", "GPU", "Calibration", "GenParallel", "LengthDist", "SimConfig", "Speculation", "TrainParallel",
    "Workload", "GPU_PROFILES", "Hardware", "hardware", "STAGES", "StepResult", "simulate",
]
