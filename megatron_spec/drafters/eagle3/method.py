"""The EAGLE-3 drafter's registry entry: one decoder layer over fused target hidden states, optionally over a draft
vocabulary."""

from __future__ import annotations

from ..registry import DrafterMethod, adapter, register

_DRAFTERS = __package__.rpartition(".")[0]
_proposer = adapter(f"{_DRAFTERS}.hidden", "hidden_state_proposer")
_load = adapter(f"{_DRAFTERS}.files", "load_head")


def _module():
    from .model import Eagle3Head

    return Eagle3Head


def _config():
    from .model import Eagle3Config

    return Eagle3Config, "eagle_config"


def _new(target, draft_preset, d2t):
    from .model import Eagle3Head

    return Eagle3Head.from_target(target, d2t=d2t)


def _save(drafter, out_dir, target):
    from ..files import save_drafter

    return save_drafter(drafter, out_dir, "eagle3", target.config)


def _loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import eagle3_pairs

    return eagle3_pairs(target, drafter, input_ids, out, logits, mask, drafts)


_export = adapter(f"{__package__}.export", "export_eagle3")
_export_files = adapter(f"{__package__}.export", "export_eagle3_files")


def _form(drafter):
    return adapter(f"{__package__}.export", "eagle3_form")(drafter.eagle_config, drafter.target_config.hidden_size)


_convert = adapter(f"{__package__}.export", "eagle3_tensors")
_sim_shape = adapter(f"{__package__}.cost", "eagle3_shape")


register(DrafterMethod("eagle3", _proposer, needs_weights=True, load=_load, module=_module, saved_config=_config,
                       new=_new, save=_save, online_loss=_loss, draft_vocab=True, vllm_method="eagle3",
                       vllm_export=_export, vllm_export_files=_export_files, vllm_form=_form, vllm_convert=_convert,
                       state_key="eagle3", megatron=f"{__package__}.megatron", sim_shape=_sim_shape, listing=2))
