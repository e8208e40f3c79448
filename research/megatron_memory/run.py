"""Does every Megatron trainer rank stay near its share of the training state (no rank holding the full model),
and does the distributed checkpoint of that run resume at another layout with the same next-step loss?

A random Qwen3-MoE (bf16 safetensors; 16 experts, top-2) trains 2 GRPO steps with `backend.trainer=megatron` on 4
gloo ranks (EP2 x PP2) and the embedded generator (`recipe.py`); each rank's peak RSS is measured from outside
(polling /proc VmHWM of every torchrun worker, by its RANK) and compared with what the run logged
(`metrics.jsonl` memory) and with the rank's share of the training state (parameters it holds x 16 B: fp32
weights, gradients, two Adam moments). Then a copy of the run directory holding only the step-0 checkpoint
resumes at EP2 without PP (2 ranks: the same 2 data-parallel ranks, so the same micro-batches and router
statistics) and its step 1 is compared with the straight run's.

    python research/megatron_memory/run.py --work /tmp/mm [--hidden 1024 --layers 14 --experts 16 --ffn 1024]

Writes research/records/megatron_memory_<hidden>x<layers>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def make_model(out: Path, hidden: int, layers: int, experts: int, ffn: int, heads: int, kv: int) -> dict:
    """A random Qwen3-MoE in HF layout, bf16, sharded safetensors; its parameter count."""
    import torch

    from megatron_spec.models import CausalLM, ModelConfig
    from megatron_spec.models.hf_io import save_tensors
    from megatron_spec.models.presets import TINY_VOCAB

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                      intermediate_size=ffn, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=ffn,
                      norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=512)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in CausalLM(cfg).state_dict().items()}
    count = sum(s.numel() for s in shapes.values())
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(0)
        tensors = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02)
                   .to(torch.bfloat16) for n, s in shapes.items()}
        save_tensors(tensors, out, max_shard_bytes=256 << 20)
        (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        del tensors
    return {"params": count, "config": cfg.to_hf()}


def rank_params(cfg: dict, ep: int, pp: int) -> list[int]:
    """Parameters each global rank holds at EP x PP (ranks ordered as Megatron's: tp, then dp/ep, then pp)."""
    h, L, E, f, v = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["moe_intermediate_size"],
                     cfg["vocab_size"])
    hd, nh, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * hd * (nh + 2 * kv) + nh * hd * h + 2 * hd + h  # qkv, o, q/k norms, input norm
    layer_dense = attn + h * E + h  # + router + post-attention norm
    layer_experts = E * 3 * h * f
    per_stage = L // pp
    out = []
    for rank in range(ep * pp):
        stage = rank // ep
        n = per_stage * (layer_dense + layer_experts // ep)
        if stage == 0:
            n += v * h
        if stage == pp - 1:
            n += v * h + h
        out.append(n)
    return out


GENERATOR = "megatron_spec.generators.process"
"""The module the embedded generator's own process runs (a child of rank 0, without torchrun's RANK)."""


class Watcher(threading.Thread):
    """Polls every descendant of `pid`: max VmHWM / VmRSS per rank (RANK in its environment) and of the
    generator's process (key "generator"), in bytes."""

    def __init__(self, pid: int, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.period, self.stop = pid, period, False
        self.peaks: dict[int, dict] = {}
        self.min_available = None

    def run(self):
        import psutil

        root = psutil.Process(self.pid)
        while not self.stop:
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                break
            for p in kids:
                try:
                    rank = int(p.environ().get("RANK", "-1"))
                    if rank < 0 and GENERATOR in " ".join(p.cmdline()):
                        rank = "generator"
                    status = Path(f"/proc/{p.pid}/status").read_text()
                except (psutil.Error, OSError, ValueError):
                    continue
                if rank == -1:
                    continue
                fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines()
                          if line.startswith(("VmHWM", "VmRSS"))}
                peak = self.peaks.setdefault(rank, {"hwm": 0, "rss": 0, "pid": p.pid})
                peak["hwm"] = max(peak["hwm"], fields.get("VmHWM", 0))
                peak["rss"] = max(peak["rss"], fields.get("VmRSS", 0))
            avail = psutil.virtual_memory().available
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            time.sleep(self.period)


def budget_check(peaks: dict, shares: list[int], metrics: list[dict]) -> dict:
    """Per rank: outside peak (MB), the largest peak the run logged for it, its share + 1.5 GB, and whether the
    peak stays below that; the generator's outside peak against the largest logged child peak."""
    out = {}
    for rank, share in enumerate(shares):
        hwm = peaks.get(rank, {}).get("hwm", 0) / 2**20
        logged = max(m["memory"]["trainer_peak_rss_mb"][rank] for m in metrics)
        bound = share / 2**20 + 1536
        out[rank] = {"outside_mb": hwm, "logged_mb": logged, "bound_mb": bound, "below": hwm < bound}
    if "generator" in peaks:
        out["generator"] = {"outside_mb": peaks["generator"]["hwm"] / 2**20,
                            "logged_largest_child_mb": max(max(m["memory"].get("children_peak_rss_mb") or [0])
                                                           for m in metrics)}
    return out


def torchrun(nproc: int, policy: Path, out: Path, overrides: list[str]) -> tuple[dict, float, int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "research/megatron_memory/recipe.py", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MM_POLICY": str(policy), "MM_OUT": str(out),
           "MEGATRON_SPEC_NO_PROGRESS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = Watcher(proc.pid)
    watch.start()
    log, _ = proc.communicate()
    watch.stop = True
    watch.join()
    return watch.__dict__, time.time() - t0, proc.returncode, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/megatron_memory")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", type=int, default=4)
    ap.add_argument("--skip-resume", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    policy = work / f"policy_{args.hidden}x{args.layers}"
    sizes = (args.hidden, args.layers, args.experts, args.ffn, args.heads, args.kv)
    if not (policy / "config.json").is_file():  # written by a child process, whose memory is then returned
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=make_model, args=(policy, *sizes))
        child.start()
        child.join()
    model = make_model(policy, *sizes)
    print(f"model: {model['params'] / 1e9:.3f} B parameters at {policy}", flush=True)

    straight = work / "run_ep2pp2"
    shutil.rmtree(straight, ignore_errors=True)
    watch, seconds, rc, log = torchrun(4, policy, straight, ["run.resume=false"])
    (work / "straight.log").write_text(log)
    shares = [n * 16 for n in rank_params(model["config"], ep=2, pp=2)]
    out = ROOT / "research" / "records" / f"megatron_memory_{args.hidden}x{args.layers}.json"
    if rc:  # what the failed run measured, kept: the outside peaks, the steps it logged, why it stopped
        print(log[-4000:])
        logged = straight / "metrics.jsonl"
        out.write_text(json.dumps({
            "question": __doc__.splitlines()[0], "failed": True, "returncode": rc, "command": " ".join(sys.argv),
            "machine": f"{platform.node()}: {os.cpu_count()} CPUs, shared with other jobs (load varies)",
            "model": {"params": model["params"], "hidden": args.hidden, "layers": args.layers},
            "outside_peak_mb": {r: {"hwm": v["hwm"] / 2**20, "rss": v["rss"] / 2**20} for r, v in watch["peaks"].items()},
            "min_available_mb": (watch["min_available"] or 0) / 2**20,
            "share_of_training_state_mb": [x / 2**20 for x in shares],
            "logged": [json.loads(line) for line in logged.read_text().splitlines()] if logged.is_file() else [],
            "log_tail": [line for line in log.splitlines() if "rror" in line or "Killed" in line][-12:],
        }, indent=2))
        return rc
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    ckpt = straight / "checkpoints" / "step_000000"
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
    model_bytes = model["params"] * 4
    record = {
        "question": __doc__.splitlines()[0],
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, shared with other jobs (load varies)",
        "command": " ".join(sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "model": {"params": model["params"], "hidden": args.hidden, "layers": args.layers, "experts": args.experts,
                  "top_k": 2, "moe_ffn": args.ffn, "checkpoint_dtype": "bfloat16", "params_dtype": "float32"},
        "layout": "EP2 x PP2, 4 gloo ranks, the embedded generator in a process of its own (a child of rank 0)",
        "seconds": seconds,
        "outside_peak_mb": {r: {"hwm": v["hwm"] / 2**20, "rss": v["rss"] / 2**20} for r, v in watch["peaks"].items()},
        "min_available_mb": (watch["min_available"] or 0) / 2**20,
        "share_of_training_state_mb": [s / 2**20 for s in shares],
        "logged_memory": [m.get("memory") for m in metrics],
        "losses": [{k: m.get(k) for k in ("step", "loss", "grpo_loss", "moe_aux_loss", "grad_norm", "reward_mean")}
                   for m in metrics],
        "budget_check": budget_check(watch["peaks"], shares, metrics),
        "checkpoint_files_bytes": files,
        "model_fp32_bytes": model_bytes,
        "largest_checkpoint_file_share_of_model": max(files.values()) / model_bytes,
    }
    if not args.skip_resume:
        resumed = work / "run_resumed_ep2"
        shutil.rmtree(resumed, ignore_errors=True)
        shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000001", "events*"))
        (resumed / "checkpoints" / "latest").write_text("step_000000")
        lines = (resumed / "metrics.jsonl").read_text().splitlines()[:1]
        (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        watch2, seconds2, rc2, log2 = torchrun(2, policy, resumed, ["run.resume=true", "backend.megatron.ep=2",
                                                                    "backend.megatron.pp=1"])
        (work / "resumed.log").write_text(log2)
        if rc2:
            print(log2[-4000:])
            return rc2
        after = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
        step1 = [m for m in after if m["step"] == 1][-1]
        record["resume"] = {
            "layout": "saved at EP2 x PP2 (4 ranks), resumed at EP2 (PP1, 2 ranks) from step 0",
            "step1_straight": record["losses"][1],
            "step1_resumed": {k: step1.get(k) for k in ("step", "loss", "grpo_loss", "moe_aux_loss", "grad_norm",
                                                         "reward_mean")},
            "outside_peak_mb": {r: {"hwm": v["hwm"] / 2**20, "rss": v["rss"] / 2**20}
                                for r, v in watch2["peaks"].items()},
            "seconds": seconds2,
        }
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
