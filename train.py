"""ulorl's entry point: RL with verifiable rewards on ultra-long outputs (UloRL + ProRL's KL control).

    python train.py                                   # tiny built-in model + task, CPU, a few minutes
    python train.py --preset ulorl --model Qwen/Qwen3-4B --data dapo.parquet --out runs/q4b
    python train.py --help                            # every knob, with the paper it comes from
    torchrun --standalone --nproc-per-node 2 train.py --parallel fsdp   # trainer ranks: FSDP2 (or ddp)

Owns the run: `Config` (every field a flag) and the presets, torchrun setup, the RL loop in paper order,
logging. Under torchrun every process is a trainer rank; rank 0 also owns the rollout engine, the pools,
the data and the logs, and hands every rank the step's batch.

One step, in paper order (ulorl.py maps every paper component to its function):
  1-4. rollout (segment_rollout.py): unfinished samples + new prompts x G decode at most one segment;
       finished samples are rewarded; complete groups that are not all-equal wait for training (dynamic
       sampling); repeat until `--train-groups` of them are ready
  5-6. ulorl.update: old log-probs (POIS recomputes them), reference log-probs (KL), entropy and the DMMPT
       mask; the clipped token-level loss (loss.py) with one global token count per optimizer step
  7.   sync the new weights to the engine
  8.   log one line + metrics.jsonl; evaluate; checkpoint
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import checkpoint
import data
import eval as eval_lib
import model as model_lib
import plan as plan_lib
import reward
import tiny
import ulorl
from engine import Sampling, engine_kind, make_engine
from segment_rollout import Pools, Sample, rollout_step
from ulorl import RunState


def flag(default, help, choices=None, ok=None):
    """A Config field: its --flag's default and help; `choices` (argparse's) or `ok`, a (test, what is allowed)
    pair that parse_config checks before anything loads."""
    return field(default=default, metadata={"help": help, "choices": choices, "ok": ok})


def at_least(lo):
    return lambda v: v >= lo, f"must be >= {lo}"


POSITIVE = (lambda v: v > 0, "must be > 0")
UNIT = (lambda v: 0 < v <= 1, "must be in (0, 1]")


def boolean(text: str) -> bool:
    """true/false, 1/0, yes/no (any case): anything else is refused, never read as false."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false (or 1/0, yes/no), got {text!r}")
    return value


@dataclass
class Config:
    # run
    preset: str = flag("tiny", "tiny (built-in default), ulorl or prorl: the papers' training settings",
                       choices=["tiny", "ulorl", "prorl"])
    model: str = flag(tiny.CKPT, "hub name or local HF directory of the policy")
    data: str = flag("tiny", "training prompts: 'tiny', a .jsonl/.json/.parquet file, a saved dataset, a hub name, "
                             "rg:NAME[:SIZE] (Reasoning Gym), or a mixture 'a.jsonl@0.7,rg:chain_sum@0.3'")
    eval_data: str = flag("tiny", "held-out prompts for --eval-every (same formats as --data); '' = none")
    prompt_key: str = flag("prompt", "column holding the prompt (dotted paths reach nested columns)")
    answer_key: str = flag("answer", "column holding the reference answer")
    steps: int = flag(150, "training steps (one update phase each)",
                      ok=at_least(1))
    out: str = flag("runs/tiny", "output directory: metrics.jsonl, samples.jsonl, step_NNNNNN/ checkpoints")
    resume: str = flag("", "checkpoint directory to continue from, or 'auto' for the newest in --out")
    overwrite: bool = flag(False, "start a new run in an --out that holds one: its metrics.jsonl, samples.jsonl and "
                                  "step_NNNNNN/ checkpoints are deleted first")
    seed: int = flag(0, "seed for data order, sampling and init")
    threads: int = flag(0, "CPU threads of torch; 0 = the cores idle when the run starts (on a small machine a busy "
                           "neighbour slows a thread pool that counts on every core 2-20x); OMP_NUM_THREADS wins",
                        ok=at_least(0))
    engine: str = flag("auto", "rollout engine: hf (transformers), vllm, or auto (vLLM when installed and on GPU; "
                               "else hf)",
                       choices=["auto", "hf", "vllm"])
    dtype: str = flag("float32", "float32, bfloat16 or float16 for the trainer's weights",
                      choices=["float32", "bfloat16", "float16"])
    device: str = flag("cpu", "torch device of the trainer")
    parallel: str = flag("fsdp", "under torchrun: fsdp (FSDP2: each decoder layer, then the root, sharded over "
                                 "the trainer ranks) or ddp (a full copy per rank)",
                         choices=["fsdp", "ddp"])
    rollout_gpus: str = flag("", "GPUs of the vLLM engine's own, e.g. '6,7', or a count taken from the last ones, "
                                 "e.g. '2'; torchrun's trainer ranks use the others. Empty: the engine shares the "
                                 "trainer's device (on a GPU it sleeps during the update; one trainer process)")
    rollout_tp: int = flag(0, "tensor-parallel size of the engine over --rollout-gpus; 0 = all of them",
                           ok=at_least(0))
    rollout_mem: float = flag(0.25, "vLLM memory: on GPU the fraction of GPU memory it may take, on CPU GiB of KV cache",
                              ok=POSITIVE)
    rope_scaling_factor: float = flag(0.0, "YaRN rope scaling factor for trainer and engine alike; 0 = off "
                                             "(UloRL 1.5; a model saved with YaRN in its config needs none)",
                                      ok=(lambda v: v == 0 or v >= 1, "must be 0 (off) or >= 1"))
    rope_original_max_positions: int = flag(0, "YaRN original_max_position_embeddings; the model then takes "
                                               "factor x this positions (UloRL 95232 -> 142848); 0 = the config's",
                                            ok=at_least(0))
    # rollout (UloRL 3.1)
    group_size: int = flag(8, "G responses per prompt (UloRL 8, ProRL 16)",
                           ok=(lambda v: v >= 2, "must be >= 2: GRPO's advantage compares the samples of one "
                                                 "prompt, and a lone sample has nothing to compare with"))
    prompts_per_step: int = flag(16, "rollout batch in prompts: unfinished samples + new groups fill "
                                     "prompts_per_step x G slots (UloRL 128, ProRL 256)",
                                 ok=at_least(1))
    segments: int = flag(4, "segments per response: each step decodes at most max_response_len / segments "
                            "new tokens per sample (UloRL 8 x 16k)",
                         ok=at_least(1))
    max_response_len: int = flag(64, "global cap on response tokens; reaching it truncates (UloRL 128k)",
                                 ok=at_least(1))
    max_prompt_len: int = flag(64, "longer prompts are skipped (and counted)",
                               ok=at_least(1))
    temperature: float = flag(1.0, "sampling temperature (UloRL 0.85, ProRL 1.2)",
                              ok=(lambda v: v > 0, "must be > 0 (logits are divided by it)"))
    top_p: float = flag(1.0, "nucleus sampling: 1 in training (both papers): the trainer's log-probs are of the "
                             "full distribution; eval.py --top-p samples held-out problems with it",
                        ok=UNIT)
    top_k: int = flag(-1, "top-k: -1 (off) in training (both papers), for the same reason; eval.py --top-k",
                      ok=(lambda v: v >= -1, "must be -1 (off) or a number of tokens"))
    # batch and optimizer
    train_groups: int = flag(16, "train once this many informative complete groups are ready",
                             ok=at_least(1))
    mini_batch: int = flag(0, "samples per optimizer step; 0 = the whole batch, one update per step "
                              "(UloRL 1024 = 128 x 8; ProRL 64 prompts x 16)",
                           ok=at_least(0))
    max_tokens_per_micro_batch: int = flag(4096, "tokens per forward/backward micro-batch: one packed row, "
                                                 "or rows x longest with --pack false; a longer sample goes alone",
                                           ok=at_least(1))
    pack: bool = flag(False, "pack micro-batches: sequences back to back in one row, positions restarting, no "
                             "attention across them; same loss as padding. Pays off with --attn-implementation "
                             "flash_attention_2; with sdpa/eager the row gets a dense [L, L] mask (slower on CPU)")
    attn_implementation: str = flag("sdpa", "the trainer's attention kernel: sdpa, eager, or flash_attention_2 "
                                            "(GPU, needs the flash-attn package; the one for --pack)",
                                     choices=["sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                              "flex_attention"])
    gradient_checkpointing: bool = flag(False, "recompute each decoder layer in the backward: less activation "
                                               "memory for long sequences, ~1/3 more compute")
    lr: float = flag(3e-4, "AdamW learning rate, constant after warm-up (UloRL 1e-6, ProRL 2e-6)",
                     ok=POSITIVE)
    warmup_steps: int = flag(0, "linear learning-rate warm-up",
                             ok=at_least(0))
    weight_decay: float = flag(0.0, "AdamW weight decay",
                               ok=at_least(0))
    grad_clip: float = flag(1.0, "max gradient norm",
                            ok=POSITIVE)
    # loss (GRPO + DAPO's token-level loss; UloRL 3.1-3.2; ProRL)
    eps_low: float = flag(0.2, "lower clip range: ratio >= 1 - eps_low (both papers 0.2)",
                          ok=(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    eps_high: float = flag(0.2, "upper clip range: ratio <= 1 + eps_high (UloRL 0.2, ProRL 0.4)",
                           ok=at_least(0))
    agg: str = flag("token", "token: DAPO's token-level mean; sample: GRPO's per-response mean",
                    choices=["token", "sample"])
    is_mode: str = flag("pois", "pi_old under segment rollout (UloRL 3.1): pois (the current weights for every "
                                "token), sais (each segment's own policy), tois (one segment only)",
                        choices=["pois", "sais", "tois"])
    mpt: str = flag("dynamic", "masking of well-mastered positive tokens: dynamic (DMMPTs), static, off",
                    choices=["dynamic", "static", "off"])
    mpt_tau: float = flag(0.99, "probability at which a positive sample's token counts as mastered (UloRL)",
                          ok=UNIT)
    mpt_sigma: float = flag(0.2, "target entropy: mask MPTs only while a sample's mean entropy is below it (UloRL)",
                            ok=POSITIVE)
    max_logprob_gap: float = flag(1.0, "the engine/trainer log-prob gap (rollout/logprob_diff_max, nats, on tokens the "
                                       "current weights sampled) past which the engine is taken to be wrong; 0 = never",
                                  ok=at_least(0))
    on_logprob_gap: str = flag("stop", "stop (before the update) or warn when the gap passes --max-logprob-gap: a "
                                       "wrong engine silently trains on garbage", choices=["stop", "warn"])
    tis_cap: float = flag(0.0, "truncated importance sampling: weight each token's loss by min(pi_old / "
                                "pi_behaviour, cap); corrects the engine/trainer mismatch on tokens the current "
                                "weights sampled and, under pois, also the version gap of older segments; 0 = off",
                          ok=at_least(0))
    clip_ratio_c: float = flag(3.0, "dual clip: a negative advantage's per-token loss is at most -A x c however "
                                    "large the ratio (verl's 3, which both papers trained with); 0 = off",
                               ok=(lambda v: v == 0 or v > 1, "must be 0 (off) or > 1"))
    dynamic_sampling: bool = flag(True, "drop groups whose rewards are all equal (DAPO, both papers)")
    kl_coef: float = flag(0.0, "k3 KL penalty to a reference policy (UloRL 0, ProRL 1e-4)",
                          ok=at_least(0))
    ref_reset_every: int = flag(0, "every N steps reset the reference to the policy AND the optimizer "
                                   "state (ProRL); 0 = never",
                                ok=at_least(0))
    ref_reset_on_stall: int = flag(0, "also reset them when held-out accuracy has not improved in K evaluations "
                                      "in a row (ProRL's other trigger); 0 = never",
                                   ok=at_least(0))
    # reward (UloRL 3.3; ProRL's verifiable domains)
    overlong: str = flag("zero", "truncated samples: zero (UloRL), soft (DAPO punishment), filter (no loss), none",
                         choices=["zero", "soft", "filter", "none"])
    overlong_buffer: int = flag(0, "soft punishment ramps over the last N tokens before the cap",
                                ok=at_least(0))
    reward_batch_timeout: float = flag(600.0, "seconds a rollout round's reward checks may take in all (hanging checks "
                                              "queue behind each other, --reward-timeout each): what is left then "
                                              "scores 0 and counts as a timeout; 0 = no bound",
                                       ok=at_least(0))
    reward_timeout: float = flag(5.0, "seconds per reward check; a check that takes longer scores 0",
                                 ok=POSITIVE)
    default_verifier: str = flag("math", "verifier of file rows without a 'verifier' field: math (last \\boxed{}, "
                                         "else the last number), math_boxed (\\boxed{} only), code, ifeval, rg, tiny",
                                 choices=sorted(reward.VERIFIERS))
    verifier_model: str = flag("", "generative verifier (UloRL 3.3): hub name or local HF directory of the judge "
                                   "model for math rows; '' = rule-based only")
    verifier_mode: str = flag("second_opinion", "with --verifier-model: second_opinion (ask the judge when the "
                                                "rule-based check says 0), alone (the judge decides), off",
                              choices=["second_opinion", "alone", "off"])
    verifier_max_tokens: int = flag(64, "tokens the judge may write before its yes/no (thinking models need more)",
                                    ok=at_least(1))
    # evaluation, logging, checkpoints
    eval_every: int = flag(25, "evaluate on --eval-data every N steps (also before step 1 and after the last)",
                           ok=at_least(0))
    eval_n: int = flag(512, "held-out prompts per evaluation (one sample each)",
                       ok=at_least(1))
    save_every: int = flag(0, "checkpoint every N steps (0: only at the end, or on SIGTERM / Ctrl-C)",
                           ok=at_least(0))
    keep_last: int = flag(3, "keep the newest N checkpoints (0: all)",
                          ok=at_least(0))
    max_bad_steps: int = flag(3, "stop after this many updates in a row skipped for a NaN/inf loss or gradient",
                              ok=at_least(1))
    report_to: str = flag("none", "also send every metrics.jsonl record to tensorboard (event files in --out/tb), "
                                  "wandb (offline unless WANDB_MODE=online), or both: 'tensorboard,wandb'",
                          ok=(lambda v: set(v.split(",")) <= {"none", "tensorboard", "wandb"},
                              "must be none, tensorboard, wandb or 'tensorboard,wandb'"))
    plan: bool = flag(False, "print the memory plan (per trainer rank, per engine GPU, from config.json alone) and exit")
    dump_samples: int = flag(256, "samples.jsonl records per step (0: none)",
                             ok=at_least(0))


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
    """The command line as a Config: the preset's values, then the flags given. Every value is checked here,
    before any model or data loads; a wrong one stops the run with a message naming the flag."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag_kw = dict(type=boolean, nargs="?", const=True) if f.type is bool else dict(type=f.type)  # --pack = --pack true
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"],
                       choices=f.metadata["choices"], **flag_kw)
    args = p.parse_args(argv)
    p.set_defaults(**PRESETS[args.preset])  # preset values, then whatever the command line says
    cfg = Config(**vars(p.parse_args(argv)))
    for f in dataclasses.fields(cfg):
        name, value, ok = "--" + f.name.replace("_", "-"), getattr(cfg, f.name), f.metadata["ok"]
        if isinstance(value, float) and not math.isfinite(value):
            p.error(f"{name} {value}: must be a finite number")
        if ok and not ok[0](value):
            p.error(f"{name} {value}: {ok[1]}")
    for problem in config_problems(cfg):
        p.error(problem)
    if (cfg.ref_reset_every or cfg.ref_reset_on_stall) and cfg.kl_coef == 0:
        print("warning: --ref-reset-every/--ref-reset-on-stall with --kl-coef 0: there is no reference, so a "
              "reset only clears the optimizer state", file=sys.stderr, flush=True)
    return cfg


def config_problems(cfg: Config) -> list[str]:
    """What is wrong with a combination of flags (each value alone passed its own check)."""
    out = []
    if cfg.max_response_len % cfg.segments:
        out.append(f"--max-response-len {cfg.max_response_len} must be a multiple of --segments {cfg.segments}")
    if cfg.is_mode == "tois" and cfg.segments > 1:
        out.append(f"--is-mode tois is defined for one segment (every token sampled by the weights being updated); "
                   f"with --segments {cfg.segments} use sais or pois")
    if cfg.top_p < 1 or cfg.top_k > 0:
        out.append(f"--top-p {cfg.top_p} / --top-k {cfg.top_k}: training samples with top_p 1 and no top-k (both "
                   f"papers): the trainer's log-probs are over the full distribution, so a truncated one would bias "
                   f"every ratio, DMMPT probability and entropy. Use them for evaluation (eval.py --top-p/--top-k)")
    if not (cfg.device == "cpu" or cfg.device == "cuda" or cfg.device.startswith("cuda:")):
        out.append(f"--device {cfg.device}: must be cpu, cuda or cuda:N")
    elif cfg.device.startswith("cuda") and not torch.cuda.is_available() and not cfg.plan:  # planning needs no GPU
        out.append(f"--device {cfg.device}: this machine has no CUDA GPU that torch can use "
                   f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu")
    if cfg.device.startswith("cuda") and cfg.rollout_mem > 1:
        out.append(f"--rollout-mem {cfg.rollout_mem}: on GPU it is the fraction of GPU memory vLLM may take, <= 1")
    if cfg.resume and cfg.overwrite:
        out.append(f"--resume {cfg.resume} and --overwrite say opposite things: continue the run, or start again")
    for flag_name, spec in (("--data", cfg.data), ("--eval-data", cfg.eval_data)) if not cfg.plan else ():
        if not spec:
            if flag_name == "--data":
                out.append("--data is empty: name the training prompts (the ulorl and prorl presets leave them to "
                           "you), e.g. --data train.parquet")
            continue
        try:
            sources = data.parse_mixture(spec)
        except ValueError as e:
            out.append(str(e).replace("--data", flag_name, 1))
            continue
        for source, _ in sources:
            path = os.path.expanduser(source)
            if (path.endswith(data.SUFFIXES) or path.startswith(("/", "."))) and not os.path.exists(path):
                out.append(f"{flag_name} {spec}: no such file or directory: {path}")
    if cfg.rollout_gpus:
        if not all(part.strip().isdigit() for part in cfg.rollout_gpus.split(",")):
            out.append(f"--rollout-gpus {cfg.rollout_gpus}: GPU ids ('6,7') or a count ('2')")
        elif not cfg.device.startswith("cuda") or cfg.engine == "hf":
            out.append(f"--rollout-gpus {cfg.rollout_gpus}: GPUs of its own are for the vLLM engine on GPU "
                       f"(--engine vllm --device cuda)")
    elif cfg.device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1 and cfg.engine == "vllm":
        out.append("--engine vllm under torchrun on GPU: give the engine GPUs of its own with --rollout-gpus (sharing "
                   "a GPU, with vLLM asleep during the update, is for one trainer process)")
    if cfg.rollout_tp and not cfg.rollout_gpus:
        out.append(f"--rollout-tp {cfg.rollout_tp}: tensor parallelism is over --rollout-gpus; give those")
    return out


def rollout_gpus(cfg: Config, local_ranks: int) -> list[int]:
    """--rollout-gpus as GPU ids: '6,7' as given, '2' the last two of this machine; none may be a trainer's
    (local rank r trains on cuda:r)."""
    if not cfg.rollout_gpus:
        return []
    parts = [int(p) for p in cfg.rollout_gpus.split(",")]
    count = torch.cuda.device_count()
    gpus = parts if "," in cfg.rollout_gpus else list(range(count - parts[0], count))
    if not gpus or min(gpus) < local_ranks or max(gpus) >= count:
        raise ValueError(f"--rollout-gpus {cfg.rollout_gpus}: GPUs {gpus} of {count}, but the {local_ranks} trainer "
                         f"process(es) of this machine use cuda:0..{local_ranks - 1}; leave those to training")
    if cfg.rollout_tp and cfg.rollout_tp != len(gpus):
        raise ValueError(f"--rollout-tp {cfg.rollout_tp}: the engine is tensor-parallel over all {len(gpus)} "
                         f"--rollout-gpus (data-parallel replicas are not built)")
    return gpus


# ---------------------------------------------------------------------------------------- distributed

def setup_distributed(cfg: Config) -> tuple[int, int]:
    """(rank, world size): one process, or torchrun's trainer ranks (gloo on CPU, NCCL with one GPU a rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(cfg.device)
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
    return model_lib.rank(), world


def busy_cores(seconds: float = 0.2) -> float:
    """How many cores other processes keep busy, from two samples of /proc/stat (0 where it is unreadable)."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait
    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (1 - (i1 - i0) / max(t1 - t0, 1)) * (os.cpu_count() or 1)


def set_threads(requested: int, local_ranks: int) -> int:
    """torch's CPU threads: --threads; for 0, OMP_NUM_THREADS when set, else the cores idle now shared by this
    machine's trainer ranks. (Measured on 2 cores with one busy neighbour: 20 tiny steps took 147 s with 2
    threads, 78 s with 1; idle, 52 s with 2.)"""
    if not requested:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        idle = len(os.sched_getaffinity(0)) - round(busy_cores())
        requested = max(1, idle // local_ranks)
    torch.set_num_threads(requested)
    return requested


def engine_shares_device(cfg: Config, world: int) -> bool:
    """Whether the rollout engine's memory comes out of a trainer's device (no --rollout-gpus)."""
    return not cfg.rollout_gpus


def memory_plan(cfg: Config, world: int) -> plan_lib.Plan:
    """plan.make_plan from the model's config.json alone (a hub name's from the Hugging Face cache or hub)."""
    config = model_lib.model_config(cfg.model, cfg.rope_scaling_factor, cfg.rope_original_max_positions)
    gpus = [g for g in cfg.rollout_gpus.split(",") if g]
    engine_ranks = cfg.rollout_tp or (int(gpus[0]) if len(gpus) == 1 else len(gpus)) or 1
    vllm = engine_kind(cfg.engine, cfg.device) == "vllm"
    return plan_lib.make_plan(plan_lib.Shape.of(config), cfg, world, engine_ranks, vllm)


# ---------------------------------------------------------------------------------- steps 1-4: rollout

class EngineFailure(RuntimeError):
    """The rollout engine failed twice in a row."""


def rollout_until_ready(engine, pools: Pools, rows, state: RunState, tokenizer, sampling: Sampling, cfg: Config,
                        m: dict, judge: reward.Judge | None, too_long: set) -> list[Sample]:
    """Steps 1-4: rollout rounds until `--train-groups` informative complete groups are ready (at least one
    round per step, so unfinished samples always advance). Returns every sample rewarded on the way.
    `too_long`: rows known to exceed --max-prompt-len (data.draw_prompts skips them untokenized)."""
    segment_len = cfg.max_response_len // cfg.segments
    scored = []
    while m["rollout/rounds"] == 0 or len(state.ready) < cfg.train_groups:
        free = cfg.prompts_per_step * cfg.group_size - len(pools.unfinished)
        n_new = 0 if len(state.ready) >= cfg.train_groups else max(free // cfg.group_size, 0)
        prompts, state.cursor, skipped = data.draw_prompts(rows, cfg.seed, state.cursor, n_new, tokenizer,
                                                           cfg.max_prompt_len, cfg.data, too_long)
        if skipped:
            m["data/skipped_long_prompts"] = m.get("data/skipped_long_prompts", 0) + skipped
        new = [pools.new_group(ids, row, cfg.group_size) for ids, row in prompts]
        try:  # 1-2. decode one segment; sort into the unfinished and experience pools
            r = rollout_step(engine, pools, new, segment_len, cfg.max_response_len, sampling, state.version)
        except Exception as e:  # one retry; the new samples already wait in the unfinished pool
            print(f"warning: the rollout engine failed ({type(e).__name__}: {e}); retrying once",
                  file=sys.stderr, flush=True)
            try:
                r = rollout_step(engine, pools, [], segment_len, cfg.max_response_len, sampling, state.version)
            except Exception as e2:
                raise EngineFailure(f"the rollout engine failed twice: {type(e2).__name__}: {e2}") from e2
        m["rollout/rounds"] += 1
        m["tokens/generated"] += r["tokens/generated"]
        m["rollout/unfinished"] = r["rollout/unfinished"]
        # 3. reward the groups whose every member is finished
        complete = [pools.pop_group(g[0].group) for g in pools.ready_groups(cfg.group_size)]
        samples = [s for g in complete for s in g]
        texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
        for k, v in reward.score_samples(samples, texts, cfg.max_response_len, cfg.overlong, cfg.overlong_buffer,
                                         cfg.reward_timeout, judge, cfg.reward_batch_timeout).items():
            m[k] = m.get(k, 0) + v
        scored += samples
        # 4. dynamic sampling: only informative groups wait for the update
        kept, dropped = ulorl.dynamic_sampling(complete, cfg.dynamic_sampling)
        state.ready += kept
        m["dynamic/dropped_groups"] += dropped
        if m["rollout/rounds"] > 100 * cfg.segments:
            raise RuntimeError(f"no informative group after {m['rollout/rounds']} rollouts: every group's "
                               f"rewards were all equal (mean reward {sum(s.reward for s in scored) / max(len(scored), 1):.3f}). "
                               f"The task is too easy or too hard for this model; try --dynamic-sampling false")
    return scored


# ------------------------------------------------------------------------- models, engine, evaluation

def load_models(cfg: Config, resume_from: str | None, world: int):
    """(policy, reference, lm, ref_lm, tokenizer): the modules the trainer calls (model.wrap; reference None
    without a KL) and the Hugging Face models inside them, from the checkpoint when resuming. Under FSDP no rank
    ever holds the whole model: each builds it on the meta device, shards it and reads only its own shards from
    the checkpoint, a layer at a time (model.load_sharded). FSDP on GPU with --dtype bfloat16 keeps fp32 master
    weights and computes in bf16; elsewhere --dtype is the weights' dtype."""
    mixed = world > 1 and cfg.parallel == "fsdp" and cfg.dtype == "bfloat16" and cfg.device.startswith("cuda")
    dtype, path = "float32" if mixed else cfg.dtype, resume_from or cfg.model
    ref_path = os.path.join(resume_from, "reference") if resume_from else cfg.model
    yarn = (cfg.rope_scaling_factor, cfg.rope_original_max_positions, cfg.attn_implementation)
    ref = ref_lm = None
    if world > 1 and cfg.parallel == "fsdp":
        policy, lm, tokenizer = model_lib.load_sharded(path, dtype, cfg.device, cfg.gradient_checkpointing, *yarn,
                                                       mixed_bf16=mixed)
        if cfg.kl_coef > 0:
            ref, ref_lm, _ = model_lib.load_sharded(ref_path, dtype, cfg.device, False, *yarn, trainable=False,
                                                    mixed_bf16=mixed)
        return policy, ref, lm, ref_lm, tokenizer
    mode = cfg.parallel if world > 1 else "none"
    lm, tokenizer = model_lib.load(path, dtype, cfg.device, cfg.gradient_checkpointing, *yarn)
    if cfg.kl_coef > 0:
        ref_lm = model_lib.load(ref_path, dtype, cfg.device, False, *yarn)[0].eval().requires_grad_(False)
        ref = model_lib.wrap(ref_lm, mode, trainable=False)
    return model_lib.wrap(lm, mode), ref, lm, ref_lm, tokenizer


def rollout_engine(cfg: Config, lm, tokenizer, path: str, world: int):
    """Rank 0's engine. In one process the transformers engine samples with the trainer's own module and vLLM
    runs in-process (or, on GPU, sleeps on the trainer's GPU during updates); under torchrun the transformers
    engine samples with a copy on rank 0, and vLLM runs in a process of its own (inside a trainer rank it would
    join torchrun's process group and wait forever), on --rollout-gpus when given."""
    gpus = rollout_gpus(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    kind = engine_kind(cfg.engine, cfg.device)
    if kind == "hf" and world > 1:  # the trainer's module is sharded: the engine samples with a whole copy
        lm = model_lib.load(path, cfg.dtype, cfg.device, False, cfg.rope_scaling_factor,
                            cfg.rope_original_max_positions, cfg.attn_implementation)[0]
    return make_engine(kind, lm, tokenizer, cfg.seed, path=path,
                       max_model_len=min(cfg.max_prompt_len + cfg.max_response_len, lm.config.max_position_embeddings),
                       mem=cfg.rollout_mem, device=cfg.device, dtype=cfg.dtype,
                       hf_overrides=model_lib.yarn_overrides(lm.config, cfg.rope_scaling_factor,
                                                             cfg.rope_original_max_positions),
                       own_process=world > 1, gpus=gpus, tp=len(gpus) or 1)


def held_out(engine, tokenizer, rows: list[dict], cfg: Config, judge: reward.Judge | None) -> dict:
    """avg@1 on the held-out prompts (eval.evaluate), sampled like the training rollouts, in one segment of
    the full length. Sample uids count down from -1: the same draws at every evaluation, apart from training's."""
    summary, _, metrics = eval_lib.evaluate(engine, tokenizer, rows, 1, cfg.max_response_len,
                                            Sampling(cfg.temperature, cfg.top_p, cfg.top_k), segments=1, batch=256,
                                            timeout=cfg.reward_timeout, overlong=cfg.overlong,
                                            overlong_buffer=cfg.overlong_buffer, judge=judge,
                                            pools=Pools(next_uid=-1, uid_step=-1))
    return {"eval/accuracy": summary["avg@k"], "eval/reward": summary["mean_reward"],
            "eval/mean_length": summary["mean_length"], "eval/truncation_rate": summary["truncation_rate"],
            "eval/reward_timeouts": metrics["reward/timeouts"]}


def sync_weights(engine, lm) -> None:
    """Step 7, the one place new weights reach the engine: rank 0's engine takes the trainer's module (vLLM
    through its weight-transfer API, weight_sync.py); the weights are gathered from the FSDP shards a layer
    at a time, and every other rank takes its part in those gathers."""
    if engine is not None:
        engine.update_weights(lm)
    else:
        model_lib.gather_only(lm)


# ----------------------------------------------------------------------------------------- logging

def git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def open_logs(out: str, resumed_step: int | None):
    """metrics.jsonl and samples.jsonl in `out`, open for appending. On resume the records written after the
    checkpoint's step are dropped: those steps are done again."""
    files = []
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(out, name)
        keep = []
        if resumed_step is not None and os.path.exists(path):
            with open(path) as f:
                keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(path, "w") as f:
            f.writelines(keep)
        files.append(open(path, "a"))
    return files


class Trackers:
    """--report-to: the numbers of every metrics.jsonl record, under the same keys, to TensorBoard and/or
    Weights & Biases (offline by default: it needs no network or account). Rank 0 only; off by default."""

    def __init__(self, cfg: Config):
        self.tb = self.wandb = None
        targets = set(cfg.report_to.split(","))
        try:
            if "tensorboard" in targets:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(cfg.out, "tb"))
            if "wandb" in targets:
                import wandb
                os.environ.setdefault("WANDB_MODE", "offline")
                self.wandb = wandb.init(project="ulorl", dir=cfg.out, config=dataclasses.asdict(cfg),
                                        resume="allow", id=os.path.basename(os.path.abspath(cfg.out)))
        except ImportError as e:
            raise ValueError(f"--report-to {cfg.report_to}: {e.name} is not installed (pip install tensorboard "
                             f"wandb)") from None

    def log(self, rec: dict) -> None:
        numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, rec["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_record(f, rec: dict) -> None:
    """One JSON line; NaN or inf (not JSON) become null."""
    rec = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
    f.write(json.dumps(rec, allow_nan=False) + "\n")
    f.flush()


def step_metrics(step: int, groups: list[list[Sample]], scored: list[Sample], t_roll: float, m: dict) -> dict:
    """The step's rollout numbers: rewards (per verifier too: one curve each in a mixture), lengths, speed."""
    trained = [s for g in groups for s in g]
    out = {}
    for v in sorted({s.row["verifier"] for s in scored}):
        rs = [s.reward for s in scored if s.row["verifier"] == v]
        out[f"reward/by_verifier/{v}"] = sum(rs) / len(rs)
    out.update({"step": step, "reward/mean": sum(s.reward for s in scored) / len(scored) if scored else None,
                "reward/trained_mean": sum(s.reward for s in trained) / len(trained),
                "response/mean_len": sum(len(s.tokens) for s in trained) / len(trained),
                "response/max_len": max(len(s.tokens) for s in trained),
                "response/truncated_frac": sum(s.finish == "truncated" for s in trained) / len(trained),
                "response/multi_segment_frac": sum(len(s.seg_starts) > 1 for s in trained) / len(trained),
                "tokens/per_s": m["tokens/generated"] / max(t_roll, 1e-9), "time/rollout_s": t_roll})
    return out


def log_line(m: dict, eta_s: float, threads: int) -> str:
    def num(key, form=".3f"):  # null (nothing measured) as "-"
        return "  -  " if m.get(key) is None else format(m[key], form)
    acc = f" | eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
    return (f"step {m['step']:5d} | reward {num('reward/mean')}{acc} | entropy {num('entropy/mean')} | "
            f"masked {num('mpt/masked_frac')} | unfinished {m['rollout/unfinished']:4d} | "
            f"tok/s {m['tokens/per_s']:7.0f} | {m['time/step_s']:.2f}s | eta {eta_s / 60:.1f}m | {threads} thr")


def dump_samples(f, groups: list[list[Sample]], step: int, tokenizer, limit: int) -> None:
    samples = [s for g in groups for s in g][:limit]
    texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
    prompts = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=False)
    for s, text, prompt in zip(samples, texts, prompts):
        f.write(json.dumps({"step": step, "group": s.group, "uid": s.uid, "verifier": s.row.get("verifier"),
                            "prompt": prompt, "response": text, "n_tokens": len(s.tokens),
                            "versions": s.segment_versions(), "finish": s.finish, "reward": s.reward}) + "\n")
    f.flush()


def stop_on_signals(lead: bool, state: RunState) -> list[str]:
    """SIGTERM (schedulers, kill) and Ctrl-C finish the current step, save a checkpoint and exit; a second
    Ctrl-C exits at once. Returns the list the signal's name lands in (under torchrun rank 0's decides)."""
    stop: list[str] = []

    def on_signal(signum, frame):
        if stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)
        if lead:
            print(f"\n{stop[-1]}: finishing step {state.step + 1}, then saving a checkpoint", file=sys.stderr,
                  flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


# -------------------------------------------------------------------------------------------- main

def main(cfg: Config, engine_hook=None) -> None:
    """The run. `engine_hook(engine) -> engine` may wrap rank 0's rollout engine (bench.py counts its work)."""
    if cfg.plan:  # for the WORLD_SIZE trainer ranks torchrun would start (1 without it); nothing is started
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plan = memory_plan(cfg, world)
        if int(os.environ.get("RANK", "0")) == 0:
            capacity = plan_lib.device_bytes(cfg.device)
            print(plan.table(f"{world} trainer rank(s), {cfg.device}"), flush=True)
            why = plan_lib.problems(plan, cfg, capacity, colocated=engine_shares_device(cfg, world))
            print("verdict: " + ("; ".join(why) if why else f"fits in {capacity / 2**30:.1f} GiB" if capacity else
                                 "this machine cannot say how much memory the device has: compare the totals"))
            if capacity and plan.engine and not why:
                print(f"vLLM holds ~{plan_lib.engine_concurrency(plan, capacity):.0f} samples at full context at once "
                      f"per engine GPU; the rest of the batch queues")
        return
    rank, world = setup_distributed(cfg)
    lead = rank == 0
    threads = set_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if lead:
        print(json.dumps(dataclasses.asdict(cfg)), flush=True)
    plan = memory_plan(cfg, world)
    if why := plan_lib.problems(plan, cfg, plan_lib.device_bytes(cfg.device), colocated=engine_shares_device(cfg, world)):
        raise ValueError("the run cannot fit (python train.py ... --plan shows the items):\n  " + "\n  ".join(why))
    resume_from = checkpoint.find_resume(cfg.resume, cfg.out, cfg.overwrite)  # --out is checked before loading
    if lead and cfg.overwrite and (gone := checkpoint.clear_run(cfg.out)):
        print(f"--overwrite: deleted {', '.join(gone)} from {cfg.out}", flush=True)
    model_lib.barrier()
    os.makedirs(cfg.out, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, default_verifier=cfg.default_verifier)
    rows = data.load_prompts(cfg.data, cfg.seed, **keys) if lead else []  # data before models: a bad row stops
    eval_rows = data.load_prompts(cfg.eval_data, cfg.seed, True, cfg.eval_n, **keys) if cfg.eval_data and lead else []
    host_before = plan_lib.reset_host_peak()
    policy, ref, lm, ref_lm, tokenizer = load_models(cfg, resume_from, world)
    load_peak = model_lib.all_max(plan_lib.host_peak() - host_before) / 2**20  # MiB, the largest rank's
    engine = rollout_engine(cfg, lm, tokenizer, resume_from or cfg.model, world) if lead else None
    if engine_hook is not None and engine is not None:
        engine = engine_hook(engine)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    judge = eval_lib.load_judge(cfg.verifier_model, cfg.verifier_mode, cfg.verifier_max_tokens, cfg.dtype, cfg.device,
                                cfg.seed) if lead and cfg.verifier_model and cfg.verifier_mode != "off" else None
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    pools, state = Pools(), RunState(run_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    save = functools.partial(checkpoint.save, lm=lm, ref_lm=ref_lm, tokenizer=tokenizer, opt=opt, sched=sched,
                             engine=engine, pools=pools, state=state, cfg=cfg, git=git_hash())
    if resume_from:
        checkpoint.load(resume_from, opt, sched, engine, pools, state)
    startup = {"memory/load_host_mib": load_peak, "memory/plan_trainer_mib": plan.trainer_total / 2**20}  # logged once
    if lead:
        if resume_from:
            print(f"resumed from {resume_from} at step {state.step}", flush=True)
        metrics_file, samples_file = open_logs(cfg.out, state.step if resume_from else None)
        trackers = Trackers(cfg)
        if state.step == 0 and eval_rows:  # held-out accuracy before any update: step 0
            t0, ev = time.time(), held_out(engine, tokenizer, eval_rows, cfg, judge)
            ulorl.stalled(state, ev["eval/accuracy"], cfg.ref_reset_on_stall)  # the baseline to improve on
            print(f"step     0 | eval accuracy {ev['eval/accuracy']:.3f} (before training)", flush=True)
            rec = {"step": 0, "time/step_s": time.time() - t0, "reward/mean": None, "entropy/mean": None,
                   "mpt/masked_frac": None, "rollout/unfinished": 0, "tokens/generated": 0, **ev, **startup}
            startup = {}
            write_record(metrics_file, {**rec, "git": git_hash(), "config": dataclasses.asdict(cfg)})
            trackers.log(rec)
    stop = stop_on_signals(lead, state)
    step_times, too_long = [], set()
    while state.step < cfg.steps:
        t0, step = time.time(), state.step + 1
        m: dict = {"reward/timeouts": 0, "reward/errors": 0, "rollout/rounds": 0, "tokens/generated": 0,
                   "dynamic/dropped_groups": 0, "rollout/unfinished": len(pools.unfinished)}
        groups, scored = None, []
        if lead:  # 1-4. rollout until enough informative complete groups are ready
            try:
                scored = rollout_until_ready(engine, pools, rows, state, tokenizer, sampling, cfg, m, judge, too_long)
            except EngineFailure:
                if world == 1:  # under torchrun a checkpoint needs every rank: the newest periodic one resumes
                    save(os.path.join(cfg.out, f"step_{state.step:06d}"))
                print(f"the rollout engine failed twice; resume from the newest checkpoint in {cfg.out} with "
                      f"--resume auto", file=sys.stderr, flush=True)
                raise
            groups, state.ready = state.ready[:cfg.train_groups], state.ready[cfg.train_groups:]
        t_roll = time.time() - t0
        groups, stop_now = model_lib.broadcast((groups, stop[0] if stop else ""))

        # 5-6. old/reference log-probs, DMMPT mask, the update (each rank its share)
        if lead:
            engine.pause()  # vLLM sharing the trainer's GPU sleeps meanwhile
        m.update(ulorl.update(policy, ref, opt, sched, groups, state.version, tokenizer.pad_token_id, cfg))
        m["memory/host_peak_mib"] = model_lib.all_max(plan_lib.host_peak() - host_before) / 2**20  # since loading
        if cfg.device.startswith("cuda"):
            m["memory/gpu_peak_mib"] = model_lib.all_max(torch.cuda.max_memory_allocated()) / 2**20
        ulorl.count_bad_steps(m, state, cfg, warn=lead)
        if m["train/optimizer_steps"]:
            state.version += 1
        if cfg.ref_reset_every and step % cfg.ref_reset_every == 0:
            ulorl.reset_reference(lm, ref_lm, opt, ref)  # ProRL: reference <- policy, fresh AdamW moments
            m["train/ref_reset"] = 1

        # 7. the new weights reach the engine; unfinished samples continue under them
        if lead:
            engine.resume()
        if m["train/optimizer_steps"]:
            t_sync = time.time()
            sync_weights(engine, lm)
            m["time/sync_s"] = time.time() - t_sync
        state.step = step

        # 8. evaluate (ProRL also resets when held-out accuracy stalls), log, checkpoint
        if cfg.eval_data and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            if lead:
                m.update(held_out(engine, tokenizer, eval_rows, cfg, judge))
            if model_lib.broadcast(lead and ulorl.stalled(state, m["eval/accuracy"], cfg.ref_reset_on_stall)):
                ulorl.reset_reference(lm, ref_lm, opt, ref)
                m["train/ref_reset"] = 1
        if lead:
            m.update(step_metrics(step, groups, scored, t_roll, m), **startup)
            startup = {}
            if cfg.dump_samples:
                dump_samples(samples_file, groups, step, tokenizer, cfg.dump_samples)
            m["time/step_s"] = time.time() - t0
            step_times.append(m["time/step_s"])
            write_record(metrics_file, m)  # before the checkpoint: every record up to a checkpoint's step exists
            trackers.log(m)
            print(log_line(m, sum(step_times) / len(step_times) * (cfg.steps - step), threads), flush=True)
        stop_now = stop_now or (stop[0] if world == 1 and stop else "")
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop_now:
            save(os.path.join(cfg.out, f"step_{step:06d}"))
        if stop_now:
            if lead:
                print(f"stopped by {stop_now} after step {step}; checkpoint saved (resume with --resume auto)",
                      flush=True)
            break
    if lead:
        metrics_file.close()
        samples_file.close()
        trackers.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(parse_config())
    except (ValueError, FileNotFoundError) as e:  # a user's mistake (a data row, an --out, a file): the message says it
        sys.exit(f"error: {e}")
