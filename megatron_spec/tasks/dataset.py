"""Prompts from a dataset: rows read with the `datasets` library (a local jsonl / json / parquet file or directory,
or a hub name), turned into chat messages and a reference answer by a named format, rendered by the policy's own
chat template and tokenizer, filtered by prompt length and shuffled with the run's seed.

`DatasetTask` has the interface the RL loop uses for its built-in synthetic tasks (`rl/task.py: PromptTask`):
`problems(start, n)`, `encode`, `decode`, `rewards`, so the loop does not know which it has. Item i of the
training order is a pure function of (rows, seed, i): epoch i // n is a fresh permutation seeded by (seed, epoch),
so a resumed run continues at step x prompts_per_step without saving any data state.

`datasets` and `pyarrow` are the `data` extra (`pip install 'megatron-spec[data]'`), imported when a dataset is
loaded.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from pathlib import Path

from .scoring import RewardScorer

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""The `datasets` builder for each file suffix a local path may have."""

FORMAT_KEYS = {"dapo": ("prompt", "reward_model.ground_truth"), "gsm8k": ("question", "answer"),
               "custom": (None, None)}
"""(prompt column, answer column) of each named format."""


@dataclass(frozen=True)
class DataProblem:
    """One row as the loop sees it."""

    messages: tuple[tuple[str, str], ...]
    """(role, content) chat messages, system prompt included, before the generation prompt."""
    answer: str
    """Reference answer the reward compares with."""
    prompt_ids: tuple[int, ...]
    """`messages` through the chat template (with the generation prompt) and the tokenizer."""


def _datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError("loading data.path needs the `data` extra: pip install 'megatron-spec[data]' "
                          "(datasets, pyarrow)") from err
    return datasets


def is_local(path: str) -> bool:
    """A path this machine has, or one written as a file path (`./x`, `/x`, `x.parquet`): not a hub name."""
    return Path(path).exists() or path.startswith((".", "/", "~")) or Path(path).suffix in FILE_BUILDERS


def load_rows(path: str, split: str):
    """The rows of `path` (file, directory or hub name) as a `datasets.Dataset`."""
    datasets = _datasets()
    local = Path(path).expanduser()
    if is_local(path) and not local.exists():
        raise FileNotFoundError(f"data.path {path} not found")
    if local.is_file():
        builder = FILE_BUILDERS.get(local.suffix)
        if builder is None:
            raise ValueError(f"data.path {path}: unknown file type {local.suffix!r}; use one of {sorted(FILE_BUILDERS)}")
        return datasets.load_dataset(builder, data_files=str(local), split="train")
    try:
        return datasets.load_dataset(str(local) if local.is_dir() else path, split=split)
    except ValueError as err:  # an unknown split names the ones there are
        raise ValueError(f"data.path {path}: {err}") from err


def field(row: dict, key: str):
    """`row[key]`, dotted keys reaching into nested fields (`reward_model.ground_truth`)."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"row has no field {key!r} (columns: {sorted(row)})")
        value = value[part]
    return value


def row_problem(row: dict, fmt: str, prompt_key: str | None, answer_key: str | None,
                system_prompt: str | None) -> tuple[list[tuple[str, str]], str]:
    """(chat messages, reference answer) of one row in format `fmt`."""
    default_prompt, default_answer = FORMAT_KEYS[fmt]
    prompt = field(row, prompt_key or default_prompt)
    answer = field(row, answer_key or default_answer)
    if isinstance(prompt, str):
        messages = [("user", prompt)]
    else:
        messages = [(m["role"], m["content"]) for m in prompt]
    if fmt == "gsm8k" and answer_key is None:  # the worked solution ends with "#### N"
        answer = str(answer).rsplit("####", 1)[-1].strip().replace(",", "")
    if system_prompt is not None:
        messages = [("system", system_prompt)] + [m for m in messages if m[0] != "system"]
    if not messages or not str(answer).strip():
        raise ValueError(f"row without a prompt or an answer: {row}")
    return messages, str(answer)


def encode_messages(tokenizer, messages, template_kwargs: dict) -> list[int]:
    """The chat template's text with the generation prompt, tokenized verbatim (it already holds the special
    tokens)."""
    chat = [{"role": r, "content": c} for r, c in messages]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


RAY_SCORER = "megatron_spec.placement.scoring:RayRewardScorer"
"""The scorer of runs placed on Ray, named (not imported) here: the core never imports Ray."""


def make_scorer(data, placement: str = "inline"):
    """The scorer of `data`'s reward: `data.reward_workers` processes on this machine for an inline run, as many
    Ray actors for a run placed on a Ray cluster (`colocated`, `disaggregated`), this process alone with 0
    workers. Same per-item timeout and timed-out count either way."""
    if placement == "inline" or data.reward_workers == 0:
        return RewardScorer(data.reward, data.reward_workers, data.reward_timeout_s)
    module, name = RAY_SCORER.split(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ImportError(f"scoring rewards with backend.placement={placement} needs Ray: "
                          f"pip install 'megatron-spec[ray]' ({err})") from err
    return cls(data.reward, data.reward_workers, data.reward_timeout_s)


class DatasetTask:
    """A dataset's problems in a seeded order, with the tokenizer that renders them and the scorer of their
    completions."""

    def __init__(self, problems: list[DataProblem], tokenizer, scorer: RewardScorer, seed: int, shuffle: bool):
        if not problems:
            raise ValueError("the dataset has no prompts left (after the prompt-length filter and the held-out rows)")
        self.items, self.tokenizer, self.scorer = problems, tokenizer, scorer
        self.seed, self.shuffle = seed, shuffle
        self._orders: dict[int, list[int]] = {}
        self.reward_stats: dict = {}

    @classmethod
    def load(cls, data, tokenizer, seed: int, eval_prompts: int,
             placement: str = "inline") -> tuple["DatasetTask", "DatasetTask"]:
        """(train task, held-out task) of the `data` section (`rl/data_config.py: DataSection`); `placement` is
        the run's (`backend.placement`), which decides where rewards are scored (`make_scorer`)."""
        kwargs = data.template_kwargs()
        scorer = make_scorer(data, placement)

        def problems(rows) -> list[DataProblem]:
            out, dropped = [], 0
            for row in rows:
                messages, answer = row_problem(row, data.format, data.prompt_key, data.answer_key,
                                               data.system_prompt)
                ids = encode_messages(tokenizer, messages, kwargs)
                if data.max_prompt_tokens and len(ids) > data.max_prompt_tokens:
                    dropped += 1
                    continue
                out.append(DataProblem(tuple(messages), answer, tuple(ids)))
            if dropped:
                print(f"data: {dropped} of {len(rows)} prompts are longer than data.max_prompt_tokens="
                      f"{data.max_prompt_tokens} and left out")
            return out

        train = problems(load_rows(data.path, data.split))
        if data.eval_split is not None:
            held = problems(load_rows(data.path, data.eval_split))
        else:
            order = list(range(len(train)))
            random.Random(f"{seed}-heldout").shuffle(order)
            n_eval = min(eval_prompts, len(train) - 1)
            held = [train[i] for i in sorted(order[:n_eval])]
            train = [train[i] for i in sorted(order[n_eval:])]
        return cls(train, tokenizer, scorer, seed, data.shuffle), cls(held, tokenizer, scorer, seed, False)

    def __len__(self) -> int:
        return len(self.items)

    def index(self, position: int) -> int:
        """The row at training position `position` (positions past the end start the next epoch)."""
        epoch, offset = divmod(position, len(self.items))
        if not self.shuffle:
            return offset
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(f"{self.seed}-epoch{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time: a run moves forward
        return self._orders[epoch][offset]

    def problems(self, start: int, n: int) -> list[DataProblem]:
        return [self.items[self.index(start + i)] for i in range(n)]

    def encode(self, problem: DataProblem) -> list[int]:
        return list(problem.prompt_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def rewards(self, token_ids: list[list[int]], problems: list[DataProblem]) -> list[float]:
        """Scores of the completions against their problems' answers, in parallel; `reward_stats` then holds the
        count that timed out."""
        scores, timeouts = self.scorer([self.decode(t) for t in token_ids], [p.answer for p in problems])
        self.reward_stats = {"reward_timeouts": timeouts}
        return scores

    def close(self) -> None:
        self.scorer.close()
