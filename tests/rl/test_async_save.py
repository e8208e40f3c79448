"""Background checkpoint saves (`run.async_save`, `rl.checkpoint.Saver`) with the embedded trainer: a background save
holds exactly what a foreground save of the same state holds although the next step changes every weight while it
writes; a run resumed from a background save takes the same next step as one that never stopped; and a process
killed in the middle of a background write leaves the previous checkpoint as `latest`, loading bit for bit."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

from megatron_spec.rl import checkpoint, loop
from megatron_spec.rl.logging import read_metrics

from .test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]


def tensors(obj, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors(value, f"{prefix}/{key}").items()}


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_background_save_equals_foreground_save_of_the_same_state(ckpts, tmp_path, shaped_reward, monkeypatch):
    """After step 0: a foreground save as step 0 and a background save of the same state as step 1, whose writer
    thread is held until step 1 has moved every weight (`moved`); once finalized the two state.pt hold the same
    tensors bitwise (weights, Adam moments and steps, drafter and its optimizer, RNG), and `latest` names step 1.
    (Without the copy at the boundary the background file would hold step 1's weights.)"""
    go, real = threading.Event(), torch.save

    def held(*args, **kwargs):
        if threading.current_thread().name == "checkpoint-writer":
            assert go.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", held)
    trainer = loop.Trainer(small_cfg(ckpts, tmp_path))
    trainer.step(0)
    cfg = trainer.cfg
    saver = checkpoint.Saver(tmp_path, background=True)
    foreground = saver.save(0, trainer.policy, cfg, background=False)
    background = saver.save(1, trainer.policy, cfg)
    assert set(foreground) == set(background) == {"save_blocking_s"}
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    trainer.step(1)
    moved = trainer.policy.model.state_dict()
    assert all(not torch.equal(before[k], moved[k]) for k in before if k.endswith("proj.weight"))
    go.set()
    assert set(saver.wait()) == {"save_background_s"}
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001"
    a, b = (checkpoint.load_dir(tmp_path / "checkpoints" / f"step_00000{s}") for s in (0, 1))
    assert (a["step"], b["step"]) == (0, 1)
    assert len(tensors(a["state"])) > 100 and same(tensors(a["state"]), tensors(b["state"]))
    assert torch.equal(a["rng"], b["rng"])


def test_resume_from_a_background_save_takes_the_same_next_step(ckpts, tmp_path, shaped_reward):
    """3 steps saving every step, in the background and in the foreground: equal checkpoints of steps 0 and 1
    (bitwise), the background run logging each save's blocking and background seconds (the step-2 save, at the
    end, in the foreground). Then a copy of the background run cut back to its step-1 checkpoint resumes and its
    step 2 equals the straight run's: metrics and final weights bitwise."""
    runs = {}
    for name, background in (("bg", True), ("fg", False)):
        cfg = small_cfg(ckpts, tmp_path / name)
        cfg.run.save_every, cfg.run.async_save = 1, background
        runs[name] = loop.train(cfg)
    for step in (0, 1):
        a, b = (checkpoint.load_dir(tmp_path / n / "checkpoints" / f"step_{step:06d}") for n in ("bg", "fg"))
        assert same(tensors(a["state"]), tensors(b["state"]))
    logged = read_metrics(tmp_path / "bg")
    assert [sorted(k for k in m if k.startswith("save_")) for m in logged] == [
        ["save_blocking_s"], ["save_background_s", "save_blocking_s"], ["save_background_s", "save_blocking_s"]]

    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "bg", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    (cut / "checkpoints" / "latest").write_text("step_000001")
    cfg = small_cfg(ckpts, cut)
    cfg.run.save_every = 1
    resumed = loop.train(cfg)
    keys = ["reward_mean", "loss", "gen_tokens", "drafter_loss", "acceptance_length"]
    assert resumed["step"] == 2 and [resumed[k] for k in keys] == [runs["bg"][k] for k in keys]
    wa, wb = (checkpoint.load_dir(d / "checkpoints" / "step_000002")["state"]["model"] for d in (tmp_path / "bg", cut))
    assert same(wa, wb)


KILLED = textwrap.dedent("""
    import io, sys, time, torch
    from megatron_spec.rl import checkpoint, loop
    from tests.rl.test_loop import small_cfg
    from pathlib import Path
    ckpts, out = Path(sys.argv[1]), Path(sys.argv[2])
    trainer = loop.Trainer(small_cfg(ckpts, out))
    trainer.step(0)
    saver = checkpoint.Saver(out, background=True)
    saver.save(0, trainer.policy, trainer.cfg, background=False)
    torch.save({k: v.clone() for k, v in trainer.policy.model.state_dict().items()}, out / "weights_at_0.pt")
    trainer.step(1)
    real = torch.save

    def half_then_hang(obj, f):  # the background writer: half of state.pt on disk, then the kill
        buf = io.BytesIO()
        real(obj, buf)
        with open(f, "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        print("WRITING", flush=True)
        time.sleep(600)

    torch.save = half_then_hang
    saver.save(1, trainer.policy, trainer.cfg)
    time.sleep(600)  # the next step, in flight when the job is killed
""")


def test_a_killed_background_save_leaves_the_previous_checkpoint_loadable(ckpts, tmp_path):
    """A process saves step 0 in the foreground, trains step 1 and starts its background save; when the writer
    thread has half of state.pt on disk the process is SIGKILLed. `latest` still names step 0, no step_000001
    exists (only the hidden temporary directory with the half file), the step-0 weights load bit for bit equal to
    what the process held at step 0, and `clear_interrupted` (run at every loop start) removes the leftover."""
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(ckpts), str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_000000"
    leftovers = [p for p in root.iterdir() if p.name.startswith(".step_000001.")]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_000000"]
    assert len(leftovers) == 1 and (leftovers[0] / "state.pt").stat().st_size > 0
    saved = checkpoint.load_latest(out)
    assert saved["step"] == 0
    assert same(saved["state"]["model"], torch.load(out / "weights_at_0.pt"))
    checkpoint.clear_interrupted(out)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000"]


def test_a_signal_after_a_background_save_exits_with_both_saves_complete(ckpts, tmp_path, shaped_reward):
    """Saving every step in the background, SIGUSR1 during step 1: the loop finalizes step 0's background save
    before it saves step 1 in the foreground and returns; both directories are complete (state.pt loads with its
    step), `latest` names step 1, no temporary directory is left, and step 1's line logs the save on the critical
    path with the background write it finalized."""
    from .test_stop import signalling_trainer

    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps, cfg.run.save_every = 4, 1
    out = loop.run(cfg, signalling_trainer(1, signal.SIGUSR1))
    assert out["stopped_on"] == "SIGUSR1" and out["step"] == 1
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000", "step_000001"]
    assert (root / "latest").read_text() == "step_000001"
    assert [checkpoint.load_dir(root / f"step_00000{s}")["step"] for s in (0, 1)] == [0, 1]
    assert {"save_blocking_s", "save_background_s"} <= set(read_metrics(tmp_path)[1])
