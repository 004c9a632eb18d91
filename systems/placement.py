"""Where a run's parts go, decided before anything loads: torchrun's ranks and their backend, torch's threads,
the engines' GPUs, tensor-parallel size and replicas, --sp and --offload-optimizer from the memory plan
(plan.py), and the checks of the model's config.json against the flags. `start` does it all for train.py;
`load_models` loads the policy and reference whole or (FSDP) sharded, never whole on any rank; `rollout_engine`
makes rank 0's engine; eval.py shares `check_context`.
"""
import dataclasses
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import model as model_lib
from config import Config, engine_placement, tensor_parallel_sizes
from systems import distributed
from systems import plan as plan_lib
from systems import routing
from systems import seqpar
from systems.engine import engine_kind, make_engine


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
    """torch's CPU threads: --threads; for 0, OMP_NUM_THREADS when the user set it, else this rank's share of the
    cores idle now among the machine's trainer ranks. torchrun sets OMP_NUM_THREADS=1 itself when it starts
    several ranks a machine and finds it unset, so there a 1 counts as unset (--threads 1 asks for one): with
    --offload-optimizer the fp32 gradients and AdamW of a 30B model would run on one core a rank while the rest
    idle. (Measured on 2 cores with one busy neighbour: 20 tiny steps took 147 s with 2 threads, 78 s with 1;
    idle, 52 s with 2.)"""
    if not requested:
        omp = os.environ.get("OMP_NUM_THREADS")
        if omp and not (omp == "1" and local_ranks > 1 and "TORCHELASTIC_RUN_ID" in os.environ):
            return torch.get_num_threads()
        idle = len(os.sched_getaffinity(0)) - round(busy_cores())
        requested = max(1, idle // local_ranks)
    torch.set_num_threads(requested)
    return requested


def check_context(need: int, what: str, model: str, config, how: str = "") -> None:
    """`need` positions (`what` says whose) against what --model takes (config.json's max_position_embeddings,
    after YaRN): an error before anything loads, never a silently shorter engine. `how` says what to change."""
    have = config.max_position_embeddings
    if need > have:
        original = (getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings") or have
        how = how or (f"extend it with YaRN, e.g. --rope-scaling-factor {need / original:.6g} "
                      f"--rope-original-max-positions {original}, or shorten the prompt or response caps")
        raise ValueError(f"{what} = {need} positions, but --model {model} takes {have} (max_position_embeddings"
                         f"{', after YaRN' if original != have else ''}): {how}")


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


def start(cfg: Config) -> tuple:
    """Checks, placement, the memory plan, torchrun's ranks: (rank, world, lead, threads, plan, engine memory);
    plan None for --plan, which prints the plan for the WORLD_SIZE ranks torchrun would start and starts
    nothing."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    model_config = model_lib.model_config(cfg.model, cfg.rope_scaling_factor, cfg.rope_original_max_positions)
    check_context(cfg.max_prompt_len + cfg.max_response_len,
                  f"--max-prompt-len {cfg.max_prompt_len} + --max-response-len {cfg.max_response_len}", cfg.model,
                  model_config)
    check_routing(cfg, model_config)
    place(cfg, model_config, local_ranks)
    check_overlap(cfg)
    fit_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")), model_config)
    if cfg.plan:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0:
            disk = plan_lib.disk_line(plan_lib.checkpoint_bytes(plan_lib.Shape.of(model_config), cfg, world), cfg)
            print(plan_lib.report(memory_plan(cfg, world, model_config), cfg, world, disk), flush=True)
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
    if rank == 0:
        check_disk(cfg, plan_lib.checkpoint_bytes(plan_lib.Shape.of(model_config), cfg, world))
    os.umask(0o077)  # what the run writes is its own: checkpoints and samples hold the data's answers
    return rank, world, rank == 0, threads, plan, engine_mem


def check_disk(cfg: Config, sizes: dict) -> None:
    """A run writes a checkpoint at its end at least: --out with less free space than one refuses it before
    anything loads (a disk that fills at step 40 would end it there); less than --keep-last needs is a warning."""
    one, where = sum(sizes.values()), os.path.abspath(cfg.out)
    while not os.path.exists(where):  # --out may not exist yet: the file system it will be made on
        where = os.path.dirname(where)
    disk = os.statvfs(where)
    free = disk.f_bavail * disk.f_frsize
    if free < one:
        raise ValueError(f"--out {cfg.out}: {free / 2**20:.1f} MiB free, and one checkpoint of this run needs "
                         f"~{one / 2**20:.1f} MiB ({', '.join(f'{k} {v / 2**20:.1f}' for k, v in sizes.items())}); "
                         f"free space there, or choose another --out")
    if cfg.keep_last > 0 and free < (cfg.keep_last + 1) * one:
        print(f"warning: --out {cfg.out} has {free / 2**30:.2f} GiB free; --keep-last {cfg.keep_last} needs "
              f"~{(cfg.keep_last + 1) * one / 2**30:.2f} GiB (checkpoints of ~{one / 2**30:.2f} GiB): a later save "
              f"may not fit", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- loading

def wrap(lm, parallel: str, trainable: bool = True, compute_dtype: torch.dtype | None = None, offload: bool = False,
         watch=None):
    """The module the trainer calls: Policy(lm), its forward run on this rank's slice of a packed row under the
    packed kernels and --sp (seqpar.sliced), through the engine's experts under --routing-replay
    (routing.replayed) and seen by the engine/trainer gap check (`watch`, an engine_gap.Watch), in one process
    or under DDP or FSDP2 (distributed.wrap)."""
    tokens = seqpar.sliced(routing.replayed(model_lib.response_tokens))
    policy = model_lib.Policy(lm, watch.around(tokens) if watch else tokens)
    return distributed.wrap(policy, lm.get_decoder().layers, parallel, trainable, compute_dtype, offload)


def load_models(cfg: Config, resume_from: str | None, world: int, watch=None):
    """(policy, reference, lm, ref_lm, tokenizer, masters): the modules the trainer calls (wrap; reference
    None without a KL), the Hugging Face models inside them, and the fp32 master weights AdamW steps when the
    run computes in bf16 outside FSDP (distributed.MasterWeights; else None), from the checkpoint when resuming.
    Under FSDP no rank ever holds the whole model: each builds it on the meta device, shards it and reads only
    its own shards from the checkpoint, a layer at a time (load_sharded). A bf16 run computes in bf16 over
    fp32 master weights in every mode (FSDP2's own mixed precision under fsdp); they load in fp32 here, and a
    resume then restores the masters themselves from the trainer state (checkpoint.load). `watch` sees the
    policy's forwards (wrap)."""
    compute = None if cfg.dtype == "float32" else model_lib.DTYPES[cfg.dtype]
    path = resume_from or cfg.model
    ref_path = os.path.join(resume_from, "reference") if resume_from else cfg.model
    yarn = (cfg.rope_scaling_factor, cfg.rope_original_max_positions,
            seqpar.attention_name(cfg.attn_implementation, cfg.sp))
    ref = ref_lm = None
    if world > 1 and cfg.parallel == "fsdp":  # (offload: the reference's fp32 shards too, as large as the masters)
        offload = cfg.offload_optimizer == "true"
        policy, lm, tokenizer = load_sharded(path, "float32", cfg.device, cfg.gradient_checkpointing, *yarn,
                                                       compute_dtype=compute, offload=offload, watch=watch)
        if cfg.kl_coef > 0:
            ref, ref_lm, _ = load_sharded(ref_path, "float32", cfg.device, False, *yarn, trainable=False,
                                                    compute_dtype=compute, offload=offload)
        return policy, ref, lm, ref_lm, tokenizer, None
    mode = cfg.parallel if world > 1 else "none"
    lm, tokenizer = model_lib.load(path, "float32", cfg.device, cfg.gradient_checkpointing, *yarn)
    masters = distributed.MasterWeights(lm, compute) if compute else None
    if cfg.kl_coef > 0:  # frozen: no masters, it computes in the run's dtype
        ref_lm = model_lib.load(ref_path, cfg.dtype, cfg.device, False, *yarn)[0].eval().requires_grad_(False)
        ref = wrap(ref_lm, mode, trainable=False)
    return wrap(lm, mode, compute_dtype=compute, watch=watch), ref, lm, ref_lm, tokenizer, masters


def load_sharded(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False,
                 rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0,
                 attn_implementation: str = "sdpa", trainable: bool = True, compute_dtype: torch.dtype | None = None,
                 offload: bool = False, watch=None):
    """(wrapped module, model, tokenizer) under FSDP2 without any rank holding the whole model: built on the
    meta device, sharded (wrap), then each rank allocates its shards and fills them from the checkpoint's
    safetensors, read a decoder layer at a time (fill_shards). Peak memory per rank: its shards + one layer.
    compute_dtype: the shards (`dtype`) are master weights, and every forward computes in this dtype (wrap).
    offload: the shards live in host memory (wrap); the buffers (rotary frequencies) on `device`."""
    tokenizer, config = model_lib.load_config(name_or_path, rope_scaling_factor, rope_original_max_positions)
    with distributed.params_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=model_lib.DTYPES[dtype], attn_implementation=attn_implementation)
    lm.eval().requires_grad_(trainable)  # as from_pretrained leaves it (a frozen reference: no gradients)
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    policy = wrap(lm, "fsdp", trainable=trainable, compute_dtype=compute_dtype, offload=offload, watch=watch)
    buffers = {name: b.clone() for name, b in lm.named_buffers()}
    policy.to_empty(device="cpu" if offload else device)  # to_empty also empties the buffers: put them back
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        lm.get_submodule(owner)._buffers[leaf] = b.to(device)
    distributed.fill_shards(lm, local_checkpoint(name_or_path))
    return policy, lm, tokenizer


def local_checkpoint(name_or_path: str) -> str:
    """The directory holding a model's files: itself, or a hub name's snapshot in the Hugging Face cache."""
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)
    from huggingface_hub import snapshot_download
    return snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])
