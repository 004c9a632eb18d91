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

import registry

LM_HEAD_CHUNK = 512  # positions per lm_head chunk: [512, 151936] fp32 logits are 0.3 GB (python -m bench memory)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean) / (std + eps) per group, std Bessel-corrected as GRPO's implementations. [n_groups, G]"""
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def _chunk_logprobs_entropy(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [n, V]: only one chunk of logits exists at a time
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    # differentiable for a loss that wants it: its backward keeps a 4th [chunk, V] fp32 tensor (297 MiB at 152k x 512)
    entropy = -(logp.exp() * logp).sum(-1)  # [n]
    return token_logp, entropy


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = LM_HEAD_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(target log-probs [N], entropy [N]) from hidden [N, H] and lm_head [V, H], `chunk` positions at a time,
    checkpointed: never more than [chunk, V] logits (8k x 151k fp32 would be 5 GB)."""
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
    """DMMPTs (UloRL 3.2): False [B, T] for the tokens of p >= tau in samples of reward 1 whose mean entropy
    is below sigma (sigma=inf: static, always). Padding stays True: combine with `mask`."""
    mean_entropy = torch.where(mask.bool(), entropy, 0).sum(1) / mask.float().sum(1).clamp(min=1)  # padding: inf
    masked_sample = (rewards >= 1) & (mean_entropy < sigma)  # [B]
    mastered = logprobs.exp() >= tau  # [B, T]
    return ~(masked_sample[:, None] & mastered & mask.bool())


def old_logprobs(is_mode: str, current: torch.Tensor, behaviour: torch.Tensor, token_versions: torch.Tensor,
                 current_version: int) -> torch.Tensor:
    """pi_old [B, T] (UloRL 3.1) from the trainer's log-probs now (`current`) and the engine's when it sampled
    (`behaviour`): sais (Eq. 8) the sampling segment's policy; tois the same, one segment; pois `current`."""
    if is_mode == "pois":
        return current
    if is_mode in ("tois", "sais"):
        return torch.where(token_versions == current_version, current, behaviour)
    raise ValueError(f"--is-mode must be tois, sais or pois, got {is_mode!r}")


def tis_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_old / pi_behaviour, cap) per token [B, T], a constant (no
    gradient). Where pi_old is the trainer's recomputation for the very weights that sampled (TOIS, SAIS's
    fresh tokens) it corrects the engine/trainer mismatch (bf16, kernels); under POIS, on older segments, it
    also corrects the gap between the version that sampled them and the current one. Where pi_old is the
    behaviour log-prob itself (SAIS's older segments) it is 1."""
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()


class Mean(float):
    """A metric that is a mean over `count` things (tokens, samples, updates) and carries its sum and count, so
    that micro-batches and ranks add up to the step's mean: the sum of totals over the sum of counts."""

    def __new__(cls, total: float, count: float):
        self = super().__new__(cls, total / max(count, 1))
        self.total, self.count = float(total), float(count)
        return self


class Max(float):
    """A metric whose step value is its largest over micro-batches and ranks."""


class Sum(float):
    """A metric whose step value is its sum over micro-batches and ranks."""


class Covariance(float):
    """The covariance of x and y over a step's N items, or a subset's part of it (its sum of (x - mean x)(y - mean y)
    over N: disjoint parts add up), carrying its sums so that micro-batches and ranks add up. Cui et al. 2025
    (arXiv 2505.22617): a policy-gradient step lowers the entropy by about that of log-probs and advantages."""

    def __new__(cls, x: torch.Tensor, y: torch.Tensor, subset: torch.Tensor | None = None):
        x, y = x.double().flatten(), y.double().flatten()
        s = torch.ones_like(x, dtype=torch.bool) if subset is None else subset.flatten()
        n = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        return cls.of(torch.stack([n, x.sum(), y.sum(), (x * y)[s].sum(), x[s].sum(), y[s].sum(),
                                   s.sum().double()]).tolist())

    @classmethod
    def of(cls, sums: list[float]) -> "Covariance":
        """From its sums (n, sum x, sum y, and over the subset: sum xy, sum x, sum y, its count)."""
        n, sx, sy, sxy, mx, my, m = sums
        mean_x, mean_y = sx / max(n, 1), sy / max(n, 1)
        self = super().__new__(cls, (sxy - mean_y * mx - mean_x * my + m * mean_x * mean_y) / max(n, 1))
        self.sums = tuple(float(v) for v in sums)
        return self


LOG_RATIO_CLAMP = 20.0  # log-ratios (and the KL's log-ratio) are clamped to +-20 before exp, as verl does: finite
KL_CLAMP = 10.0  # ... and k3 to at most 10 (verl's low_var_kl)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimator k3 = exp(d) - d - 1 with d = ref - logp: unbiased, always >= 0.
    d is clamped to +-LOG_RATIO_CLAMP and k3 to KL_CLAMP, so a token the reference finds impossible
    cannot make the loss inf."""
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (d.exp() - d - 1).clamp(max=KL_CLAMP)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, agg: str = "token",
                denom: float | torch.Tensor | None = None, tis_cap: float | None = None,
                behaviour_logprobs: torch.Tensor | None = None, pg_mask: torch.Tensor | None = None,
                clip_ratio_c: float = 0.0) -> tuple[torch.Tensor, dict]:
    """UloRL Eq. 10 to minimise: 1/sum_i|o_i| * sum_i sum_t [1 - I_msk(i,t)] * -min(r A, clip(r) A) + kl_coef * k3,
    r = exp(logp - old); ProRL's decoupled clip (1 - eps_low, 1 + eps_high), verl's dual clip (A < 0: at most
    -A * clip_ratio_c; 0 off), TIS (tis_cap; None off). Tensors [B, T] (advantages [B] or [B, T]). mask: what the
    loss averages over, each token with its KL; pg_mask (default mask): where the policy gradient counts (DMMPTs).
    agg: "token" (DAPO, both papers) or "sample" (GRPO); denom: the step's count over micro-batches and ranks."""
    loss_mask = mask.bool()
    pg_mask = loss_mask if pg_mask is None else pg_mask.bool() & loss_mask
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    if clip_ratio_c:  # dual clip: a negative advantage's loss is capped, however large the ratio
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * clip_ratio_c), per_token)
    if tis_cap is not None:
        per_token = per_token * tis_weights(old_logprobs, behaviour_logprobs, tis_cap)
    per_token = torch.where(pg_mask, per_token, 0)  # padding may hold inf/nan: drop, not 0 * x
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    per_token = torch.where(loss_mask, per_token + kl_coef * kl, 0)

    loss = aggregate(per_token, loss_mask, agg, denom)

    with torch.no_grad():
        pg_tokens, loss_tokens = pg_mask.sum().item(), loss_mask.sum().item()
        adv_full = adv.expand_as(ratio)
        metrics = {
            "loss/kl": Mean(torch.where(loss_mask, kl, 0).sum().item(), loss_tokens),
            "clip/low_frac": Mean(((adv_full < 0) & (ratio < 1 - eps_low) & pg_mask).sum().item(), pg_tokens),
            "clip/high_frac": Mean(((adv_full > 0) & (ratio > 1 + eps_high) & pg_mask).sum().item(), pg_tokens),
            "clip/dual_frac": Mean(((adv_full < 0) & (ratio > clip_ratio_c) & pg_mask).sum().item() if clip_ratio_c
                                   else 0.0, pg_tokens),
            "ratio/mean": Mean(torch.where(pg_mask, ratio, 0).sum().item(), pg_tokens),
            "ratio/max": Max(ratio[pg_mask].max().item() if pg_mask.any() else 1.0),
        }
    return loss, metrics


def policy_loss_named(name: str):
    """The loss --policy-loss `name` names (registry.POLICY_LOSSES): policy_loss, or a variant with its arguments."""
    return registry.function(registry.POLICY_LOSSES[name])


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token",
              denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """A per-token term [B, T] as a loss: "token", over the tokens; "sample", the mean of the samples' means.
    denom: the count to divide by instead (the step's, over every micro-batch and rank)."""
    if agg == "token":
        total, n = per_token.sum(), mask.sum()
    elif agg == "sample":
        tokens = mask.sum(1)  # [B]
        total, n = (per_token.sum(1) / tokens.clamp(min=1)).sum(), (tokens > 0).sum()
    else:
        raise ValueError(f"agg must be 'token' or 'sample', got {agg!r}")
    n = n if denom is None else torch.as_tensor(denom, dtype=per_token.dtype)
    return total / n.clamp(min=1)
