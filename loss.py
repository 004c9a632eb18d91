"""Pure tensor functions of the RL objective: group advantages, chunked token log-probs and entropy, the
DMMPT mask, the choice of pi_old (TOIS / SAIS / POIS), truncated importance-sampling weights, the clipped
token-level loss and the k3 KL. No model, no state: every function is testable on CPU in milliseconds
(tests/test_loss.py).

Shapes: B samples, T response tokens (padded), N = number of real response tokens, V vocabulary, H hidden.
Every log-prob here is of the *sampling* distribution: logits / temperature, as the engines' processed
log-probs are.
"""
import torch
from torch.utils.checkpoint import checkpoint

LM_HEAD_CHUNK = 512  # positions per lm_head chunk: [512, 151936] fp32 logits are 0.3 GB (bench.py memory)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage: (r - mean) / (std + eps) within each group (row). [n_groups, G] -> [n_groups, G].
    std is the *sample* standard deviation (Bessel-corrected, torch.std's default), as in GRPO's reference
    implementations. An all-equal group gets 0 (dynamic sampling drops those groups anyway)."""
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def _chunk_logprobs_entropy(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [n, V]: only one chunk of logits exists at a time
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    with torch.no_grad():  # entropy is a statistic for DMMPTs, never differentiated
        entropy = -(logp.exp() * logp).sum(-1)  # [n]
    return token_logp, entropy


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = LM_HEAD_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the full-vocabulary entropy at each position, from the last hidden
    states [N, H] and the lm_head weight [V, H]. Computed `chunk` positions at a time; with grad enabled
    each chunk is checkpointed, so neither the forward nor the backward ever holds more than [chunk, V]
    logits (an [8k, 151k] fp32 logits tensor alone would be 5 GB). Returns (logprobs [N], entropy [N])."""
    logps, ents = [], []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], weight, targets[i:i + chunk], temperature)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def mpt_mask(logprobs: torch.Tensor, entropy: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
             tau: float = 0.99, sigma: float = 0.2) -> torch.Tensor:
    """DMMPTs (UloRL 3.2). Returns bool [B, T], True where a token still trains. False exactly for the
    well-mastered positive tokens (a sample with reward >= 1, token probability >= tau) of samples whose mean
    token entropy over their response (where mask is 1) is below sigma. Padding (mask 0) stays True: combine
    with `mask` to get the tokens that train. sigma=inf gives the static variant (always mask MPTs)."""
    m = mask.float()
    mean_entropy = torch.where(mask.bool(), entropy, 0).sum(1) / m.sum(1).clamp(min=1)  # [B]; padding may hold inf
    masked_sample = (rewards >= 1) & (mean_entropy < sigma)  # [B]
    mastered = logprobs.exp() >= tau  # [B, T]
    return ~(masked_sample[:, None] & mastered & mask.bool())


def old_logprobs(is_mode: str, current: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """pi_old of the importance ratio (UloRL 3.1), [B, T]:
    - tois / sais: the behaviour log-probs stored at sampling time. With one segment (TOIS) that is the one
      policy that sampled the sample; with several (SAIS) each token's own segment's policy.
    - pois: the current weights' log-probs of the whole sample, recomputed before the update, so the ratio
      starts at exactly 1 for every token (pseudo on-policy; UloRL's choice)."""
    if is_mode == "pois":
        return current
    if is_mode in ("tois", "sais"):
        return behaviour
    raise ValueError(f"--is-mode must be tois, sais or pois, got {is_mode!r}")


def tis_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_old / pi_engine, cap) per token [B, T], a constant (no gradient)
    that corrects for the engine sampling from a slightly different distribution than the trainer's pi_old."""
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimator k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, always >= 0."""
    d = ref_logprobs - logprobs
    return d.exp() - d - 1


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, agg: str = "token",
                denom: float | torch.Tensor | None = None, tis_cap: float | None = None,
                behaviour_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate with decoupled clip range (DAPO / ProRL) and optional k3 KL, as a loss to minimise.

    logprobs, old_logprobs, mask: [B, T]; advantages: [B] or [B, T]. mask is 1 where a token trains.
    per-token loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + kl_coef * k3
    agg="token":  sum over kept tokens / their count (DAPO; the default in both papers' code).
    agg="sample": mean over each sample's kept tokens, then over samples with any kept token (GRPO).
    denom: the count to divide by instead of this call's own (kept tokens for "token", samples for
    "sample"); the trainer passes the count over *all* micro-batches and ranks so that gradients of a
    split batch sum to those of the whole batch.
    tis_cap: truncated importance-sampling correction of the engine/trainer mismatch: each token's loss
    is weighted by min(exp(old - behaviour), tis_cap) (needs behaviour_logprobs); None = off.
    """
    m = mask.to(logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    if tis_cap is not None:
        per_token = per_token * tis_weights(old_logprobs, behaviour_logprobs, tis_cap)
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    per_token = torch.where(m.bool(), per_token + kl_coef * kl, 0)  # padding may hold inf/nan: drop, not 0 * x

    if agg == "token":
        total, n = per_token.sum(), m.sum()
    elif agg == "sample":
        tokens = m.sum(1)  # [B]
        total, n = (per_token.sum(1) / tokens.clamp(min=1)).sum(), (tokens > 0).sum()
    else:
        raise ValueError(f"agg must be 'token' or 'sample', got {agg!r}")
    n = n if denom is None else torch.as_tensor(denom, dtype=per_token.dtype)
    loss = total / n.clamp(min=1)

    with torch.no_grad():
        kept = m.bool()
        n_kept = max(int(kept.sum()), 1)
        adv_full = adv.expand_as(ratio)
        metrics = {
            "loss/policy": loss.item(),
            "loss/kl": (kl * m).sum().item() / n_kept,
            "clip/low_frac": ((adv_full < 0) & (ratio < 1 - eps_low) & kept).sum().item() / n_kept,
            "clip/high_frac": ((adv_full > 0) & (ratio > 1 + eps_high) & kept).sum().item() / n_kept,
            "ratio/mean": (ratio * m).sum().item() / n_kept,
            "ratio/max": ratio[kept].max().item() if kept.any() else 1.0,
        }
    return loss, metrics
