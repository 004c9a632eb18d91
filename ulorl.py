"""The paper-to-code index, and the algorithm of one RL step after the rollout: dynamic sampling,
advantages, the token masks (overlong filtering, DMMPTs), the update (`update`: old and reference log-probs,
the global token denominator, the loss, the optimizer steps, the NaN skip) and ProRL's reference/optimizer
reset. One RL step reads train.py (the loop) -> rollouts.py -> segment_rollout.py -> ulorl.py -> loss.py.

Where each part of the papers lives (every paper number is a flag default or a preset in config.py):

  UloRL (arXiv 2507.19766)
    3.1 segment rollout, Algorithm 1 ...... segment_rollout.rollout_step, Pools; rollouts.Rollouts;
                                            --segments (8), --max-response-len (131072)
    3.1 speed 1240 s -> 601 s (4 segs) ..... bench.py segments
    3.1 TOIS / SAIS / POIS ................ loss.old_logprobs, used in prepare() below; --is-mode (pois)
    3.2 DMMPTs (tau 0.99, sigma 0.2) ...... loss.mpt_mask, token_masks() below; --mpt, --mpt-tau, --mpt-sigma
    3.2 Eq. 10: masked tokens stay in the denominator ... optimize() below, loss.policy_loss(pg_mask=...)
    3.3 {0,1} reward, truncated = 0 ....... reward.py, reward.overlong_reward; --overlong (zero)
    3.3 generative verifier ............... reward.Judge, reward.judge_rewards; --verifier-model, --verifier-mode
    3.4 data cleaning ..................... data.py clean (python data.py clean --help)
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
    reference + optimizer reset ........... reset_reference(), stalled() below; --ref-reset-every, --ref-reset-on-stall
    constant learning rate (both papers) .. lr_factor() below; --lr-final 1 (the tiny default decays to 0.1)
    settings: n 16, T 1.2, 256 prompts, mini-batch 64 prompts, lr 2e-6 ... config.PRESETS["prorl"]
    rewards: math, code (sandbox.py), Reasoning Gym (--data rg:NAME), instruction following ... reward.VERIFIERS
    pass@k ................................ eval.pass_at_k

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
import math
import sys
from dataclasses import dataclass, field

import torch

import model as model_lib
from loss import group_advantages, mpt_mask, old_logprobs, policy_loss
from model import MicroBatch


@dataclass
class Prefetched:
    """--overlap 1: the next step's rollout as far as it ran during the last update (its samples are in the pools
    and `ready`): what that step continues from, and what a checkpoint keeps of it."""
    record: dict  # the step's metrics.jsonl record so far
    rewards: list  # (verifier, reward) of every sample rewarded in it
    version: int  # the policy version whose weights decoded it


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
    engine_kl: list = field(default_factory=list)  # the last steps' rollout/engine_kl (engine_gap_check)
    prefetched: Prefetched | None = None  # --overlap: the next step's rollout, decoded during the last update


def dynamic_sampling(groups: list[list], enabled: bool) -> tuple[list[list], int]:
    """Dynamic sampling (DAPO, both papers): a group whose rewards are all equal has zero advantage and
    teaches nothing, so it is dropped and sampling continues. Returns (kept groups, number dropped)."""
    if not enabled:
        return groups, 0
    kept = [g for g in groups if len({s.reward for s in g}) > 1]
    return kept, len(groups) - len(kept)


def take_groups(state: RunState, cfg) -> tuple[list[list], int | None]:
    """The step's --train-groups groups, first ready first trained; the rest wait for the next step, except under
    TOIS, where every trained token must come from the weights being updated: they are dropped. Returns (groups,
    how many were dropped: None when none can be)."""
    groups, state.ready = state.ready[:cfg.train_groups], state.ready[cfg.train_groups:]
    if cfg.is_mode != "tois":
        return groups, None
    dropped, state.ready = len(state.ready), []
    return groups, dropped


def sample_advantages(groups: list[list]) -> torch.Tensor:
    """One advantage per sample, groups flattened in order: [n_groups * G]."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
    return group_advantages(rewards).flatten()


def token_masks(mb: MicroBatch, current: torch.Tensor, entropy: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Which response tokens train, [b, T] bool each: (loss_mask, pg_mask).
    loss_mask: the tokens the loss averages over (its denominator), every token of a sample that trains;
      overlong filtering (--overlong filter, as DAPO) removes truncated samples whole.
    pg_mask: the loss_mask tokens whose policy-gradient term trains; DMMPTs drop the well-mastered tokens of
      positive samples (UloRL 3.2: --mpt dynamic while the sample's entropy is below sigma, static always,
      off never). A dropped token stays in the denominator (UloRL Eq. 10) and keeps its KL term."""
    loss_mask = mb.resp_mask.clone() & (not mb.empty)
    if cfg.overlong == "filter":
        loss_mask &= ~mb.truncated[:, None]
    pg_mask = loss_mask.clone()
    if cfg.mpt != "off":
        sigma = cfg.mpt_sigma if cfg.mpt == "dynamic" else math.inf
        pg_mask &= mpt_mask(current, entropy, mb.rewards, mb.resp_mask, cfg.mpt_tau, sigma)
    return loss_mask, pg_mask


def staleness(samples: list, version: int) -> dict:
    """How many policy versions behind `version` (the weights being updated) the trained tokens were sampled,
    and the samples' last segments: a sample that finished early waits in the experience pool while its
    group completes, and surplus ready groups carry over to the next step; both are off-policy in ways
    POIS does not correct. Counted per segment, so 128k-token samples cost nothing."""
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


def plan_micro_batches(samples: list, adv: torch.Tensor, pad_id: int, cfg) -> list[list[MicroBatch]]:
    """Mini-batches are optimizer steps (whole groups, in order); micro-batches are forward/backward calls.
    Under torchrun each rank takes a share of every mini-batch (balanced by tokens; under --sp the ranks of a
    sequence-parallel group take the same share, each a slice of its rows); a rank with fewer micro-batches
    than another runs empty stand-ins, so that every rank's collectives line up."""
    per_mini = len(samples) if cfg.mini_batch <= 0 else cfg.mini_batch
    minis = []
    for lo in range(0, len(samples), per_mini):
        idx = list(range(lo, min(lo + per_mini, len(samples))))
        mine = model_lib.rank_share([len(samples[i].prompt_ids) + len(samples[i].tokens) for i in idx],
                                    model_lib.data_rank(), model_lib.data_world())
        mine = [idx[j] for j in mine]
        mbs = [[mine[j] for j in mb] for mb in model_lib.micro_batches([samples[i] for i in mine],
                                                                         cfg.max_tokens_per_micro_batch, cfg.pack)]
        collated = []
        for mb_idx in mbs:
            mb = model_lib.collate([samples[i] for i in mb_idx], pad_id, cfg.device, cfg.pack)
            mb.adv = adv[mb_idx].to(cfg.device)
            collated.append(mb)
        for _ in range(int(model_lib.all_max(len(mbs))) - len(mbs)):  # a real sample's shapes, nothing kept
            mb = model_lib.collate([samples[0]], pad_id, cfg.device, cfg.pack)
            mb.adv, mb.empty = torch.zeros(1, device=cfg.device), True
            collated.append(mb)
        minis.append(collated)
    return minis


GAP_BINS = (-12.0, 2.0, 280)  # log10 |trainer - engine log-prob| from 1e-12 to 100 nats, 20 bins a decade
# The engine/trainer KL leaves out its GAP_OUTLIERS largest tokens: one bf16 MoE token 3.5 nats off adds
# e^3.5 - 4.5 = 28.6 to the sum, 0.11 a token over --overlap's 256-token probe, past --max-engine-kl, while an
# engine that missed a sync is off on many (trimming 1% instead hid most of a stale tiny engine's KL: 30x -> 7x)
GAP_OUTLIERS = 2


def trimmed_kl(kl_sum: float, n: int, largest: list[float]) -> float | None:
    """The mean per-token KL of `n` tokens whose k3 values add up to `kl_sum`, without the GAP_OUTLIERS largest
    (`largest`: at least those); None without tokens."""
    if not n:
        return None
    k = min(GAP_OUTLIERS, len(largest)) if n > 2 * GAP_OUTLIERS else 0
    return max(kl_sum - sum(sorted(largest, reverse=True)[:k]), 0.0) / (n - k)


@torch.no_grad()
def prepare(policy, ref, minis: list[list[MicroBatch]], version: int, cfg) -> tuple[dict, float, torch.Tensor]:
    """Step 5, one pass with the weights about to be updated: pi_old (loss.old_logprobs: these current
    log-probs for every token under POIS, for the tokens these weights sampled under TOIS/SAIS), the
    reference's log-probs for the KL, entropy and the token masks; and how far the engine's behaviour
    log-probs are from the trainer's on the tokens these very weights sampled.
    Returns (sums for the metrics, the largest engine/trainer gap, a histogram of the gaps (GAP_BINS), the
    GAP_OUTLIERS largest per-token KLs)."""
    stats = {"entropy": 0.0, "tokens": 0, "loss_tokens": 0, "pg_tokens": 0, "diff_sum": 0.0, "diff_n": 0,
             "kl_sum": 0.0, "route_differ": 0, "route_compared": 0}
    diff_max, hist, top = 0.0, torch.zeros(GAP_BINS[2], dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    for mbs in minis:
        for mb in mbs:
            # --routing-replay: the positions these weights routed in the engine, compared with the trainer's router
            # (each rank its own slice under --sp: counted on every rank)
            mb.tally = {"version": version, "differ": 0, "compared": 0} if not mb.empty else None
            cur, entropy = policy(mb, cfg.temperature)
            if mb.tally is not None:
                stats["route_differ"] += mb.tally["differ"]
                stats["route_compared"] += mb.tally["compared"]
                mb.tally = None
            mb.old = old_logprobs(cfg.is_mode, cur, mb.behaviour, mb.versions, version)
            if ref is not None:
                mb.ref = ref(mb, cfg.temperature)[0]
            mb.loss_mask, mb.pg_mask = token_masks(mb, cur, entropy, cfg)
            if mb.empty or not model_lib.counts():  # (a sequence-parallel group's other ranks: counted once)
                continue
            stats["entropy"] += entropy[mb.resp_mask].sum().item()
            stats["tokens"] += int(mb.resp_mask.sum())
            stats["loss_tokens"] += int(mb.loss_mask.sum())
            stats["pg_tokens"] += int(mb.pg_mask.sum())
            d = (cur.double() - mb.behaviour.double())[mb.versions == version]  # log p_trainer - log p_engine
            if d.numel():
                diff_max = max(diff_max, d.abs().max().item())
                stats["diff_sum"] += d.abs().sum().item()
                stats["diff_n"] += d.numel()
                # KL(engine || trainer) per token, k3 on the engine's own samples: unbiased, never negative
                k3 = d.clamp(max=30).exp() - 1 - d
                stats["kl_sum"] += k3.sum().item()
                top = torch.cat([top, k3.cpu()]).topk(min(GAP_OUTLIERS, top.numel() + k3.numel())).values
                hist += torch.histc(d.abs().clamp(1e-12, 99.0).log10().cpu(), GAP_BINS[2], *GAP_BINS[:2])
    return stats, diff_max, hist, top.tolist()


def quantile(hist: torch.Tensor, q: float) -> float:
    """The q-quantile of the gaps a GAP_BINS histogram counts, as its bin's upper edge (12% resolution)."""
    lo, hi, bins = GAP_BINS
    k = int(torch.searchsorted(hist.cumsum(0), q * hist.sum().item()))
    return 10 ** (lo + (hi - lo) * min(k + 1, bins) / bins)


def optimize(policy, opt, sched, minis: list[list[MicroBatch]], cfg,
             masters=None) -> tuple[dict, float, int, torch.Tensor]:
    """Step 6: one optimizer step per mini-batch, gradients accumulated over its micro-batches. An update
    whose loss or gradient is NaN/inf on any rank is skipped: the optimizer never sees it. `masters`
    (model.MasterWeights, bf16 outside FSDP): the fp32 weights the optimizer steps, copied to the module after.
    Returns (token-weighted metric sums, the largest ratio, updates skipped, the last gradient norm)."""
    policy.train()
    params = [p for g in opt.param_groups for p in g["params"]]  # what AdamW steps: fp32 in a bf16 run
    totals: dict = {}
    skipped, grad_norm, ratio_max = 0, torch.tensor(float("nan")), 0.0
    for mbs in minis:
        # The one place that decides what the loss averages over: every loss_mask token (DMMPT-masked ones
        # included, UloRL Eq. 10; overlong-filtered samples not) of *all* micro-batches of this optimizer
        # step on all ranks (samples, for agg="sample"). DDP and FSDP average gradients over ranks; scaling
        # by the world size makes it a sum. Under --sp each rank of a group computes the whole loss but its
        # gradient flows through its own slice's tokens only: the group's gradients add up to the loss's.
        local = sum(int(mb.loss_mask.sum()) if cfg.agg == "token" else int((mb.loss_mask.sum(1) > 0).sum())
                    for mb in mbs) if model_lib.counts() else 0
        denom = model_lib.all_sum({"n": local})["n"]
        opt.zero_grad(set_to_none=True)
        finite = True
        for i, mb in enumerate(mbs):  # (bf16 outside FSDP: the masters add up and reduce the gradients in fp32)
            with model_lib.grad_sync(policy, last=i == len(mbs) - 1 and masters is None):
                logprobs, _ = policy(mb, cfg.temperature)
                loss, loss_metrics = policy_loss(
                    logprobs, mb.old, mb.adv, mb.loss_mask, pg_mask=mb.pg_mask, eps_low=cfg.eps_low,
                    eps_high=cfg.eps_high, clip_ratio_c=cfg.clip_ratio_c, ref_logprobs=mb.ref, kl_coef=cfg.kl_coef,
                    agg=cfg.agg, denom=denom, tis_cap=cfg.tis_cap or None, behaviour_logprobs=mb.behaviour)
                (loss * model_lib.world()).backward()
            if masters is not None:
                masters.take_grads()
            finite &= bool(torch.isfinite(loss))
            ratio = loss_metrics.pop("ratio/max")
            for k in loss_metrics:  # every rank sums the same keys in update(), whatever it trained on
                totals.setdefault(k, 0.0)
            if mb.empty or not model_lib.counts():
                continue
            # policy_loss's metrics are means over this micro-batch's pg_mask tokens (the KL: loss_mask tokens);
            # weighted by those counts here, update() divides them by the step's counts (prepare's)
            ratio_max = max(ratio_max, ratio)  # a max, not a mean
            for k, v in loss_metrics.items():  # the loss already carries the global denominator: it adds up
                weight = 1 if k == "loss/policy" else (mb.loss_mask if k == "loss/kl" else mb.pg_mask).sum().item()
                totals[k] += v * weight
        if masters is not None:
            masters.reduce_grads()
        grad_norm = model_lib.full_tensor(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        if not (model_lib.all_true(finite) and torch.isfinite(grad_norm)):
            opt.zero_grad(set_to_none=True)
            skipped += 1
            continue
        opt.step()
        sched.step()
        if masters is not None:
            masters.copy_to_model()
    opt.zero_grad(set_to_none=True)  # no gradient outlives the update (a colocated engine wakes into that memory)
    return totals, ratio_max, skipped, grad_norm


KL_HISTORY = 10  # steps whose engine/trainer KL the jump check compares with (their median)
# ... and the least median it compares with: over a few hundred tokens a step bf16 noise swings from 1e-7 to
# 4e-5 (the tiny model: 246x between two healthy steps), so a jump is measured from at least this
KL_FLOOR = 5e-5


def engine_gap_check(kl: float, diff_max: float, cfg, recent: list) -> None:
    """A rollout engine that disagrees with the trainer about the tokens the very same weights sampled is stale
    (a weight sync that did not land) or wrong (weights, kernels), and every sample it makes trains on
    garbage: stop before the update, or warn. The statistic is the mean per-token KL between them, not the
    largest gap: bf16 engines and trainers differ by noise whose largest value grows with the tokens compared
    (3.5 nats have been reported on a MoE model) while its mean stays put. Its noise level depends on the
    model and the dtype (fp32 ~1e-12, the tiny model in bf16 ~3e-5, reports on 8-30B models in bf16 ~1e-3), so
    two tests: past --engine-kl-jump times the median of the last KL_HISTORY steps, or KL_FLOOR when that is
    less (an engine that stopped following the trainer; a fresh run has no history, and its first rollout
    comes from the weights both loaded), or past --max-engine-kl whatever the history. `recent` is that history;
    this step's value joins it."""
    baseline = max(sorted(recent)[len(recent) // 2], KL_FLOOR) if recent else None
    why = None
    if cfg.max_engine_kl and kl > cfg.max_engine_kl:
        why = f"past --max-engine-kl {cfg.max_engine_kl}: its weights or kernels are wrong"
    elif cfg.engine_kl_jump and baseline and kl > cfg.engine_kl_jump * baseline:
        why = (f"{kl / baseline:.0f}x the median of the last {len(recent)} steps (at least {KL_FLOOR:g}: "
               f"{baseline:.3g}), past --engine-kl-jump {cfg.engine_kl_jump}: the engine is stale (a weight sync "
               f"that did not land?)")
    recent[:] = (recent + [kl])[-KL_HISTORY:]
    if why is None:
        return
    message = (f"the rollout engine and the trainer disagree on the tokens the current weights sampled: mean KL "
               f"{kl:.3g} per token (rollout/engine_kl; largest log-prob gap {diff_max:.3g} nats), {why}")
    if cfg.on_engine_kl == "stop":
        raise RuntimeError(message + "; stopping before the update (--on-engine-kl warn trains on)")
    if model_lib.rank() == 0:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def update(policy, ref, opt, sched, groups: list[list], version: int, pad_id: int, cfg, masters=None,
           recent_kl: list | None = None, probe=None) -> dict:
    """Steps 5-6 on a batch of complete, informative groups (the same batch on every rank); `version` is the
    policy version of the current weights. `policy` and `ref` are model.wrap()ped: they map a micro-batch to
    response log-probs and entropy. `cfg` is config.py's Config; `masters`: optimize's; `recent_kl`: the
    engine/trainer KL history (RunState.engine_kl); `probe`: a function every rank calls once its pass over the
    batch is done, returning the same samples on each (or None): ones the engine decoded with the current weights
    for the engine/trainer gap check alone (--overlap, where no trained token came from them), never trained.
    Returns the step's training metrics."""
    samples = [s for g in groups for s in g]
    minis = plan_micro_batches(samples, sample_advantages(groups), pad_id, cfg)
    stats, diff_max, gap_hist, top = prepare(policy, ref, minis, version, cfg)
    if probe is not None and (probes := probe()):  # their log-probs beside the engine's: only the gap's sums kept
        extra, extra_max, extra_hist, extra_top = prepare(
            policy, None, plan_micro_batches(probes, torch.zeros(len(probes)), pad_id, cfg), version, cfg)
        for k in ("diff_sum", "diff_n", "kl_sum", "route_differ", "route_compared"):
            stats[k] += extra[k]
        diff_max, gap_hist, top = max(diff_max, extra_max), gap_hist + extra_hist, top + extra_top
    stats, diff_max = model_lib.all_sum(stats), model_lib.all_max(diff_max)  # every rank's, before the check
    gap_hist = model_lib.all_sum_tensor(gap_hist)
    top = [x for rank_top in model_lib.gather_objects(top) for x in rank_top]
    engine_kl = trimmed_kl(stats["kl_sum"], stats["diff_n"], top)
    if engine_kl is not None:
        engine_gap_check(engine_kl, diff_max, cfg, [] if recent_kl is None else recent_kl)
    totals, ratio_max, skipped, grad_norm = optimize(policy, opt, sched, minis, cfg, masters)
    totals = model_lib.all_sum(totals)
    pg_tokens, loss_tokens = max(stats["pg_tokens"], 1), max(stats["loss_tokens"], 1)
    ratio_max = model_lib.all_max(ratio_max)
    out = {k: v / len(minis) if k == "loss/policy" else v / (loss_tokens if k == "loss/kl" else pg_tokens)
           for k, v in totals.items()}
    out["ratio/max"] = ratio_max
    out = {k: (v if math.isfinite(v) else None) for k, v in out.items()}  # JSON has no NaN
    out.update({"train/samples": len(samples), "train/lr": sched.get_last_lr()[0],
                "train/grad_norm": grad_norm.item() if torch.isfinite(grad_norm) else None,
                "train/optimizer_steps": len(minis) - skipped, "train/skipped_updates": skipped,
                "entropy/mean": stats["entropy"] / max(stats["tokens"], 1),
                # of the response tokens: dropped from the policy-gradient term by DMMPTs (still in the
                # denominator and the KL), and left out of the loss whole by --overlong filter
                "mpt/masked_frac": (stats["loss_tokens"] - stats["pg_tokens"]) / max(stats["tokens"], 1),
                "overlong/filtered_frac": 1 - stats["loss_tokens"] / max(stats["tokens"], 1),
                # unknown (null), not perfect, when no trained token came from the current weights
                "rollout/engine_kl": engine_kl,
                "rollout/logprob_diff_max": diff_max if stats["diff_n"] else None,
                "rollout/logprob_diff_mean": stats["diff_sum"] / stats["diff_n"] if stats["diff_n"] else None,
                "rollout/logprob_diff_p99": min(quantile(gap_hist, 0.99), diff_max) if stats["diff_n"] else None,
                **staleness(samples, version)})
    if cfg.routing_replay != "false":  # of the (token, layer) decisions these weights made in the engine
        out["rollout/routing_mismatch"] = stats["route_differ"] / stats["route_compared"] \
            if stats["route_compared"] else None
    return out


def count_bad_steps(record: dict, state: RunState, cfg, warn: bool = True) -> None:
    """Updates skipped for a NaN/inf loss or gradient are reported (`record` holds update()'s metrics);
    --max-bad-steps steps in a row without any applied update stop the run."""
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
    """The learning rate of optimizer update `update` (0, 1, ...) as a fraction of --lr: a linear warm-up over
    --warmup-steps updates, 1 until the last --lr-decay-steps RL steps (0: all after warm-up), and over those a
    cosine down to --lr-final at the run's last update. An RL step is ceil(train_groups x G / mini_batch)
    updates. (Warmup-stable-decay: most of the run learns at full speed, and the end is annealed.)"""
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


def reset_reference(policy_lm, ref_lm, opt, ref=None) -> None:
    """ProRL's reset: the reference becomes the current policy and AdamW forgets its moments (without a
    reference, --kl-coef 0, only the optimizer resets). `ref`: the reference as model.wrap()ped; under FSDP2
    its root keeps full (unsharded) parameters after a forward with no backward, so it is resharded first,
    to match the policy's shards."""
    if ref_lm is not None:
        if hasattr(ref, "reshard"):
            ref.reshard()
        with torch.no_grad():
            for (name, p), (ref_name, r) in zip(policy_lm.named_parameters(), ref_lm.named_parameters()):
                assert name == ref_name, (name, ref_name)
                r.copy_(p)
    opt.state.clear()
