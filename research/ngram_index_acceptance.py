"""Acceptance length of the n-gram drafter with this checkout's suffix index against the one before the change that
extends a match cut short by the end of the text (commit 5a97003): tiny model, 16 arithmetic prompts, greedy, k=3,
128 new tokens, with and without EOS. Acceptance only (no timing), so the machine's load does not matter.

    python research/ngram_index_acceptance.py > research/records/ngram_index_acceptance.json
"""

import json
import subprocess

import torch

import megatron_spec.drafters.ngram.proposer as ngram
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.rl.task import PromptTask
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.speculative.stats import speculation_summary

BEFORE = "5a97003"


def index_before():
    src = subprocess.run(["git", "show", f"{BEFORE}:megatron_spec/drafters/ngram/proposer.py"], capture_output=True,
                         text=True, check=True).stdout
    ns: dict = {}
    exec(compile(src.replace("from .base import", "from megatron_spec.drafters.proposer import"), "ngram_before",
                 "exec"), ns)
    return ns["SuffixIndex"]


def main() -> None:
    torch.set_num_threads(1)
    model = from_pretrained("checkpoints/tiny-qwen3")
    task = PromptTask.build("tiny", "checkpoints/tiny-qwen3", 64, 0, "eval")
    prompts = [task.encode(p) for p in task.problems(0, 16)]
    result = {"setup": "tiny-qwen3, 16 eval prompts, greedy, ngram k=3 (n 2-4), 128 new tokens", "before": BEFORE}
    for name, index in (("before", index_before()), ("now", ngram.SuffixIndex)):
        ngram.SuffixIndex = index
        for ignore_eos in (False, True):
            outs = LLMEngine(model, spec=SpecConfig("ngram", 3)).generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=128, seed=0, ignore_eos=ignore_eos))
            result[f"{name}, ignore_eos={ignore_eos}"] = round(speculation_summary(outs)["acceptance_length"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
