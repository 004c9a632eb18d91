"""The paper-to-code index, and the algorithm of one RL step after the rollout: dynamic sampling,
advantages, the token masks (overlong filtering, DMMPTs), the update (`update`: old and reference log-probs,
the global token denominator, the loss, the optimizer steps, the NaN skip) and ProRL's reference/optimizer
reset. One RL step reads train.py (the loop) -> rollouts.py -> segment_rollout.py -> ulorl.py -> loss.py.

Where each part of the papers lives (every paper number is a flag default or a preset in config.py):

  UloRL (arXiv 2507.19766)
    3.1 segment rollout, Algorithm 1 ...... segment_rollout.rollout_step, Pools; rollouts.Rollouts;
                                            --segments (8), --max-response-len (131072)
    3.1 speed 1240 s -> 601 s (4 segs) ..... bench/segments.py
    3.1 TOIS / SAIS / POIS ................ loss.old_logprobs, used in old_ref_and_masks() below; --is-mode (pois)
    3.2 DMMPTs (tau 0.99, sigma 0.2) ...... loss.mpt_mask, token_masks() below; --mpt, --mpt-tau, --mpt-sigma
    3.2 Eq. 10: masked tokens stay in the denominator ... optimize() below, loss.policy_loss(pg_mask=...)
    3.3 {0,1} reward, truncated = 0 ....... reward.score_samples, reward.overlong_reward; --overlong (zero)
    3.3 generative verifier ............... reward.Judge, reward.judge_rewards; --verifier-model, --verifier-mode
    3.4 data cleaning ..................... clean.py (python clean.py --help)
    4   YaRN (factor 1.5, 95232) .......... model.yarn_overrides; --rope-scaling-factor, --rope-original-max-positions
    4   settings: lr 1e-6, 128 x 8, T 0.85, mini-batch 1024 .......... config.PRESETS["ulorl"]
    4   avg@32 with T 0.85, top_p 0.95, top_k 20 ...................... eval.py --preset ulorl
  ProRL (arXiv 2507.12507, 2505.24864)
    GRPO advantages ....................... loss.group_advantages, sample_advantages() below
    decoupled clip 0.2 / 0.4 .............. loss.policy_loss; --eps-low, --eps-high
    dual clip c = 3 (verl, both papers) ... loss.policy_loss; --clip-ratio-c
    token-level loss (DAPO) ............... optimize() below: one denominator over micro-batches and ranks; --agg
    dynamic sampling ...................... dynamic_sampling() below; --dynamic-sampling
    KL k3 to a reference, beta 1e-4 ....... loss.kl_k3; --kl-coef
    reference + optimizer reset ........... reset_reference(), stalled() below; --ref-reset-every, --ref-reset-on-stall,
                                            --reset (both; or the reference or the optimizer alone)
    constant learning rate (both papers) .. lr_factor() below; --lr-final 1 (the tiny default decays to 0.1)
    settings: n 16, T 1.2, 256 prompts, mini-batch 64 prompts, lr 2e-6 ... config.PRESETS["prorl"]
    rewards: math, code (systems/sandbox.py), Reasoning Gym (--data rg:NAME), instruction following ... registry.VERIFIERS
    pass@k ................................ eval.pass_at_k

Simplifications of the papers, all of them:
  - A training step waits until `--train-groups` informative groups are complete, instead of training on
    whatever the experience pool holds after one rollout; with one mini-batch this is UloRL's one update
    per step, and it keeps the batch size (and so the gradient noise) fixed.
  - Entropy for DMMPTs is that of the sampling distribution (logits / temperature), like every log-prob.
  - Groups are all-or-nothing: a group trains once all G members are finished (as UloRL describes).
  - The generative verifier is whatever model the user names (--verifier-model), asked with a fixed prompt;
    UloRL trains its own verifier model. It judges math rows only.
  - Reasoning Gym's continuous scores (ProRL's puzzles) count as they are only on datasets where no wrong answer
    a policy could learn earns credit (34 of 104); on the others a score counts at full marks only, and 5 are
    refused (verifiers.rg_probe, docs/rewards.md).
  - Data cleaning drops what it can check mechanically (sub-question markers, long or matrix answers,
    problems solved k of k, majority disagreement); UloRL's rewriting of multiple-choice and proof questions
    into short-answer ones is not automated.
"""
import math
import sys
from dataclasses import dataclass, field

import torch

import model as model_lib
from loss import Covariance, Max, Mean, Sum, group_advantages, mpt_mask, old_logprobs, policy_loss_named
from model import MicroBatch


@dataclass
class RunState:
    """Where a run stands between steps (a checkpoint saves it beside the pools)."""
    step: int = 0  # RL steps done
    version: int = 0  # the policy version: +1 whenever an update changed the weights; stamped on sampled tokens
    cursor: int = 0  # prompts drawn so far from the endless shuffled stream (data.draw_order)
    ready: list = field(default_factory=list)  # informative complete groups waiting for an update
    bad_steps: int = 0  # steps in a row whose every update was skipped for a NaN/inf loss or gradient
    run_id: str = ""  # names the run in its checkpoints' manifests: --keep-last prunes only its own
    best_eval: float | None = None  # the best held-out accuracy so far (--ref-reset-on-stall)
    evals_since_best: int = 0  # evaluations since it last improved, or since the last reset
    engine_kl: list = field(default_factory=list)  # the last steps' rollout/engine_kl (engine_gap.check)
    prefetched: object = None  # --overlap: the next step's rollout, decoded during the last update (rollouts.Prefetched)


def dynamic_sampling(groups: list[list], enabled: bool) -> tuple[list[list], int]:
    """DAPO's dynamic sampling: drop the groups of equal rewards (zero advantage). (kept, how many dropped)"""
    if not enabled:
        return groups, 0
    kept = [g for g in groups if len({s.reward for s in g}) > 1]
    return kept, len(groups) - len(kept)


def take_groups(state: RunState, cfg) -> tuple[list[list], int | None]:
    """The first --train-groups ready groups; the rest wait, or are dropped (TOIS trains only tokens of the weights
    it updates; --surplus drop). (groups, how many dropped: None when none can be)"""
    groups, state.ready = state.ready[:cfg.train_groups], state.ready[cfg.train_groups:]
    if cfg.is_mode != "tois" and cfg.surplus == "wait":
        return groups, None
    dropped, state.ready = len(state.ready), []
    return groups, dropped


def sample_advantages(groups: list[list]) -> torch.Tensor:
    """One advantage per sample, groups flattened in order: [n_groups * G]."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
    return group_advantages(rewards).flatten()


def token_masks(mb: MicroBatch, current: torch.Tensor, entropy: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask: what the loss averages over, pg_mask: where the policy gradient trains), [b, T]: a DMMPT-masked
    token stays in the denominator with its KL term (UloRL Eq. 10)."""
    loss_mask = mb.resp_mask.clone() & (not mb.empty)
    if cfg.overlong == "filter":
        loss_mask &= ~mb.truncated[:, None]
    pg_mask = loss_mask.clone()
    if cfg.mpt != "off":
        sigma = cfg.mpt_sigma if cfg.mpt == "dynamic" else math.inf
        pg_mask &= mpt_mask(current, entropy, mb.rewards, mb.resp_mask, cfg.mpt_tau, sigma)
    return loss_mask, pg_mask


def staleness(samples: list, version: int) -> dict:
    """How many versions behind `version` the trained tokens and the last segments were sampled."""
    tokens = lag_sum = lag_max = 0
    last = []
    for s in samples:
        bounds = s.seg_starts + [len(s.tokens)]
        for a, b in zip(bounds, bounds[1:]):
            if b > a:  # every token of a segment was sampled by one version
                lag = version - s.versions[a]
                tokens, lag_sum, lag_max = tokens + b - a, lag_sum + lag * (b - a), max(lag_max, lag)
        last.append(version - s.versions[-1] if s.versions else 0)
    return {"staleness/token_mean": lag_sum / max(tokens, 1), "staleness/token_max": lag_max,
            "staleness/last_segment_mean": sum(last) / max(len(last), 1), "staleness/last_segment_max": max(last, default=0)}


def plan_micro_batches(samples: list, adv: torch.Tensor, pad_id: int, cfg, ranks) -> list[list[MicroBatch]]:
    """Mini-batches (optimizer steps, whole groups) of this rank's micro-batches; a rank with fewer runs empty
    stand-ins, so that every rank's collectives line up."""
    per_mini = len(samples) if cfg.mini_batch <= 0 else cfg.mini_batch
    minis = []
    for lo in range(0, len(samples), per_mini):
        idx = list(range(lo, min(lo + per_mini, len(samples))))
        mine = [idx[j] for j in ranks.share([len(samples[i].prompt_ids) + len(samples[i].tokens) for i in idx])]
        mbs = [[mine[j] for j in mb] for mb in model_lib.micro_batches([samples[i] for i in mine],
                                                                         cfg.max_tokens_per_micro_batch, cfg.pack)]
        collated = []
        for mb_idx in mbs:
            mb = model_lib.collate([samples[i] for i in mb_idx], pad_id, cfg.device, cfg.pack)
            mb.adv, mb.counted = adv[mb_idx].to(cfg.device), ranks.counted
            collated.append(mb)
        for _ in range(ranks.most(len(mbs)) - len(mbs)):
            mb = model_lib.collate([samples[0]], pad_id, cfg.device, cfg.pack)
            mb.adv, mb.empty, mb.counted = torch.zeros(1, device=cfg.device), True, False
            collated.append(mb)
        minis.append(collated)
    return minis


class Tally:
    """The step's metrics over micro-batches and ranks: Mean, Sum and Covariance sums add up, Max takes the largest.
    `counted` False (MicroBatch.counted) adds only the key: every rank reduces the same."""

    def __init__(self):
        self.means, self.sums, self.maxes, self.covs = {}, {}, {}, {}

    def add(self, metrics: dict, counted: bool = True) -> None:
        for k, m in metrics.items():
            if isinstance(m, Max):
                self.maxes[k] = max(self.maxes.get(k, 0.0), m if counted else 0.0)
            elif isinstance(m, Sum):
                self.sums[k] = self.sums.get(k, 0.0) + (m if counted else 0.0)
            elif isinstance(m, Covariance):
                self.covs[k] = [a + (b if counted else 0.0) for a, b in zip(self.covs.get(k, [0.0] * len(m.sums)),
                                                                             m.sums)]
            else:
                total, count = self.means.get(k, (0.0, 0.0))
                self.means[k] = (total + m.total, count + m.count) if counted else (total, count)

    def reduce(self, ranks) -> dict:
        """Every rank's, combined (every rank calls it)."""
        totals = ranks.sum({(k, part): v[i] for k, v in self.means.items() for i, part in enumerate(("total", "n"))}
                           | {(k, "sum"): v for k, v in self.sums.items()}
                           | {(k, f"c{i}"): v for k, sums in self.covs.items() for i, v in enumerate(sums)})
        out = {k: totals[k, "total"] / max(totals[k, "n"], 1) for k in self.means}
        return (out | {k: totals[k, "sum"] for k in self.sums} | {k: ranks.max(v) for k, v in self.maxes.items()}
                | {k: Covariance.of([totals[k, f"c{i}"] for i in range(len(sums))]) for k, sums in self.covs.items()})


@torch.no_grad()
def old_ref_and_masks(policy, ref, minis: list[list[MicroBatch]], version: int, cfg, tally: Tally) -> None:
    """Step 5, one pass with the weights of version `version`: each micro-batch's pi_old (TOIS/SAIS/POIS), reference
    log-probs and token masks."""
    for mbs in minis:
        for mb in mbs:
            current, entropy = policy(mb, cfg.temperature)
            mb.old_logprobs = old_logprobs(cfg.is_mode, current, mb.behaviour, mb.versions, version)
            if ref is not None:
                mb.ref_logprobs = ref(mb, cfg.temperature)[0]
            mb.loss_mask, mb.pg_mask = token_masks(mb, current, entropy, cfg)
            tokens = int(mb.resp_mask.sum())
            # log-prob/advantage covariance (the entropy a step takes away): all, DMMPT-masked and trained tokens
            lp, adv = current[mb.loss_mask], mb.adv[:, None].expand_as(current)[mb.loss_mask]
            masked = ~mb.pg_mask[mb.loss_mask]
            tally.add({"entropy/mean": Mean(entropy[mb.resp_mask].sum().item(), tokens),
                       "mpt/masked_frac": Mean(int(mb.loss_mask.sum()) - int(mb.pg_mask.sum()), tokens),
                       "overlong/filtered_frac": Mean(tokens - int(mb.loss_mask.sum()), tokens),
                       "entropy/cov": Covariance(lp, adv), "entropy/cov_masked": Covariance(lp, adv, masked),
                       "entropy/cov_trained": Covariance(lp, adv, ~masked)}, mb.counted)


def micro_batch_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, denom: int,
                     cfg) -> tuple[torch.Tensor, dict]:
    """Step 6 on one micro-batch: the loss --policy-loss names (clipped: UloRL Eq. 10) over the step's count
    `denom`. A metric it returns (loss.Mean, Sum or Max) lands in metrics.jsonl as its value over the step."""
    loss, metrics = policy_loss_named(cfg.policy_loss)(
        logprobs=logprobs, old_logprobs=mb.old_logprobs, advantages=mb.adv, mask=mb.loss_mask, pg_mask=mb.pg_mask,
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, clip_ratio_c=cfg.clip_ratio_c, ref_logprobs=mb.ref_logprobs,
        kl_coef=cfg.kl_coef, agg=cfg.agg, denom=denom, tis_cap=cfg.tis_cap or None, behaviour_logprobs=mb.behaviour)
    return loss, metrics


def optimize(policy, opt, sched, minis: list[list[MicroBatch]], cfg, tally: Tally, ranks) -> tuple[int, torch.Tensor]:
    """Step 6: an optimizer step per mini-batch, gradients summed over its micro-batches and ranks; one whose loss
    or gradient is NaN/inf on any rank is skipped. Returns (updates skipped, the last gradient norm)."""
    policy.train()
    params = [p for g in opt.param_groups for p in g["params"]]  # what AdamW steps: fp32 in a bf16 run
    skipped, grad_norm = 0, torch.tensor(float("nan"))
    for mbs in minis:
        # UloRL Eq. 10's denominator: the loss_mask tokens (--agg sample: samples) of every micro-batch and rank;
        # DDP/FSDP average over ranks, so x world makes it a sum (--sp: each rank's slice adds to its group's)
        local = sum(int(mb.loss_mask.sum()) if cfg.agg == "token" else int((mb.loss_mask.sum(1) > 0).sum())
                    for mb in mbs if mb.counted)
        denom = ranks.sum({"n": local})["n"]
        opt.zero_grad(set_to_none=True)
        finite = True
        for i, mb in enumerate(mbs):
            with ranks.micro_batch(last=i == len(mbs) - 1):
                logprobs, entropy = policy(mb, cfg.temperature)
                loss, metrics = micro_batch_loss(mb, logprobs, entropy, denom, cfg)
                (loss * ranks.world).backward()
            finite &= bool(torch.isfinite(loss))
            tally.add({**metrics, "loss/policy": Sum(loss.item() / len(minis))}, counted=mb.counted)
        grad_norm = ranks.clip_grads(params, cfg.grad_clip)
        if not (ranks.all_true(finite) and torch.isfinite(grad_norm)):
            opt.zero_grad(set_to_none=True)
            skipped += 1
            continue
        opt.step()
        sched.step()
        ranks.after_step()
    opt.zero_grad(set_to_none=True)  # no gradient outlives the update (a colocated engine wakes into that memory)
    return skipped, grad_norm


def update(policy, ref, opt, sched, groups: list[list], version: int, pad_id: int, cfg, ranks, probe=None) -> dict:
    """Steps 5-6 on the same informative groups on every rank, with the weights of `version`. `probe` (--overlap):
    samples the current weights decoded, which only the engine/trainer gap check sees. Returns the metrics."""
    samples = [s for g in groups for s in g]
    minis = plan_micro_batches(samples, sample_advantages(groups), pad_id, cfg, ranks)
    tally = Tally()
    old_ref_and_masks(policy, ref, minis, version, cfg, tally)
    if probe is not None and (probes := probe()):
        old_ref_and_masks(policy, None, plan_micro_batches(probes, torch.zeros(len(probes)), pad_id, cfg, ranks),
                          version, cfg, Tally())
    skipped, grad_norm = optimize(policy, opt, sched, minis, cfg, tally, ranks)
    out = tally.reduce(ranks)
    out.update({"train/samples": len(samples), "train/lr": sched.get_last_lr()[0],
                "train/grad_norm": grad_norm.item(),
                "train/optimizer_steps": len(minis) - skipped, "train/skipped_updates": skipped,
                **staleness(samples, version)})
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}  # JSON: no NaN


def after_update(record: dict, state: RunState, cfg, warn: bool = True) -> None:
    """The version advances when the weights changed; --max-bad-steps steps without an update stop the run."""
    if record["train/optimizer_steps"]:
        state.version += 1
    if not record["train/skipped_updates"]:
        state.bad_steps = 0
        return
    state.bad_steps = state.bad_steps + 1 if record["train/optimizer_steps"] == 0 else 0
    if warn:
        print(f"warning: step {state.step + 1}: skipped {record['train/skipped_updates']} update(s) with a NaN/inf loss "
              f"or gradient ({state.bad_steps} step(s) in a row)", file=sys.stderr, flush=True)
    if state.bad_steps >= cfg.max_bad_steps:
        raise RuntimeError(f"{state.bad_steps} steps in a row had only NaN/inf losses or gradients; "
                           f"stopping. Look at samples.jsonl for odd rewards; lower --lr; the newest "
                           f"checkpoint in {cfg.out} holds the last good weights")


def lr_factor(update: int, cfg) -> float:
    """Update `update`'s learning rate over --lr: warm-up-stable-decay, linear over --warmup-steps updates, then 1,
    then a cosine to --lr-final over the last --lr-decay-steps RL steps (0: all of them)."""
    if update < cfg.warmup_steps:
        return (update + 1) / cfg.warmup_steps
    per_step = math.ceil(cfg.train_groups * cfg.group_size / cfg.mini_batch) if cfg.mini_batch else 1
    last = cfg.steps * per_step - 1  # the run's last update
    start = max(cfg.warmup_steps, last + 1 - cfg.lr_decay_steps * per_step if cfg.lr_decay_steps else 0)
    progress = min(1.0, max(0, update - start) / max(last - start, 1))
    return cfg.lr_final + (1 - cfg.lr_final) * 0.5 * (1 + math.cos(math.pi * progress))


def stalled(state: RunState, accuracy: float, patience: int) -> bool:
    """ProRL's second reset trigger: True when `patience` evaluations in a row have not improved on the best
    held-out accuracy so far (0 = never). After a True the count starts again; the best stays."""
    if state.best_eval is None or accuracy > state.best_eval:
        state.best_eval, state.evals_since_best = accuracy, 0
        return False
    state.evals_since_best += 1
    if patience and state.evals_since_best >= patience:
        state.evals_since_best = 0
        return True
    return False


def reset_reference(policy_lm, ref_lm, opt, ref=None, renew: str = "both") -> None:
    """ProRL's reset: the reference becomes the current policy and AdamW forgets its moments; `renew` (--reset)
    "reference" or "optimizer" does one alone (without a reference, --kl-coef 0, only the optimizer resets).
    `ref`: the reference as placement.wrap()ped, resharded first (FSDP2 leaves its root unsharded after a forward
    with no backward)."""
    if ref_lm is not None and renew != "optimizer":
        if ref is not None:
            ref.reshard()
        with torch.no_grad():
            for (name, p), (ref_name, r) in zip(policy_lm.named_parameters(), ref_lm.named_parameters()):
                assert name == ref_name, (name, ref_name)
                r.copy_(p)
    if renew != "reference":
        opt.state.clear()
