"""The paper-to-code index, and the step logic that train.py and eval.py share.

Where each part of the papers lives (SPEC.md restates them; bold numbers there are flag defaults here):

  UloRL (arXiv 2507.19766)
    3.1 segment rollout, Algorithm 1 ...... segment_rollout.rollout_step, Pools; --segments (8), --max-response-len
    3.1 speed 1240 s -> 601 s (4 segs) ..... bench.py segments
    3.1 TOIS / SAIS / POIS ................ old_logprobs() below; --is-mode (pois)
    3.2 DMMPTs (tau 0.99, sigma 0.2) ...... loss.mpt_mask; --mpt {dynamic,static,off}, --mpt-tau, --mpt-sigma
    3.3 {0,1} reward, truncated = 0 ....... reward.py, reward.overlong_reward; --overlong (zero)
    3.3 generative verifier ............... reward.judge_rewards, JUDGE_PROMPT; --verifier-model, --verifier-mode
    3.4 data cleaning ..................... data.py clean (python data.py clean --help)
    4   YaRN (factor 1.5, 95232) .......... model.yarn_overrides; --rope-scaling-factor, --rope-original-max-positions
    4   settings: lr 1e-6, 128 x 8, T 0.85, mini-batch 1024 .......... train.py PRESETS["ulorl"]
    4   avg@32 with T 0.85, top_p 0.95, top_k 20 ...................... eval.py (issue 7)
  ProRL (arXiv 2507.12507, 2505.24864)
    GRPO advantages ....................... loss.group_advantages
    decoupled clip 0.2 / 0.4 .............. loss.policy_loss; --eps-low, --eps-high
    dynamic sampling ...................... take_informative() below; --dynamic-sampling
    KL k3 to a reference, beta 1e-4 ....... loss.kl_k3; --kl-coef
    reference + optimizer reset ........... train.py reset_reference(); --ref-reset-every
    settings: n 16, T 1.2, 256 prompts, mini-batch 64 prompts, lr 2e-6 ... train.py PRESETS["prorl"]
    rewards: math, code (sandbox.py), Reasoning Gym (--data rg:NAME), instruction following ... reward.VERIFIERS

Simplifications of the papers, all of them:
  - A training step waits until `--train-groups` informative groups are complete, instead of training on
    whatever the experience pool holds after one rollout; with one mini-batch this is UloRL's one update
    per step, and it keeps the batch size (and so the gradient noise) fixed.
  - Entropy for DMMPTs is that of the sampling distribution (logits / temperature), like every log-prob.
  - Groups are all-or-nothing: a group trains once all G members are finished (as UloRL describes).
  - The generative verifier is whatever model the user names (--verifier-model), asked with a fixed prompt;
    UloRL trains its own verifier model. It judges math rows only.
  - Data cleaning drops what it can check mechanically (sub-question markers, long or matrix answers,
    problems solved k of k, majority disagreement); UloRL's rewriting of multiple-choice and proof questions
    into short-answer ones is not automated.
"""
import itertools

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


def micro_batches(samples: list, max_tokens: int, pack: bool = True) -> list[list[int]]:
    """Split sample indices into micro-batches of at most `max_tokens` tokens (prompt + response) each.
    pack=True: each micro-batch is one row of sequences laid back to back (collate(pack=True)), nothing
    padded; bins are filled first-fit in order of decreasing length. pack=False: rows padded to the
    longest of their micro-batch, rows x longest <= max_tokens; sorting by length keeps padding small.
    A sequence longer than `max_tokens` gets a micro-batch of its own."""
    lengths = [len(s.prompt_ids) + len(s.tokens) for s in samples]
    if pack:
        bins, room = [], []
        for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
            b = next((b for b, r in enumerate(room) if lengths[i] <= r), len(bins))
            if b == len(bins):
                bins.append([])
                room.append(max_tokens)
            bins[b].append(i)
            room[b] -= lengths[i]
        return [sorted(b) for b in bins]
    out, cur, longest = [], [], 0
    for i in sorted(range(len(samples)), key=lambda i: lengths[i]):
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    return out + ([cur] if cur else [])


def collate(samples: list, pad_id: int, device="cpu", pack: bool = True) -> dict:
    """The trainer's input for one micro-batch, and its response-aligned tensors ([b] or [b, T], right-padded).

    pack=True: one row [1, L] of the sequences back to back, with position_ids restarting at 0 for each,
    and no attention_mask: transformers then derives a block-diagonal causal mask from the position resets
    (masking_utils.find_packed_sequence_indices; only with attention_mask=None and no KV cache), so no
    token attends across sequences. pack=False: rows [b, L], right-padded, with an attention_mask.
    Response token t of sample i sits at (rows, cols) = (row of i, start of i + P_i + t) and is predicted
    by the hidden state one column earlier (P_i = prompt length)."""
    seqs = [s.prompt_ids + s.tokens for s in samples]
    T = max(len(s.tokens) for s in samples)
    if pack:
        ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)  # [1, L]
        pos = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]  # [1, L]
        starts = [0] + list(itertools.accumulate(map(len, seqs)))[:-1]
        inputs = {"input_ids": ids, "position_ids": pos}
    else:
        L = max(map(len, seqs))
        ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
        attn = torch.zeros((len(samples), L), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = 1
        starts = [0] * len(samples)
        inputs = {"input_ids": ids, "attention_mask": attn}
    resp_mask = torch.zeros((len(samples), T), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), T))
    versions = torch.full((len(samples), T), -1, dtype=torch.long)
    rows, cols = [], []
    for i, (s, start) in enumerate(zip(samples, starts)):
        n, p = len(s.tokens), len(s.prompt_ids)
        resp_mask[i, :n] = True
        behaviour[i, :n] = torch.tensor(s.logprobs)
        versions[i, :n] = torch.tensor(s.versions)
        rows += [0 if pack else i] * n
        cols += range(start + p - 1, start + p - 1 + n)
    targets = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long)
    out = {**inputs, "resp_mask": resp_mask, "behaviour": behaviour, "versions": versions,
           "rows": torch.tensor(rows), "cols": torch.tensor(cols), "targets": targets,
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


def rank_share(lengths: list[int], rank: int, world: int) -> list[int]:
    """The positions of a mini-batch that trainer rank `rank` of `world` trains on: longest sequence first,
    each to the rank with the fewest tokens so far (ties: the lowest rank), so ranks get about equal work.
    Every rank computes the same split from the same batch. One process: everything."""
    if world == 1:
        return list(range(len(lengths)))
    load, owner = [0] * world, {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(world), key=lambda r: load[r])
        owner[i], load[r] = r, load[r] + lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]
