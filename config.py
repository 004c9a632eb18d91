"""Every knob of a run: `Config` (one dataclass, every field a `--flag` whose help names the paper's value),
the presets (`tiny`, the built-in default; `ulorl` and `prorl`, the papers' training settings) and the checks
that stop a wrong flag before anything loads.

    python train.py --help                  # these fields, as flags
    python train.py --preset ulorl --model Qwen/Qwen3-4B --data dapo.parquet --lr 2e-6   # a preset, then flags

(Kept apart from train.py, as TRL keeps `GRPOConfig` beside its trainer: ~90 flags with their checks would
bury the loop.)
"""
import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

import registry

# What --help shows is all here and in registry.py (the verifiers' and data sources' names and help, as strings):
# this file loads no torch, transformers or other project module until the flags are parsed (each costs seconds),
# so `python train.py --help` and a wrong value answer at once
TINY_CKPT = "tiny_ckpt"  # tiny.CKPT: the built-in task's warm start


def is_local_path(name: str) -> bool:
    """A name meant as a local directory (absolute, ./, ../, ~), as opposed to a hub name like Qwen/Qwen3-4B."""
    return name.startswith(("/", "./", "../", "~")) or os.path.isdir(name)


def flag(default, help, choices=None, ok=None, group=None):
    """A Config field: its --flag's default and help; `choices` (argparse's) or `ok`, a (test, what is allowed)
    pair that parse_config checks before anything loads. `group`: the heading in --help of the flags from this
    one on (the algorithm's first, the systems' last)."""
    return field(default=default, metadata={"help": help, "choices": choices, "ok": ok, "group": group})


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
    preset: str = flag("tiny", "tiny (the built-in task), ulorl or prorl: the papers' training settings. Unset: "
                               "ulorl for a hub model name (--model Qwen/Qwen3-30B-A3B), tiny for a local directory",
                       choices=["tiny", "ulorl", "prorl"], group="run")
    model: str = flag(TINY_CKPT, "hub name or local HF directory of the policy")
    data: str = flag("tiny", "training prompts: " + registry.DATA_HELP)
    eval_data: str = flag("auto", "held-out prompts for --eval-every (same formats as --data); auto: --data's own "
                                  "held-out draw where it has one (tiny, tiny:K and rg:NAME: problems, or a seed, "
                                  "training never draws), none for files and datasets; '' = none. Training leaves "
                                  "out every prompt the held-out set holds")
    prompt_key: str = flag("prompt", "column holding the prompt (dotted paths reach nested columns)")
    answer_key: str = flag("answer", "column holding the reference answer")
    steps: int = flag(150, "training steps (one update phase each)",
                      ok=at_least(1))
    out: str = flag("runs/tiny", "output directory: metrics.jsonl, samples.jsonl, step_NNNNNN/ checkpoints")
    resume: str = flag("", "checkpoint directory to continue from, or 'auto' for the newest in --out")
    overwrite: bool = flag(False, "start a new run in an --out that holds one: its metrics.jsonl, samples.jsonl and "
                                  "step_NNNNNN/ checkpoints are deleted first")
    seed: int = flag(0, "seed for data order, sampling and init")
    group_size: int = flag(8, "G responses per prompt (UloRL 8, ProRL 16)",
                           ok=(lambda v: v >= 2, "must be >= 2: GRPO's advantage compares the samples of one "
                                                 "prompt, and a lone sample has nothing to compare with"),
                           group="rollout (UloRL 3.1)")
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
    eps_low: float = flag(0.2, "lower clip range: ratio >= 1 - eps_low (both papers 0.2)",
                          ok=(lambda v: 0 <= v < 1, "must be in [0, 1)"),
                          group="loss (GRPO + DAPO's token-level loss; UloRL 3.1-3.2; ProRL)")
    eps_high: float = flag(0.2, "upper clip range: ratio <= 1 + eps_high (UloRL 0.2, ProRL 0.4)",
                           ok=at_least(0))
    policy_loss: str = flag("clipped", "the policy loss (registry.POLICY_LOSSES): clipped, the token-level clipped "
                                       "surrogate of DAPO / ProRL with decoupled clip (--eps-low, --eps-high), dual "
                                       "clip and the k3 KL", choices=list(registry.POLICY_LOSSES))
    agg: str = flag("token", "token: DAPO's token-level mean; sample: GRPO's per-response mean",
                    choices=["token", "sample"])
    is_mode: str = flag("pois", "pi_old under segment rollout (UloRL 3.1): pois (the current weights for every "
                                "token), sais (each segment's own policy), tois (one segment only; every "
                                "trained token from the weights being updated: surplus groups are dropped)",
                        choices=["pois", "sais", "tois"])
    mpt: str = flag("dynamic", "masking of well-mastered positive tokens: dynamic (DMMPTs), static, off",
                    choices=["dynamic", "static", "off"])
    mpt_tau: float = flag(0.99, "probability at which a positive sample's token counts as mastered (UloRL)",
                          ok=UNIT)
    mpt_sigma: float = flag(0.2, "target entropy: mask MPTs only while a sample's mean entropy is below it (UloRL)",
                            ok=POSITIVE)
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
    reset: str = flag("both", "what a reset renews: both (ProRL: the reference becomes the policy and AdamW forgets "
                              "its moments), reference (the KL anchor alone) or optimizer (AdamW's moments alone)",
                      choices=["both", "reference", "optimizer"])
    train_groups: int = flag(16, "train once this many informative complete groups are ready",
                             ok=at_least(1), group="batch and optimizer")
    surplus: str = flag("wait", "informative complete groups past --train-groups: wait for the next step (their "
                                "tokens one version older then), or drop (a trained token is then stale only for the "
                                "segments after its own; --is-mode tois always drops)", choices=["wait", "drop"])
    mini_batch: int = flag(0, "samples per optimizer step; 0 = the whole batch, one update per step "
                              "(UloRL 1024 = 128 x 8; ProRL 64 prompts x 16)",
                           ok=at_least(0))
    lr: float = flag(3e-4, "AdamW learning rate after warm-up (UloRL 1e-6, ProRL 2e-6)",
                     ok=POSITIVE)
    warmup_steps: int = flag(0, "linear learning-rate warm-up, in optimizer steps",
                             ok=at_least(0))
    lr_final: float = flag(0.1, "the learning rate of the last update as a fraction of --lr; 1 = constant (both "
                                "papers). The tiny default anneals: at a constant 3e-4 its last steps swing "
                                "held-out accuracy by several points",
                           ok=UNIT)
    lr_decay_steps: int = flag(50, "the last N steps anneal the learning rate from --lr to --lr-final x --lr by a "
                                   "cosine (warmup-stable-decay); 0 = every step after warm-up",
                               ok=at_least(0))
    weight_decay: float = flag(0.0, "AdamW weight decay",
                               ok=at_least(0))
    grad_clip: float = flag(1.0, "max gradient norm",
                            ok=POSITIVE)
    overlong: str = flag("zero", "truncated samples: zero (UloRL), soft (DAPO punishment), filter (no loss), none",
                         choices=["zero", "soft", "filter", "none"],
                         group="reward (UloRL 3.3; ProRL's verifiable domains)")
    overlong_buffer: int = flag(0, "soft punishment ramps over the last N tokens before the cap",
                                ok=at_least(0))
    reward_batch_timeout: float = flag(600.0, "seconds a rollout round's reward checks may take in all (hanging checks "
                                              "queue behind each other, --reward-timeout each): what is left then "
                                              "scores 0 and counts as a timeout; 0 = no bound",
                                       ok=at_least(0))
    reward_timeout: float = flag(5.0, "seconds per reward check; a check that takes longer scores 0",
                                 ok=POSITIVE)
    default_verifier: str = flag("math", registry.default_verifier_help(), choices=registry.FILE_VERIFIERS)
    verifier_model: str = flag("", "generative verifier (UloRL 3.3): hub name or local HF directory of the judge "
                                   "model for math rows; '' = rule-based only")
    verifier_mode: str = flag("second_opinion", "with --verifier-model: second_opinion (ask the judge when the "
                                                "rule-based check says 0), alone (the judge decides), off",
                              choices=["second_opinion", "alone", "off"])
    verifier_max_tokens: int = flag(64, "tokens the judge may write before its yes/no (thinking models need more)",
                                    ok=at_least(1))
    eval_every: int = flag(25, "evaluate on --eval-data every N steps, before step 1 and after the last; 0 = never",
                           ok=at_least(0), group="evaluation, logging, checkpoints")
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
    dump_samples: int = flag(256, "samples.jsonl records per step (0: none)",
                             ok=at_least(0))
    threads: int = flag(0, "CPU threads of torch; 0 = the cores idle when the run starts (on a small machine a busy "
                           "neighbour slows a thread pool that counts on every core 2-20x); OMP_NUM_THREADS wins",
                        ok=at_least(0), group="systems: devices, parallelism, memory, long contexts")
    engine: str = flag("auto", "rollout engine: hf (transformers), vllm, or auto (vLLM when installed and on GPU; "
                               "else hf)",
                       choices=["auto", "hf", "vllm"])
    dtype: str = flag("float32", "the trainer's compute dtype and its checkpoints' (float32, bfloat16, float16); "
                                 "below float32 the optimizer steps fp32 master weights",
                      choices=["float32", "bfloat16", "float16"])
    device: str = flag("auto", "torch device of the trainer: auto (the GPU when torch sees one, else cpu), cpu, cuda, "
                               "cuda:N")
    parallel: str = flag("fsdp", "under torchrun: fsdp (FSDP2: each decoder layer, then the root, sharded over "
                                 "the trainer ranks) or ddp (a full copy per rank)",
                         choices=["fsdp", "ddp"])
    sp: int = flag(1, "Ulysses sequence parallelism under torchrun: each packed micro-batch is split over this many "
                      "trainer ranks for everything but attention, which trades the split for one over heads "
                      "(all-to-all); activations per rank / N. Divides the trainer ranks and the attention heads; "
                      "needs --pack. 0 = auto: the least the memory plan fits (the ulorl preset)",
                   ok=at_least(0))
    offload_optimizer: str = flag("false", "under FSDP: the fp32 master weights, their gradients and the AdamW "
                                           "moments live in host memory and AdamW steps there (FSDP2's "
                                           "CPUOffloadPolicy): 16 bytes a parameter off each GPU, paid in host "
                                           "memory and transfers; auto: only when the memory plan needs it",
                                  choices=["false", "true", "auto"])
    dist_timeout: float = flag(1800.0, "seconds a collective of the trainer ranks' own (the update's gathers and "
                                       "reductions) may wait before the run ends (NCCL's watchdog: 600 by default). "
                                       "Waiting for rank 0's rollout, evaluation or checkpoint is not bounded by it",
                               ok=POSITIVE)
    rollout_gpus: str = flag("", "GPUs of the vLLM engine's own, e.g. '6,7', or a count taken from the last ones, "
                                 "e.g. '2'; torchrun's trainer ranks use the others. Empty: the GPUs the trainer "
                                 "processes leave free, or, with none free, the trainer's own (one trainer process; "
                                 "vLLM sleeps during the update)")
    rollout_tp: int = flag(0, "tensor-parallel size of each vLLM engine over --rollout-gpus; 0 = all of them, or "
                              "their share with --rollout-replicas",
                           ok=at_least(0))
    rollout_replicas: int = flag(0, "data-parallel vLLM engines, each decoding its share of a round's samples (split by "
                                    "expected tokens) and each taking every weight sync; 0 = len(--rollout-gpus) / "
                                    "--rollout-tp on GPU, 1 on CPU (where each replica is a process with its own cores)",
                                 ok=at_least(0))
    rollout_mem: float = flag(0.0, "vLLM memory: on GPU the fraction of GPU memory it may take (0 = auto: 0.9 on "
                                   "GPUs of its own, sharing the trainer's GPU what the memory plan leaves), on CPU "
                                   "GiB of KV cache (0 = 0.25)",
                              ok=at_least(0))
    max_tokens_per_micro_batch: int = flag(4096, "tokens per forward/backward micro-batch: one packed row, "
                                                 "or rows x longest with --pack false; a longer sample goes alone",
                                           ok=at_least(1))
    pack: bool = flag(False, "pack micro-batches: sequences back to back in one row, positions restarting, no "
                             "attention across them; same loss as padding. Pays off on GPU with the varlen kernel "
                             "(--attn-implementation auto); with sdpa/eager the row gets a dense [L, L] mask "
                             "(slower on CPU). Needed by --sp")
    attn_implementation: str = flag("auto", "the trainer's attention kernel: varlen (torch's FlashAttention kernels "
                                            "for packed rows: GPU, bf16/fp16, --pack; no [L, L] scores), sdpa (on "
                                            "CPU; a packed row gets an [L, L] mask), eager, flash_attention_2 (needs "
                                            "the flash-attn package); auto: varlen where it runs, else sdpa",
                                     choices=["auto", "varlen", "sdpa", "eager", "flash_attention_2",
                                              "flash_attention_3", "flex_attention"])
    gradient_checkpointing: bool = flag(False, "recompute each decoder layer in the backward: less activation "
                                               "memory for long sequences, ~1/3 more compute")
    rope_scaling_factor: float = flag(0.0, "YaRN rope scaling factor for trainer and engine alike; 0 = off "
                                             "(UloRL 1.5; a model saved with YaRN in its config needs none)",
                                      ok=(lambda v: v == 0 or v >= 1, "must be 0 (off) or >= 1"))
    rope_original_max_positions: int = flag(0, "YaRN original_max_position_embeddings; the model then takes "
                                               "factor x this positions (UloRL 95232 -> 142848); 0 = the config's",
                                            ok=at_least(0))
    plan: bool = flag(False, "print the memory plan (per trainer rank, per engine GPU, from config.json alone) and exit")
    device_memory: float = flag(0.0, "memory of one device in decimal GB, as vendors state it (H200: 141, H100: 80), "
                                     "for the plan and its checks; 0 = what torch reports (the RAM on CPU)",
                                ok=at_least(0))
    max_engine_kl: float = flag(0.1, "the mean per-token KL between the engine's and the trainer's log-probs on tokens "
                                     "the current weights sampled (rollout/engine_kl) past which the engine is taken "
                                     "to be wrong; 0 = never (bf16 noise: ~3e-5 on the tiny model, ~1e-3 reported on "
                                     "8-30B models)",
                                ok=at_least(0), group="systems: the engine against the trainer, overlap, MoE routing")
    engine_kl_jump: float = flag(10.0, "also stop when rollout/engine_kl passes this many times the median of the "
                                       "last 10 steps (at least 5e-5, bf16 noise's reach on a small model): an engine "
                                       "that stopped following the trainer (off by one update; at lr 1e-6 that is "
                                       "below bf16 noise); 0 = never",
                                 ok=(lambda v: v == 0 or v > 1, "must be 0 (off) or > 1"))
    on_engine_kl: str = flag("stop", "stop (before the update) or warn when the engine/trainer KL check fails: a "
                                     "wrong engine silently trains on garbage", choices=["stop", "warn"])
    overlap: int = flag(0, "rollout overlapped with training: the engine (in a process of its own: --engine vllm, on "
                           "--rollout-gpus on GPU) decodes the next step's whole rollout with the current weights while "
                           "the trainers update them, so every step after the first trains tokens one version old "
                           "(staleness/engine_lag; SAIS corrects them with their own behaviour log-probs, POIS "
                           "trains them as on-policy); 0 = off",
                        ok=(lambda v: v in (0, 1), "must be 0 (off) or 1 (one step's rollout in flight)"))
    routing_replay: str = flag("false", "Mixture-of-Experts models: the engine returns the experts each layer "
                                        "routed every token to (uint8 ids, kept with the samples and checkpoints) "
                                        "and the trainer's forwards use them, with gate weights from its own router "
                                        "(rollout routing replay); record: keep and compare them "
                                        "(rollout/routing_mismatch), never replay. vLLM: GPU only (its V2 model runner)",
                               choices=["false", "true", "record"])

PRESETS = {
    "tiny": {},
    # 2048 + 131072 = 133120 positions: YaRN x 4.0625 over Qwen3's 32768 native ones (Qwen documents x 4 for
    # 131072). The paper's YaRN (x 1.5 over 95232) extends its 128k-trained model to 140k: README, "Long contexts"
    "ulorl": dict(model="Qwen/Qwen3-30B-A3B", dtype="bfloat16", device="cuda", group_size=8, prompts_per_step=128,
                  segments=8, max_response_len=131072, max_prompt_len=2048, temperature=0.85, train_groups=128,
                  mini_batch=1024, lr=1e-6, lr_final=1.0, eps_low=0.2, eps_high=0.2, is_mode="pois", mpt="dynamic",
                  mpt_tau=0.99, mpt_sigma=0.2, kl_coef=0.0, overlong="zero", max_tokens_per_micro_batch=65536,
                  gradient_checkpointing=True, pack=True, sp=0, offload_optimizer="auto",
                  rope_scaling_factor=4.0625, rope_original_max_positions=32768,
                  eval_every=10, eval_n=30, save_every=10, dump_samples=16, data="", eval_data=""),
    "prorl": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", dtype="bfloat16", device="cuda",
                  group_size=16, prompts_per_step=256, segments=1, max_response_len=8192, max_prompt_len=2048,
                  temperature=1.2, train_groups=256, mini_batch=1024, lr=2e-6, lr_final=1.0, eps_low=0.2, eps_high=0.4,
                  mpt="off", kl_coef=1e-4, ref_reset_every=500, overlong="zero",
                  max_tokens_per_micro_batch=32768, gradient_checkpointing=True, pack=True, eval_every=50, eval_n=256,
                  save_every=50, dump_samples=16, data="", eval_data=""),
}


def parse_config(argv=None, description: str = __doc__) -> Config:
    """The command line as a Config: the preset's values, then the flags given. Every value is checked here,
    before any model or data loads; a wrong one stops the run with a message naming the flag. `description`
    heads --help (train.py passes its own docstring)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = p
    for f in dataclasses.fields(Config):
        if f.metadata["group"]:
            group = p.add_argument_group(f.metadata["group"])
        flag_kw = dict(type=boolean, nargs="?", const=True) if f.type is bool else dict(type=f.type)  # --pack = --pack true
        group.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"],
                           choices=f.metadata["choices"], **flag_kw)
    p.set_defaults(preset=None)
    args = p.parse_args(argv)
    # a hub model name without a preset is a real run: the project's namesake's settings, not the tiny task's
    implied = args.preset is None and args.model != TINY_CKPT and not is_local_path(args.model)
    args.preset = args.preset or ("ulorl" if implied else "tiny")
    p.set_defaults(**PRESETS[args.preset], preset=args.preset)  # preset values, then whatever the command line says
    cfg = Config(**vars(p.parse_args(argv)))
    given = sys.argv[1:] if argv is None else argv
    if implied and not cfg.plan and not any(a == "--data" or a.startswith("--data=") for a in given):
        p.error(f"--model {cfg.model} is a hub model: without --preset it trains with UloRL's settings (--preset "
                f"ulorl: lr 1e-6, 128k responses, bf16 on GPU), on prompts you give with --data (the built-in task "
                f"is the tiny model's). For example:\n  torchrun --nproc-per-node 6 train.py --model {cfg.model} "
                f"--data train.parquet --out runs/q30b\nor --preset prorl for ProRL's; --preset tiny keeps the tiny "
                f"task's settings")
    if cfg.device == "auto":  # a GPU for each of this machine's trainer processes, or the CPU
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        cfg.device = "cuda" if gpus and gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "cpu"
    if cfg.attn_implementation == "auto":  # FlashAttention's packed kernels where they run
        cfg.attn_implementation = "varlen" if cfg.device.startswith("cuda") and cfg.pack and cfg.dtype != "float32" \
            else "sdpa"
    for f in dataclasses.fields(cfg):
        name, value, ok = "--" + f.name.replace("_", "-"), getattr(cfg, f.name), f.metadata["ok"]
        if isinstance(value, float) and not math.isfinite(value):
            p.error(f"{name} {value}: must be a finite number")
        if ok and not ok[0](value):
            p.error(f"{name} {value}: {ok[1]}")
    if cfg.eval_data == "auto":
        cfg.eval_data = held_out_of(cfg.data, cfg.eval_every)
    for problem in config_problems(cfg):
        p.error(problem)
    if (cfg.ref_reset_every or cfg.ref_reset_on_stall) and cfg.kl_coef == 0 and cfg.reset != "reference":
        print("warning: --ref-reset-every/--ref-reset-on-stall with --kl-coef 0: there is no reference, so a "
              "reset only clears the optimizer state", file=sys.stderr, flush=True)
    return cfg


def held_out_of(spec: str, eval_every: int) -> str:
    """--eval-data auto: --data itself where every source of it has a held-out draw of its own (the built-in task,
    Reasoning Gym: registry.Source.held_out), else none, said once."""
    try:
        sources = registry.parse_mixture(spec)
    except ValueError:
        return ""  # --data's own check says what is wrong with it
    if all(registry.SOURCES[registry.source_kind(source)].held_out for source, _ in sources):
        return spec
    if eval_every:
        print(f"note: --data {spec} has no held-out draw of its own: no held-out evaluation (--eval-data auto); name "
              f"held-out prompts with --eval-data FILE", file=sys.stderr, flush=True)
    return ""


def data_problems(cfg: Config) -> list[str]:
    """What is wrong with --data and --eval-data before anything is read: a mixture that does not parse, a file
    that is not there (each source kind's own check, registry.Source.check)."""
    out = []
    for flag_name, spec in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if not spec:
            if flag_name == "--data":
                out.append("--data is empty: name the training prompts (the ulorl and prorl presets leave them to "
                           "you), e.g. --data train.parquet")
            continue
        try:
            sources = registry.parse_mixture(spec)
        except ValueError as e:
            out.append(str(e).replace("--data", flag_name, 1))
            continue
        for source, _ in sources:
            check = registry.SOURCES[registry.source_kind(source)].check
            try:
                if check:
                    registry.function(check)(source)
            except (ValueError, OSError) as e:
                out.append(f"{flag_name} {e}")
    return out


def no_cuda() -> str:
    """Why torch cannot use a CUDA GPU here ('' when it can). torch loads here, once a flag names CUDA."""
    import torch
    return "" if torch.cuda.is_available() else (f"this machine has no CUDA GPU that torch can use (torch "
                                                  f"{torch.__version__}, torch.cuda.is_available() is False)")


def config_problems(cfg: Config) -> list[str]:
    """What is wrong with a combination of flags (each value alone passed its own check)."""
    out = []
    if cfg.max_response_len % cfg.segments:
        out.append(f"--max-response-len {cfg.max_response_len} must be a multiple of --segments {cfg.segments}")
    if cfg.is_mode == "tois" and cfg.segments > 1:
        out.append(f"--is-mode tois is defined for one segment (every token sampled by the weights being updated); "
                   f"with --segments {cfg.segments} use sais or pois")
    if cfg.overlap and cfg.is_mode == "tois":
        out.append(f"--overlap {cfg.overlap} trains tokens of the previous weights; --is-mode tois admits only the "
                   f"current ones: use pois or sais")
    if cfg.top_p < 1 or cfg.top_k > 0:
        out.append(f"--top-p {cfg.top_p} / --top-k {cfg.top_k}: training samples with top_p 1 and no top-k (both "
                   f"papers): the trainer's log-probs are over the full distribution, so a truncated one would bias "
                   f"every ratio, DMMPT probability and entropy. Use them for evaluation (eval.py --top-p/--top-k)")
    if not (cfg.device in ("cpu", "cuda") or cfg.device.startswith("cuda:")):
        out.append(f"--device {cfg.device}: must be auto, cpu, cuda or cuda:N")
    elif cfg.device.startswith("cuda") and not cfg.plan and (why := no_cuda()):  # planning needs no GPU
        out.append(f"--device {cfg.device}: {why}; use --device cpu")
    if cfg.device.startswith("cuda") and cfg.rollout_mem > 1:
        out.append(f"--rollout-mem {cfg.rollout_mem}: on GPU it is the fraction of GPU memory vLLM may take, <= 1")
    if cfg.resume and cfg.overwrite:
        out.append(f"--resume {cfg.resume} and --overwrite say opposite things: continue the run, or start again")
    out += [] if cfg.plan else data_problems(cfg)
    if cfg.rollout_gpus:
        if not all(part.strip().isdigit() for part in cfg.rollout_gpus.split(",")):
            out.append(f"--rollout-gpus {cfg.rollout_gpus}: GPU ids ('6,7') or a count ('2')")
        elif not cfg.device.startswith("cuda") or cfg.engine == "hf":
            out.append(f"--rollout-gpus {cfg.rollout_gpus}: GPUs of its own are for the vLLM engine on GPU "
                       f"(--engine vllm --device cuda)")
    if cfg.reset == "reference" and cfg.kl_coef == 0 and (cfg.ref_reset_every or cfg.ref_reset_on_stall):
        out.append("--reset reference with --kl-coef 0: there is no reference, so the resets would renew nothing; "
                   "give --kl-coef > 0 or --reset optimizer")
    if cfg.ref_reset_on_stall and not (cfg.eval_data and cfg.eval_every):
        out.append(f"--ref-reset-on-stall {cfg.ref_reset_on_stall} counts held-out evaluations: give --eval-data and "
                   f"--eval-every > 0")
    if cfg.sp > 1 and not cfg.pack:
        out.append(f"--sp {cfg.sp}: sequence parallelism splits packed rows; add --pack true")
    if cfg.sp > 1 and cfg.attn_implementation not in ("sdpa", "varlen"):
        out.append(f"--sp {cfg.sp} with --attn-implementation {cfg.attn_implementation}: sequence parallelism runs "
                   f"varlen (GPU) or sdpa (CPU) between its all-to-alls")
    if cfg.attn_implementation == "varlen" and (cfg.dtype == "float32" or not cfg.pack or
                                                not cfg.device.startswith("cuda")):
        out.append(f"--attn-implementation varlen: FlashAttention's kernels take packed rows (--pack true) in bf16 or "
                   f"fp16 on a GPU (here --pack {str(cfg.pack).lower()}, --dtype {cfg.dtype}, --device {cfg.device}); "
                   f"sdpa runs everywhere")
    if cfg.rollout_tp and not cfg.rollout_gpus:
        out.append(f"--rollout-tp {cfg.rollout_tp}: tensor parallelism is over --rollout-gpus; give those")
    if cfg.rollout_replicas > 1 and (cfg.engine == "hf" or cfg.engine == "auto" and not cfg.device.startswith("cuda")):
        out.append(f"--rollout-replicas {cfg.rollout_replicas}: replicas are vLLM engines; add --engine vllm")
    elif cfg.rollout_replicas > 1 and cfg.device.startswith("cuda") and not cfg.rollout_gpus:
        out.append(f"--rollout-replicas {cfg.rollout_replicas}: on GPU the replicas need GPUs of their own: "
                   f"--rollout-gpus (replicas x --rollout-tp of them)")
    return out


def tensor_parallel_sizes(heads: int, kv_heads: int, most: int) -> list[int]:
    """Tensor-parallel sizes vLLM can split a model over, up to `most`: each divides the attention heads, and
    divides the KV heads or is a multiple of them (KV heads are then replicated)."""
    return [t for t in range(1, most + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]


def engine_placement(cfg: Config, gpu_count: int, local_ranks: int, heads: int, kv_heads: int,
                     vllm: bool) -> tuple[list[int], int]:
    """(the vLLM engines' GPU ids, each engine's tensor-parallel size: len(ids) / size replicas, in order).
    --rollout-gpus as given ('6,7'; a count '2': the last ones), split into --rollout-replicas when given. Unset,
    on a machine with GPUs and vLLM on GPU, the GPUs its trainer processes leave free (local rank r trains on
    cuda:r; one process: its --device), one engine over as many as the largest TP that fits them
    (`torchrun --nproc-per-node 6` on 8 GPUs: 6,7, TP 2); none free: the trainer's GPU, one trainer process
    only ([] here), since several colocated trainer processes are not built. gpu_count 0 (a plan made without
    GPUs): --rollout-gpus as written, not checked against a machine. `vllm`: the engine is vLLM (engine.engine_kind)."""
    used = [int(cfg.device.split(":")[1])] if local_ranks == 1 and ":" in cfg.device else list(range(local_ranks))
    if cfg.rollout_gpus:
        parts = [int(p) for p in cfg.rollout_gpus.split(",")]
        if not gpu_count:
            gpus = parts if "," in cfg.rollout_gpus else list(range(local_ranks, local_ranks + parts[0]))
        else:
            gpus = parts if "," in cfg.rollout_gpus else list(range(gpu_count - parts[0], gpu_count))
            if not gpus or set(gpus) & set(used) or max(gpus) >= gpu_count:
                raise ValueError(f"--rollout-gpus {cfg.rollout_gpus}: GPUs {gpus} of {gpu_count}, but this machine's "
                                 f"trainer process(es) use {', '.join(f'cuda:{g}' for g in used)}; leave those to "
                                 f"training")
        tp = cfg.rollout_tp or len(gpus) // (cfg.rollout_replicas or 1)
        replicas = cfg.rollout_replicas or len(gpus) // max(tp, 1)
        if not tp or tp * replicas != len(gpus):
            want = f"{cfg.rollout_replicas} engine(s)" if cfg.rollout_replicas else "a whole number of engines"
            raise ValueError(f"--rollout-gpus {cfg.rollout_gpus}: {len(gpus)} GPUs are not {want} of "
                             + (f"tensor-parallel size {cfg.rollout_tp}" if cfg.rollout_tp else "one size")
                             + ": give --rollout-replicas x --rollout-tp of them")
        if tp not in tensor_parallel_sizes(heads, kv_heads, tp):
            raise ValueError(f"--rollout-gpus {cfg.rollout_gpus}: vLLM cannot split {heads} attention heads ({kv_heads} "
                             f"KV heads) over {tp} GPUs; an engine takes "
                             f"{' or '.join(map(str, tensor_parallel_sizes(heads, kv_heads, tp)))} of them "
                             f"(--rollout-tp; GPUs beyond one engine's make --rollout-replicas)")
        return gpus, tp
    if not cfg.device.startswith("cuda") or not gpu_count or not vllm:
        return [], 1
    free = [g for g in range(gpu_count) if g not in used]
    if not free:
        if local_ranks > 1:
            raise ValueError(f"every GPU of this machine ({gpu_count}) is a trainer rank, and vLLM needs GPUs of its own "
                             f"under torchrun: run torchrun --nproc-per-node {max(gpu_count - 2, 1)} (the last "
                             f"{min(2, gpu_count - 1)} serve), or one trainer process (vLLM shares its GPU and sleeps "
                             f"during the update), or --engine hf")
        return [], 1
    tp = max(tensor_parallel_sizes(heads, kv_heads, len(free)))
    return free[:tp], tp
