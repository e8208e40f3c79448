"""`LLMEngine`: the single-machine rollout generator (continuous batching over a slotted KV cache), with
optional lossless speculative decoding.

A decode step and a verify step are the same thing: feed each sequence its last token plus its drafts (none for
plain decoding), then let verification decide how many drafts stand. With no drafts that is exactly plain
sampling from p, so one code path serves both; and since every output position's token is drawn with that
position's own uniform, a seed gives the same tokens with speculation as without (deterministic drafters).

New weights may arrive between two steps of a running generation (`refit`, in-flight RL updates): the running
sequences' keys and values are then computed again under them, so every later token is sampled, and every draft
verified, by exactly the new policy, and each token's policy version is recorded in its completion.
"""

from __future__ import annotations

import time

import torch

from .. import kernels
from ..models.config import token_id_tuple
from ..models.decoder import CausalLM, weights_fixed
from ..models.host import float_tensor, long_tensor
from ..speculative.adaptive import AdaptiveController
from ..drafters.config import SpecConfig
from ..drafters.proposer import Drafts, Proposer
from ..drafters.registry import build_proposer
from ..speculative.sampling import PositionUniforms, UniformStreams, position_uniforms, processed_logprobs, uniforms
from ..speculative.verify import Verdict, emitted_logprobs, verify_coupled, verify_greedy, verify_sampled
from ..models.kv_cache import KVCache
from .inflight import RefitHandoff
from .params import Completion, SamplingParams
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, draw_seed


class LLMEngine:
    def __init__(self, model: CausalLM, max_num_seqs: int = 64, max_prefill_tokens: int = 16384,
                 eos_token_id: int | list[int] | None = None, spec: SpecConfig | None = None, drafter=None,
                 record_routing: bool = False):
        self.model = model.eval()
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = set(token_id_tuple(eos))
        self.spec = spec
        self.proposer: Proposer = build_proposer(spec, model, drafter) if spec else Proposer()
        self.k_max = spec.num_speculative_tokens if spec else 0
        self.controller = AdaptiveController(self.k_max) if spec and spec.adaptive else None
        self.drafted_last = False
        """The previous step drafted. Only then is the drafter caught up: after a plain or prefill step an MTP /
        EAGLE-3 head or a draft model first runs over the positions it missed, which is not what drafting costs."""
        self.cache: KVCache | None = None
        self.version = 0
        """The policy version of the weights in place (set by `refit`); each emitted token is recorded with it."""
        self.refits = RefitHandoff()
        """Where another thread hands a refit in while this engine generates (`RefitHandoff.refit`)."""
        self.record_routing = record_routing
        """Return each completion's MoE routing (`Completion.routing`), for the trainer to replay."""

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> None:
        seqs, is_prefill = self.scheduler.schedule()
        starts = [s.num_cached for s in seqs]
        if is_prefill:
            logits, out = self.runner.prefill(seqs)
            self.drafted_last = False
            emitted = self.accept(seqs, Drafts.none(len(seqs)), logits[:, None])
            valid = [len(s.prompt) for s in seqs]
        else:
            after_drafting, started = self.drafted_last, time.perf_counter()
            drafts = self.propose(seqs)
            logits, out = self.runner.verify(seqs, drafts)
            emitted = self.accept(seqs, drafts, logits)
            valid = [len(tokens) for tokens, _ in emitted]  # the last token and the accepted drafts
        self.proposer.observe(seqs, out, starts, valid)
        self.keep_routing(seqs, out, valid)
        for seq, (tokens, logprobs) in zip(seqs, emitted):
            self.append(seq, tokens, logprobs)
        if self.controller and not is_prefill:
            self.time_step(len(seqs), logits.shape[1] - 1, after_drafting, started)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        with self.refits.generating_in(self), torch.inference_mode():
            seqs = self.start(prompts, params)
            while not self.scheduler.is_finished():
                with weights_fixed():  # left for a refit: the weights' packed forms are checked again after it
                    while not self.scheduler.is_finished() and not self.refits.due:
                        self.step()
                self.refits.take(self)
        return [self.completion(s) for s in seqs]

    # -- in-flight refits -----------------------------------------------------------------------------------
    def refit(self, load, version: int):
        """Between two steps (or with no generation running): `load()` new weights (policy and drafter together),
        record them as `version`, and compute the running sequences' keys and values again under them, with the
        drafter's state, so the next token is sampled and every next draft made and verified by the new policy
        alone (a token's log-prob is then exactly the new policy's given the prefix). Returns what `load` did."""
        with torch.inference_mode(False):
            loaded = load()
        self.version = version
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None or scheduler.is_finished():
            return loaded
        for seq in self.seqs:
            if not seq.output:  # not started: all of its tokens will be the new version's
                seq.versions = [(0, version)]
            elif seq.finish_reason is None:
                seq.versions.append((len(seq.output), version))
        with torch.inference_mode():
            self.recompute(scheduler.running)
        return loaded

    def recompute(self, running: list[Sequence]) -> None:
        """Each running sequence's keys and values again, over all its tokens but the last (which the next step
        feeds), in forwards of at most `max_prefill_tokens`; the drafter starts over on them as after a prefill."""
        self.proposer.start(self.seqs, self.params, self.max_len, self.cache.num_slots)
        self.drafted_last = False
        batch: list[Sequence] = []
        for seq in sorted(running, key=lambda s: s.slot) + [None]:
            if batch and (seq is None or max(s.length for s in batch + [seq]) * (len(batch) + 1)
                          > self.max_prefill_tokens):
                for s in batch:
                    s.num_cached = 0
                    s.routing.clear()  # the later tokens read these positions' states as the new weights route them
                out = self.runner.forward(batch, [s.tokens[:-1] for s in batch])
                self.proposer.observe(batch, out, [0] * len(batch), [s.length - 1 for s in batch])
                self.keep_routing(batch, out, [s.length - 1 for s in batch])
                batch = []
            if seq is not None:
                batch.append(seq)

    def keep_routing(self, seqs: list[Sequence], out, counts: list[int]) -> None:
        """Where routing is recorded, each sequence's rows of a target forward that stand (the first counts[b]: a
        prompt, a step's last token and accepted drafts, or a recompute's whole prefix)."""
        if out.routing is not None:
            rows = out.routing.cpu()
            for b, (seq, n) in enumerate(zip(seqs, counts)):
                seq.routing.append(rows[b, :n])

    # -- speculation ----------------------------------------------------------------------------------------
    def time_step(self, batch: int, k: int, after_drafting: bool, started: float) -> None:
        """Report a decode step (k drafts, 0: plain) to the adaptive controller: drafting, the target forward,
        sampling, rollback and bookkeeping. A drafting step right after a plain one includes the drafter catching
        up over the positions it skipped (see `drafted_last`): that is what switching to speculation costs, so it
        counts. A plain step right after a drafting one is not reported: it runs with the drafter's weights and cache
        where the target's were (a draft model on the deep tiny target at B=8: 2 % slower than after a plain step,
        `research/shape_costs.py`), which is not what plain decoding costs."""
        if k or not after_drafting:
            self.controller.record_step(batch, k, time.perf_counter() - started, catch_up=k > 0 and not after_drafting)

    def propose(self, seqs: list[Sequence]) -> Drafts:
        k = self.controller.choose_k(len(seqs)) if self.controller else self.k_max
        if k == 0:
            self.drafted_last = False
            return Drafts.none(len(seqs))
        drafts = self.proposer.propose(seqs, k)
        self.drafted_last = True
        return drafts

    def accept(self, seqs: list[Sequence], drafts: Drafts, logits: torch.Tensor):
        """Verify drafts (none: a plain step) against target `logits` [B, k+1, V]; roll back rejected KV; per
        sequence return the emitted tokens (accepted drafts + one) with their log-probs under the processed target
        distribution. Deterministic drafts are verified by drawing each position's token with that position's
        uniform (`verify_coupled`), as a plain step draws it, so the tokens are plain decoding's whatever is
        drafted; sampled drafts by rejection sampling (`verify_sampled`) on the sequence's in-order stream."""
        p = self.params
        logprobs = processed_logprobs(logits, p.temperature, p.top_k, p.top_p)
        k = logits.shape[1] - 1
        # Everything the verifier reads lives where the logits do (the model's device); only the per-sequence
        # Python lists below come back to the host, in two reads a step (on a GPU each read waits for the device):
        # the verdict with the drafts, and the log-probs.
        dev = logits.device
        counts = drafts.lengths
        draft_len = long_tensor(counts, dev)
        padded = drafts.padded(dev)
        if p.greedy:
            verdict = verify_greedy(logprobs, padded, draft_len)
            lps = emitted_logprobs(logprobs, padded, verdict)
        elif drafts.probs is None:
            u = float_tensor(position_uniforms(seqs, k + 1), dev)
            if kernels.usable(logprobs):  # the same verdict in one call, on the CPU
                num_accepted, next_token, lps = kernels.verify_coupled(logprobs, padded, draft_len, u)
                verdict = Verdict(num_accepted, next_token)
            else:
                verdict = verify_coupled(logprobs.exp(), padded, draft_len, u)
                lps = emitted_logprobs(logprobs, padded, verdict)
        else:
            u = float_tensor(uniforms(seqs, k + 1), dev)
            verdict = verify_sampled(logprobs.exp(), padded, draft_len, u[:, :k], u[:, k], drafts.probs)
            lps = emitted_logprobs(logprobs, padded, verdict)
        if k == 0:  # a plain step (or a prefill): one token each
            return [([t], [lp]) for t, lp in zip(verdict.next_token.tolist(), lps[:, 0].tolist())]
        decided = torch.cat([verdict.num_accepted[:, None], verdict.next_token[:, None], padded], 1).tolist()
        emitted = []
        for (n, last, *row), lps, drafted, seq in zip(decided, lps.tolist(), counts, seqs):
            emitted.append((row[:n] + [last], lps[: n + 1]))
            if drafted:
                seq.num_cached -= drafted - n  # rollback: rejected drafts' keys are now stale
                seq.verify_outcomes.append((drafted, n))
        if self.controller:
            self.controller.record_acceptance(counts, [n for n, *_ in decided])
        return emitted

    # -- pieces ---------------------------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Validate the request, size the KV cache for it and queue one sequence per prompt."""
        self.validate(prompts)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        context = self.model.config.max_position_embeddings
        # Drafts are written past a sequence's end before verification, hence k_max + 1 spare positions.
        max_len = self.max_len = min(context, max(len(p) for p in prompts) + params.max_tokens) + self.k_max + 1
        num_slots = min(len(prompts), self.max_num_seqs)
        self.ensure_cache(num_slots, max_len)
        self.scheduler = Scheduler(self.cache, self.max_num_seqs, self.max_prefill_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.proposer.capture_layers, self.record_routing)
        seqs = []
        keys = [params.seed * 1_000_003 + i for i in range(len(prompts))]
        generators = [torch.Generator().manual_seed(key) for key in keys]
        positions = PositionUniforms(generators)
        stream = UniformStreams([torch.Generator().manual_seed(draw_seed(key)) for key in keys])
        for i, (prompt, gen) in enumerate(zip(prompts, generators)):
            seq = Sequence(i, list(prompt), min(params.max_tokens, context - len(prompt)), gen, stream=stream,
                           stream_row=i, positions=positions, positions_row=i, versions=[(0, self.version)])
            self.scheduler.add(seq)
            seqs.append(seq)
        self.proposer.start(seqs, params, max_len, self.cache.num_slots)
        self.seqs = seqs
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

    def ensure_cache(self, num_slots: int, max_len: int) -> None:
        """Reuse the KV cache when it is large enough, else allocate one sized for this request."""
        c = self.cache
        if c is None or c.num_slots < num_slots or c.max_len < max_len:
            cfg = self.model.config
            self.cache = KVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                 self.model.dtype, self.model.device)
        self.cache.free_slots = list(range(self.cache.num_slots))

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Append emitted tokens, stopping at the first stop token or at the length limit."""
        if len(tokens) < seq.remaining and self.stop_ids.isdisjoint(tokens):  # most steps: all of them, no end
            seq.output += tokens
            seq.logprobs += logprobs
            return
        for token, logprob in zip(tokens, logprobs):
            seq.output.append(token)
            seq.logprobs.append(logprob)
            reason = "stop" if token in self.stop_ids else "length" if seq.remaining <= 0 else None
            if reason:
                self.scheduler.finish(seq, reason)
                self.proposer.finish(seq)
                return

    def completion(self, seq: Sequence) -> Completion:
        spec = {}
        if seq.verify_steps:
            spec = {"drafted": seq.drafted, "accepted": sum(seq.accepted_per_pos), "verify_steps": seq.verify_steps,
                    "accepted_per_pos": seq.accepted_per_pos, "drafted_per_pos": seq.drafted_per_pos}
        # A stop token among accepted drafts leaves rows past the completion: its last input is at length - 2.
        routing = torch.cat(seq.routing)[: seq.length - 1].numpy() if seq.routing else None
        return Completion(seq.output, seq.logprobs, seq.finish_reason, len(seq.prompt), spec,
                          versions=token_versions(seq.versions, len(seq.output)), routing=routing)


def token_versions(starts: list[tuple[int, int]], n: int) -> list[int]:
    """The policy version of each of n output tokens, from (first output index, version) pairs in order."""
    ends = [first for first, _ in starts[1:]] + [n]
    return [version for (first, version), end in zip(starts, ends) for _ in range(first, min(end, n))]
