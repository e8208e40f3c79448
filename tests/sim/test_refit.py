"""The refit in the step model: the CPU host's measured gloo figure, and the GPU links' spec-sheet figures, by
placement (colocated: CUDA IPC device copy or a gather over NVLink; disaggregated: NVLink or InfiniBand)."""

import json
from pathlib import Path

import pytest

from megatron_spec.sim.calibration import HOPPER
from megatron_spec.sim.config import LengthDist, SimConfig, TrainParallel, Workload
from megatron_spec.sim.hardware import (
    CPU_GLOO_REFIT_BW, GPU_PROFILES, H100_CUDA_IPC_MEASURED_BW, NDR_IB_BW, NVLINK4_BW, hardware,
)
from megatron_spec.sim.pipeline import build, simulate
from megatron_spec.sim.stages import refit_bytes, refit_link

RECORDS = Path(__file__).resolve().parents[2] / "research" / "records"
RECORD = RECORDS / "refit_collective.json"
W = Workload(64, 16, 200, LengthDist(mean=2000, max_tokens=8192))


def test_cpu_figure_is_the_committed_measurement():
    """The CPU host's refit bandwidth is the collective (gloo) transport's median GB/s in the committed benchmark
    record, to its third digit (the constant is rounded to 0.537 GB/s)."""
    runs = {r["transport"]: r for r in json.loads(RECORD.read_text())["runs"]}
    assert CPU_GLOO_REFIT_BW == pytest.approx(runs["collective"]["gb_per_s"] * 1e9, rel=1e-3)
    assert hardware("cpu").refit_bw == CPU_GLOO_REFIT_BW


def test_measured_cuda_ipc_figure_is_the_committed_one():
    """The H100 CUDA IPC figure shown beside the device-copy bound is the committed measurement's GB/s."""
    rows = {r["transport"]: r for r in json.loads((RECORDS / "refit_cuda_ipc_h100.json").read_text())["rows"]}
    assert H100_CUDA_IPC_MEASURED_BW == pytest.approx(rows["cuda_ipc"]["gb_per_s"] * 1e9, rel=2e-3)


def test_gpu_figures_are_the_spec_sheets():
    """NVLink 4: 900 GB/s per H100 / H200, both directions added; NDR InfiniBand: 400 Gb/s = 50 GB/s a port."""
    assert NVLINK4_BW == 900e9 and NDR_IB_BW == 50e9
    for name in ("h100", "h200"):
        assert GPU_PROFILES[name].link_bw == NVLINK4_BW and GPU_PROFILES[name].net_bw == NDR_IB_BW


@pytest.mark.parametrize("colocated, gpus, train, transport, bw", [
    (True, 8, TrainParallel(dp=8), "CUDA IPC", 3.35e12 / 2 * HOPPER.mem_eff),
    (True, 8, TrainParallel(tp=2, dp=4), "NVLink gather", 450e9 * HOPPER.refit_eff),
    (False, 8, TrainParallel(tp=2, dp=2), "NVLink broadcast", 450e9 * HOPPER.refit_eff),
    (False, 16, TrainParallel(tp=2, dp=4), "InfiniBand broadcast", 50e9 * HOPPER.refit_eff),
])
def test_transport_by_placement(colocated, gpus, train, transport, bw):
    """Each placement's transport and the bandwidth it reaches: colocated on one GPU a device copy through CUDA IPC
    (HBM read and write), a split trainer gathers over NVLink; disaggregated, NVLink inside an 8-GPU node and the
    NIC once the job spans nodes. The refit time is the bytes over that bandwidth."""
    cfg = SimConfig(model="qwen3-8b", hardware="h100", gpus=gpus, workload=W, train=train, colocated=colocated,
                    gen_gpus=0 if colocated else gpus // 2)
    hw, cal, target, drafter = build(cfg)
    name, got = refit_link(cfg, hw, cal)
    assert transport in name and "spec sheet" in name
    assert got == pytest.approx(bw)
    result = simulate(cfg)
    assert result.refit_s == pytest.approx(refit_bytes(cfg, target, drafter) / bw)
    assert transport in result.refit_transport


@pytest.mark.parametrize("colocated", [True, False])
def test_cpu_host_refits_at_the_measured_figure(colocated):
    """On the CPU host both placements refit at the measured gloo figure: the tiny deep policy's float32 bytes
    over 0.537 GB/s."""
    cfg = SimConfig(model="tiny-qwen3-deep", hardware="cpu", gpus=2, workload=Workload(8, 8, 16, LengthDist(30, 160)),
                    train=TrainParallel(dp=2 if colocated else 1), colocated=colocated,
                    gen_gpus=0 if colocated else 1, gen_dtype_bytes=4, offload=False if colocated else None)
    hw, cal, target, drafter = build(cfg)
    assert refit_link(cfg, hw, cal) == ("gloo broadcast (measured)", CPU_GLOO_REFIT_BW)
    assert simulate(cfg).refit_s == pytest.approx(target.total_params * 4 / CPU_GLOO_REFIT_BW)
