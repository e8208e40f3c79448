"""The MTP drafter's registry entry: Megatron-layout multi-token prediction heads on the target's hidden states."""

from __future__ import annotations

from ..registry import DrafterMethod, adapter, register

_DRAFTERS = __package__.rpartition(".")[0]
_proposer = adapter(f"{_DRAFTERS}.hidden", "hidden_state_proposer")
_load = adapter(f"{_DRAFTERS}.files", "load_head")


def _module():
    from .model import MTP

    return MTP


def _config():
    from .model import MTPConfig

    return MTPConfig, "mtp_config"


def _new(target, draft_preset, d2t):
    from .model import MTP, MTPConfig

    return MTP(target.config, MTPConfig(1))


def _save(drafter, out_dir, target):
    from ..files import save_drafter

    return save_drafter(drafter, out_dir, "mtp", target.config)


def _loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import mtp_pairs

    return mtp_pairs(target, drafter, input_ids, out, logits, mask, drafts)


_export = adapter(f"{__package__}.export", "export_mtp")
_export_files = adapter(f"{__package__}.export", "export_mtp_files")
_sim_shape = adapter(f"{__package__}.cost", "mtp_shape")


register(DrafterMethod("mtp", _proposer, needs_weights=True, load=_load, module=_module, saved_config=_config,
                       new=_new, save=_save, online_loss=_loss, vllm_method="mtp", vllm_export=_export, megatron_layers=True,
                       vllm_export_files=_export_files, sim_shape=_sim_shape, listing=1))
