import copy

import torch


def naive_greedy(model, prompt, n):
    """Reference decoder: a full forward over the whole sequence and an argmax, every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def noisy_copy(model, scale, seed):
    """A copy of `model` with N(0, scale^2) noise on every weight: a draft model that agrees with it often but not
    always (partial acceptance exercises rollback), or another policy version to refit to."""
    torch.manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn_like(p) * scale)
    return out
