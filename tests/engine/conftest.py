import torch


def naive_greedy(model, prompt, n):
    """Reference decoder: a full forward over the whole sequence and an argmax, every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
