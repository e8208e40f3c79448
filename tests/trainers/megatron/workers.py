"""What each of the 2 gloo ranks runs for `test_distributed.py` (spawned once; every scenario in one process pair,
so megatron-core is imported twice, not once per test). Each scenario returns plain tensors and strings; the
tests compare them in the parent process."""

from __future__ import annotations

import torch

from .common import MTP_LAYERS, hf_tensors, policy_part, tiny, token_ids

LAYOUTS = {
    "dense": {"tp1": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2)},
    "moe": {"tp1": dict(), "tp2": dict(tp=2), "ep2": dict(ep=2, etp=1), "pp2": dict(pp=2)},
    "mixed": {"ep2": dict(ep=2, etp=1), "pp2": dict(pp=2)},
    "tied": {"tp2": dict(tp=2), "pp2": dict(pp=2)},
}
BUCKET_BYTES = 80 * 1024  # above the largest parameter (64 KiB), small enough for many buckets and PP broadcasts


def run_all(rank: int, world: int) -> dict:
    from megatron_spec.trainers.megatron.parallel import Parallelism

    out = {}
    for kind, layouts in LAYOUTS.items():
        cfg, hf = tiny(kind), hf_tensors(tiny(kind))
        for name, sizes in layouts.items():
            out[kind, name] = _scenario(cfg, hf, Parallelism(**sizes))
        if kind in ("mixed", "tied"):
            continue
        for tp in (1, 2):
            out[kind, f"native_tp{tp}"] = _native_init(cfg, Parallelism(tp=tp))
        # Megatron-Core refuses to train MoE with TP > 1 unless sequence parallel is on (not on CPU): use EP there.
        out[kind, "train_mtp"] = _train_mtp_only(cfg, hf, Parallelism(tp=2) if kind == "dense" else Parallelism(ep=2, etp=1))
    out["errors"] = _bad_inputs()
    return out


def _scenario(cfg, hf, par) -> dict:
    """Import the seeded HF tensors, export them back; with the whole model on each rank, also forward on CPU."""
    from megatron_spec.trainers.megatron.cpu import on_cpu
    from megatron_spec.trainers.megatron.exporter import export_buckets
    from megatron_spec.trainers.megatron.forward import detached_mtp_logits
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    init_model_parallel(par, cfg)
    model = build_model(cfg, par, mtp_num_layers=MTP_LAYERS, init=False)
    import_hf(model, hf)
    buckets = list(export_buckets(model, BUCKET_BYTES))
    result = {
        "export": {n: t.clone() for b in buckets for n, t in b},
        "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
        "bucket_sizes": [len(b) for b in buckets],
    }
    if par.pp == 1:
        model.eval()
        with on_cpu(), torch.no_grad():
            policy, mtp = detached_mtp_logits(model, token_ids(cfg))
        result["logits"], result["mtp_logits"] = policy, mtp
    return result


def _native_init(cfg, par) -> dict:
    """Megatron-Core's own seeded CPU init (no importer), exported: the export alone must undo the TP split."""
    from megatron_spec.trainers.megatron.exporter import export_hf
    from megatron_spec.trainers.megatron.parallel import init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    init_model_parallel(par, cfg)
    # vocab 96 padded to a multiple of 16 * tp is 96 for tp = 1 and 2, so both draw the same embedding.
    model = build_model(cfg, par, mtp_num_layers=MTP_LAYERS, seed=1234, vocab_divisible_by=16)
    return {n: t.clone() for n, t in export_hf(model, BUCKET_BYTES)}


def _train_mtp_only(cfg, hf, par) -> dict:
    """One backward of the soft MTP loss through detached inputs, then an SGD step on every parameter with a grad."""
    from megatron_spec.trainers.megatron.cpu import on_cpu
    from megatron_spec.trainers.megatron.forward import detached_mtp_logits, mtp_loss
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    init_model_parallel(par, cfg)
    model = build_model(cfg, par, mtp_num_layers=MTP_LAYERS, init=False)
    import_hf(model, hf)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with on_cpu():
        policy, mtp = detached_mtp_logits(model, token_ids(cfg))
        loss = mtp_loss(policy, mtp, token_ids(cfg), soft=True)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.grad is not None], lr=0.1)
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    return {
        "loss": loss.item(),
        "trunk_with_grad": sorted(n for n, g in grads.items() if not n.startswith("mtp.") and g is not None),
        "mtp_without_grad": sorted(n for n, g in grads.items() if n.startswith("mtp.") and (g is None or not g.any())),
        "changed": sorted(changed),
        "params": sorted(grads),
    }


def _bad_inputs() -> dict:
    """Errors that need a built model: a tensor whose shape does not fit, a missing tensor, an unknown tensor."""
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import Parallelism, init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    cfg, par = tiny("dense"), Parallelism(tp=2)
    init_model_parallel(par, cfg)
    model = build_model(cfg, par, init=False)
    good = policy_part(hf_tensors(cfg))
    cases = {
        "wrong_shape": {**good, "model.layers.1.mlp.up_proj.weight": torch.zeros(96, cfg.hidden_size)},
        "missing": {n: t for n, t in good.items() if n != "model.layers.1.self_attn.k_norm.weight"},
        "unexpected": {**good, "model.layers.7.mlp.up_proj.weight": torch.zeros(1)},
    }
    errors = {}
    for case, tensors in cases.items():
        try:
            import_hf(model, tensors)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    return errors
