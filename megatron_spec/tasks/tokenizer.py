"""Character-level tokenizer of the synthetic task, for the tiny reference models.

One id per character keeps the tiny models honest (no merges that hide arithmetic structure) and makes the
vocabulary fit in `TINY_VOCAB` (64) rows. Ids are fixed forever: a checkpoint trained with this alphabet is only
meaningful with this exact table, so new characters may only ever be appended at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_spec.models.presets import TINY_VOCAB

PAD_ID = 0
"""Padding; never produced by a trained model, skipped by `decode`."""
BOS_ID = 1
"""Beginning of sequence; prepended to every prompt of the tiny models."""
EOS_ID = 2
"""End of sequence; generation stops on it."""
_SPECIALS = ("<pad>", "<bos>", "<eos>")
UNKNOWN_CHAR = "\ufffd"
"""What `decode` writes for a model id that no character owns."""

# Order is part of the checkpoint format (see the module docstring). Lower-case letters only: the tiny task needs
# none, but a few words in prompts must stay possible without retraining a new tokenizer.
ALPHABET = "\n 0123456789+-*/=().,:;?>abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Maps each character of `ALPHABET` to one id after the three special ids (pad=0, bos=1, eos=2)."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("tokenizer alphabet has repeated characters")
        if len(alphabet) + len(_SPECIALS) > TINY_VOCAB:
            raise ValueError(f"alphabet of {len(alphabet)} characters + 3 specials exceeds TINY_VOCAB={TINY_VOCAB}")
        self.alphabet = alphabet
        self._id_of = {ch: i + len(_SPECIALS) for i, ch in enumerate(alphabet)}
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID

    @property
    def vocab_size(self) -> int:
        """Ids in use (specials + alphabet); the model's embedding may have more rows, never fewer."""
        return len(_SPECIALS) + len(self.alphabet)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`, optionally wrapped in bos/eos. Unknown characters raise a ValueError naming them."""
        try:
            ids = [self._id_of[ch] for ch in text]
        except KeyError:
            bad = sorted({ch for ch in text if ch not in self._id_of})
            raise ValueError(
                f"characters {bad!r} are not in the tiny tokenizer's alphabet {self.alphabet!r}"
            ) from None
        return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids are dropped (callers cut at eos themselves).

        Ids in [vocab_size, TINY_VOCAB) are rows of the model's embedding that no character owns: a sampling
        policy can still emit them, so they become U+FFFD (a reward then simply fails to parse) instead of
        crashing a rollout. Ids outside the model's vocabulary are a bug and raise.
        """
        chars = []
        for i in ids:
            i = int(i)
            if not 0 <= i < TINY_VOCAB:
                raise ValueError(f"token id {i} is outside the tiny vocabulary [0, {TINY_VOCAB})")
            if i >= self.vocab_size:
                chars.append(UNKNOWN_CHAR)
            elif i >= len(_SPECIALS):
                chars.append(self.alphabet[i - len(_SPECIALS)])
        return "".join(chars)
