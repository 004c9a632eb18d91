"""ulorl's entry point: RL with verifiable rewards on ultra-long outputs (UloRL + ProRL's KL control).

    python train.py                                   # tiny built-in model + task: minutes on a laptop CPU
    python train.py --preset ulorl --model Qwen/Qwen3-4B --data dapo.parquet --out runs/q4b
    python train.py --help                            # every knob, with the paper it comes from
    torchrun --standalone --nproc-per-node 2 train.py --parallel fsdp   # trainer ranks: FSDP2 (or ddp)

Owns the run: torchrun setup, loading, the RL loop in paper order and its console line. Every flag is a
field of config.py's `Config`; logs.py writes metrics.jsonl, samples.jsonl and the trackers. Under torchrun
every process is a trainer rank; rank 0 also owns the rollout engine, the pools, the data and the logs, and
hands every rank the step's batch.

One step, in paper order (ulorl.py maps every paper component to its function):
  1-4. rollout (rollouts.py, segment_rollout.py): unfinished samples + new prompts x G decode at most one
       segment; finished samples are rewarded; complete groups that are not all-equal wait for training
       (dynamic sampling); repeat until `--train-groups` of them are ready
  5-6. ulorl.update: old log-probs (POIS recomputes them), reference log-probs (KL), entropy and the DMMPT
       mask; the clipped token-level loss (loss.py) with one global token count per optimizer step
  7.   sync the new weights to the engine (--overlap 1: the engine decoded the next step's rollout, steps 1-4,
       during 5-6, on the weights before them; it ends first)
  8.   log one line + metrics.jsonl; evaluate; checkpoint
"""
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
import data
import eval as eval_lib
import logs
import distributed
from routing import Routing
import seqpar
import model as model_lib
import plan as plan_lib
import reward
import sandbox
import ulorl
from config import Config, engine_placement, parse_config, tensor_parallel_sizes
from engine import Sampling, engine_kind, make_engine
from rollouts import EngineFailure, Rollouts
from segment_rollout import Pools, Sample
from ulorl import RunState


# ------------------------------------------------------------------- set-up: ranks, threads, memory

def setup_distributed(cfg: Config) -> tuple[int, int]:
    """(rank, world size): one process, or torchrun's trainer ranks (gloo on CPU, NCCL with one GPU a rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(cfg.device)
        # (optimizer offload: the gradient norm and the checkpoint's gathers of host-memory shards go through gloo)
        backend = "gloo" if not cfg.device.startswith("cuda") else \
            "cpu:gloo,cuda:nccl" if cfg.offload_optimizer == "true" else "nccl"
        distributed.init_distributed(backend, cfg.dist_timeout)
        seqpar.init_sequence_parallel(cfg.sp)
    return distributed.rank(), world


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


def check_context(cfg: Config, config) -> None:
    """A run needs --max-prompt-len + --max-response-len positions; a model that cannot take them (config.json's
    max_position_embeddings, after YaRN) is an error before anything loads, never a silently shorter engine."""
    need, have = cfg.max_prompt_len + cfg.max_response_len, config.max_position_embeddings
    if need > have:
        original = (getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings") or have
        raise ValueError(f"--max-prompt-len {cfg.max_prompt_len} + --max-response-len {cfg.max_response_len} = {need} "
                         f"positions, but --model {cfg.model} takes {have} (max_position_embeddings"
                         f"{', after YaRN' if cfg.rope_scaling_factor else ''}): extend it with YaRN, e.g. "
                         f"--rope-scaling-factor {need / original:.6g} --rope-original-max-positions {original}, or "
                         f"shorten the prompt or response caps")


def check_routing(cfg: Config, config) -> None:
    """--routing-replay needs a Mixture-of-Experts model, and an engine that returns routing on this device."""
    if cfg.routing_replay == "false":
        return
    if not getattr(config, "num_experts", 0):
        raise ValueError(f"--routing-replay {cfg.routing_replay}: --model {cfg.model} has no Mixture-of-Experts "
                         f"layers (config.json: no num_experts); routing replay is for MoE models such as qwen3_moe")
    if engine_kind(cfg.engine, cfg.device) == "vllm" and cfg.device == "cpu":
        raise ValueError(f"--routing-replay {cfg.routing_replay} with --engine vllm: vLLM returns routed experts from "
                         f"its V2 model runner, which its CPU build lacks; on CPU use --engine hf")


def check_overlap(cfg: Config) -> None:
    """--overlap decodes while the trainers update: the engine needs a process of its own and must not share
    the trainer's GPU (a colocated engine sleeps through the update)."""
    if not cfg.overlap:
        return
    if engine_kind(cfg.engine, cfg.device) != "vllm":
        raise ValueError(f"--overlap {cfg.overlap}: the transformers engine samples with the trainer's own module; "
                         f"overlap needs an engine in a process of its own: --engine vllm")
    if cfg.device.startswith("cuda") and not cfg.rollout_gpus:
        raise ValueError(f"--overlap {cfg.overlap}: the engine shares the trainer's GPU and sleeps during the update; "
                         f"give it GPUs of its own with --rollout-gpus")
    if cfg.verifier_model and cfg.verifier_mode != "off":
        raise ValueError(f"--overlap {cfg.overlap} scores the next step's rollout during the update, and the judge "
                         f"(--verifier-model) would run beside it on the trainer's {cfg.device}, in memory the plan "
                         f"does not count; use --overlap 0 with a generative verifier")
    if cfg.is_mode == "pois" and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: --overlap {cfg.overlap} with --is-mode pois trains the previous weights' tokens as if "
              f"on-policy (reward per step falls behind); --is-mode sais corrects them with their engine log-probs",
              file=sys.stderr, flush=True)


def place(cfg: Config, config, local_ranks: int) -> None:
    """The engines' GPUs, tensor-parallel size and count into cfg.rollout_gpus / rollout_tp / rollout_replicas
    (config.engine_placement; the model's heads bound the TP)."""
    gpus, tp = engine_placement(cfg, torch.cuda.device_count() if cfg.device.startswith("cuda") else 0, local_ranks,
                                config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                                or config.num_attention_heads, engine_kind(cfg.engine, cfg.device) == "vllm")
    cfg.rollout_gpus, cfg.rollout_tp = ",".join(map(str, gpus)), tp if gpus else 0
    cfg.rollout_replicas = len(gpus) // tp if gpus else cfg.rollout_replicas or 1


def fit_parallelism(cfg: Config, world: int, config) -> None:
    """--sp and --offload-optimizer checked against the model's heads and the trainer ranks, and those left at auto
    (the ulorl preset's) chosen from the memory plan (plan.choose), after place()."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    splits = cfg.pack and cfg.attn_implementation in ("sdpa", "varlen")  # what --sp runs on (config_problems)
    sizes = [n for n in tensor_parallel_sizes(heads, kv, world) if world % n == 0] if splits else [1]
    if cfg.sp > 1 and cfg.sp not in sizes:
        raise ValueError(f"--sp {cfg.sp}: a sequence-parallel size divides the {world} trainer rank(s) and the model's "
                         f"{heads} attention heads, and divides its {kv} KV heads or is a multiple of them: "
                         f"{', '.join(map(str, sizes))} here")
    fsdp = world > 1 and cfg.parallel == "fsdp"
    if cfg.offload_optimizer == "true" and not fsdp:
        raise ValueError("--offload-optimizer true is FSDP2's CPU offload: under torchrun with --parallel fsdp")
    capacity = plan_lib.device_bytes(cfg.device, cfg.device_memory)
    cfg.sp, cfg.offload_optimizer = plan_lib.choose(lambda c: memory_plan(c, world, config), cfg, capacity, sizes, fsdp)


def memory_plan(cfg: Config, world: int, config) -> plan_lib.Plan:
    """plan.make_plan from the model's config.json alone (`config`; a hub name's from the Hugging Face cache or
    hub), after place()."""
    vllm = engine_kind(cfg.engine, cfg.device) == "vllm"
    return plan_lib.make_plan(plan_lib.Shape.of(config), cfg, world, cfg.rollout_tp or 1, vllm)


def placement_line(cfg: Config, world: int, local_ranks: int, mem: float) -> str:
    """The startup line that says where everything runs."""
    ranks = f"{world} trainer rank{'s' if world > 1 else ''}"
    where = cfg.device if world == 1 or not cfg.device.startswith("cuda") else \
        f"cuda:0-{local_ranks - 1}" + (" of each node" if world > local_ranks else "")
    compute = f"{cfg.dtype} over fp32 master weights" if cfg.dtype != "float32" else "float32"
    kind = engine_kind(cfg.engine, cfg.device)
    if kind == "hf":
        engine = "transformers, on " + ("the trainer's own module" if world == 1 else "a copy on rank 0")
    elif not cfg.device.startswith("cuda"):
        engine = (f"{cfg.rollout_replicas} vLLM replicas" if cfg.rollout_replicas > 1 else "vLLM") + \
            f" on CPU ({mem:g} GiB of KV cache{' each' if cfg.rollout_replicas > 1 else ''})"
    elif cfg.rollout_gpus:
        engine = (f"vLLM on GPU {cfg.rollout_gpus} (" + (f"{cfg.rollout_replicas} replicas of " if cfg.rollout_replicas > 1
                  else "") + f"TP {cfg.rollout_tp}, gpu_memory_utilization {mem:.2f})")
    else:
        engine = f"vLLM sharing {cfg.device}, asleep during the update (gpu_memory_utilization {mem:.2f})"
    parallel = (f", {cfg.parallel}" + (f", sequence-parallel groups of {cfg.sp}" if cfg.sp > 1 else "")
                + (", optimizer state in host memory" if cfg.offload_optimizer == "true" else "")) if world > 1 else ""
    return f"placement: {ranks} on {where} ({compute}{parallel}); rollout engine: {engine}"


def memory_peaks(cfg: Config, host_before: int) -> dict:
    """The step's memory high-water marks in MiB, the largest rank's: host since loading began, and GPU."""
    out = {"memory/host_peak_mib": distributed.all_max(plan_lib.host_peak() - host_before) / 2**20}
    if cfg.device.startswith("cuda"):
        out["memory/gpu_peak_mib"] = distributed.all_max(torch.cuda.max_memory_allocated()) / 2**20
    return out


# ------------------------------------------------------------------------- models, engine, evaluation

def load_models(cfg: Config, resume_from: str | None, world: int):
    """(policy, reference, lm, ref_lm, tokenizer, masters): the modules the trainer calls (model.wrap; reference
    None without a KL), the Hugging Face models inside them, and the fp32 master weights AdamW steps when the
    run computes in bf16 outside FSDP (distributed.MasterWeights; else None), from the checkpoint when resuming.
    Under FSDP no rank ever holds the whole model: each builds it on the meta device, shards it and reads only
    its own shards from the checkpoint, a layer at a time (model.load_sharded). A bf16 run computes in bf16 over
    fp32 master weights in every mode (FSDP2's own mixed precision under fsdp); they load in fp32 here, and a
    resume then restores the masters themselves from the trainer state (checkpoint.load)."""
    compute = None if cfg.dtype == "float32" else model_lib.DTYPES[cfg.dtype]
    path = resume_from or cfg.model
    ref_path = os.path.join(resume_from, "reference") if resume_from else cfg.model
    yarn = (cfg.rope_scaling_factor, cfg.rope_original_max_positions,
            seqpar.attention_name(cfg.attn_implementation, cfg.sp))
    ref = ref_lm = None
    if world > 1 and cfg.parallel == "fsdp":  # (offload: the reference's fp32 shards too, as large as the masters)
        offload = cfg.offload_optimizer == "true"
        policy, lm, tokenizer = model_lib.load_sharded(path, "float32", cfg.device, cfg.gradient_checkpointing, *yarn,
                                                       compute_dtype=compute, offload=offload)
        if cfg.kl_coef > 0:
            ref, ref_lm, _ = model_lib.load_sharded(ref_path, "float32", cfg.device, False, *yarn, trainable=False,
                                                    compute_dtype=compute, offload=offload)
        return policy, ref, lm, ref_lm, tokenizer, None
    mode = cfg.parallel if world > 1 else "none"
    lm, tokenizer = model_lib.load(path, "float32", cfg.device, cfg.gradient_checkpointing, *yarn)
    masters = distributed.MasterWeights(lm, compute) if compute else None
    if cfg.kl_coef > 0:  # frozen: no masters, it computes in the run's dtype
        ref_lm = model_lib.load(ref_path, cfg.dtype, cfg.device, False, *yarn)[0].eval().requires_grad_(False)
        ref = model_lib.wrap(ref_lm, mode, trainable=False)
    return model_lib.wrap(lm, mode, compute_dtype=compute), ref, lm, ref_lm, tokenizer, masters


def rollout_engine(cfg: Config, lm, tokenizer, path: str, world: int, mem: float):
    """Rank 0's engine. In one process the transformers engine samples with the trainer's own module and vLLM
    runs in-process (or, on GPU, sleeps on the trainer's GPU during updates); under torchrun the transformers
    engine samples with a copy on rank 0, and vLLM runs in a process of its own (inside a trainer rank it would
    join torchrun's process group and wait forever), on the GPUs place() chose. `mem`: plan.engine_memory."""
    gpus = [int(g) for g in cfg.rollout_gpus.split(",") if g]
    kind = engine_kind(cfg.engine, cfg.device)
    if kind == "hf" and world > 1:  # the trainer's module is sharded: the engine samples with a whole copy
        lm = model_lib.load(path, cfg.dtype, cfg.device, False, cfg.rope_scaling_factor,
                            cfg.rope_original_max_positions, seqpar.attention_name(cfg.attn_implementation, 1))[0]
    return make_engine(kind, lm, tokenizer, cfg.seed, path=path,
                       max_model_len=cfg.max_prompt_len + cfg.max_response_len, mem=mem, device=cfg.device,
                       dtype=cfg.dtype,
                       hf_overrides=model_lib.yarn_overrides(lm.config, cfg.rope_scaling_factor,
                                                             cfg.rope_original_max_positions),
                       own_process=world > 1 or cfg.overlap > 0, gpus=gpus, tp=cfg.rollout_tp or 1,
                       routing=cfg.routing_replay != "false", replicas=cfg.rollout_replicas)


def held_out(engine, tokenizer, rows: list[dict], cfg: Config, judge: reward.Judge | None) -> dict:
    """avg@1 on the held-out prompts (eval.evaluate), sampled like the training rollouts, in one segment of
    the full length. Sample uids count down from -1: the same draws at every evaluation, apart from training's.
    Judged as eval.py judges, whatever --overlong shapes the training reward: a truncated response is unsolved."""
    kept = engine.bookkeeping() if hasattr(engine, "bookkeeping") else None  # --rollout-replicas: the rollout's
    summary, _, metrics = eval_lib.evaluate(engine, tokenizer, rows, 1, cfg.max_response_len,
                                            Sampling(cfg.temperature, cfg.top_p, cfg.top_k), segments=1, batch=256,
                                            timeout=cfg.reward_timeout, overlong="zero", judge=judge,
                                            pools=Pools(next_uid=-1, count_down=True))
    if kept is not None:  # an evaluation's calls neither teach the replicas' split nor count in their idle share
        engine.restore(kept)
    return {"eval/accuracy": summary["avg@k"], "eval/reward": summary["mean_reward"],
            "eval/mean_length": summary["mean_length"], "eval/truncation_rate": summary["truncation_rate"],
            "eval/reward_timeouts": metrics["reward/timeouts"]}


def evaluate_before_training(engine, tokenizer, eval_rows, cfg: Config, judge, state: RunState) -> dict:
    """Step 0's record: held-out accuracy before any update, also the baseline --ref-reset-on-stall improves on."""
    t0, ev = time.time(), held_out(engine, tokenizer, eval_rows, cfg, judge)
    ulorl.stalled(state, ev["eval/accuracy"], cfg.ref_reset_on_stall)
    print(f"step     0 | eval accuracy {ev['eval/accuracy']:.3f} (before training)", flush=True)
    return {"step": 0, "time/step_s": time.time() - t0, "reward/mean": None, "entropy/mean": None,
            "mpt/masked_frac": None, "rollout/unfinished": 0, "tokens/generated": 0, **ev}


def sync_weights(engine, lm, dtype: str, replicas: int = 1) -> None:
    """Step 7, the one place new weights reach the engine: rank 0's engine takes the trainer's module (vLLM
    through its weight-transfer API, weight_sync.py); the weights are gathered from the FSDP shards a layer
    at a time, cast to the run's `dtype` first (fp32 masters travel as bf16), and every other rank takes its
    part in those gathers: once for each of the `replicas` engines, which take the weights one after the other."""
    if engine is not None:
        engine.update_weights(lm)
    else:
        for _ in range(replicas):
            distributed.gather_only(lm, model_lib.DTYPES[dtype])


# ----------------------------------------------------------------------------------------- logging

def step_metrics(step: int, groups: list[list[Sample]], rewards: list, t_roll: float, record: dict) -> dict:
    """The step's rollout numbers: rewards (per verifier too: one curve each in a mixture), lengths, speed.
    `rewards`: (verifier, reward) of every sample the step's rollout rewarded; `record` is the step's record so
    far (its generated-token count)."""
    trained = [s for g in groups for s in g]
    out = {}
    for v in sorted({v for v, _ in rewards}):
        rs = [r for w, r in rewards if w == v]
        out[f"reward/by_verifier/{v}"] = sum(rs) / len(rs)
    out.update({"step": step, "reward/mean": sum(r for _, r in rewards) / len(rewards) if rewards else None,
                "reward/trained_mean": sum(s.reward for s in trained) / len(trained),
                "response/mean_len": sum(len(s.tokens) for s in trained) / len(trained),
                "response/max_len": max(len(s.tokens) for s in trained),
                "response/truncated_frac": sum(s.finish == "truncated" for s in trained) / len(trained),
                "response/multi_segment_frac": sum(len(s.seg_starts) > 1 for s in trained) / len(trained),
                # (--overlap: the rollout's own time, most of it beside the last update)
                "tokens/per_s": record["tokens/generated"] / max(t_roll + record.get("time/rollout_ahead_s", 0),
                                                                 1e-9), "time/rollout_s": t_roll})
    return out


def log_line(record: dict, eta_s: float, threads: int) -> str:
    def num(key, form=".3f"):  # null (nothing measured) as "-"
        return "  -  " if record.get(key) is None else format(record[key], form)
    acc = f" | eval {record['eval/accuracy']:.3f}" if "eval/accuracy" in record else ""
    return (f"step {record['step']:5d} | reward {num('reward/mean')}{acc} | entropy {num('entropy/mean')} | "
            f"masked {num('mpt/masked_frac')} | unfinished {record['rollout/unfinished']:4d} | "
            f"tok/s {record['tokens/per_s']:7.0f} | {record['time/step_s']:.2f}s | eta {eta_s / 60:.1f}m | "
            f"{threads} thr")


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


def start(cfg: Config) -> tuple:
    """Checks, placement, the memory plan, torchrun's ranks: (rank, world, lead, threads, plan, engine memory);
    plan None for --plan, which prints the plan for the WORLD_SIZE ranks torchrun would start and starts
    nothing."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    model_config = model_lib.model_config(cfg.model, cfg.rope_scaling_factor, cfg.rope_original_max_positions)
    check_context(cfg, model_config)
    check_routing(cfg, model_config)
    place(cfg, model_config, local_ranks)
    check_overlap(cfg)
    fit_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")), model_config)
    if cfg.plan:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0:
            print(plan_lib.report(memory_plan(cfg, world, model_config), cfg, world), flush=True)
        return 0, world, False, 0, None, 0.0
    rank, world = setup_distributed(cfg)
    threads = set_threads(cfg.threads, local_ranks)
    plan, capacity = memory_plan(cfg, world, model_config), plan_lib.device_bytes(cfg.device, cfg.device_memory)
    engine_mem = plan_lib.engine_memory(plan, cfg, capacity)
    if rank == 0:
        print(json.dumps(dataclasses.asdict(cfg)), flush=True)
        print(placement_line(cfg, world, local_ranks, engine_mem), flush=True)
    if why := plan_lib.problems(plan, cfg, capacity, colocated=not cfg.rollout_gpus):
        raise ValueError("the run cannot fit (python train.py ... --plan shows the items):\n  " + "\n  ".join(why))
    os.umask(0o077)  # what the run writes is its own: checkpoints and samples hold the data's answers
    return rank, world, rank == 0, threads, plan, engine_mem


def load_data(cfg: Config, lead: bool) -> tuple[list[dict], list[dict]]:
    """Rank 0's training and held-out rows (other ranks: none); a run whose rows run model output as code
    stops here when this machine cannot isolate it."""
    if not lead:
        return [], []
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, default_verifier=cfg.default_verifier)
    rows = data.load_prompts(cfg.data, cfg.seed, **keys)
    evaluating = bool(cfg.eval_data and cfg.eval_every)
    eval_rows = data.load_prompts(cfg.eval_data, cfg.seed, True, cfg.eval_n, **keys) if evaluating else []
    if any(r["verifier"] in ("code", "rg") for r in rows + eval_rows) and (why := sandbox.available()):
        raise ValueError(why)  # model output that may run as code is never scored unisolated
    return rows, eval_rows


def replay_routing(cfg: Config, lm, ref_lm) -> None:
    """--routing-replay true: the trainer's forwards route as the engine did (record: they only compare)."""
    for module in (lm, ref_lm) if cfg.routing_replay != "false" else ():
        if module is not None:
            Routing.of(module).swap = cfg.routing_replay == "true"


def startup_metrics(load_peak_mib: float, plan: plan_lib.Plan) -> dict:
    """What the first metrics.jsonl record holds once: loading's host peak and the plan's totals."""
    out = {"memory/load_host_mib": load_peak_mib, "memory/plan_trainer_mib": plan.trainer_total / 2**20}
    if "offloaded optimizer state" in plan.host:
        out["memory/plan_offloaded_mib"] = plan.host["offloaded optimizer state"] / 2**20
    return out


def save_checkpoint(path: str, **kw) -> None:
    """checkpoint.save, with a refused write (full disk, read-only --out) reported as what it is: the
    unfinished step_N.tmp is removed, and the message says what is safe."""
    try:
        checkpoint.save(path, **kw)
    except OSError as e:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        if (error := checkpoint.write_error(e, f"could not write checkpoint {path}", kw["cfg"].out)) is None:
            raise
        raise error from None


@dataclasses.dataclass
class Run:
    """What the loop works with, set up once: the trainer's side (every rank) and rank 0's engine, data and logs."""
    cfg: Config
    world: int
    lead: bool  # rank 0: the engine, the pools, the data and the logs
    threads: int
    policy: torch.nn.Module  # model.wrap()ped: micro-batch -> (log-probs, entropy)
    ref: torch.nn.Module | None  # the KL reference, wrapped the same way (--kl-coef 0: none)
    lm: torch.nn.Module  # the Hugging Face model under `policy`
    ref_lm: torch.nn.Module | None
    tokenizer: object
    masters: object  # distributed.MasterWeights: the fp32 weights AdamW steps in a bf16 run outside FSDP (else None)
    opt: torch.optim.Optimizer
    sched: object
    state: RunState
    host_before: int  # the host memory peak before loading (memory/* metrics)
    engine: object = None
    rollouts: Rollouts | None = None
    judge: reward.Judge | None = None
    eval_rows: list = dataclasses.field(default_factory=list)
    log: logs.RunLog | None = None
    out_lock: object = None
    save: object = None  # save(path): a checkpoint of everything
    startup: dict = dataclasses.field(default_factory=dict)  # logged once, with the first record

    def reset_reference(self) -> None:  # ProRL: reference <- policy, fresh AdamW moments
        ulorl.reset_reference(self.lm, self.ref_lm, self.opt, self.ref)


def claim_out(cfg: Config, lead: bool) -> tuple[str | None, object]:
    """--out before anything loads: the checkpoint --resume names (None: a fresh run) and rank 0's lock, one run
    per --out until this process ends; --overwrite clears the old run first."""
    resume_from = checkpoint.find_resume(cfg.resume, cfg.out, cfg.overwrite)
    out_lock = checkpoint.lock_out(cfg.out) if lead else None
    if lead and cfg.overwrite and (gone := checkpoint.clear_run(cfg.out)):
        print(f"--overwrite: deleted {', '.join(gone)} from {cfg.out}", flush=True)
    distributed.barrier()
    return resume_from, out_lock


def set_up(cfg: Config) -> Run | None:
    """Checks, data, models, the engine, the optimizer and a resumed run's state; the held-out accuracy before
    training. None for --plan (printed; nothing started)."""
    rank, world, lead, threads, plan, engine_mem = start(cfg)
    if plan is None:
        return None
    resume_from, out_lock = claim_out(cfg, lead)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)
    rows, eval_rows = load_data(cfg, lead)  # data before models: a bad row stops the run at once
    host_before = plan_lib.reset_host_peak()
    policy, ref, lm, ref_lm, tokenizer, masters = load_models(cfg, resume_from, world)
    replay_routing(cfg, lm, ref_lm)
    load_peak = distributed.all_max(plan_lib.host_peak() - host_before) / 2**20  # MiB, the largest rank's
    opt = torch.optim.AdamW(masters.parameters() if masters else policy.parameters(), lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(ulorl.lr_factor, cfg=cfg))
    state = RunState(run_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    run = Run(cfg, world, lead, threads, policy, ref, lm, ref_lm, tokenizer, masters, opt, sched, state, host_before,
              eval_rows=eval_rows, out_lock=out_lock, startup=startup_metrics(load_peak, plan))
    pools = Pools()
    if lead:
        run.engine = rollout_engine(cfg, lm, tokenizer, resume_from or cfg.model, world, engine_mem)
        if cfg.verifier_model and cfg.verifier_mode != "off":
            run.judge = eval_lib.load_judge(cfg.verifier_model, cfg.verifier_mode, cfg.verifier_max_tokens,
                                            cfg.dtype, cfg.device, cfg.seed)
    run.save = functools.partial(save_checkpoint, lm=lm, ref_lm=ref_lm, tokenizer=tokenizer, opt=opt, sched=sched,
                                 engine=run.engine, pools=pools, state=state, cfg=cfg, git=logs.git_hash())
    if resume_from:
        checkpoint.load(resume_from, opt, sched, run.engine, pools, state, masters)
    if lead:
        sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
        run.rollouts = Rollouts(run.engine, pools, rows, state, tokenizer, sampling, cfg, run.judge)
        if resume_from:
            print(f"resumed from {resume_from} at step {state.step}", flush=True)
        run.log = logs.RunLog(cfg, state.step if resume_from else None)
        if state.step == 0 and eval_rows:
            run.log.record({**evaluate_before_training(run.engine, tokenizer, eval_rows, cfg, run.judge, state),
                            **run.startup})
            run.startup = {}
    return run


def next_batch(run: Run):
    """Steps 1-4 on rank 0: the step's groups (rollouts.Batch). An engine that failed leaves a checkpoint of the
    samples decoded so far in one process (under torchrun a checkpoint needs every rank: the newest periodic
    one resumes)."""
    try:
        return run.rollouts.next()
    except EngineFailure:
        if run.world == 1:
            run.save(os.path.join(run.cfg.out, f"step_{run.state.step:06d}"))
        raise


def finish_step(run: Run, step: int, batch, record: dict, t_roll: float, t0: float, step_times: list) -> None:
    """Step 8 before the checkpoint: the held-out evaluation (ProRL also resets when its accuracy stalls), then
    rank 0's metrics.jsonl record, samples and console line."""
    cfg, lead = run.cfg, run.lead
    if cfg.eval_data and cfg.eval_every and (step == cfg.steps or step % cfg.eval_every == 0):
        if lead:
            record.update(held_out(run.engine, run.tokenizer, run.eval_rows, cfg, run.judge))
        if distributed.broadcast(lead and ulorl.stalled(run.state, record["eval/accuracy"], cfg.ref_reset_on_stall)):
            run.reset_reference()
            record["train/ref_reset"] = 1
    if not lead:
        return
    record.update(step_metrics(step, batch.groups, batch.rewards, t_roll, record), **run.startup)
    run.startup = {}
    if cfg.dump_samples:
        run.log.dump_samples(batch.groups, step, run.tokenizer, cfg.dump_samples)
    record["time/step_s"] = time.time() - t0
    step_times.append(record["time/step_s"])
    run.log.record(record)  # before the checkpoint: every record up to a checkpoint's step exists
    print(log_line(record, sum(step_times) / len(step_times) * (cfg.steps - step), run.threads), flush=True)


# -------------------------------------------------------------------------------------------- main

def main(cfg: Config) -> None:
    """The run: set-up, then the RL loop, one step in the papers' order."""
    run = set_up(cfg)
    if run is None:  # --plan: printed, nothing started
        return
    state, lead, engine, rollouts = run.state, run.lead, run.engine, run.rollouts
    stop, step_times = stop_on_signals(lead, state), []
    while state.step < cfg.steps:
        t0, step = time.time(), state.step + 1

        # 1-4. rollout: segments of unfinished and new samples, rewards, dynamic sampling, until enough groups
        batch = next_batch(run) if lead else None
        t_roll = time.time() - t0
        if lead and cfg.overlap:  # the next step's rollout (the probe first) decodes during this update
            rollouts.start_next(batch, step)
        groups, probing, stop_now = distributed.broadcast((batch.groups, batch.probing, stop[0] if stop else "")
                                                        if lead else None)
        record = batch.record if lead else {}  # the step's metrics.jsonl record: the rollout's counts first
        # every rank takes the probe when the update asks for it (after its own pass over the batch)
        probe = (lambda: distributed.broadcast(rollouts.probe() if lead else None)) if probing else None

        # 5-6. pi_old, reference log-probs and DMMPT mask, the clipped loss, the optimizer (each rank its share)
        if lead:
            engine.pause()  # vLLM sharing the trainer's GPU sleeps meanwhile
        record.update(ulorl.update(run.policy, run.ref, run.opt, run.sched, groups, state.version,
                                   run.tokenizer.pad_token_id, cfg, run.masters, state.engine_kl, probe))
        record.update(memory_peaks(cfg, run.host_before))
        ulorl.count_bad_steps(record, state, cfg, warn=lead)
        if record["train/optimizer_steps"]:
            state.version += 1
        if cfg.ref_reset_every and step % cfg.ref_reset_every == 0:
            run.reset_reference()  # ProRL: reference <- policy, fresh AdamW moments
            record["train/ref_reset"] = 1

        # 7. the new weights reach the engine (after the rollout decoding ahead ended); unfinished samples continue
        if cfg.overlap:  # the other ranks wait for it here, with no timeout: in the sync's gathers NCCL's watchdog
            record["time/engine_wait_s"] = rollouts.join() if lead else 0.0  # would end the run (--dist-timeout)
            distributed.barrier()
        if lead:
            engine.resume()
        if record["train/optimizer_steps"]:
            t_sync = time.time()
            sync_weights(engine, run.lm, cfg.dtype, cfg.rollout_replicas or 1)
            record["time/sync_s"] = time.time() - t_sync
        state.step = step

        # 8. evaluate, log, checkpoint
        finish_step(run, step, batch, record, t_roll, t0, step_times)
        stop_now = stop_now or (stop[0] if run.world == 1 and stop else "")
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop_now:
            run.save(os.path.join(cfg.out, f"step_{step:06d}"))
        if stop_now:
            if lead:
                print(f"stopped by {stop_now} after step {step}; checkpoint saved (resume with --resume auto)",
                      flush=True)
            break
    if lead:
        run.log.close()
        run.out_lock.close()
    if run.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(parse_config(description=__doc__))
    except (ValueError, FileNotFoundError) as e:  # a user's mistake (a data row, an --out, a file): the message says it
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk or a read-only --out while writing the logs
        if e.errno not in checkpoint.WRITE_ERRORS:
            raise
        sys.exit(f"error: {e.strerror} ({e.filename}); the newest complete checkpoint in --out resumes with "
                 f"--resume auto once it can be written")
