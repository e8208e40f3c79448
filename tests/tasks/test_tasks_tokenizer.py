"""Character tokenizer: fixed ids, round trip, clear errors."""

import pytest

from megatron_spec.models.presets import TINY_VOCAB
from megatron_spec.tasks.arithmetic import ArithmeticDataset, Difficulty
from megatron_spec.tasks.tokenizer import ALPHABET, BOS_ID, EOS_ID, PAD_ID, UNKNOWN_CHAR, CharTokenizer


def test_ids_are_fixed():
    # The table is part of the checkpoint format: these ids must never move.
    tok = CharTokenizer()
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert tok.vocab_size == 54 <= TINY_VOCAB
    assert tok.encode("\n 09+-=>a") == [3, 4, 5, 14, 15, 16, 19, 27, 28]
    assert tok.encode("7", bos=True, eos=True) == [1, 12, 2]


def test_round_trip_of_alphabet_and_task_text():
    tok = CharTokenizer()
    assert tok.decode(tok.encode(ALPHABET)) == ALPHABET
    for p in ArithmeticDataset(50, seed=3, difficulty=Difficulty(ops="+-*")):
        text = p.prompt + p.solution
        assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


def test_decode_drops_specials_and_marks_unowned_ids():
    tok = CharTokenizer()
    assert tok.decode([1, 12, 0, 2, 13]) == "78"
    assert tok.decode([12, tok.vocab_size, TINY_VOCAB - 1]) == "7" + UNKNOWN_CHAR * 2


@pytest.mark.parametrize("bad_id", [-1, TINY_VOCAB, 1000])
def test_decode_rejects_ids_outside_the_model_vocab(bad_id):
    with pytest.raises(ValueError, match=f"token id {bad_id} is outside"):
        CharTokenizer().decode([5, bad_id])


def test_unknown_characters_are_named():
    with pytest.raises(ValueError, match=r"\['A', 'é'\] are not in the tiny tokenizer's alphabet"):
        CharTokenizer().encode("1+A=é")


def test_bad_alphabets_are_rejected():
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aab")
    with pytest.raises(ValueError, match="exceeds TINY_VOCAB=64"):
        CharTokenizer("".join(chr(0x100 + i) for i in range(62)))
