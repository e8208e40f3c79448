"""The draft model's registry entry: a smaller causal LM of the target's tokenizer."""

from __future__ import annotations

from ..registry import DrafterMethod, adapter, register


def _module():
    from ...models.decoder import CausalLM

    return CausalLM


def _proposer(spec, target, drafter):
    from ..files import check_draft_model
    from .proposer import DraftModelProposer

    check_draft_model(drafter.config, target.config)
    return DraftModelProposer(drafter.to(target.device), spec.draft_sampling)


def _load(path, target, device):
    from ...models import from_pretrained

    return from_pretrained(path, dtype=target.dtype, device=device)


def _new(target, draft_preset, d2t):
    from ...models import CausalLM, preset

    if not draft_preset:
        raise ValueError("draft_model training needs --draft-preset (e.g. tiny-draft) or --init DIR")
    return CausalLM(preset(draft_preset))


def _save(drafter, out_dir, target):
    from ...models import save_pretrained

    return save_pretrained(drafter, out_dir)


def _loss(target, drafter, input_ids, out, logits, mask, drafts):
    from .loss import draft_model_pairs

    return draft_model_pairs(drafter, input_ids, logits, mask)


_export = adapter("megatron_spec.generators.vllm.export", "export_target")
_export_files = adapter(f"{__package__}.export", "export_draft_model_files")
_sim_shape = adapter(f"{__package__}.cost", "draft_model_shape")


register(DrafterMethod("draft_model", _proposer, needs_weights=True, load=_load, module=_module, new=_new, save=_save,
                       online_loss=_loss, vllm_method="draft_model", vllm_export=_export,
                       vllm_export_files=_export_files, sim_shape=_sim_shape, sim_name="model", listing=0))
