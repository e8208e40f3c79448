"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from ..speculative.sampling import PositionUniforms, UniformStreams


def draw_seed(seed: int) -> int:
    """The seed of a sequence's in-order stream (a sampling drafter's draws and their verification) from that of
    its position uniforms. The two streams must not share values: a draft drawn with the uniform that drew an
    earlier token would depend on that token. Torch's CPU generator keeps only a seed's low 32 bits, so this is a
    32-bit map, x * 0x9E3779B1 + 0x7F4A7C15 mod 2^32, with no fixed point (x(0x9E3779B1 - 1) is even, the
    constant's negative odd)."""
    return ((seed & 0xFFFFFFFF) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    index: int
    """Position of the prompt in the `generate` call (completions come back in this order)."""
    prompt: list[int]
    """Prompt token ids."""
    max_tokens: int
    """New tokens allowed (already capped at the end of the context)."""
    generator: torch.Generator
    """This sequence's own generator for its position uniforms (`positions`), so its tokens do not depend on the
    rest of the batch; its in-order stream (`stream`) is seeded with `draw_seed` of its seed."""
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    num_cached: int = 0
    """Tokens whose keys/values are in the KV cache; rollback after a rejected draft just lowers it."""
    finish_reason: str | None = None
    verify_outcomes: list[tuple[int, int]] = field(default_factory=list)
    """(drafts offered, drafts accepted) of each target forward that verified drafts for this sequence: one append
    a step, where counting per position cost ~0.7 us a sequence (~130 us of a step at 192); the statistics below
    are counted from it when read."""
    stream: UniformStreams | None = field(default=None, repr=False)
    """Where this sequence's uniforms are held (the engine's, shared by a `generate` call's sequences; else one of
    its own, made on first use)."""
    stream_row: int = 0
    """This sequence's row in `stream`."""
    positions: PositionUniforms | None = field(default=None, repr=False)
    """Where this sequence's position uniforms are held (the engine's, shared by a `generate` call's sequences;
    else a table of its own, made on first use)."""
    positions_row: int = 0
    """This sequence's row in `positions`."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(first output index, policy version) each time the weights that sample its tokens changed (`LLMEngine.refit`
    between two steps); the first entry is its start's."""
    routing: list = field(default_factory=list, repr=False)
    """With routing recorded: per target forward, the experts of the input positions that stand ([n, MoE layers,
    top_k] each, on the host): the prompt's, then each step's last token and accepted drafts."""

    def uniforms(self, n: int) -> list[float]:
        """The next n uniforms in [0, 1) of this sequence's in-order stream (`UniformStreams`)."""
        if self.stream is None:
            draws = torch.Generator().manual_seed(draw_seed(self.generator.initial_seed()))
            self.stream, self.stream_row = UniformStreams([draws]), 0
        return self.stream.take(np.array([self.stream_row]), n)[0].tolist()

    def position_table(self) -> PositionUniforms:
        """`positions`, made from `generator` on first use."""
        if self.positions is None:
            self.positions, self.positions_row = PositionUniforms([self.generator]), 0
        return self.positions

    @property
    def drafted(self) -> int:
        """Speculative tokens proposed for this sequence."""
        return sum(d for d, _ in self.verify_outcomes)

    @property
    def verify_steps(self) -> int:
        """Target forwards that verified drafts for this sequence."""
        return len(self.verify_outcomes)

    @property
    def drafted_per_pos(self) -> list[int]:
        """Drafts offered by draft position (index 0 = first drafted token), as long as the most ever offered."""
        width = max((d for d, _ in self.verify_outcomes), default=0)
        return [sum(d > i for d, _ in self.verify_outcomes) for i in range(width)]

    @property
    def accepted_per_pos(self) -> list[int]:
        """Accepted drafts by draft position, as long as `drafted_per_pos`."""
        width = max((d for d, _ in self.verify_outcomes), default=0)
        return [sum(a > i for _, a in self.verify_outcomes) for i in range(width)]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

