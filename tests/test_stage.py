"""Hub checkpoints on several nodes: a multi-node launch with a hub name and no `model.hub_cache` is refused before
submission, and `megatron-spec stage RECIPE` puts a recipe's hub checkpoints into the cache once. Nothing is
downloaded: HF_HUB_OFFLINE is set and the hub cache is laid out here as huggingface_hub writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from launchers.checks import shared_cache_problems
from megatron_spec import cli
from megatron_spec.rl.overrides import apply_overrides

from .test_launchers import AT_SCALE_SUBMIT, hub_cache, recipe, refused  # noqa: F401  (refused: a fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = "recipes/tiny_moe_grpo_spec.py"


def test_hub_names_on_several_nodes_need_a_shared_cache():
    """Two nodes, a hub policy, no cache: one problem naming the name, the field to set and the stage command;
    none on one node, with a cache, or with local directories only."""
    cfg = apply_overrides(recipe("tiny_moe_grpo_spec").tiny_moe_grpo_spec(), ["model.policy=someone/tiny-moe"])
    assert shared_cache_problems(cfg, 2, "tiny_moe_grpo_spec") == [
        "hub name(s) someone/tiny-moe on 2 nodes need model.hub_cache on a file system every node mounts: set "
        "model.hub_cache=/shared/hf and stage them there once with `megatron-spec stage "
        "recipes/tiny_moe_grpo_spec.py model.hub_cache=/shared/hf` (or give local directories)"]
    assert shared_cache_problems(cfg, 1) == []
    assert shared_cache_problems(apply_overrides(cfg, ["model.hub_cache=/lustre/hf"]), 2) == []
    assert shared_cache_problems(recipe("tiny_moe_grpo_spec").tiny_moe_grpo_spec(), 2) == []


def test_a_multi_node_launch_without_a_shared_cache_is_refused(refused):
    """The 8B recipe (a hub policy, no model.hub_cache) on 2 nodes: refused before submission, the one error line
    naming model.hub_cache and the stage command."""
    err = refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, "--nodes", "2"])
    assert "hub name(s) Qwen/Qwen3-8B" in err and " on 2 nodes need model.hub_cache" in err
    assert "megatron-spec stage recipes/qwen3_8b_grpo_spec.py model.hub_cache=/shared/hf" in err


def stage(capsys, *argv: str) -> tuple[int, list[str], str]:
    rc = cli.main(["stage", *argv])
    out = capsys.readouterr()
    return rc, out.out.splitlines(), out.err


def test_stage_resolves_hub_names_into_the_cache(tmp_path, monkeypatch, capsys):
    """The tiny MoE recipe with its policy named on the hub and found in model.hub_cache: `stage` prints the
    snapshot directory for it and leaves the local drafter as it is."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = hub_cache(tmp_path, "someone/tiny-moe", {"model_type": "qwen3_moe"})
    rc, out, err = stage(capsys, TINY_MOE, "model.policy=someone/tiny-moe", f"model.hub_cache={tmp_path}")
    assert rc == 0, err
    assert out == [f"model.policy someone/tiny-moe: {snap}",
                   "model.drafter checkpoints/tiny-qwen3-moe-mtp: a local directory, nothing to stage"]


def test_stage_refuses_the_default_cache_and_missing_inputs(tmp_path, monkeypatch, capsys):
    """Without model.hub_cache a hub name is refused (the default cache is this machine's alone); a hub name not in
    the cache with HF_HUB_OFFLINE set names the download command; a local path that does not exist is named."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = stage(capsys, TINY_MOE, "model.policy=someone/tiny-moe")
    assert rc == 2 and "someone/tiny-moe would go to this machine's default cache" in err
    rc, _, err = stage(capsys, TINY_MOE, "model.policy=someone/tiny-moe", f"model.hub_cache={tmp_path}")
    assert rc == 2 and f"hf download someone/tiny-moe --cache-dir {tmp_path}" in err
    rc, _, err = stage(capsys, TINY_MOE, f"model.drafter={tmp_path}/none")
    assert rc == 2 and f"model.drafter {tmp_path}/none is neither a directory on this machine nor a hub name" in err


def test_stage_needs_a_recipe_file(capsys, tmp_path):
    rc, _, err = stage(capsys, str(tmp_path / "nope.py"))
    assert rc == 2 and "is not a Python file" in err
