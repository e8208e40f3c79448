"""Ray placement: the one RL loop (`megatron_spec.rl.loop`) over two worker groups in Ray placement groups.

Files, in reading order:
    bundles.py    who runs in which bundle, colocated or disaggregated, and the resource checks     pure
    workers.py    the Ray actors: a trainer rank (a torch.distributed group of them) and an engine
    groups.py     the groups as the loop sees them: a Policy proxy and a Generator that splits prompts
                  over N engines (GRPO groups whole), restarts dead engines and re-issues their prompts
    transport.py  how refits travel: a weight-update group (gloo / NCCL) from trainer rank 0 to every
                  engine worker, or Ray's object store as the fallback
    driver.py     `train(cfg, layout=None)`: the loop's Trainer with its stages on the groups, async GRPO

`bundles` never imports Ray; everything else needs `pip install 'megatron-spec[ray]'`.
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'megatron-spec[ray]'"


def require_ray():
    """The `ray` module, or an ImportError that names the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"the Ray backend (backend.placement colocated / disaggregated) needs ray, which is not "
                          f"installed: {INSTALL_HINT}") from err
    return ray
