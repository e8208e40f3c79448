"""train-drafter with `--draft-vocab`: the map is the most frequent generated ids (EOS forced in, sorted), the
trained head keeps it through save/load, and training on cached target features equals training on a fresh
target forward per step."""

from pathlib import Path

import pytest
import torch

from megatron_spec.cli import main as cli_main
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.drafters.loss import drafter_loss
from megatron_spec.drafters.registry import drafter_method
from megatron_spec.rl.train_drafter import draft_vocab, target_features, train

EAGLE3_LOSS = drafter_method("eagle3").online_loss

TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-qwen3"


def test_draft_vocab_picks_the_most_frequent_generated_ids():
    ids = torch.tensor([[7, 7, 7, 3, 3, 5, 1, 9], [9, 9, 9, 9, 9, 0, 0, 0]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :2] = False  # prompt positions do not count: generated 9:4, 0:3, 3:2, 7:1, 5:1, 1:1
    assert draft_vocab(ids, mask, 3, 12).tolist() == [0, 3, 9]
    assert draft_vocab(ids, mask, 3, 12, always=(11,)).tolist() == [0, 9, 11]  # EOS in, unseen or not
    assert draft_vocab(ids, mask, 4, 12).tolist() == [0, 1, 3, 9]  # ties (7, 5, 1 once each): smaller id first
    assert draft_vocab(ids, mask, 9, 12).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]  # unseen ids fill by id
    with pytest.raises(ValueError, match="1..11"):
        draft_vocab(ids, mask, 12, 12)
    with pytest.raises(ValueError, match="cannot hold"):
        draft_vocab(ids, mask, 1, 12, always=(10, 11))


def test_cached_features_give_the_per_step_loss(tiny_model):
    """The loss on cached, row-gathered and trimmed features equals the loss with the target run on the batch."""
    torch.manual_seed(0)
    head = Eagle3Head.from_target(tiny_model, d2t=torch.arange(0, 64, 4))
    ids = torch.randint(0, 64, (4, 12))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 4:10] = True
    feats = target_features(tiny_model, head, ids, chunk=3)
    rows, n = torch.tensor([2, 0]), 10
    cached = type(feats)(feats.hidden[rows, :n], {i: h[rows, :n] for i, h in feats.layers.items()})
    with torch.no_grad():
        a = drafter_loss(EAGLE3_LOSS, tiny_model, head, ids[rows, :n], mask[rows, :n], out=cached)
        b = drafter_loss(EAGLE3_LOSS, tiny_model, head, ids[rows, :n], mask[rows, :n])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not TARGET.is_dir(), reason=f"shipped tiny checkpoint missing at {TARGET}")
def test_cli_trains_and_saves_a_draft_vocab_head(tmp_path, capsys):
    out, cache = tmp_path / "head", tmp_path / "rollouts.pt"
    args = ["train-drafter", "--target", str(TARGET), "--method", "eagle3", "--out", str(out), "--num-prompts", "24",
            "--max-tokens", "24", "--steps", "20", "--batch-size", "8", "--draft-vocab", "24", "--rollouts", str(cache)]
    assert cli_main([*args, "--save-dtype", "bfloat16"]) == 0
    assert "covers" in capsys.readouterr().out and cache.is_file()
    # A second run reuses the saved rollouts, and refuses rollouts made with other settings.
    assert cli_main([*args, "--out", str(tmp_path / "again")]) == 0
    assert load_drafter(tmp_path / "again", from_pretrained(TARGET).config).d2t.tolist() == load_drafter(
        out, from_pretrained(TARGET).config).d2t.tolist()
    assert cli_main([*args, "--max-tokens", "16"]) == 2
    assert "holds rollouts for" in capsys.readouterr().err
    target = from_pretrained(TARGET)
    head = load_drafter(out, target.config)
    assert head.eagle_config.draft_vocab_size == 24 and head.lm_head.weight.shape[0] == 24
    assert 2 in head.d2t.tolist() and head.d2t.tolist() == sorted(head.d2t.tolist())  # EOS (id 2) included
    assert head.lm_head.weight.dtype == torch.float32  # saved bf16, cast to the target's dtype on load
    # --draft-vocab is for a fresh EAGLE-3 head only.
    assert cli_main(["train-drafter", "--target", str(TARGET), "--method", "mtp", "--out", str(tmp_path / "m"),
                     "--draft-vocab", "24"]) == 2


@pytest.mark.skipif(not TARGET.is_dir(), reason=f"shipped tiny checkpoint missing at {TARGET}")
def test_recorded_features_and_training_with_draft_vocab():
    from megatron_spec.rl.train_drafter import capture_layers, rollouts, task_prompts

    torch.manual_seed(0)
    target = from_pretrained(TARGET)
    ids, mask, feats = rollouts(target, task_prompts(str(TARGET), 48, seed=1), max_tokens=32, temperature=1.0,
                                seed=1, capture=capture_layers("eagle3", target))
    head = Eagle3Head.from_target(target, d2t=draft_vocab(ids, mask, 24, 64, (2,)))
    # Features recorded during generation are the teacher-forced ones (up to float rounding) where a loss reads them.
    forced = target_features(target, head, ids)
    length = torch.arange(mask.shape[1]) * mask  # per row, the last generated position L-1 ...
    fed = torch.arange(mask.shape[1])[None] < length.max(1, keepdim=True).values  # ... was never fed to the target
    for a, b in [(feats.hidden, forced.hidden), *((feats.layers[i], forced.layers[i]) for i in forced.layers)]:
        torch.testing.assert_close(a[fed], b[fed], atol=1e-4, rtol=1e-4)
    losses = train(target, head, "eagle3", ids, mask, steps=40, batch_size=8, lr=3e-3, seed=0, log_every=0,
                   feats=feats)
    assert losses[-1] < 0.5 * losses[0]
