"""Naive references the tests compare the real code with, written independently of it, and the small
helpers several test files share (imported as `from naive import ...`: pytest puts tests/ on the path)."""
import math

import torch

from systems.engine import Sampling

TOL = 1e-5  # fp32 engine (KV cache, left padding) vs one unpadded forward
PROMPTS = ["3+4=", "1+2+3+4+5+6=", "9=", "5+5+5="]  # 4, 12, 2 and 6 tokens: left padding differs per row


def ids(tok, text):
    return tok(text).input_ids


def make_row(prompt: str) -> dict:
    """A tiny-task row for prompt "a+b+...=": its answer is the sum."""
    return {"prompt": prompt, "answer": str(sum(map(int, prompt[:-1].split("+")))), "verifier": "tiny"}


def naive_dists(model, prompt: list[int], tokens: list[int], sampling: Sampling) -> list[dict[int, float]]:
    """For each response token: {token id: log-prob} of the sampling distribution at that position, over
    the tokens it keeps, from one forward over prompt + response without padding or cache. Written
    independently of engine.process_logits: plain Python over the sorted vocabulary."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()  # [L, V]
    dists = []
    for t in range(len(tokens)):
        row = (logits[len(prompt) - 1 + t] / sampling.temperature).tolist()
        order = sorted(range(len(row)), key=lambda j: -row[j])
        if 0 < sampling.top_k < len(row):
            order = order[:sampling.top_k]
        z = math.log(sum(math.exp(row[j]) for j in order))
        logp = {j: row[j] - z for j in order}
        if sampling.top_p < 1.0:  # the smallest prefix of the ranking whose mass reaches top_p
            kept, mass = [], 0.0
            for j in order:
                kept.append(j)
                mass += math.exp(logp[j])
                if mass >= sampling.top_p:
                    break
            z = math.log(sum(math.exp(logp[j]) for j in kept))
            logp = {j: logp[j] - z for j in kept}
        dists.append(logp)
    return dists


def naive_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    dists = naive_dists(model, prompt, tokens, Sampling(temperature))
    return torch.tensor([d[x] for d, x in zip(dists, tokens)], dtype=torch.float64)
