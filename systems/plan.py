"""The memory plan: what a run needs per trainer GPU and per engine GPU, from the model's config.json alone,
before anything loads (`python train.py ... --plan` prints it; every run checks it and stops when it cannot
fit), and the host-memory peaks train.py measures; `python -m bench plan check` (bench/memory_plan.py) checks
the plan against them (on CPU, host memory stands in for the device's).

    WORLD_SIZE=6 python train.py --preset ulorl --model Qwen/Qwen3-30B-A3B --rollout-gpus 6,7 --plan

(--plan needs no GPU and no data: WORLD_SIZE is the number of trainer ranks torchrun would start.)

Per trainer rank (P parameters, sharded over the trainer ranks under FSDP, whole under DDP or one process;
b = 4: a bf16 run keeps fp32 master weights in every mode, and c = bytes of the run's dtype, the compute's):
  weights, gradients      P x b each
  AdamW                   2 x P x b (its two moments, in the masters' dtype)
  compute copy            bf16 outside FSDP: the module the forward runs, P x c (FSDP casts a layer at a time)
  reference (KL only)     P x b under FSDP (sharded like the masters), else P x c
  gathered                FSDP: the root's parameters (embeddings, lm_head) and two decoder layers (the one
                          computing and the next, prefetched) in the compute dtype
  activations             per decoder layer for T = --max-tokens-per-micro-batch tokens (under --sp N, T / N on
                          each rank): kept for every layer (or, with --gradient-checkpointing, only each layer's
                          input, plus one layer's activations while it is recomputed in the backward)
  all-to-all (--sp)       a layer's q, k, v and attention output at the whole row's length for heads / N, sent
                          and received (every layer's without checkpointing)
  attention               with a mask, for rows of L tokens (packed: L = T): sdpa keeps an [L, L] float mask per
                          layer (eager: heads x L x L scores per layer); under --sp on CPU one mask shared by
                          every layer; varlen and flash attention keep none
  lm_head                 512 positions at a time: 4 x [512, V] fp32 (logits, log-softmax, probabilities,
                          their gradient; measured: 4.0, and 5.0 with the entropy in the loss)
  routing replay ids      --routing-replay (MoE): the running layer's replayed experts, [tokens, top_k] int64
                          (the replay ids themselves stay in host memory, below)
--offload-optimizer true (FSDP): weights, gradients, AdamW moments (and the reference) move to the host; the GPU
keeps each gathered layer's fp32 shard on its way in. Per node, host memory is then every rank's share of them.
Per trainer process's host: the rollout's records (ids, log-probs, versions: HOST_BYTES_PER_TOKEN a token) of
every sample in flight at full length on rank 0, and the step's batch, pickled and unpickled, on every rank;
with --routing-replay (MoE) the same samples' routing too, layers x top_k ids a token (routing.routing_dtype: one byte
each up to 256 experts, else two), and the running micro-batch's replay ids (routing.replay_layout, made for each
forward: layers x top_k int16 a token and an int64 version a token; under --sp the whole row, on every rank of the
group), plus each router's copy of its slice of it (routing.Routing.use; the reference's too). Samples in flight: the rollout batch's slots (--prompts-per-step x
--group-size) at full length. That assumes the experience pool and the ready groups carried over (neither has a cap
of its own) fit in the room the unfinished samples leave: samples that finished early are short.
Per engine GPU (vLLM, tensor-parallel over --rollout-tp): its weights / tp, and the KV cache of one sample
and of the whole rollout batch (--prompts-per-step x --group-size samples) at full context (--max-prompt-len
+ --max-response-len). Weights and one sample must fit; vLLM queues the samples its KV cache cannot hold,
which costs throughput, not the run. Sharing a trainer's GPU (no --rollout-gpus), vLLM sleeps during the
update, and while it samples the trainer keeps its weights, gradients and AdamW moments.
A decoder layer's activations: its inputs and norms (~8 H), q/k/v and their normed/rotated copies
(~(3 nq + 5 nkv) D), attention output (nq D), the MLP's gate, up, activation and product (4 I; for a
Mixture-of-Experts layer 4 K Im for the K experts each token visits, plus the routed copies of the hidden
states, 2 K H): in the compute dtype; and one layer's worth again for the gradients the backward holds.
"""
import dataclasses
import os
from dataclasses import dataclass

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A sample's token on the host: its id (a Python int in a list, 36 bytes), behaviour log-prob (a float, 32) and
# policy version (8), ~80 bytes with the lists' slack (tracemalloc, 200k tokens); pickled for the step's
# broadcast, ~15 (tests/test_plan.py measures both)
HOST_BYTES_PER_TOKEN, PICKLED_BYTES_PER_TOKEN = 80, 15
JSON_BYTES_PER_TOKEN = 40  # a pooled sample's token in a checkpoint's ulorl_state.json: id, log-prob, version
GIB = 2**30


@dataclass
class Shape:
    """What the plan needs of a config.json (dense Qwen3-style or Mixture-of-Experts)."""
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    expert_intermediate: int = 0
    tied: bool = False

    @classmethod
    def of(cls, config) -> "Shape":
        get = lambda *names, default=0: next((getattr(config, n) for n in names if getattr(config, n, None)), default)
        heads = get("num_attention_heads")
        experts = get("num_experts", "num_local_experts", "n_routed_experts")
        return cls(layers=get("num_hidden_layers"), hidden=get("hidden_size"), vocab=get("vocab_size"), heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads),
                   head_dim=get("head_dim", default=get("hidden_size") // max(heads, 1)),
                   intermediate=get("intermediate_size"), experts=experts,
                   experts_per_token=get("num_experts_per_tok", "top_k") if experts else 0,
                   expert_intermediate=get("moe_intermediate_size") if experts else 0,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    def layer_params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        norms = 2 * self.hidden + 2 * self.head_dim
        mlp = (self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
               if self.experts else 3 * self.hidden * self.intermediate)
        return attn + norms + mlp

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def layer_activations(self, tokens: int) -> int:
        """Numbers (not bytes) one decoder layer keeps for the backward, for `tokens` tokens."""
        qkv = (3 * self.heads + 5 * self.kv_heads) * self.head_dim + self.heads * self.head_dim
        mlp = (4 * self.experts_per_token * self.expert_intermediate + 2 * self.experts_per_token * self.hidden
               + self.experts) if self.experts else 4 * self.intermediate
        return tokens * (8 * self.hidden + qkv + mlp)


@dataclass
class Plan:
    """Bytes per trainer rank and per engine GPU, and host memory per trainer process, item by item."""
    trainer: dict
    engine: dict
    host: dict = dataclasses.field(default_factory=dict)

    @property
    def trainer_total(self) -> int:
        return sum(self.trainer.values())

    @property
    def engine_total(self) -> int:
        """Weights and the KV cache of the whole batch at full context (the KV cache of one sample is part of it)."""
        return sum(v for k, v in self.engine.items() if k != "KV cache, 1 sample")

    @property
    def engine_minimum(self) -> int:
        """Weights and one sample's KV cache at full context: less and vLLM cannot run the sample at all."""
        return self.engine.get("weights", 0) + self.engine.get("KV cache, 1 sample", 0)

    def table(self, title: str = "") -> str:
        lines = [f"memory plan{f' ({title})' if title else ''}, per trainer rank:"]
        lines += [f"  {k:<30}{v / GIB:9.3f} GiB" for k, v in self.trainer.items()]
        lines.append(f"  {'total':<30}{self.trainer_total / GIB:9.3f} GiB")
        if self.engine:
            lines.append("per engine GPU (vLLM):")
            lines += [f"  {k:<30}{v / GIB:9.3f} GiB" for k, v in self.engine.items()]
            lines.append(f"  {'needed (weights, 1 sample)':<30}{self.engine_minimum / GIB:9.3f} GiB")
            lines.append(f"  {'all samples at once':<30}{self.engine_total / GIB:9.3f} GiB")
        if self.host:
            lines.append("host memory per trainer process (not the GPU's):")
            lines += [f"  {k:<30}{v / GIB:9.3f} GiB" for k, v in self.host.items()]
        return "\n".join(lines)


def make_plan(shape: Shape, cfg, world: int, engine_ranks: int, vllm: bool) -> Plan:
    """The plan of a run: `cfg` is config.py's Config, `world` the trainer ranks, `engine_ranks` the GPUs the
    vLLM engine spans (`vllm`: whether it runs at all; the transformers engine shares the trainer's module)."""
    b = 4  # master weights, gradients, AdamW moments: fp32 in every run
    c = BYTES[cfg.dtype]  # compute
    shards = world if cfg.parallel == "fsdp" and world > 1 else 1
    sp = max(cfg.sp, 1)
    offload = cfg.offload_optimizer == "true" and shards > 1
    P = shape.params()
    L = max(cfg.max_tokens_per_micro_batch, cfg.max_prompt_len + cfg.max_response_len)  # a longer sample goes alone
    T = -(-L // sp)  # the tokens of a micro-batch on this rank: its slice under --sp
    state = {"weights": P * b // shards, "gradients": P * b // shards, "AdamW moments": 2 * P * b // shards}
    trainer = {k: 0 for k in state} if offload else dict(state)
    if c != b and shards == 1:
        trainer["compute copy (bf16)"] = P * c
    if cfg.kl_coef > 0:
        trainer["reference"] = 0 if offload else P * b // shards if shards > 1 else P * c
    if shards > 1:  # (offloaded: each layer's shard is copied in for its all-gather, then the layer)
        layer, root = shape.layer_params(), shape.root_params()
        gathered = root + 2 * layer
        trainer["gathered (FSDP)"] = gathered * c + (gathered * b // shards if offload else 0)
        # the backward's gradients on their way to their shards: a layer's whole gradient forms in the compute dtype
        # while the previous layer's fp32 reduce-scatter input is still held (FSDP2 frees one when the next is made),
        # then it is copied into its own, once the layer's activations are freed (the excess over them counts); the
        # root's (lm_head, embeddings) is held from the first step of the backward to the last
        trainer["reduce-scatter (FSDP)"] = root * c + layer * (4 + c) + max(
            0, layer * 4 - shape.layer_activations(T) * c)
    if sp > 1:  # a layer's q, k, v and output at the whole row's length for heads / sp, sent and received
        kv = max(shape.kv_heads, sp)
        trainer["all-to-all (--sp)"] = 2 * (2 * shape.heads + 2 * kv) // sp * L * shape.head_dim * c * \
            (1 if cfg.gradient_checkpointing else shape.layers)
    trainer.update({"activations": activation_bytes(shape, cfg, T, c),
                    "attention scores": attention_bytes(shape, cfg, L, sp, c),
                    "attention backward": attention_backward_bytes(shape, cfg, L, sp, c),
                    "lm_head chunks": 4 * 512 * shape.vocab * 4,
                    "micro-batches (collated)": collated_bytes(cfg, rank_samples(cfg, world, sp))})
    routed = shape.layers * shape.experts_per_token if cfg.routing_replay != "false" and shape.experts else 0
    if routed:  # the replay ids wait in host memory (below); each router moves its layer's slice to the device
        trainer["routing replay ids"] = T * shape.experts_per_token * 8
    slots = cfg.prompts_per_step * cfg.group_size
    share = -(-slots // max(cfg.rollout_replicas, 1))  # each of --rollout-replicas engines holds its share of them
    kv_per_slot = 2 * shape.layers * shape.kv_heads * shape.head_dim * c * (cfg.max_prompt_len + cfg.max_response_len)
    engine = {}
    if vllm:  # vLLM queues what its KV cache cannot hold: the whole batch at full context is the ideal, not a must
        engine = {"weights": P * c // engine_ranks, "KV cache, 1 sample": kv_per_slot // engine_ranks,
                  (f"KV cache, all {slots} samples" if share == slots else f"KV cache, its {share} samples"):
                      kv_per_slot * share // engine_ranks}
    else:  # the transformers engine samples on rank 0, beside the trainer: the batch's cache (<= 256 held-out rows),
        # and under torchrun a whole copy of the model (the trainer's module is sharded or replicated)
        trainer["rollout KV cache (rank 0)"] = kv_per_slot * max(slots, min(256, cfg.eval_n) if cfg.eval_data else 0)
        if world > 1:
            trainer["rollout model copy (rank 0)"] = P * c
    host = host_items(shape, cfg, world, sp, L, routed)
    if offload:
        host["offloaded optimizer state"] = sum(state.values()) + (P * b // shards if cfg.kl_coef > 0 else 0)
    return Plan(trainer, engine, host)


def checkpoint_bytes(shape: Shape, cfg, world: int) -> dict:
    """What one checkpoint holds, item by item, at most: the weights in the run's dtype (and the reference's, with
    a KL), every rank's optimizer state (AdamW's two fp32 moments, and a bf16 run's fp32 master weights, sharded
    under FSDP, whole on every rank otherwise), and the samples in flight at full length (ulorl_state.json;
    routing.pt with --routing-replay). The headline's (Qwen3-30B-A3B, 6 ranks, bf16): ~430 GB."""
    P, c = shape.params(), BYTES[cfg.dtype]
    copies = world if cfg.parallel == "ddp" and world > 1 else 1
    full, slots = cfg.max_prompt_len + cfg.max_response_len, cfg.prompts_per_step * cfg.group_size
    routed = shape.layers * shape.experts_per_token if cfg.routing_replay != "false" and shape.experts else 0
    return {"weights": P * c * (2 if cfg.kl_coef > 0 else 1),
            "optimizer states": (2 + (cfg.dtype != "float32")) * P * 4 * copies + STATE_EXTRA * max(world, 1),
            "pools": slots * full * (JSON_BYTES_PER_TOKEN + routed),
            "tokenizer and configs": side_files(cfg.model) * (2 if cfg.kl_coef > 0 else 1)}


STATE_EXTRA = 64 << 10  # a rank's scheduler, RNG streams and torch.save's framing beside its tensors
SIDE_FILES = 16 << 20  # a hub model's tokenizer and configs, not counted locally (Qwen3's tokenizer.json: 11 MB)


def side_files(model: str) -> int:
    """The bytes a checkpoint holds beside the weights for the tokenizer and configs: those of a local model's
    folder, else SIDE_FILES."""
    if not os.path.isdir(model):
        return SIDE_FILES
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
    return sum(e.stat().st_size for e in os.scandir(model) if e.is_file() and not e.name.endswith(weights))


def disk_line(sizes: dict, cfg) -> str:
    """What `--plan` says of the checkpoints: one's size, and what --keep-last keeps in --out (the next one is
    written beside them before the oldest goes)."""
    one = sum(sizes.values())
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sizes.items())
    keep = (f"--keep-last {cfg.keep_last} needs ~{(cfg.keep_last + 1) * one / GIB:.1f} GiB in --out "
            f"({cfg.keep_last} kept and the next written beside them)" if cfg.keep_last > 0 else
            f"--keep-last 0 keeps every one: ~{one / GIB:.1f} GiB more each save")
    return f"checkpoint: ~{one / GIB:.1f} GiB each ({parts}); {keep}"


def activation_bytes(shape: Shape, cfg, T: int, c: int) -> int:
    """Kept for the backward of a micro-batch of T tokens: every layer's activations, or (checkpointing) every
    layer's input plus the one layer recomputed; and, as the backward walks a layer, the gradients of its
    activations."""
    per_layer = shape.layer_activations(T) * c
    kept = shape.layers * T * shape.hidden * c + per_layer if cfg.gradient_checkpointing else shape.layers * per_layer
    return kept + per_layer


def attention_bytes(shape: Shape, cfg, L: int, sp: int, c: int) -> int:
    """The masks (or eager's scores) attention keeps for a micro-batch of L tokens in rows of `cfg`'s length."""
    rows_len = L if cfg.pack else min(L, cfg.max_prompt_len + cfg.max_response_len)
    if cfg.attn_implementation.startswith("flash") or cfg.attn_implementation == "varlen":
        return 0
    if sp > 1:  # seqpar.packed_attention's sdpa: one additive [L, L] mask, shared by the layers
        return rows_len * rows_len * c
    # transformers' sdpa: each layer keeps its float copy of the boolean mask (eager: every head's scores)
    return (shape.heads if cfg.attn_implementation == "eager" else 1) * shape.layers * rows_len * rows_len \
        * c * (L // rows_len)


def attention_backward_bytes(shape: Shape, cfg, L: int, sp: int, c: int) -> int:
    """The attention kernel's backward beyond the gradients of q, k, v (activations count those): fp32 sums of a
    layer's dq and of each row's softmax over the whole row of L tokens, heads / sp of them (under --sp the
    all-to-all gives each rank whole rows for its heads); with grouped-query attention, the key and value
    gradients at the query heads' count in the compute dtype, before each group is summed into its shared head
    (at the headline, 32 query heads on 4: 2.05 GiB more). Eager attention's scores are counted whole instead."""
    if cfg.attn_implementation == "eager":
        return 0
    heads = -(-shape.heads // sp)
    grouped = 2 * L * heads * shape.head_dim * c if shape.kv_heads < shape.heads else 0
    return L * heads * (shape.head_dim + 1) * 4 + grouped


# A collated micro-batch (model.MicroBatch), bytes a token: input ids and positions (or the attention mask), int64
# each; and a response token's row, column and target (int64), behaviour log-prob, pi_old (fp32), version (int64),
# and its three masks, plus the reference's log-prob (fp32) with a KL
COLLATED_BYTES_PER_TOKEN, COLLATED_BYTES_PER_RESPONSE_TOKEN = 16, 3 * 8 + 2 * 4 + 8 + 3


def rank_samples(cfg, world: int, sp: int) -> int:
    """How many of the step's samples one rank trains: its share of each mini-batch (whole samples, split over the
    world / sp data ranks; a sequence-parallel group's ranks share theirs)."""
    samples = cfg.train_groups * cfg.group_size
    mini = cfg.mini_batch if cfg.mini_batch > 0 else samples
    return sum(-(-min(mini, samples - lo) // max(world // sp, 1)) for lo in range(0, samples, mini))


def collated_bytes(cfg, samples: int) -> int:
    """The step's micro-batches of one rank, collated on its device before the update (ulorl.plan_micro_batches)
    and kept to the end with what the pass before the update adds (pi_old, masks, the reference's log-probs), at
    full length."""
    per_response = COLLATED_BYTES_PER_RESPONSE_TOKEN + (4 if cfg.kl_coef > 0 else 0)
    return samples * ((cfg.max_prompt_len + cfg.max_response_len) * COLLATED_BYTES_PER_TOKEN
                      + cfg.max_response_len * per_response)


def host_items(shape: Shape, cfg, world: int, sp: int, L: int, routed: int) -> dict:
    """Host memory of a trainer process for the rollout's records and the step's batch (`routed`: replayed
    expert ids a token, 0 without routing replay; L: a micro-batch's row, of which each rank of an --sp group
    computes its slice)."""
    full, samples = cfg.max_prompt_len + cfg.max_response_len, cfg.train_groups * cfg.group_size
    batch = samples * full
    slots = cfg.prompts_per_step * cfg.group_size
    # the rollout's records live in Python lists on the host: rank 0 holds every sample in flight (the rollout
    # batch's slots, module docstring) at full length at worst, and every rank the step's batch (the broadcast's
    # pickle, then the samples it unpickles); --routing-replay: their routing too, in a tensor (pickled whole)
    host = {"rollout records (rank 0)": slots * full * HOST_BYTES_PER_TOKEN,
            "the step's batch (every rank)": batch * (HOST_BYTES_PER_TOKEN + PICKLED_BYTES_PER_TOKEN)}
    if routed:  # the running micro-batch's replay ids, made for its forward over its whole row; each router (the
        # reference's too) keeps its rank's slice of them
        ids = routed * (1 if shape.experts <= 256 else 2)  # bytes a token: routing.routing_dtype
        host.update({"routing records (rank 0)": slots * full * ids, "batch's routing (every rank)": 2 * batch * ids,
                     "routing replay ids (every rank)": L * (routed * 2 + 8)
                     + (2 if cfg.kl_coef > 0 else 1) * -(-L // sp) * routed * 2})
    return host


def device_bytes(device: str, stated_gb: float = 0.0) -> int | None:
    """Memory of one device: `stated_gb` (--device-memory, decimal gigabytes as vendors state them) when given,
    else a GPU's, or this machine's RAM for cpu; None when unknown."""
    if stated_gb:
        return int(stated_gb * 10**9)
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


ENGINE_SHARE = 0.9  # of a GPU the engine owns alone (vLLM's own default)
RESERVE = 0.05  # of a GPU the trainer's share leaves for CUDA's context, NCCL and fragmentation
SAMPLING_STATE = ("weights", "AdamW moments", "compute copy (bf16)", "reference")  # kept while a colocated vLLM samples


def engine_memory(plan: Plan, cfg, capacity: int | None) -> float:
    """What the engine is given: --rollout-mem when set; on CPU 0.25 (GiB of KV cache); on GPU vLLM's
    gpu_memory_utilization, a fraction of the whole GPU: ENGINE_SHARE on GPUs of its own, and sharing the
    trainer's GPU what the trainer keeps while vLLM samples leaves (its weights, masters, AdamW moments and
    reference stay; gradients and activations are freed), less RESERVE. vLLM refuses to start when its
    fraction cannot hold its weights and one full-length sample (problems() says so before that)."""
    if cfg.rollout_mem:
        return cfg.rollout_mem
    if not cfg.device.startswith("cuda"):
        return 0.25
    if cfg.rollout_gpus or not capacity:
        return ENGINE_SHARE
    state = sum(v for k, v in plan.trainer.items() if k in SAMPLING_STATE)
    return max(0.0, int((1 - RESERVE - state / capacity) * 100) / 100)


def problems(plan: Plan, cfg, capacity: int | None, colocated: bool) -> list[str]:
    """Why the plan cannot fit (empty when it can), with the flags that would help. On a GPU the trainer may
    use all but RESERVE of it."""
    if capacity is None:
        return []
    out = []
    need = plan.trainer_total
    if colocated and plan.engine:  # vLLM sleeps while the trainer works; while it samples, the trainer's state stays
        need = max(need, sum(v for k, v in plan.trainer.items() if k in SAMPLING_STATE) + plan.engine_minimum)
    gpu = cfg.device.startswith("cuda")
    budget = capacity * (1 - RESERVE) if gpu else capacity
    if need > budget:
        help_ = ["more trainer GPUs (FSDP shards weights, gradients and AdamW)"]
        if not plan.trainer.get("gathered (FSDP)"):
            help_.append("--parallel fsdp under torchrun")
        elif cfg.offload_optimizer != "true":
            help_.append("--offload-optimizer true")
        if plan.trainer["activations"] > budget / 4:
            help_.append("--sp N (sequence parallelism; N divides the trainer ranks and the attention heads)"
                         if cfg.pack else "--pack true with --sp N (sequence parallelism)")
            help_.append("--gradient-checkpointing true" if not cfg.gradient_checkpointing
                         else "a smaller --max-tokens-per-micro-batch")
        if plan.trainer["attention scores"] > budget / 8:
            help_.append("--attn-implementation varlen (with --pack, on GPU)")
        out.append(f"the trainer needs {need / GIB:.1f} GiB per {'GPU' if gpu else 'machine'}"
                   f"{' (with the engine sharing it)' if colocated else ''}, more than "
                   + (f"the {budget / GIB:.1f} GiB it may use of {capacity / GIB:.1f} GiB" if gpu else
                      f"its {capacity / GIB:.1f} GiB") + f": try {', '.join(help_)}")
    if plan.engine and gpu:
        fraction = engine_memory(plan, cfg, capacity)
        if plan.engine_minimum > fraction * capacity:
            more = "more --rollout-gpus / --rollout-tp" if not colocated else \
                "GPUs of its own for the engine (--rollout-gpus), or FSDP over more trainer GPUs"
            out.append(f"the vLLM engine needs {plan.engine_minimum / GIB:.1f} GiB per GPU for its weights and one "
                       f"sample's KV cache at full context, more than its {fraction:.2f} of {capacity / GIB:.1f} GiB "
                       f"(gpu_memory_utilization; --rollout-mem): {more}")
    return out


def choose(make, cfg, capacity: int | None, sp_sizes: list[int], offload_ok: bool) -> tuple[int, str]:
    """(--sp, --offload-optimizer) for those left at auto (0, "auto"): the first that fits, of the least
    sequence-parallel size without offload, then the next size, ..., then each size with offload (sequence
    parallelism costs an all-to-all a layer; offload copies every layer's shard to the GPU for each forward and
    steps AdamW on the CPU). `make(cfg)` is the plan of a config; `sp_sizes` the sizes the world and the model's
    heads allow. Nothing fits (or the device's memory is unknown): the last candidate, whose plan says why."""
    sps = sp_sizes if cfg.sp == 0 else [cfg.sp]
    offloads = (["false", "true"] if offload_ok else ["false"]) if cfg.offload_optimizer == "auto" \
        else [cfg.offload_optimizer]
    candidates = [(sp, off) for off in offloads for sp in sps]
    if capacity is None:
        return candidates[0]
    for sp, off in candidates:
        trial = dataclasses.replace(cfg, sp=sp, offload_optimizer=off)
        if not problems(make(trial), trial, capacity, colocated=not cfg.rollout_gpus):
            return sp, off
    return candidates[-1]


def report(plan: Plan, cfg, world: int, disk: str = "") -> str:
    """What `train.py --plan` prints: the plan's table, host memory per node, whether it fits the device, and
    `disk` (disk_line)."""
    capacity = device_bytes(cfg.device, cfg.device_memory)
    why = problems(plan, cfg, capacity, colocated=not cfg.rollout_gpus)  # no --rollout-gpus: vLLM shares the GPU
    local = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    node = sum(v for k, v in plan.host.items() if "rank 0" not in k) * local + \
        sum(v for k, v in plan.host.items() if "rank 0" in k)
    parallel = f"--sp {max(cfg.sp, 1)}, --offload-optimizer {cfg.offload_optimizer}, " \
               f"--attn-implementation {cfg.attn_implementation}"
    lines = [plan.table(f"{world} trainer rank(s), {cfg.device}; {parallel}"),
             f"  {f'per node ({local} trainer processes)':<30}{node / GIB:9.3f} GiB",
             "verdict: " + ("; ".join(why) if why else f"fits in {capacity / GIB:.1f} GiB" if capacity else
                            "this machine cannot say how much memory the device has: give it, e.g. --device-memory 141 "
                            "for an H200")]
    if capacity and plan.engine and not why and cfg.device.startswith("cuda"):
        fraction = engine_memory(plan, cfg, capacity)
        lines.append(f"vLLM gets gpu_memory_utilization {fraction:.2f} and holds "
                     f"~{engine_concurrency(plan, capacity, fraction)} samples at full context at once per "
                     f"engine GPU; the rest of the batch queues")
    return "\n".join(lines + ([disk] if disk else []))


def engine_concurrency(plan: Plan, capacity: int, mem_fraction: float = ENGINE_SHARE) -> int:
    """How many samples vLLM can hold at full context at once in `mem_fraction` of a GPU (the rest queue)."""
    return max(0, int((capacity * mem_fraction - plan.engine["weights"]) // plan.engine["KV cache, 1 sample"]))


# --------------------------------------------------------------------------------------- measuring

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_host_peak() -> int:
    """Start a new host-memory high-water mark (Linux /proc/self/clear_refs); returns the resident bytes now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def host_peak() -> int:
    """This process's resident-memory high-water mark, in bytes, since the last reset_host_peak()."""
    return _status_kib("VmHWM") * 1024
