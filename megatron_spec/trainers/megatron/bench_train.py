"""`python -m megatron_spec.trainers.megatron.bench_train [--out FILE]`: the Megatron trainer's GRPO step against
the embedded trainer's on the same batch.

The tiny Qwen3-MoE (`checkpoints/tiny-qwen3-moe`) with its MTP head (`checkpoints/tiny-qwen3-moe-mtp`), one
synthetic batch shaped like the tiny MoE recipe's (8 prompts x 8 rollouts, 10-token prompts, completions of 8-40
tokens): the embedded trainer (policy step + online MTP drafter step), `MegatronPolicy` in one process (EP1) and on
2 gloo ranks (EP2), each with the MTP layer trained jointly (detached). Median of `--repeats` steps after one
warm-up, `--threads` torch threads per process. Times are wall-clock seconds of `train_step` on rank 0.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from megatron_spec.bench.common import emit
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.drafters.registry import method_of
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
from megatron_spec.interfaces import Batch
from megatron_spec.trainers.embedded import EmbeddedPolicy

POLICY, DRAFTER = "checkpoints/tiny-qwen3-moe", "checkpoints/tiny-qwen3-moe-mtp"
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def batch(vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 41, (64,), generator=g)
    T = 10 + int(lengths.max())
    ids = torch.randint(3, vocab, (64, T), generator=g)
    mask = torch.zeros(64, T, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, 10 : 10 + n] = True
    return Batch(ids, mask, torch.randn(64, generator=g))


def timed(policy, b: Batch, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats + 1):
        fresh = Batch(b.input_ids, b.mask, b.advantages)
        t0 = time.perf_counter()
        policy.train_step(fresh)
        out.append(time.perf_counter() - t0)
    return out[1:]


def embedded(repeats: int) -> list[float]:
    model = from_pretrained(POLICY)
    drafter = load_drafter(DRAFTER, model.config)
    policy = EmbeddedPolicy(model, GRPOSection(), SAMPLING, drafter, method_of(drafter).name,
                            DrafterTrainSection(agreement=False))
    return timed(policy, batch(model.config.vocab_size), repeats)


def megatron(rank: int, world: int, repeats: int, threads: int) -> list[float]:
    from .checks import Parallelism
    from .policy import MegatronPolicy

    torch.set_num_threads(threads)
    model = from_pretrained(POLICY)
    policy = MegatronPolicy(model, GRPOSection(), SAMPLING, Parallelism(ep=world, etp=1),
                            drafter=load_drafter(DRAFTER, model.config), mtp_num_layers=1)
    return timed(policy, batch(model.config.vocab_size), repeats)


def main(argv: list[str] | None = None) -> dict:
    from .parallel import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)/process",
              "batch": "64 rows, 10-token prompts, 8-40-token completions (tiny MoE recipe's shape)"}
    runs = {"embedded": embedded(args.repeats),
            "megatron_ep1": spawn(megatron, 1, args.repeats, args.threads, threads=args.threads)[0],
            "megatron_ep2": spawn(megatron, 2, args.repeats, args.threads, threads=args.threads)[0]}
    for name, times in runs.items():
        result[name] = {"median_s": statistics.median(times), "times_s": times}
    result["ratio_megatron_ep1_to_embedded"] = result["megatron_ep1"]["median_s"] / result["embedded"]["median_s"]
    result["ratio_megatron_ep2_to_embedded"] = result["megatron_ep2"]["median_s"] / result["embedded"]["median_s"]
    return emit(result, args.out)


if __name__ == "__main__":
    main()
