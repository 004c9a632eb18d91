"""The paper-to-code index, and the step logic that train.py and eval.py share.

Where each part of the papers lives (SPEC.md restates them; bold numbers there are flag defaults here):

  UloRL (arXiv 2507.19766)
    3.1 segment rollout, Algorithm 1 ...... segment_rollout.rollout_step, Pools; --segments (8), --max-response-len
    3.1 speed 1240 s -> 601 s (4 segs) ..... bench.py segments
    3.1 TOIS / SAIS / POIS ................ old_logprobs() below; --is-mode (pois)
    3.2 DMMPTs (tau 0.99, sigma 0.2) ...... loss.mpt_mask; --mpt {dynamic,static,off}, --mpt-tau, --mpt-sigma
    3.3 {0,1} reward, truncated = 0 ....... reward.py, reward.overlong_reward; --overlong (zero)
    3.3 generative verifier ............... reward.py (issue 6)
    3.4 data cleaning ..................... data.py (issue 6)
    4   YaRN (factor 1.5, 95232) .......... model.py (issue 5)
    4   settings: lr 1e-6, 128 x 8, T 0.85, mini-batch 1024 .......... train.py PRESETS["ulorl"]
    4   avg@32 with T 0.85, top_p 0.95, top_k 20 ...................... eval.py (issue 7)
  ProRL (arXiv 2507.12507, 2505.24864)
    GRPO advantages ....................... loss.group_advantages
    decoupled clip 0.2 / 0.4 .............. loss.policy_loss; --eps-low, --eps-high
    dynamic sampling ...................... take_informative() below; --dynamic-sampling
    KL k3 to a reference, beta 1e-4 ....... loss.kl_k3; --kl-coef
    reference + optimizer reset ........... train.py reset_reference(); --ref-reset-every
    settings: n 16, T 1.2, 256 prompts, mini-batch 64 prompts, lr 2e-6 ... train.py PRESETS["prorl"]

Simplifications of the papers, all of them:
  - A training step waits until `--train-groups` informative groups are complete, instead of training on
    whatever the experience pool holds after one rollout; with one mini-batch this is UloRL's one update
    per step, and it keeps the batch size (and so the gradient noise) fixed.
  - Entropy for DMMPTs is that of the sampling distribution (logits / temperature), like every log-prob.
  - Groups are all-or-nothing: a group trains once all G members are finished (as UloRL describes).
"""
import torch

from loss import group_advantages


def take_informative(groups: list[list], dynamic_sampling: bool) -> tuple[list[list], int]:
    """Dynamic sampling (DAPO, both papers): a group whose rewards are all equal has zero advantage and
    teaches nothing, so it is dropped and sampling continues. Returns (kept groups, number dropped)."""
    if not dynamic_sampling:
        return groups, 0
    kept = [g for g in groups if len({s.reward for s in g}) > 1]
    return kept, len(groups) - len(kept)


def sample_advantages(groups: list[list]) -> torch.Tensor:
    """One advantage per sample, groups flattened in order: [n_groups * G]."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
    return group_advantages(rewards).flatten()


def micro_batches(samples: list, max_tokens: int) -> list[list[int]]:
    """Split sample indices into micro-batches whose padded size (rows x longest sequence) stays within
    `max_tokens`. Sorting by length first keeps padding small."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].tokens))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(samples[i].prompt_ids) + len(samples[i].tokens)
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return out + ([cur] if cur else [])


def collate(samples: list, pad_id: int, device="cpu") -> dict:
    """Right-padded tensors for the trainer's forward. Response token t of sample i sits at position
    P_i + t and is predicted by the hidden state at P_i + t - 1 (P_i = prompt length)."""
    seqs = [s.prompt_ids + s.tokens for s in samples]
    L, T = max(map(len, seqs)), max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), L), dtype=torch.long)
    resp_mask = torch.zeros((len(samples), T), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), T))
    versions = torch.full((len(samples), T), -1, dtype=torch.long)
    rows, cols = [], []
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        n, p = len(s.tokens), len(s.prompt_ids)
        resp_mask[i, :n] = True
        behaviour[i, :n] = torch.tensor(s.logprobs)
        versions[i, :n] = torch.tensor(s.versions)
        rows += [i] * n
        cols += range(p - 1, p - 1 + n)
    targets = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long)
    out = {"input_ids": ids, "attention_mask": attn, "resp_mask": resp_mask, "behaviour": behaviour,
           "versions": versions, "rows": torch.tensor(rows), "cols": torch.tensor(cols), "targets": targets,
           "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
           "truncated": torch.tensor([s.finish == "truncated" for s in samples])}
    return {k: v.to(device) for k, v in out.items()}


def old_logprobs(is_mode: str, current: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """pi_old of the importance ratio (UloRL 3.1), [b, T]:
    - tois / sais: the behaviour log-probs stored at sampling time. With one segment (TOIS) that is the one
      policy that sampled the sample; with several (SAIS) each token's own segment's policy.
    - pois: the current weights' log-probs of the whole sample, recomputed before the update, so the ratio
      starts at exactly 1 for every token (pseudo on-policy; UloRL's choice)."""
    if is_mode == "pois":
        return current
    if is_mode in ("tois", "sais"):
        return behaviour
    raise ValueError(f"--is-mode must be tois, sais or pois, got {is_mode!r}")
