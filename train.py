"""ulorl's entry point: RL with verifiable rewards on ultra-long outputs (UloRL + ProRL's KL control).

    python train.py                                   # tiny built-in model + task, CPU, a few minutes
    python train.py --preset ulorl --model Qwen/Qwen3-4B --data dapo.parquet --out runs/q4b
    python train.py --help                            # every knob, with the paper it comes from
    torchrun --standalone --nproc-per-node 2 train.py --parallel fsdp   # trainer ranks: FSDP2 (or ddp)

Under torchrun every process is a trainer rank; rank 0 also owns the rollout engine, the pools and the logs
and hands each rank the step's batch (see `Parallel`).

One step, in paper order (ulorl.py maps every paper component to its function):
  1-4. rollout: unfinished samples + new prompts x G decode at most one segment; finished samples are
       rewarded; complete groups that are not all-equal wait for training (dynamic sampling); repeat
       until `--train-groups` of them are ready
  5.   old log-probs (POIS recomputes them), reference log-probs (KL), entropy and the DMMPT mask
  6.   update: clipped token-level loss, one global token count per optimizer step
  7.   sync the new weights to the engine
  8.   log one line + metrics.jsonl; evaluate; checkpoint
"""
import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import data
import model as model_lib
import reward
import tiny
import ulorl
from engine import Sampling, engine_kind, make_engine
from loss import mpt_mask, policy_loss
from segment_rollout import Pools, Sample, rollout_step


def flag(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # run
    preset: str = flag("tiny", "tiny (built-in default), ulorl or prorl: the papers' settings (SPEC section 6)")
    model: str = flag(tiny.CKPT, "hub name or local HF directory of the policy")
    data: str = flag("tiny", "training prompts: 'tiny', a .jsonl/.json/.parquet file, a saved dataset, a hub name, "
                             "rg:NAME[:SIZE] (Reasoning Gym), or a mixture 'a.jsonl@0.7,rg:chain_sum@0.3'")
    eval_data: str = flag("tiny", "held-out prompts for --eval-every (same formats as --data); '' = none")
    prompt_key: str = flag("prompt", "column holding the prompt (dotted paths reach nested columns)")
    answer_key: str = flag("answer", "column holding the reference answer")
    steps: int = flag(150, "training steps (one update phase each)")
    out: str = flag("runs/tiny", "output directory: metrics.jsonl, samples.jsonl, step_NNNNNN/ checkpoints")
    resume: str = flag("", "checkpoint directory to continue from, or 'auto' for the newest in --out")
    seed: int = flag(0, "seed for data order, sampling and init")
    engine: str = flag("auto", "rollout engine: hf (transformers), vllm, or auto (vLLM when installed and on GPU; "
                               "else hf)")
    dtype: str = flag("float32", "float32, bfloat16 or float16 for the trainer's weights")
    device: str = flag("cpu", "torch device of the trainer")
    parallel: str = flag("fsdp", "under torchrun: fsdp (FSDP2: each decoder layer, then the root, sharded over "
                                 "the trainer ranks) or ddp (a full copy per rank)")
    rollout_gpus: str = flag("", "GPUs for the rollout engine, e.g. '6,7' (empty: colocated with training)")
    rollout_mem: float = flag(0.25, "vLLM memory: on GPU the fraction of GPU memory it may take, on CPU GiB of KV cache")
    rope_scaling_factor: float = flag(0.0, "YaRN rope scaling factor for trainer and engine alike; 0 = off "
                                             "(UloRL 1.5; a model saved with YaRN in its config needs none)")
    rope_original_max_positions: int = flag(0, "YaRN original_max_position_embeddings; the model then takes "
                                               "factor x this positions (UloRL 95232 -> 142848); 0 = the config's")
    # rollout (UloRL 3.1)
    group_size: int = flag(8, "G responses per prompt (UloRL 8, ProRL 16)")
    prompts_per_step: int = flag(16, "rollout batch in prompts: unfinished samples + new groups fill "
                                     "prompts_per_step x G slots (UloRL 128, ProRL 256)")
    segments: int = flag(4, "segments per response: each step decodes at most max_response_len / segments "
                            "new tokens per sample (UloRL 8 x 16k)")
    max_response_len: int = flag(64, "global cap on response tokens; reaching it truncates (UloRL 128k)")
    max_prompt_len: int = flag(64, "longer prompts are skipped (and counted)")
    temperature: float = flag(1.0, "sampling temperature (UloRL 0.85, ProRL 1.2)")
    top_p: float = flag(1.0, "nucleus sampling for rollouts (both papers 1.0)")
    top_k: int = flag(-1, "top-k for rollouts, -1 = off (both papers)")
    # batch and optimizer
    train_groups: int = flag(16, "train once this many informative complete groups are ready")
    mini_batch: int = flag(0, "samples per optimizer step; 0 = the whole batch, one update per step "
                              "(UloRL 1024 = 128 x 8; ProRL 64 prompts x 16)")
    max_tokens_per_micro_batch: int = flag(4096, "tokens per forward/backward micro-batch: one packed row, "
                                                 "or rows x longest with --pack false; a longer sample goes alone")
    pack: bool = flag(False, "pack micro-batches: sequences back to back in one row, positions restarting, no "
                             "attention across them; same loss as padding. Pays off with --attn-implementation "
                             "flash_attention_2; with sdpa/eager the row gets a dense [L, L] mask (slower on CPU)")
    attn_implementation: str = flag("sdpa", "the trainer's attention kernel: sdpa, eager, or flash_attention_2 "
                                            "(GPU, needs the flash-attn package; the one for --pack)")
    gradient_checkpointing: bool = flag(False, "recompute each decoder layer in the backward: less activation "
                                               "memory for long sequences, ~1/3 more compute")
    lr: float = flag(3e-4, "AdamW learning rate, constant after warm-up (UloRL 1e-6, ProRL 2e-6)")
    warmup_steps: int = flag(0, "linear learning-rate warm-up")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    grad_clip: float = flag(1.0, "max gradient norm")
    # loss (SPEC sections 1 and 4)
    eps_low: float = flag(0.2, "lower clip range: ratio >= 1 - eps_low (both papers 0.2)")
    eps_high: float = flag(0.2, "upper clip range: ratio <= 1 + eps_high (UloRL 0.2, ProRL 0.4)")
    agg: str = flag("token", "token: DAPO's token-level mean; sample: GRPO's per-response mean")
    is_mode: str = flag("pois", "importance sampling under segment rollout: tois, sais or pois (UloRL 3.1)")
    mpt: str = flag("dynamic", "masking of well-mastered positive tokens: dynamic (DMMPTs), static, off")
    mpt_tau: float = flag(0.99, "probability at which a positive sample's token counts as mastered (UloRL)")
    mpt_sigma: float = flag(0.2, "target entropy: mask MPTs only while a sample's mean entropy is below it (UloRL)")
    tis_cap: float = flag(0.0, "truncated importance sampling: weight each token's loss by min(pi_old / "
                                "pi_engine, cap) to correct the engine/trainer mismatch; 0 = off")
    dynamic_sampling: bool = flag(True, "drop groups whose rewards are all equal (DAPO, both papers)")
    kl_coef: float = flag(0.0, "k3 KL penalty to a reference policy (UloRL 0, ProRL 1e-4)")
    ref_reset_every: int = flag(0, "every N steps reset the reference to the policy AND the optimizer "
                                   "state (ProRL); 0 = never")
    # reward (SPEC section 5)
    overlong: str = flag("zero", "truncated samples: zero (UloRL), soft (DAPO punishment), filter (no loss), none")
    overlong_buffer: int = flag(0, "soft punishment ramps over the last N tokens before the cap")
    reward_timeout: float = flag(5.0, "seconds per reward check; a check that takes longer scores 0")
    default_verifier: str = flag("math", "verifier of file rows without a 'verifier' field: math (last \\boxed{}, "
                                         "else the last number), math_boxed (\\boxed{} only), code, ifeval, rg, tiny")
    verifier_model: str = flag("", "generative verifier (UloRL 3.3): hub name or local HF directory of the judge "
                                   "model for math rows; '' = rule-based only")
    verifier_mode: str = flag("second_opinion", "with --verifier-model: second_opinion (ask the judge when the "
                                                "rule-based check says 0), alone (the judge decides), off")
    verifier_max_tokens: int = flag(64, "tokens the judge may write before its yes/no (thinking models need more)")
    # evaluation, logging, checkpoints
    eval_every: int = flag(25, "evaluate on --eval-data every N steps (also before step 1 and after the last)")
    eval_n: int = flag(512, "held-out prompts per evaluation (one sample each)")
    save_every: int = flag(0, "checkpoint every N steps (0: only at the end, or on SIGTERM / Ctrl-C)")
    keep_last: int = flag(3, "keep the newest N checkpoints (0: all)")
    max_bad_steps: int = flag(3, "stop after this many updates in a row skipped for a NaN/inf loss or gradient")
    dump_samples: int = flag(256, "samples.jsonl records per step (0: none)")


PRESETS = {
    "tiny": {},
    "ulorl": dict(model="Qwen/Qwen3-30B-A3B", dtype="bfloat16", device="cuda", group_size=8, prompts_per_step=128,
                  segments=8, max_response_len=131072, max_prompt_len=2048, temperature=0.85, train_groups=128,
                  mini_batch=1024, lr=1e-6, eps_low=0.2, eps_high=0.2, is_mode="pois", mpt="dynamic",
                  mpt_tau=0.99, mpt_sigma=0.2, kl_coef=0.0, overlong="zero", max_tokens_per_micro_batch=65536,
                  gradient_checkpointing=True, rope_scaling_factor=1.5, rope_original_max_positions=95232,
                  eval_every=10, eval_n=30, save_every=10, dump_samples=16, data="", eval_data=""),
    "prorl": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", dtype="bfloat16", device="cuda",
                  group_size=16, prompts_per_step=256, segments=1, max_response_len=8192, max_prompt_len=2048,
                  temperature=1.2, train_groups=256, mini_batch=1024, lr=2e-6, eps_low=0.2, eps_high=0.4,
                  mpt="off", kl_coef=1e-4, ref_reset_every=500, overlong="zero",
                  max_tokens_per_micro_batch=32768, gradient_checkpointing=True, eval_every=50, eval_n=256,
                  save_every=50, dump_samples=16, data="", eval_data=""),
}


def parse_config(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        kind = {bool: lambda s: s.lower() in ("1", "true", "yes")}.get(f.type, f.type)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"])
    args = p.parse_args(argv)
    if args.preset not in PRESETS:
        p.error(f"--preset {args.preset}: choose from {', '.join(PRESETS)}")
    p.set_defaults(**PRESETS[args.preset])  # preset values, then whatever the command line says
    cfg = Config(**vars(p.parse_args(argv)))
    if cfg.max_response_len % cfg.segments:
        p.error(f"--max-response-len {cfg.max_response_len} must be a multiple of --segments {cfg.segments}")
    if cfg.rollout_gpus:  # the flag is part of the interface; the engine on GPUs of its own is not built yet
        p.error("--rollout-gpus: running the engine on GPUs of its own (NCCL weight transfer) is not supported "
                "yet; leave it empty and the engine shares the trainer's device")
    return cfg


# ---------------------------------------------------------------------------------------- distributed

@dataclass
class Parallel:
    """Who this process is under torchrun, and the few collectives the loop needs (all no-ops in one
    process). Rank 0 owns the engine, the pools, the data and the logs; every rank trains on its share
    of each batch (train_on) and takes part in weight gathering and checkpoints."""
    rank: int = 0
    world: int = 1
    mode: str = "none"  # none (one process), ddp, fsdp
    device: str = "cpu"  # where collectives' tensors live: cpu for gloo, the rank's GPU for nccl

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def sum(self, values: dict) -> dict:
        """Each key summed over ranks (float64)."""
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def max(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def all(self, flag: bool) -> bool:
        return self.max(-float(flag)) == -1.0  # all true <=> max(-flag) == -1

    def broadcast(self, obj):
        """Rank 0's object on every rank (pickled; used for the batch of samples and the stop flag)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=torch.device(self.device))
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def grad_sync(self, policy, last: bool):
        """Reduce gradients only in the backward of an optimizer step's last micro-batch."""
        if self.mode == "ddp" and not last:
            return policy.no_sync()
        if self.mode == "fsdp":
            policy.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def local(self, obj):
        """An optimizer state dict with each sharded (DTensor) value replaced by this rank's shard."""
        if isinstance(obj, DTensor):
            return obj.to_local()
        if isinstance(obj, dict):
            return {k: self.local(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.local(v) for v in obj]
        return obj

    def load_optimizer(self, opt, saved: dict) -> None:
        """Inverse of local(): this rank's shards become DTensors shaped like their parameters again."""
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, st in saved["state"].items():
            p = params[int(i)]
            if isinstance(p, DTensor):
                for k, v in st.items():
                    if k != "step" and torch.is_tensor(v) and v.shape == p.to_local().shape:
                        st[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        opt.load_state_dict(saved)


def setup_parallel(cfg: Config) -> Parallel:
    """One process, or torchrun's trainer ranks: gloo on CPU, NCCL on GPU (one GPU per rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Parallel()
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(cfg.device)
    dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
    return Parallel(dist.get_rank(), world, cfg.parallel, cfg.device)


# ---------------------------------------------------------------------------------------------- data

def load_prompts(spec: str, cfg: Config, eval_set: bool = False) -> list[dict]:
    """Rows of --data / --eval-data: one source or a weighted mixture ("a.jsonl@0.7,rg:chain_sum@0.3");
    every row keeps its own verifier."""
    sources = []
    for source, weight in data.parse_mixture(spec):
        if source == "tiny":  # the built-in task: a fixed training draw and a separate held-out draw
            rows = tiny.held_out_rows(cfg.eval_n, cfg.seed) if eval_set else tiny.make_rows(100_000, cfg.seed)
        elif source.startswith("rg:"):  # generated here; the held-out draw uses another seed
            rows = data.rg_rows(source, cfg.seed + 1_000_003 if eval_set else cfg.seed,
                                size=cfg.eval_n if eval_set else 1000)
        else:
            rows = data.load_rows(source, cfg.prompt_key, cfg.answer_key, default_verifier=cfg.default_verifier,
                                  split="test" if eval_set else "train")
        sources.append((rows, weight))
    rows = sources[0][0] if len(sources) == 1 else data.mix(sources, cfg.seed)
    return rows[:cfg.eval_n] if eval_set else rows


def draw_groups(rows, state, n_groups, tokenizer, pools: Pools, cfg: Config, metrics: dict) -> list[list[Sample]]:
    """The next n_groups prompts of the endless shuffled stream (data.draw_order), each as G samples."""
    groups, skipped = [], 0
    while len(groups) < n_groups:
        row = rows[data.draw_order(len(rows), cfg.seed, state["cursor"], 1)[0]]
        state["cursor"] += 1
        ids = data.encode_prompt(tokenizer, row["prompt"])
        if len(ids) > cfg.max_prompt_len:
            metrics["data/skipped_long_prompts"] = metrics.get("data/skipped_long_prompts", 0) + 1
            skipped += 1
            if skipped >= len(rows):  # a whole pass without a usable prompt: it would loop forever
                raise ValueError(f"--data {cfg.data}: every prompt is longer than --max-prompt-len "
                                 f"{cfg.max_prompt_len} tokens (e.g. {len(ids)}, {row.get('where', '')}); "
                                 f"raise --max-prompt-len")
            continue
        groups.append(pools.new_group(ids, row, cfg.group_size))
    return groups


_JUDGES: dict = {}  # --verifier-model -> (engine, tokenizer): the judge, loaded on first use


def score(samples: list[Sample], tokenizer, cfg: Config) -> dict:
    """Reward every sample: the verifier's score (and the judge's, with --verifier-model), then the overlong
    rule for truncated samples."""
    texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
    items = [(s.row["verifier"], t, s.row["answer"]) for s, t in zip(samples, texts)]
    rewards, metrics = reward.score_batch(items, timeout=cfg.reward_timeout)
    if cfg.verifier_model and cfg.verifier_mode != "off" and samples:
        if cfg.verifier_model not in _JUDGES:  # the transformers engine on --device, greedy
            judge_model, judge_tok = model_lib.load(cfg.verifier_model, cfg.dtype, cfg.device)
            _JUDGES[cfg.verifier_model] = (make_engine("hf", judge_model.eval(), judge_tok, cfg.seed), judge_tok)
        judge_engine, judge_tok = _JUDGES[cfg.verifier_model]
        rewards, metrics["reward/judge_calls"] = reward.judge_rewards(
            judge_engine, judge_tok, [s.row for s in samples], texts, rewards, cfg.verifier_mode,
            cfg.verifier_max_tokens)
    for s, r in zip(samples, rewards):
        s.reward = reward.overlong_reward(r, len(s.tokens), s.finish == "truncated", cfg.max_response_len,
                                          "none" if cfg.overlong == "filter" else cfg.overlong, cfg.overlong_buffer)
    return metrics


@torch.no_grad()
def evaluate(engine, tokenizer, rows: list[dict], cfg: Config) -> dict:
    """avg@1 on the held-out prompts, sampled like the training rollouts, in one segment of the full length."""
    samples = [Sample(i, i, data.encode_prompt(tokenizer, r["prompt"]), r) for i, r in enumerate(rows)]
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    for i in tqdm(range(0, len(samples), 256), desc="eval", leave=False, disable=len(samples) <= 256):
        chunk = samples[i:i + 256]
        gens = engine.generate([s.prompt_ids for s in chunk], [cfg.max_response_len] * len(chunk), sampling,
                               keys=[-1 - s.uid for s in chunk])  # the same draws at every evaluation
        for s, g in zip(chunk, gens):
            s.tokens, s.finish = g.tokens, "eos" if g.finish == "stop" else "truncated"
    metrics = score(samples, tokenizer, cfg)
    return {"eval/accuracy": sum(s.reward > 0 for s in samples) / len(samples),
            "eval/reward": sum(s.reward for s in samples) / len(samples),
            "eval/mean_length": sum(len(s.tokens) for s in samples) / len(samples),
            "eval/truncation_rate": sum(s.finish == "truncated" for s in samples) / len(samples),
            "eval/reward_timeouts": metrics["reward/timeouts"]}


# ------------------------------------------------------------------------------------------- update

def train_on(policy, ref, opt, sched, groups: list[list[Sample]], version: int, pad_id: int, cfg: Config,
             dp: "Parallel | None" = None) -> dict:
    """Steps 5-6 on a batch of complete, informative groups (the same batch on every rank). `policy` and
    `ref` are model.wrap()ed: they map a micro-batch to response log-probs and entropy. Returns metrics."""
    dp = dp or Parallel()
    samples = [s for g in groups for s in g]
    adv = ulorl.sample_advantages(groups)  # [n_samples]
    # mini-batches are optimizer steps (whole groups, in order); micro-batches are forward/backward calls.
    # Under torchrun each rank takes a share of every mini-batch (balanced by tokens); a rank with fewer
    # micro-batches than another runs empty ones (None), so that every rank's collectives line up.
    per_mini = len(samples) if cfg.mini_batch <= 0 else cfg.mini_batch
    minis = []
    for lo in range(0, len(samples), per_mini):
        idx = list(range(lo, min(lo + per_mini, len(samples))))
        mine = ulorl.rank_share([len(samples[i].prompt_ids) + len(samples[i].tokens) for i in idx],
                                dp.rank, dp.world)
        mine = [idx[j] for j in mine]
        mbs = ulorl.micro_batches([samples[i] for i in mine], cfg.max_tokens_per_micro_batch, cfg.pack)
        mbs = [[mine[j] for j in mb] for mb in mbs]
        minis.append(mbs + [None] * (int(dp.max(len(mbs))) - len(mbs)))

    def collate(idx):
        if idx is None:  # an empty micro-batch: a real sample's shapes, no token kept, no statistics
            mb = ulorl.collate([samples[0]], pad_id, cfg.device, cfg.pack)
            mb["adv"] = torch.zeros(1, device=cfg.device)
            mb["empty"] = True
            return mb
        mb = ulorl.collate([samples[i] for i in idx], pad_id, cfg.device, cfg.pack)
        mb["adv"] = adv[idx].to(cfg.device)
        mb["empty"] = False
        return mb

    # 5. one no-grad pass with the weights that will be updated: current log-probs (pi_old under POIS, and
    # the gap to the engine's behaviour log-probs), entropy for DMMPTs, reference log-probs for the KL
    batches, stats = [], {"entropy": 0.0, "tokens": 0, "kept": 0, "diff_sum": 0.0, "diff_n": 0}
    diff_max = 0.0
    with torch.no_grad():
        for mini in minis:
            mbs = []
            for idx in mini:
                mb = collate(idx)
                cur, entropy = policy(mb, cfg.temperature)
                mb["old"] = ulorl.old_logprobs(cfg.is_mode, cur, mb["behaviour"])
                if ref is not None:
                    mb["ref"] = ref(mb, cfg.temperature)[0]
                keep = mb["resp_mask"].clone() & (not mb["empty"])
                if cfg.mpt != "off":
                    sigma = cfg.mpt_sigma if cfg.mpt == "dynamic" else math.inf
                    keep &= mpt_mask(cur, entropy, mb["rewards"], mb["resp_mask"], cfg.mpt_tau, sigma)
                if cfg.overlong == "filter":
                    keep &= ~mb["truncated"][:, None]
                mb["keep"] = keep
                mbs.append(mb)
                if mb["empty"]:
                    continue
                fresh = mb["versions"] == version  # tokens sampled by exactly these weights
                gap = (cur - mb["behaviour"]).abs()[fresh]
                stats["entropy"] += entropy[mb["resp_mask"]].sum().item()
                stats["tokens"] += int(mb["resp_mask"].sum())
                stats["kept"] += int(keep.sum())
                if gap.numel():
                    diff_max = max(diff_max, gap.max().item())
                    stats["diff_sum"] += gap.sum().item()
                    stats["diff_n"] += gap.numel()
            batches.append(mbs)

    # 6. update: each mini-batch is one optimizer step
    policy.train()
    totals: dict = {}
    skipped, grad_norm, ratio_max = 0, torch.tensor(float("nan")), 0.0
    for mbs in batches:
        # The one place that decides what the loss averages over: the kept response tokens (after DMMPTs and
        # overlong filtering) of *all* micro-batches of this optimizer step on all ranks (samples, for
        # agg="sample"). DDP and FSDP average gradients over ranks; scaling by the world size makes it a sum.
        local = sum(int(mb["keep"].sum()) if cfg.agg == "token" else int((mb["keep"].sum(1) > 0).sum())
                    for mb in mbs)
        denom = dp.sum({"n": local})["n"]
        opt.zero_grad(set_to_none=True)
        finite = True
        for i, mb in enumerate(mbs):
            with dp.grad_sync(policy, last=i == len(mbs) - 1):
                logprobs, _ = policy(mb, cfg.temperature)
                loss, m = policy_loss(logprobs, mb["old"], mb["adv"], mb["keep"], cfg.eps_low, cfg.eps_high,
                                      mb.get("ref"), cfg.kl_coef, cfg.agg, denom, cfg.tis_cap or None,
                                      mb["behaviour"])
                (loss * dp.world).backward()
            finite &= bool(torch.isfinite(loss))
            if mb["empty"]:
                continue
            w = int(mb["keep"].sum())
            ratio_max = max(ratio_max, m.pop("ratio/max"))  # a max, not a mean
            for k, v in m.items():  # the loss already carries the global denominator: it adds up
                totals[k] = totals.get(k, 0.0) + (v if k == "loss/policy" else v * w)
            totals["_w"] = totals.get("_w", 0) + w
        grad_norm = dp.full(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip))
        if not (dp.all(finite) and torch.isfinite(grad_norm)):  # a NaN/inf loss or gradient: skip, never apply
            opt.zero_grad(set_to_none=True)
            skipped += 1
            continue
        opt.step()
        sched.step()
    totals = dp.sum({**totals, **stats})
    stats = {k: totals.pop(k) for k in list(stats)}
    w, ratio_max, diff_max = max(totals.pop("_w", 0), 1), dp.max(ratio_max), dp.max(diff_max)
    out = {k: (v / len(batches) if k == "loss/policy" else v / w) for k, v in totals.items()}
    out["ratio/max"] = ratio_max
    out = {k: (v if math.isfinite(v) else None) for k, v in out.items()}  # JSON has no NaN
    out.update({"train/samples": len(samples), "train/lr": sched.get_last_lr()[0],
                "train/grad_norm": grad_norm.item() if torch.isfinite(grad_norm) else None,
                "train/optimizer_steps": len(batches) - skipped, "train/skipped_updates": skipped,
                "entropy/mean": stats["entropy"] / max(stats["tokens"], 1),
                "mpt/masked_frac": 1 - stats["kept"] / max(stats["tokens"], 1),
                "rollout/logprob_diff_max": diff_max,
                "rollout/logprob_diff_mean": stats["diff_sum"] / max(stats["diff_n"], 1)})
    return out


def reset_reference(policy_lm, ref_lm, opt, ref=None) -> None:
    """ProRL's reset: the reference becomes the current policy and AdamW forgets its moments. `ref`: the
    reference as model.wrap()ped; under FSDP2 its root keeps full (unsharded) parameters after a forward
    with no backward, so it is resharded first, to match the policy's shards."""
    if hasattr(ref, "reshard"):
        ref.reshard()
    with torch.no_grad():
        for (name, p), (ref_name, r) in zip(policy_lm.named_parameters(), ref_lm.named_parameters()):
            assert name == ref_name, (name, ref_name)
            r.copy_(p)
    opt.state.clear()


# -------------------------------------------------------------------------------------- checkpoints

def sample_to_dict(s: Sample) -> dict:
    return dataclasses.asdict(s)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(path: str, lm, ref_lm, tokenizer, opt, sched, engine, pools: Pools, state: dict, cfg: Config,
                    dp: "Parallel | None" = None):
    """Everything a run needs to continue bit for bit: HF weights (safetensors, gathered parameter by
    parameter from the shards), the reference, each rank's optimizer and scheduler state, the unfinished /
    experience pools and ready groups, the RNG streams, the data cursor. Written to `path.tmp`, fsynced,
    described by manifest.json (size and sha256 of every file), then renamed: a crash leaves either the old
    state or the new one, and a damaged checkpoint is detected on resume. Every rank calls this."""
    dp = dp or Parallel()
    tmp = path + ".tmp"
    if dp.lead:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dp.barrier()
    for model, sub in ((lm, ""), (ref_lm, "reference")):
        if model is not None:
            weights = model_lib.full_weights(model)  # every rank gathers, rank 0 writes
            if dp.lead:
                model_lib.save_weights(model, weights, tokenizer, os.path.join(tmp, sub))
            else:
                for _ in weights:
                    pass
    rank_file = os.path.join(tmp, f"trainer_state_rank{dp.rank}.pt")
    torch.save({"optimizer": dp.local(opt.state_dict()), "scheduler": sched.state_dict(),
                "engine_rng": engine.rng_state() if engine is not None else None,
                "torch_rng": torch.get_rng_state()}, rank_file)
    dp.barrier()
    if dp.lead:
        pool_state = {"unfinished": [sample_to_dict(s) for s in pools.unfinished],
                      "finished": [sample_to_dict(s) for g in pools.finished.values() for s in g],
                      "ready": [[sample_to_dict(s) for s in g] for g in state["ready"]],
                      "next_uid": pools.next_uid, "next_group": pools.next_group}
        with open(os.path.join(tmp, "ulorl_state.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "git": git_hash(), "step": state["step"],
                       "version": state["version"], "cursor": state["cursor"], "bad_steps": state["bad_steps"],
                       "world_size": dp.world, "python_rng": random.getstate(), "pools": pool_state}, f)
        files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, names in os.walk(tmp) for n in names)
        manifest = {f: {"size": os.path.getsize(os.path.join(tmp, f)), "sha256": file_digest(os.path.join(tmp, f))}
                    for f in files}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        for f in files + ["manifest.json"]:  # data on disk before the rename makes it visible
            fd = os.open(os.path.join(tmp, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        ckpts = list_checkpoints(cfg.out)
        for old in ckpts[:-cfg.keep_last] if cfg.keep_last > 0 else []:
            shutil.rmtree(os.path.join(cfg.out, old), ignore_errors=True)
    dp.barrier()


def list_checkpoints(out: str) -> list[str]:
    """step_NNNNNN directories in `out`, oldest first (unfinished `.tmp` writes excluded)."""
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out) if d.startswith("step_") and not d.endswith(".tmp"))


def checkpoint_problem(path: str) -> str | None:
    """Why a checkpoint cannot be trusted (missing manifest, missing, resized or altered file), or None."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable manifest.json ({e})"
    for name, want in manifest.items():
        p = os.path.join(path, name)
        if not os.path.exists(p):
            return f"{name} is missing"
        if os.path.getsize(p) != want["size"]:
            return f"{name} has {os.path.getsize(p)} bytes, the manifest says {want['size']}"
        if file_digest(p) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def find_resume(cfg: Config) -> str | None:
    """--resume DIR, or for 'auto' the newest checkpoint in --out that passes its manifest check."""
    if cfg.resume != "auto":
        if cfg.resume and (problem := checkpoint_problem(cfg.resume)):
            raise ValueError(f"--resume {cfg.resume}: {problem}")
        return cfg.resume or None
    for name in reversed(list_checkpoints(cfg.out)):
        problem = checkpoint_problem(os.path.join(cfg.out, name))
        if problem is None:
            return os.path.join(cfg.out, name)
        print(f"warning: skipping checkpoint {os.path.join(cfg.out, name)}: {problem}", file=sys.stderr, flush=True)
    return None


def load_checkpoint(path: str, opt, sched, engine, pools: Pools, state: dict, dp: "Parallel | None" = None) -> None:
    """The state save_checkpoint wrote (the weights were loaded with the model); every rank reads its own
    optimizer state, so a sharded run resumes on the same number of ranks."""
    dp = dp or Parallel()
    with open(os.path.join(path, "ulorl_state.json")) as f:
        saved = json.load(f)
    if saved.get("world_size", 1) != dp.world:
        raise ValueError(f"--resume {path}: saved by {saved.get('world_size', 1)} trainer process(es), resumed "
                         f"with {dp.world}; run with --nproc-per-node {saved.get('world_size', 1)}")
    trainer = torch.load(os.path.join(path, f"trainer_state_rank{dp.rank}.pt"), weights_only=True)
    dp.load_optimizer(opt, trainer["optimizer"])
    sched.load_state_dict(trainer["scheduler"])
    if engine is not None:
        engine.set_rng_state(trainer["engine_rng"])
    torch.set_rng_state(trainer["torch_rng"])
    version, internal, gauss = saved["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    p = saved["pools"]
    pools.unfinished = [Sample(**d) for d in p["unfinished"]]
    for d in p["finished"]:
        pools.finished.setdefault(d["group"], []).append(Sample(**d))
    pools.next_uid, pools.next_group = p["next_uid"], p["next_group"]
    state.update(step=saved["step"], version=saved["version"], cursor=saved["cursor"], bad_steps=saved["bad_steps"],
                 ready=[[Sample(**d) for d in g] for g in p["ready"]])


# ----------------------------------------------------------------------------------------- logging

def git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def log_line(m: dict, cfg: Config, eta_s: float) -> str:
    acc = f" | eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    reward = "  -  " if m["reward/mean"] is None else f"{m['reward/mean']:.3f}"
    return (f"step {m['step']:5d} | reward {reward}{acc} | entropy {m['entropy/mean']:.3f} | "
            f"masked {m['mpt/masked_frac']:.3f} | unfinished {m['rollout/unfinished']:4d} | "
            f"tok/s {m['tokens/per_s']:7.0f} | {m['time/step_s']:.2f}s | eta {eta_s / 60:.1f}m")


def dump_samples(f, groups: list[list[Sample]], step: int, tokenizer, limit: int) -> None:
    samples = [s for g in groups for s in g][:limit]
    texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
    prompts = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=False)
    for s, text, prompt in zip(samples, texts, prompts):
        f.write(json.dumps({"step": step, "group": s.group, "uid": s.uid, "verifier": s.row.get("verifier"),
                            "prompt": prompt, "response": text, "n_tokens": len(s.tokens),
                            "versions": s.segment_versions(), "finish": s.finish, "reward": s.reward}) + "\n")
    f.flush()


# ------------------------------------------------------------------------------------------- main

def rollout_until_ready(engine, pools: Pools, rows, state: dict, tokenizer, sampling: Sampling, cfg: Config,
                        m: dict, on_engine_failure) -> list:
    """Steps 1-4: rollout rounds until `--train-groups` informative complete groups are ready (at least one
    round per step, so unfinished samples always advance). Returns every sample rewarded on the way."""
    segment_len = cfg.max_response_len // cfg.segments
    scored = []
    while m["rollout/rounds"] == 0 or len(state["ready"]) < cfg.train_groups:
        free = cfg.prompts_per_step * cfg.group_size - len(pools.unfinished)
        n_new = 0 if len(state["ready"]) >= cfg.train_groups else max(free // cfg.group_size, 0)
        new = draw_groups(rows, state, n_new, tokenizer, pools, cfg, m)
        try:
            r = rollout_step(engine, pools, new, segment_len, cfg.max_response_len, sampling, state["version"])
        except Exception as e:  # one retry; the new samples already wait in the unfinished pool
            print(f"warning: the rollout engine failed ({type(e).__name__}: {e}); retrying once",
                  file=sys.stderr, flush=True)
            try:
                r = rollout_step(engine, pools, [], segment_len, cfg.max_response_len, sampling, state["version"])
            except Exception:
                on_engine_failure()
                raise
        m["rollout/rounds"] += 1
        m["tokens/generated"] += r["tokens/generated"]
        m["rollout/unfinished"] = r["rollout/unfinished"]
        complete = [pools.pop_group(g[0].group) for g in pools.ready_groups(cfg.group_size)]
        for k, v in score([s for g in complete for s in g], tokenizer, cfg).items():
            m[k] = m.get(k, 0) + v
        scored += [s for g in complete for s in g]
        kept, dropped = ulorl.take_informative(complete, cfg.dynamic_sampling)
        state["ready"] += kept
        m["dynamic/dropped_groups"] += dropped
        if m["rollout/rounds"] > 100 * cfg.segments:
            raise RuntimeError(f"no informative group after {m['rollout/rounds']} rollouts: every group's "
                               f"rewards were all equal (mean reward {sum(s.reward for s in scored) / max(len(scored), 1):.3f}). "
                               f"The task is too easy or too hard for this model; try --dynamic-sampling false")
    return scored


def sync_weights(engine, lm, dp: Parallel) -> None:
    """Step 7, the one place new weights reach the engine: full parameters one at a time (gathered from
    the shards under FSDP; every rank takes part), handed to rank 0's engine."""
    weights = model_lib.full_weights(lm)
    if dp.lead:
        engine.update_weights(weights)
    else:
        for _ in weights:
            pass


def main(cfg: Config) -> None:
    dp = setup_parallel(cfg)
    if dp.lead:
        print(json.dumps(dataclasses.asdict(cfg)), flush=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + dp.rank)
    os.makedirs(cfg.out, exist_ok=True)
    resume_from = find_resume(cfg)
    # FSDP on GPU keeps fp32 master weights and computes in bf16 (model.wrap); elsewhere --dtype is the weights'
    mixed = dp.mode == "fsdp" and cfg.dtype == "bfloat16" and cfg.device.startswith("cuda")
    lm, tokenizer = model_lib.load(resume_from or cfg.model, "float32" if mixed else cfg.dtype, cfg.device,
                                   cfg.gradient_checkpointing, cfg.rope_scaling_factor,
                                   cfg.rope_original_max_positions, cfg.attn_implementation)
    ref_lm = None
    if cfg.kl_coef > 0:
        ref_path = os.path.join(resume_from, "reference") if resume_from else cfg.model
        ref_lm = model_lib.load(ref_path, "float32" if mixed else cfg.dtype, cfg.device, False,
                                cfg.rope_scaling_factor, cfg.rope_original_max_positions,
                                cfg.attn_implementation)[0].eval().requires_grad_(False)
    # In one process the transformers engine samples with the trainer's own module and vLLM runs in-process;
    # under torchrun the transformers engine samples with a copy on rank 0, and vLLM runs in a process of its
    # own (inside a trainer rank it would join torchrun's process group and wait for the others forever).
    kind = engine_kind(cfg.engine, cfg.device)
    engine = None
    if dp.lead:
        engine = make_engine(kind, lm if dp.world == 1 or kind != "hf" else copy.deepcopy(lm), tokenizer, cfg.seed,
                             path=resume_from or cfg.model,
                             max_model_len=min(cfg.max_prompt_len + cfg.max_response_len,
                                               lm.config.max_position_embeddings),
                             mem=cfg.rollout_mem, device=cfg.device, dtype=cfg.dtype,
                             hf_overrides=model_lib.yarn_overrides(lm.config, cfg.rope_scaling_factor,
                                                                   cfg.rope_original_max_positions),
                             own_process=dp.world > 1)
    policy = model_lib.wrap(lm, dp.mode, mixed_bf16=mixed)
    ref = model_lib.wrap(ref_lm, dp.mode, trainable=False, mixed_bf16=mixed) if ref_lm is not None else None
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    rows = load_prompts(cfg.data, cfg) if dp.lead else []
    eval_rows = load_prompts(cfg.eval_data, cfg, eval_set=True) if cfg.eval_data and dp.lead else []
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    pools, state = Pools(), {"step": 0, "version": 0, "cursor": 0, "ready": [], "bad_steps": 0}
    metrics_path, samples_path = os.path.join(cfg.out, "metrics.jsonl"), os.path.join(cfg.out, "samples.jsonl")

    def checkpoint(step: int) -> None:
        save_checkpoint(os.path.join(cfg.out, f"step_{step:06d}"), lm, ref_lm, tokenizer, opt, sched, engine,
                        pools, state, cfg, dp)

    if resume_from:
        load_checkpoint(resume_from, opt, sched, engine, pools, state, dp)
    if dp.lead and resume_from:
        print(f"resumed from {resume_from} at step {state['step']}", flush=True)
        for path in (metrics_path, samples_path):  # records written after the checkpoint are redone now
            if os.path.exists(path):
                with open(path) as f:
                    keep = [line for line in f if line.strip() and json.loads(line)["step"] <= state["step"]]
                with open(path, "w") as f:
                    f.writelines(keep)
    elif dp.lead:
        open(metrics_path, "w").close()
        open(samples_path, "w").close()
    metrics_file = open(metrics_path, "a") if dp.lead else None
    samples_file = open(samples_path, "a") if dp.lead else None

    def write_record(rec: dict) -> None:
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()

    if state["step"] == 0 and eval_rows:  # held-out accuracy before any update: step 0
        t0 = time.time()
        ev = evaluate(engine, tokenizer, eval_rows, cfg)
        print(f"step     0 | eval accuracy {ev['eval/accuracy']:.3f} (before training)", flush=True)
        write_record({"step": 0, "time/step_s": time.time() - t0, "reward/mean": None, "entropy/mean": None,
                      "mpt/masked_frac": None, "rollout/unfinished": 0, "tokens/generated": 0, **ev,
                      "git": git_hash(), "config": dataclasses.asdict(cfg)})

    # SIGTERM (schedulers, kill) and Ctrl-C finish the current step, save a checkpoint and exit; a second
    # Ctrl-C exits at once. Under torchrun rank 0's flag, sent with the batch, decides for every rank.
    stop_signal: list[str] = []

    def on_signal(signum, frame):
        if stop_signal and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop_signal.append(signal.Signals(signum).name)
        if dp.lead:
            print(f"\n{signal.Signals(signum).name}: finishing step {state['step'] + 1}, then saving a checkpoint",
                  file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_engine_failure():
        if dp.world > 1:  # a checkpoint needs every rank; the newest periodic one resumes exactly
            print("the rollout engine failed twice; resume from the newest checkpoint with --resume auto",
                  file=sys.stderr, flush=True)
            return
        checkpoint(state["step"])
        print(f"the rollout engine failed twice; saved a checkpoint of step {state['step']} in {cfg.out} "
              f"(resume with --resume auto)", file=sys.stderr, flush=True)

    step_times = []
    while state["step"] < cfg.steps:
        t0 = time.time()
        step = state["step"] + 1
        m: dict = {"reward/timeouts": 0, "reward/errors": 0, "rollout/rounds": 0, "tokens/generated": 0,
                   "dynamic/dropped_groups": 0, "rollout/unfinished": len(pools.unfinished)}
        groups, scored, t_roll = None, [], time.time()
        if dp.lead:  # 1-4. rollout until enough informative complete groups are ready
            scored = rollout_until_ready(engine, pools, rows, state, tokenizer, sampling, cfg, m, on_engine_failure)
            groups, state["ready"] = state["ready"][:cfg.train_groups], state["ready"][cfg.train_groups:]
        t_roll = time.time() - t_roll
        groups, stop_now = dp.broadcast((groups, stop_signal[0] if stop_signal else ""))

        # 5-6. old/reference log-probs, DMMPT mask, update (each rank its share)
        m.update(train_on(policy, ref, opt, sched, groups, state["version"], tokenizer.pad_token_id, cfg, dp))
        if m["train/skipped_updates"]:
            state["bad_steps"] = state["bad_steps"] + 1 if m["train/optimizer_steps"] == 0 else 0
            if dp.lead:
                print(f"warning: step {step}: skipped {m['train/skipped_updates']} update(s) with a NaN/inf loss "
                      f"or gradient ({state['bad_steps']} step(s) in a row)", file=sys.stderr, flush=True)
            if state["bad_steps"] >= cfg.max_bad_steps:
                raise RuntimeError(f"{state['bad_steps']} steps in a row had only NaN/inf losses or gradients; "
                                   f"stopping. Look at samples.jsonl for odd rewards; lower --lr; the newest "
                                   f"checkpoint in {cfg.out} holds the last good weights")
        else:
            state["bad_steps"] = 0
        if m["train/optimizer_steps"]:
            state["version"] += 1
        if cfg.ref_reset_every and step % cfg.ref_reset_every == 0 and ref_lm is not None:
            reset_reference(lm, ref_lm, opt, ref)
            m["train/ref_reset"] = 1

        # 7. the new weights reach the engine; unfinished samples continue under them
        if m["train/optimizer_steps"]:
            sync_weights(engine, lm, dp)
        state["step"] = step

        # 8. log, evaluate, checkpoint
        if dp.lead:
            trained = [s for g in groups for s in g]
            for v in sorted({s.row["verifier"] for s in scored}):  # per domain: one curve each in a mixture
                rs = [s.reward for s in scored if s.row["verifier"] == v]
                m[f"reward/by_verifier/{v}"] = sum(rs) / len(rs)
            m.update({"step": step, "reward/mean": sum(s.reward for s in scored) / len(scored) if scored else None,
                      "reward/trained_mean": sum(s.reward for s in trained) / len(trained),
                      "response/mean_len": sum(len(s.tokens) for s in trained) / len(trained),
                      "response/max_len": max(len(s.tokens) for s in trained),
                      "response/truncated_frac": sum(s.finish == "truncated" for s in trained) / len(trained),
                      "response/multi_segment_frac": sum(len(s.seg_starts) > 1 for s in trained) / len(trained),
                      "tokens/per_s": m["tokens/generated"] / max(t_roll, 1e-9), "time/rollout_s": t_roll})
            if eval_rows and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                m.update(evaluate(engine, tokenizer, eval_rows, cfg))
            if cfg.dump_samples:
                dump_samples(samples_file, groups, step, tokenizer, cfg.dump_samples)
            m["time/step_s"] = time.time() - t0
            step_times.append(m["time/step_s"])
            write_record(m)  # before the checkpoint: every record up to a checkpoint's step exists on resume
            print(log_line(m, cfg, sum(step_times) / len(step_times) * (cfg.steps - step)), flush=True)
        stop_now = stop_now or (stop_signal[0] if dp.world == 1 and stop_signal else "")
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop_now:
            checkpoint(step)
        if stop_now:
            if dp.lead:
                print(f"stopped by {stop_now} after step {step}; checkpoint saved (resume with --resume auto)",
                      flush=True)
            break
    if dp.lead:
        metrics_file.close()
        samples_file.close()
    if dp.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_config())
