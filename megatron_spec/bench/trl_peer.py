"""The peer of `bench step`: TRL's `GRPOTrainer` on the same tiny model, prompts, reward and workload.

Everything that decides how much work one step is comes from the same `RLConfig` our plain run uses: the policy
checkpoint (loaded by transformers, which reads our HF-layout safetensors as they are), the prompts of
`PromptTask` in the same order, our reward on the completion ids, prompts x group completions per optimizer step,
max tokens, sampling, learning rate, clip range, KL weight (0: no reference model) and gradient clipping. TRL
otherwise runs with its defaults on one CPU process (`transformers` `generate` for the rollouts, no vLLM), except
two that would make it do different work from ours: fp32 instead of bf16, and no activation checkpointing.

With one update per generation batch both take the behaviour log-probs from the training forward itself (ours:
`grpo.fold_logprob`, so our `logprob` stage is ~0 s). One difference is in TRL's favour and left in: TRL generates
with the training model in place, so it has nothing like our `prepare` stage (refit + wake).

The step time is measured by a callback from `on_step_begin` (before generation) to `on_step_end` (after the
optimizer step), so TRL's logging between steps is not counted, as our stage timers do not count ours.
"""

from __future__ import annotations

import tempfile
import time
import warnings

PEER_INSTALL = "pip install 'megatron-spec[peer]'"


def missing_reason() -> str | None:
    """Why the peer cannot run here (None when it can): the check `bench step` and the tests share."""
    try:
        import trl  # noqa: F401
    except ImportError as err:
        return f"TRL is not installed ({err}); `{PEER_INSTALL}` adds it"
    return None


def require_trl():
    try:
        import trl
    except ImportError as err:
        raise ImportError(f"the TRL peer needs trl: `{PEER_INSTALL}`") from err
    return trl


def hf_tokenizer():
    """Our character tokenizer as a `PreTrainedTokenizerFast`, which is what TRL accepts as processing class.

    One WordLevel entry per character after a split into single characters, the three specials at the same ids,
    and a post-processor that prepends <bos> the way `PromptTask.encode` does. Built in memory: nothing to ship.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from ..tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

    ours = CharTokenizer()
    specials = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}
    vocab = specials | {ch: ours.encode(ch)[0] for ch in ours.alphabet}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()  # characters join without the spaces a word-level decoder would insert
    tok.add_special_tokens(list(specials))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def check_tokenizer(tokenizer, task, problems) -> None:
    """The peer must see exactly the token ids our trainer sees, or the two runs are not the same workload."""
    for p in problems:
        theirs, ours = tokenizer(p.prompt)["input_ids"], task.encode(p)
        if theirs != ours:
            raise AssertionError(f"TRL tokenizer gives {theirs} for {p.prompt!r}, ours gives {ours}")


def reward_func(task, problems):
    """Our reward in TRL's signature. It reads the completion ids rather than TRL's decoded text, so ids beyond the
    character vocabulary are handled exactly as in our run; `index` is a dataset column TRL passes through."""

    def accuracy(completions, completion_ids, index, **_) -> list[float]:
        return [task.reward(ids, problems[i]) for ids, i in zip(completion_ids, index)]

    return accuracy


def grpo_config(cfg, steps: int, out_dir: str):
    """GRPOConfig equal to our recipe where it matters for the work done per step; the rest switched off."""
    from trl import GRPOConfig

    g = cfg.grpo
    # TRL turns activation checkpointing on by default; our trainer does not recompute activations. transformers 5
    # renamed the switch and warns on the old name, which older versions still need.
    fields = GRPOConfig.__dataclass_fields__
    no_ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return GRPOConfig(
        output_dir=out_dir, max_steps=steps, seed=cfg.run.seed, use_cpu=True, bf16=False, fp16=False, **{no_ckpt: False},
        per_device_train_batch_size=g.prompts_per_step * g.group_size,  # completions per optimizer step
        gradient_accumulation_steps=1, num_iterations=1, num_generations=g.group_size,
        max_completion_length=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
        shuffle_dataset=False,  # PromptTask's order: step s gets problems [s * P, (s + 1) * P)
        learning_rate=g.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=g.max_grad_norm,  # policy.py's AdamW
        beta=g.kl_coef, epsilon=g.clip_low, epsilon_high=g.clip_high,
        scale_rewards="group" if g.std != "none" else "none",
        loss_type="dapo" if g.loss_agg == "token" else "grpo",  # dapo: mean over all tokens of the batch
        logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False,
    )


def make_trainer(cfg, steps: int, out_dir: str, callbacks=(), reward=None):
    """A GRPOTrainer for `steps` optimizer steps of `cfg`'s workload; `reward` wraps the reward (tests spy on it)."""
    require_trl()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOTrainer

    from ..rl.task import PromptTask

    if cfg.model.task != "tiny":
        raise ValueError(f"the TRL peer runs the tiny character task only, not {cfg.model.task!r}")
    g = cfg.grpo
    task = PromptTask.build(cfg.model.task, cfg.model.policy, cfg.run.dataset_size, cfg.run.seed, "train",
                             cfg.model.terms_weights)
    problems = task.problems(0, steps * g.prompts_per_step)
    tokenizer = hf_tokenizer()
    check_tokenizer(tokenizer, task, problems)
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "index": list(range(len(problems)))})
    model = AutoModelForCausalLM.from_pretrained(cfg.model.policy, dtype=torch.float32)
    fn = reward_func(task, problems)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward(fn) if reward else fn], args=grpo_config(cfg, steps, out_dir),
                          train_dataset=data, processing_class=tokenizer, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # it prints every step's metrics dict; the bench prints its own table
    return trainer


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step, generation included, logging between steps excluded."""

        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    return StepTimer()


def run_trl(cfg, steps: int) -> dict:
    """`steps` TRL GRPO steps of `cfg`'s workload; the mean over all but the first (warm-up), like `run_variant`."""
    import torch

    trl = require_trl()
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(cfg.run.threads)
    timer = step_timer()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the weight-loading bar; the bench prints one line per variant
    try:
        with tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings():
            # Deprecation notices from TRL's own calls into transformers, nothing about this configuration.
            warnings.simplefilter("ignore", FutureWarning)
            trainer = make_trainer(cfg, steps, out_dir, callbacks=[timer])
            trainer.train()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    kept = slice(1, None) if len(timer.times) > 1 else slice(None)
    times, logs = timer.times[kept], logs[kept]
    return {"step_time": sum(times) / len(times), "step_times": timer.times, "trl": trl.__version__,
            "response_len_mean": sum(h["completions/mean_length"] for h in logs) / len(logs),
            "reward_mean": sum(h["reward"] for h in logs) / len(logs)}


GOALS = {"plain": 2.0, "spec": 3.0}
"""Goals for the step-time ratio TRL / ours: plain at least 2x, with speculation at least 3x."""


def run_peer(args, plain_cfg, plain: dict, best_row: dict | None) -> dict:
    """`bench step`'s peer entry: TRL measured on the plain run's config, or why it was skipped.

    `plain` is our plain run's result (`run_variant`), `best_row` the fastest speculative row of the table."""
    if args.no_peer:
        return {"name": "trl", "skipped": "--no-peer"}
    reason = missing_reason()
    if reason is not None:
        if args.peer == "trl":  # asked for by name: missing is an error, not a skip
            require_trl()
        return {"name": "trl", "skipped": reason}
    print("bench step: peer TRL GRPOTrainer ...")
    r = run_trl(plain_cfg, args.steps)
    peer = {"name": "trl", "version": r["trl"], "step_s": r["step_time"], "step_times": r["step_times"],
            "response_len_mean": r["response_len_mean"], "reward_mean": r["reward_mean"],
            "ours_response_len_mean": plain["response_len_mean"],
            "plain_speedup": r["step_time"] / plain["step_time"], "best_spec": None, "spec_speedup": None}
    if best_row is not None:
        peer["best_spec"], peer["spec_speedup"] = best_row["variant"], r["step_time"] / best_row["step_s"]
    return peer


def print_peer(peer: dict) -> None:
    if "skipped" in peer:
        print(f"peer {peer['name']}: skipped ({peer['skipped']})")
        return
    print(f"peer: TRL {peer['version']} GRPOTrainer, same workload: step {peer['step_s']:.2f} s, mean response "
          f"{peer['response_len_mean']:.1f} tokens (ours plain {peer['ours_response_len_mean']:.1f})")
    line = f"  TRL step / ours: plain {peer['plain_speedup']:.2f}x (goal >= {GOALS['plain']:.0f}x)"
    if peer["best_spec"] is not None:
        line += f", {peer['best_spec']} {peer['spec_speedup']:.2f}x (goal >= {GOALS['spec']:.0f}x)"
    print(line)
