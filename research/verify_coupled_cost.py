"""What drawing every drafted position's token costs against rejection sampling, on SmolLM2-135M.

The coupled verifier (`kernels.verify_coupled`) exponentiates and sums the distribution of every position up to the
first rejected draft; the rejection sampler it replaced (`verify_onehot`, built here from `--before`'s source under
its own namespace) exponentiated one row a sequence. At the main job's 64-token vocabulary neither shows; at
SmolLM2's 49,152 it might. In one process, alternately, `--rounds` times after an untimed round:

- `kernel`: each verifier alone on SmolLM2-sized processed log-probs (k = 3, drafts standing 3/4 of the time, so
  about 2.3 rows drawn a sequence), at each `--batch`;
- `engine`: SmolLM2 with its shipped EAGLE-3 head (k = 3, T = 1) generating 64 tokens for `--batch` chat prompts,
  the engine's verifier switched between the two kernels (the rejection sampler then reads each position's
  uniform for its test and the last for its residual: the same distribution, other tokens, so the runs take other
  numbers of steps, and the engine cells compare seconds per verify step, the most steps of a sequence). The
  order of the two alternates between rounds. Printed and written: seconds per call (kernel) or per step (engine)
  and coupled over rejection sampling (median of paired rounds).

    python research/verify_coupled_cost.py --before aa98f05~1 --out research/records/verify_coupled_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import git, ops_of  # noqa: E402

from megatron_spec import kernels  # noqa: E402
from megatron_spec.bench.common import machine, write_json  # noqa: E402
from megatron_spec.speculative.sampling import processed_logprobs  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def in_order(items: dict, r: int) -> list:
    """`items`' entries, reversed on odd rounds: neither version always runs first (warm caches, the host's drift)."""
    return list(items.items())[:: -1 if r % 2 else 1]


def paired(times: list[tuple[float, float]]) -> dict:
    """Coupled over rejection-sampling seconds, median of the rounds' ratios, with the totals (of seconds per call
    or per step)."""
    return {"onehot_s": round(sum(a for a, _ in times), 4), "coupled_s": round(sum(b for _, b in times), 4),
            "coupled_over_onehot": round(statistics.median(b / a for a, b in times), 4)}


def kernel_cells(old, batches: list[int], rounds: int, vocab: int = 49152, k: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    cells = []
    for B in batches:
        lp = processed_logprobs(torch.randn(B, k + 1, vocab, generator=g) * 4)
        best = lp[:, :k].argmax(-1)
        drafts = torch.where(torch.rand(B, k, generator=g) < 0.75, best, torch.randint(0, vocab, (B, k), generator=g))
        draft_len, u = torch.full((B,), k), torch.rand(B, k + 1, generator=g)
        times = []
        calls = {"onehot": lambda: old.verify_onehot(lp, drafts, draft_len, u),
                 "coupled": lambda: kernels.verify_coupled(lp, drafts, draft_len, u)}
        with torch.inference_mode():
            for r in range(rounds + 1):
                t = {name: timed(lambda: [call() for _ in range(10)]) / 10 for name, call in in_order(calls, r)}
                if r:
                    times.append((t["onehot"], t["coupled"]))
        cells.append({"batch": B, **paired(times), "onehot_ms": round(1e3 * statistics.median(a for a, _ in times), 3),
                      "coupled_ms": round(1e3 * statistics.median(b for _, b in times), 3)})
        print(cells[-1], flush=True)
    return cells


def engine_cells(old, batches: list[int], rounds: int) -> list[dict]:
    from megatron_spec.engine import LLMEngine, SamplingParams
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.models.hf_io import from_pretrained, smollm2_dir
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.rl.train_drafter import task_prompts

    root = Path(__file__).resolve().parents[1]
    target = from_pretrained(smollm2_dir())
    head = load_drafter(root / "checkpoints" / "smollm2-135m-eagle3", target.config)
    engine = LLMEngine(target, max_num_seqs=64, spec=SpecConfig("eagle3", 3), drafter=head)
    coupled = kernels.verify_coupled
    cells = []
    for B in batches:
        prompts = task_prompts("smollm2-135m", B, seed=7)
        times, accepted = [], []
        for r in range(rounds + 1):
            params = SamplingParams(temperature=1.0, max_tokens=64, seed=r, ignore_eos=True)
            t = {}
            for name, verifier in in_order({"onehot": old.verify_onehot, "coupled": coupled}, r):
                kernels.verify_coupled = verifier
                with torch.inference_mode():
                    start = time.perf_counter()
                    outs = engine.generate(prompts, params)
                    seconds = time.perf_counter() - start
                # The two verifiers emit different samples, so their runs take different numbers of steps: compare
                # seconds per target forward (a sequence's verify steps, the longest sequence's at B = 1).
                steps = max(o.spec.get("verify_steps", 0) for o in outs)
                t[name] = seconds / steps
                accepted.append(sum(o.spec.get("accepted", 0) for o in outs)
                                / max(1, sum(o.spec.get("verify_steps", 0) for o in outs)))
            kernels.verify_coupled = coupled
            if r:
                times.append((t["onehot"], t["coupled"]))
        cells.append({"batch": B, **paired(times), "accepted_per_verify": round(statistics.fmean(accepted), 3)})
        print(cells[-1], flush=True)
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a revision whose cpu_ops.cpp has verify_onehot")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert kernels.loaded()
    with tempfile.TemporaryDirectory() as work:
        old = ops_of(git("show", f"{args.before}:megatron_spec/kernels/cpu_ops.cpp"), "before_verify", Path(work))
    record = {"machine": machine(), "before": git("rev-parse", "--short", args.before),
              "after": git("rev-parse", "--short", "HEAD"), "threads": args.threads, "rounds": args.rounds,
              "command": "python research/verify_coupled_cost.py " + " ".join(sys.argv[1:]),
              "kernel": kernel_cells(old, args.batch, args.rounds),
              "engine": engine_cells(old, args.batch, args.rounds)}
    if args.out:
        print(f"wrote {write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
