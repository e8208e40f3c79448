"""Does a background checkpoint save overlap the next training step? The Megatron trainer's GRPO step on a random
Qwen3-MoE, in one process, timed side by side in each round: a step with no save, a foreground save then a step,
and a background save (`run.async_save`) whose write runs during the step that follows it, written by a thread
or by a process (`run.async_save_writer`).

    flock /tmp/ms-timing.lock python benchmarks/async_save.py --out research/records/async_save_megatron.json

Each round runs the cases in a rotated order after one warm-up step and save of each kind; every save goes
through the loop's `rl.checkpoint.Saver` into a fresh run directory (deleted after), so it is the loop's path: the
shards (fp32 weights and both Adam moments, `torch_dist`), `state.pt`, the rename and `latest`. Per case it
records the step's seconds and the save's seconds on the critical path: the foreground save whole; for the
background save the copy and planning before the step (`save_blocking_s`) and the wait after it for a write not
yet done (`finish_s`), beside the write's own seconds (`save_background_s`). The writer shares the machine's cores
with the step, so on a small CPU the overlap shows as a slower step, not as free time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("none", "foreground", "background", "background_process")
"""`background`: the shards written by a thread of the trainer's process; `background_process`: by a spawned
process, handed the copy in shared memory (`run.async_save_writer`)."""


def machine(threads: int) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    isa = "AVX-512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "AVX2"
    return f"{cpu} ({isa}), {torch.get_num_threads()} CPU(s) visible, {threads} torch thread(s)"


def model_config(args):
    from megatron_spec.models import ModelConfig
    from megatron_spec.models.presets import TINY_VOCAB

    return ModelConfig(model_type="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=args.hidden // 16, intermediate_size=args.ffn, num_experts=args.experts,
                       num_experts_per_tok=2, moe_intermediate_size=args.ffn, norm_topk_prob=True,
                       rope_theta=10000.0, max_position_embeddings=512)


def batch(vocab: int, rows: int, prompt: int, completion: int, seed: int):
    from megatron_spec.interfaces import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + completion), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, prompt:] = True
    return Batch(ids, mask, torch.randn(rows, generator=g))


def bench(rank: int, world: int, args) -> dict:
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.models import CausalLM
    from megatron_spec.rl.checkpoint import Saver
    from megatron_spec.rl.config import GRPOSection, RLConfig

    torch.manual_seed(0)
    cfg = model_config(args)
    model = CausalLM(cfg)
    model.reset_parameters(std=0.02)
    params = sum(p.numel() for p in model.parameters())
    policy = MegatronPolicy(model, GRPOSection(micro_batch_tokens=args.rows * (args.prompt + args.completion)),
                            dict(temperature=1.0, top_k=0, top_p=1.0), Parallelism())
    del model
    rl = RLConfig()
    rl_process = dataclasses.replace(rl, run=dataclasses.replace(rl.run, async_save_writer="process"))
    work = Path(tempfile.mkdtemp(prefix="async-save-", dir=args.work))
    counter = iter(range(10**6))

    def step() -> float:
        b = batch(cfg.vocab_size, args.rows, args.prompt, args.completion, next(counter))
        t0 = time.perf_counter()
        policy.train_step(b)
        return time.perf_counter() - t0

    def case(kind: str) -> dict:
        run_dir = work / f"run{next(counter)}"
        saver = Saver(run_dir, background=kind.startswith("background"))
        out = {}
        if kind != "none":
            t0 = time.perf_counter()
            out.update(saver.save(0, policy, rl_process if kind == "background_process" else rl))
            out["save_call_s"] = time.perf_counter() - t0
        out["step_s"] = step()
        t0 = time.perf_counter()
        out.update(saver.wait())
        out["finish_s"] = time.perf_counter() - t0
        out["critical_s"] = out["step_s"] + out.get("save_blocking_s", 0.0) + out["finish_s"]
        if kind != "none":
            files = list((run_dir / "checkpoints" / "step_000000").rglob("*"))
            out["checkpoint_bytes"] = sum(f.stat().st_size for f in files if f.is_file())
        shutil.rmtree(run_dir, ignore_errors=True)
        return out

    for kind in CASES:  # warm-up: the first step and the first save of each kind set up what later ones reuse
        case(kind)
    rounds = []
    for r in range(args.rounds):
        order = CASES[r % len(CASES):] + CASES[: r % len(CASES)]
        rounds.append({kind: case(kind) for kind in order})
    shutil.rmtree(work, ignore_errors=True)
    return {"params": params, "rounds": rounds}


def summarize(rounds: list[dict]) -> dict:
    med = {k: {m: statistics.median(r[k][m] for r in rounds) for m in rounds[0][k]} for k in CASES}
    ratio = {f"{k}_{m}_over_none_step": statistics.median(r[k][m] / r["none"]["step_s"] for r in rounds)
             for k in CASES[1:] for m in ("step_s", "critical_s")}
    return {"median": med, "ratio_per_round_median": ratio}


def main(argv: list[str] | None = None) -> dict:
    from megatron_spec.trainers.megatron.parallel import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=10)
    p.add_argument("--completion", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=None, help="where the checkpoints are written (default: the temp dir)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    t0, load_before = time.time(), os.getloadavg()
    res = spawn(bench, 1, args, threads=args.threads)[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record = {
        "question": "does a background checkpoint save overlap the next training step (Megatron trainer)?",
        "machine": machine(args.threads),
        "command": "flock /tmp/ms-timing.lock python benchmarks/async_save.py " + " ".join(argv or sys.argv[1:]),
        "commit": commit.stdout.strip(),
        "model": {"params": res["params"], "hidden": args.hidden, "layers": args.layers, "experts": args.experts,
                  "top_k": 2, "moe_ffn": args.ffn, "params_dtype": "float32"},
        "batch": f"{args.rows} rows, {args.prompt}-token prompts, {args.completion}-token completions",
        "seconds": round(time.time() - t0, 1),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),  # other jobs on the machine skew timings
        **summarize(res["rounds"]),
        "rounds": res["rounds"],
    }
    print(json.dumps({k: record[k] for k in ("machine", "model", "median", "ratio_per_round_median")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
