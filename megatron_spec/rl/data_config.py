"""The `data` section of an RL config: which prompts a run trains on and how their completions are scored.

Without `data.path` the run uses its built-in synthetic task (`model.task`); with it, prompts come from a dataset
file, directory or hub name (`megatron_spec/tasks/dataset.py`), each rendered by the policy's own chat template.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("dapo", "gsm8k", "custom")
"""Named row layouts: `dapo` (DAPO-Math-17k and verl's RL parquet: `prompt` as chat messages,
`reward_model.ground_truth`), `gsm8k` (`question`, and `answer` whose final line is `#### N`), `custom` (the
columns `prompt_key` and `answer_key` name)."""


@dataclass
class DataSection:
    path: str | None = None
    """Local `.jsonl` / `.json` / `.parquet` file, a local directory of them (split by file name, as the `datasets`
    library splits), or a hub dataset name (`owner/name`, fetched on the machine that runs the job). None: the
    built-in synthetic task of `model.task`."""
    split: str = "train"
    """Split of a directory or hub dataset to train on (a single file is one split)."""
    eval_split: str | None = None
    """Split for the held-out accuracy; None: the first `run.eval_prompts` rows of the seeded shuffle are held out
    and never trained on."""
    format: str = "dapo"
    """Row layout (`FORMATS`): `dapo`, `gsm8k` or `custom`."""
    prompt_key: str | None = None
    """Column of the prompt (dotted for nested fields): a string (one user message) or a list of chat messages
    (`role`, `content`). None: the format's (`prompt` for dapo, `question` for gsm8k); required for custom."""
    answer_key: str | None = None
    """Column of the reference answer (dotted for nested fields, e.g. `reward_model.ground_truth`). None: the
    format's; required for custom."""
    system_prompt: str | None = None
    """System message put before every prompt (replacing one the row carries); None: the row's own, if any."""
    chat_template_kwargs: tuple[str, ...] = ()
    """Extra variables of the chat template as `key=value` (values read as YAML: `enable_thinking=false`)."""
    max_prompt_tokens: int = 0
    """Drop prompts longer than this many tokens after the chat template (0: keep all); the count is printed."""
    shuffle: bool = True
    """Shuffle the rows with the run's seed, afresh each epoch (the order is a function of seed and epoch, so a
    resumed run continues at step x prompts_per_step)."""
    reward: str = "megatron_spec.tasks.math_verify_reward:math_verify_reward"
    """Reward function as `package.module:function`, called as `function(completion_text, answer) -> float`;
    importable by name in worker processes. The default is math-verify's equivalence check (1.0 or 0.0)."""
    reward_workers: int = 2
    """Processes scoring the completions in parallel, or Ray actors where the run is placed on Ray
    (`backend.placement` colocated / disaggregated); 0: in this process, one after another."""
    reward_timeout_s: float = 10.0
    """Longest a reward call may take; a completion that runs over scores 0 and is counted (`reward_timeouts`)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format must be one of {FORMATS}, got {self.format!r}")
        if self.format == "custom" and self.path and not (self.prompt_key and self.answer_key):
            raise ValueError("data.format=custom needs data.prompt_key and data.answer_key (the columns to read)")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"data.max_prompt_tokens must be >= 0 (0: no limit), got {self.max_prompt_tokens}")
        if self.reward_workers < 0:
            raise ValueError(f"data.reward_workers must be >= 0 (0: in process), got {self.reward_workers}")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"data.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if ":" not in self.reward:
            raise ValueError(f"data.reward must be 'package.module:function', got {self.reward!r}")
        for item in self.chat_template_kwargs:
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise ValueError(f"data.chat_template_kwargs items must be key=value, got {item!r}")

    def template_kwargs(self) -> dict:
        """`chat_template_kwargs` as a dict, each value read as YAML (`false` -> False, `3` -> 3)."""
        import yaml

        return {k.strip(): yaml.safe_load(v) for k, v in (item.split("=", 1) for item in self.chat_template_kwargs)}
