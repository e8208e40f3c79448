"""`LLMEngine`: the single-machine rollout generator (continuous batching over a slotted KV cache)."""

from __future__ import annotations

import torch

from ..models.decoder import CausalLM
from ..spec.sampling import processed_logprobs, sample_tokens
from .kv_cache import KVCache
from .params import Completion, SamplingParams
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


class LLMEngine:
    def __init__(self, model: CausalLM, max_num_seqs: int = 64, max_prefill_tokens: int = 16384,
                 eos_token_id: int | list[int] | None = None):
        self.model = model.eval()
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.cache: KVCache | None = None

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> None:
        seqs, is_prefill = self.scheduler.schedule()
        logits, _ = self.runner.prefill(seqs) if is_prefill else self.runner.decode(seqs)
        tokens, logprobs = self.sample(seqs, logits)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            self.append(seq, [token], [logprob])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        seqs = self.start(prompts, params)
        with torch.inference_mode():
            while not self.scheduler.is_finished():
                self.step()
        return [self.completion(s) for s in seqs]

    # -- pieces ---------------------------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Validate the request, size the KV cache for it and queue one sequence per prompt."""
        self.validate(prompts)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        context = self.model.config.max_position_embeddings
        max_len = min(context, max(len(p) for p in prompts) + params.max_tokens) + self.cache_slack()
        self.ensure_cache(min(len(prompts), self.max_num_seqs), max_len)
        self.scheduler = Scheduler(self.cache, self.max_num_seqs, self.max_prefill_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.capture_layers())
        seqs = []
        for i, prompt in enumerate(prompts):
            gen = torch.Generator().manual_seed(params.seed * 1_000_003 + i)
            seq = Sequence(i, list(prompt), min(params.max_tokens, context - len(prompt)), gen)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def validate(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise ValueError("generate() got an empty prompt list")
        vocab, context = self.model.config.vocab_size, self.model.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= context:
                raise ValueError(f"prompt {i} has {len(p)} tokens: longer than the model's context ({context}) allows")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    def cache_slack(self) -> int:
        """Extra KV positions beyond the longest sequence (speculation writes drafts past the end)."""
        return 1

    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def cache_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def ensure_cache(self, num_slots: int, max_len: int) -> None:
        """Reuse the KV cache when it is large enough, else allocate one sized for this request."""
        c = self.cache
        if c is None or c.num_slots < num_slots or c.max_len < max_len or c.k.shape[0] < self.cache_layers():
            cfg = self.model.config
            self.cache = KVCache(self.cache_layers(), num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                 self.model.dtype, self.model.device)
        self.cache.free_slots = list(range(self.cache.num_slots))

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        p = self.params
        logprobs = processed_logprobs(logits, p.temperature, p.top_k, p.top_p)
        u = None if p.greedy else torch.cat([torch.rand(1, generator=s.generator) for s in seqs])
        tokens, token_logprobs = sample_tokens(logprobs, u, p.greedy)
        return tokens.tolist(), token_logprobs.tolist()

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Append accepted tokens, stopping at the first stop token or at the length limit."""
        for token, logprob in zip(tokens, logprobs):
            seq.output.append(token)
            seq.logprobs.append(logprob)
            if token in self.stop_ids:
                self.scheduler.finish(seq, "stop")
                return
            if seq.remaining <= 0:
                self.scheduler.finish(seq, "length")
                return

    def completion(self, seq: Sequence) -> Completion:
        return Completion(seq.output, seq.logprobs, seq.finish_reason, len(seq.prompt))
