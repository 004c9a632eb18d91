"""The model side of the trainer: loading the model and tokenizer (YaRN flags), the micro-batch layout
(`MicroBatch`, `micro_batches`, `collate`, `rank_share`), the forward pass to response log-probs, FSDP2/DDP
wrapping and the few collectives the update needs, gathering full weights, and HF-format weights on disk
(safetensors, loadable by `AutoModelForCausalLM.from_pretrained` and by vLLM).
"""
import contextlib
import copy
import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def yarn_overrides(config, factor: float, original_max_positions: int = 0) -> dict:
    """Config fields that turn on YaRN rope scaling (UloRL section 4: factor 1.5 over 95232 original
    positions, so 142848 positions reach 128k responses); {} when factor is 0. The same dict goes to the
    trainer's config (load) and to vLLM (`hf_overrides`), so both compute the same positions.
    transformers 5 keeps rope settings in `config.rope_parameters` (rope_theta included), and both it and
    vLLM take `max_position_embeddings` as the length *after* scaling. original_max_positions 0: the
    config's own (its YaRN original when it has one, so that a checkpoint saved with YaRN is not scaled
    twice on resume). A model saved with YaRN in its config.json needs no flag."""
    if not factor:
        return {}
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in rope:
        raise ValueError(f"--rope-scaling-factor: the model config has no single rope_parameters dict with a "
                         f"rope_theta ({rope!r}); set YaRN in its config.json instead")
    original = (original_max_positions or rope.get("original_max_position_embeddings")
                or config.max_position_embeddings)
    kept = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}
    return {"rope_parameters": {**kept, "rope_type": "yarn", "factor": float(factor),
                                "original_max_position_embeddings": original},
            "max_position_embeddings": int(original * factor)}


def is_local_path(name: str) -> bool:
    """A name meant as a local directory (absolute, ./, ../, ~), as opposed to a hub name like Qwen/Qwen3-4B."""
    return name.startswith(("/", "./", "../", "~")) or os.path.isdir(name)


def load_config(name_or_path: str, rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0):
    """(tokenizer, config) of a hub name (from the Hugging Face cache, or downloaded) or a local directory,
    with the YaRN flags applied (yarn_overrides) and a Mixture-of-Experts model's router auxiliary loss off
    (output_router_logits False): RL's loss is the policy's alone, and the trainer's forward
    (response_logprobs) runs the decoder without it."""
    tokenizer = hub_files(name_or_path, AutoTokenizer.from_pretrained)
    if tokenizer.pad_token_id is None:  # base models often lack one; it is only used as padding here
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model_config(name_or_path, rope_scaling_factor, rope_original_max_positions)


def model_config(name_or_path: str, rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0):
    """The config.json alone (what train.py --plan reads), with load_config's YaRN and router settings."""
    config = hub_files(name_or_path, AutoConfig.from_pretrained)
    for key, value in yarn_overrides(config, rope_scaling_factor, rope_original_max_positions).items():
        setattr(config, key, value)  # what vLLM does with hf_overrides
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    return config


def hub_files(name_or_path: str, load):
    """load(name_or_path), with one clear error when neither a directory nor the hub/cache has it."""
    if is_local_path(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"--model {name_or_path}: no such directory")
    try:
        return load(name_or_path)
    except OSError as e:
        offline = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise FileNotFoundError(f"--model {name_or_path}: neither a local directory nor a model the Hugging Face "
                                f"hub or cache has{offline}: {e}") from None


def load(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False,
         rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0, attn_implementation: str = "sdpa"):
    """(model, tokenizer), the whole model in this process (one process, DDP, the engine's copy): a hub name
    or a local directory (load_config), weights from safetensors only (no pickle)."""
    tokenizer, config = load_config(name_or_path, rope_scaling_factor, rope_original_max_positions)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=DTYPES[dtype],
                                                 use_safetensors=True, attn_implementation=attn_implementation)
    if gradient_checkpointing:  # recompute each decoder layer in the backward (non-reentrant checkpoint)
        model.gradient_checkpointing_enable()
    return model.to(device), tokenizer


@contextlib.contextmanager
def params_on_meta():
    """Parameters are made on the meta device (no memory, no random init); buffers as usual (rotary
    frequencies are computed when the model is built and are in no checkpoint)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":  # an existing meta parameter (a tie) stays itself
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_sharded(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False,
                 rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0,
                 attn_implementation: str = "sdpa", trainable: bool = True, compute_dtype: torch.dtype | None = None,
                 offload: bool = False):
    """(wrapped module, model, tokenizer) under FSDP2 without any rank holding the whole model: built on the
    meta device, sharded (wrap), then each rank allocates its shards and fills them from the checkpoint's
    safetensors, read a decoder layer at a time (fill_shards). Peak memory per rank: its shards + one layer.
    compute_dtype: the shards (`dtype`) are master weights, and every forward computes in this dtype (wrap).
    offload: the shards live in host memory (wrap); the buffers (rotary frequencies) on `device`."""
    tokenizer, config = load_config(name_or_path, rope_scaling_factor, rope_original_max_positions)
    with params_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    lm.eval().requires_grad_(trainable)  # as from_pretrained leaves it (a frozen reference: no gradients)
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    policy = wrap(lm, "fsdp", trainable=trainable, compute_dtype=compute_dtype, offload=offload)
    buffers = {name: b.clone() for name, b in lm.named_buffers()}
    policy.to_empty(device="cpu" if offload else device)  # to_empty also empties the buffers: put them back
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        lm.get_submodule(owner)._buffers[leaf] = b.to(device)
    fill_shards(lm, local_checkpoint(name_or_path))
    return policy, lm, tokenizer


def local_checkpoint(name_or_path: str) -> str:
    """The directory holding a model's files: itself, or a hub name's snapshot in the Hugging Face cache."""
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)
    from huggingface_hub import snapshot_download
    return snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])


def checkpoint_to_internal(lm, tensors: dict) -> dict:
    """Checkpoint tensors (names and layout as on disk) as the module holds them: transformers' own loading
    conversion (e.g. a Mixture-of-Experts layer's per-expert tensors stacked into one fused tensor), applied
    to part of a checkpoint (one decoder layer); the inverse of hf_weights. Keys the module has no use for
    are dropped."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    transforms = get_model_conversion_mapping(lm)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = {n for n, _ in lm.named_parameters()}
    pending = {}
    for key, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(key, renamings, converters)
        if target not in names and key in names:
            target, pattern = key, None
        if target in names:
            op = pending.setdefault(target, copy.deepcopy(by_pattern[pattern]) if pattern else WeightRenaming(key, target))
            op.add_tensor(target, key, pattern or key, tensor)
    out = {}
    for target, op in pending.items():
        for name, value in op.convert(target, model=lm, config=lm.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def fill_shards(lm, path: str) -> None:
    """Each rank reads the checkpoint in `path` a decoder layer at a time, converts it to the module's layout
    and keeps only its own shard of each parameter (distribute_tensor with no source rank: no communication)."""
    from safetensors import safe_open
    from torch.distributed.tensor import distribute_tensor
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            where = {k: os.path.join(path, "model.safetensors") for k in f.keys()}
    by_layer: dict = {}
    for key in where:
        by_layer.setdefault(layer_of(key), []).append(key)
    params, filled = dict(lm.named_parameters()), set()
    with torch.no_grad():
        for keys in by_layer.values():
            tensors = {}
            for key in keys:
                with safe_open(where[key], "pt") as f:
                    tensors[key] = f.get_tensor(key)
            for name, full in checkpoint_to_internal(lm, tensors).items():
                p = params[name]
                full = full.to(device=p.device, dtype=p.dtype)
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local() \
                    if isinstance(p, DTensor) else full
                (p.to_local() if isinstance(p, DTensor) else p).copy_(local)
                filled.add(name)
    if missing := sorted(set(params) - filled):
        raise ValueError(f"{path}: the checkpoint has no tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


# ------------------------------------------------------------------------------------ micro-batches

@dataclass
class MicroBatch:
    """One forward/backward of the trainer: the model's inputs and the response-aligned tensors ([b] or
    [b, T], right-padded). `collate` fills the first block; the update (ulorl.py) fills the second."""
    input_ids: torch.Tensor  # [rows, L]
    attention_mask: torch.Tensor | None  # [b, L] when padded; None when packed
    position_ids: torch.Tensor | None  # [1, L] when packed (restarting at 0 for each sequence); None when padded
    rows: torch.Tensor  # [N]: row and column of the hidden state that predicts each response token
    cols: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]: the response tokens, samples in order
    resp_mask: torch.Tensor  # [b, T] bool: a real response token
    behaviour: torch.Tensor  # [b, T]: the engine's log-prob of each token when it was sampled
    versions: torch.Tensor  # [b, T]: the policy version that sampled each token (-1 on padding)
    rewards: torch.Tensor  # [b]
    truncated: torch.Tensor  # [b] bool
    replay: torch.Tensor | None = None  # [layers, rows x L, top_k]: the engine's experts per position (replay_layout)
    replay_versions: torch.Tensor | None = None  # [rows x L]: the policy version that routed each position
    # (both in host memory, whatever `device` collate was given)
    # filled by the update
    adv: torch.Tensor | None = None  # [b]
    old: torch.Tensor | None = None  # [b, T]: pi_old
    ref: torch.Tensor | None = None  # [b, T]: the reference policy's log-probs (KL)
    loss_mask: torch.Tensor | None = None  # [b, T] bool: the tokens the loss averages over (its denominator)
    pg_mask: torch.Tensor | None = None  # [b, T] bool: the loss_mask tokens whose policy-gradient term trains
    empty: bool = False  # a stand-in that trains nothing (ranks with fewer micro-batches run these)
    tally: dict | None = None  # set around one forward: count its routing mismatch (Routing.use)

    def to(self, device) -> "MicroBatch":
        for f in fields(self):
            v = getattr(self, f.name)
            if torch.is_tensor(v) and not f.name.startswith("replay"):  # those stay on the host
                setattr(self, f.name, v.to(device))
        return self


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


def collate(samples: list, pad_id: int, device="cpu", pack: bool = True) -> MicroBatch:
    """The trainer's input for one micro-batch of samples (segment_rollout.Sample).

    pack=True: one row [1, L] of the sequences back to back, with position_ids restarting at 0 for each,
    and no attention_mask: transformers then derives a block-diagonal causal mask from the position resets
    (masking_utils.find_packed_sequence_indices; only with attention_mask=None and no KV cache), so no
    token attends across sequences. pack=False: rows [b, L], right-padded, with an attention_mask.
    Response token t of sample i sits at (rows, cols) = (row of i, start of i + P_i + t) and is predicted
    by the hidden state one column earlier (P_i = prompt length)."""
    seqs = [s.prompt_ids + s.tokens for s in samples]
    T = max(len(s.tokens) for s in samples)
    attn = pos = None
    if pack:
        ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)  # [1, L]
        pos = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]  # [1, L]
        starts = [0] + list(itertools.accumulate(map(len, seqs)))[:-1]
    else:
        L = max(map(len, seqs))
        ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
        attn = torch.zeros((len(samples), L), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = 1
        starts = [0] * len(samples)
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
    mb = MicroBatch(input_ids=ids, attention_mask=attn, position_ids=pos, rows=torch.tensor(rows),
                      cols=torch.tensor(cols), targets=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
                      resp_mask=resp_mask, behaviour=behaviour, versions=versions,
                      rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                      truncated=torch.tensor([s.finish == "truncated" for s in samples])).to(device)
    # replay ids stay in host memory (a step's micro-batches all wait for the update): each router moves its
    # layer's slice to the device as it runs (Routing._route)
    first = [start + (0 if pack else i * ids.shape[1]) for i, start in enumerate(starts)]  # in [rows x L] order
    mb.replay, mb.replay_versions = replay_layout(samples, first, ids.numel()) or (None, None)
    return mb


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


# ---------------------------------------------------------------------------------- the forward pass

def response_logprobs(model, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every response token of a micro-batch (packed or padded), as [b, T] (0 on
    padding). Only the N real response positions go through the lm_head, in chunks (loss.token_logprobs).
    use_cache=False matters for packed rows: with a KV cache transformers skips the packed-sequence mask and
    every sequence would attend to those before it in the row. Under sequence parallelism (--sp) this rank
    runs the decoder on its slice of the packed row only (sequence_slice) and computes the response tokens
    that fall in it; the others' are summed in from the group, so every rank of it returns the whole [b, T]."""
    ids, pos, lo, extra = mb.input_ids, mb.position_ids, 0, {}
    if model.config._attn_implementation in PACKED_KERNELS and pos is not None:
        ids, pos, lo, extra = sequence_slice(ids, pos)
    if (routing := getattr(model, "_ulorl_routing", None)) is not None:  # --routing-replay: the engine's experts
        routing.use(mb.replay, lo, ids.numel(), mb.tally, mb.replay_versions)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mb.attention_mask, position_ids=pos, use_cache=False,
                                 **extra).last_hidden_state
    rows, cols, targets, mine = mb.rows, mb.cols, mb.targets, None
    if extra.get("sp_group") is not None:  # the response tokens predicted from this rank's slice
        mine = (cols >= lo) & (cols < lo + ids.shape[1])
        rows, cols, targets = rows[mine], cols[mine] - lo, targets[mine]
    h = hidden[rows, cols]  # [N, H]: the positions that predict response tokens
    lp, ent = loss.token_logprobs(h, model.get_output_embeddings().weight, targets, temperature)
    if mine is not None:  # this rank's tokens in place, 0 elsewhere; summed over the group
        lp = torch.zeros(mine.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mine, lp)
        ent = torch.zeros(mine.shape, dtype=ent.dtype, device=ent.device).masked_scatter(mine, ent)
        lp, ent = _SumOverGroup.apply(lp, _sp_group), _SumOverGroup.apply(ent, _sp_group)
    out_lp = torch.zeros(mb.resp_mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mb.resp_mask, lp)
    out_ent = torch.zeros(mb.resp_mask.shape, dtype=ent.dtype, device=ent.device).masked_scatter(mb.resp_mask, ent)
    return out_lp, out_ent


# --------------------------------------------------------- packed attention and sequence parallelism
#
# Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's ulysses_sequence_parallel_size), --sp N: the N
# ranks of a sequence-parallel group train the same micro-batches, each on a contiguous 1/N of the packed
# row, so activations, MLPs (experts included) and the lm_head take 1/N of the memory and work. Attention
# needs every earlier token: around its kernel an all-to-all trades the sequence split for a head split
# (each rank then attends over the whole row with 1/N of the heads), and a second one trades back. The
# all-to-all's gradient is the same all-to-all backwards, so the backward needs nothing more. FSDP2 shards
# over all ranks as before: N ranks hold one group's micro-batch, and the data is split over world / N groups.
#
# The kernels run on the packed row's sequence boundaries (cu_seqlens), never an [L, L] mask on a GPU: torch's
# varlen_attn (FlashAttention kernels for packed sequences, CUDA, bf16/fp16) or, on CPU, sdpa with a
# block-diagonal causal mask. They are registered under names of their own, so that only the trainer's
# module uses them: rank 0's engine copy and the reference of other runs keep "sdpa". Called without
# cu_seqlens (generation with a KV cache, padded rows) they are transformers' sdpa.

_sp_group = None  # this rank's sequence-parallel group; None: --sp 1


def init_sequence_parallel(size: int) -> None:
    """Groups of `size` consecutive trainer ranks (every rank makes every group, as torch requires)."""
    global _sp_group
    if size <= 1:
        return
    if world() % size:
        raise ValueError(f"--sp {size}: must divide the {world()} trainer ranks")
    for first in range(0, world(), size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank() < first + size:
            _sp_group = group


def sp_size() -> int:
    return dist.get_world_size(_sp_group) if _sp_group is not None else 1


def data_rank() -> int:
    """Which share of the batch this rank trains: ranks of one sequence-parallel group share one."""
    return rank() // sp_size()


def data_world() -> int:
    return world() // sp_size()


def counts() -> bool:
    """Whether this rank's tokens count in sums over ranks (token counts, metrics): the first rank of its
    sequence-parallel group; the others hold the same micro-batches and would count them again."""
    return _sp_group is None or dist.get_rank(_sp_group) == 0


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of a packed row [1, L]: where each sequence starts (its position is 0), and L."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    return cu, int(cu.diff().max())


def sequence_slice(ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """(this rank's input_ids, position_ids, its first column, the attention's arguments) of a packed row. Under
    --sp N the row is padded to a multiple of N (a last sequence of padding, attending only to itself) and cut
    in N; the attention's arguments are the whole row's sequence boundaries and the group."""
    n = sp_size()
    pad = -ids.shape[1] % n
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        pos = torch.cat([pos, torch.arange(pad, device=pos.device)[None]], 1)
    cu, longest = sequence_bounds(pos)
    extra = {"cu_seqlens": cu, "max_seqlen": longest, "masks": {}}
    if n == 1:
        return ids, pos, 0, extra
    width = ids.shape[1] // n
    lo = dist.get_rank(_sp_group) * width
    return ids[:, lo:lo + width], pos[:, lo:lo + width], lo, {**extra, "sp_group": _sp_group}


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    """x cut in N along split_dim, piece j to rank j; the pieces received joined along cat_dim in rank order."""
    n = dist.get_world_size(group)
    send = torch.stack([t.contiguous() for t in x.chunk(n, split_dim)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), cat_dim)


class _AllToAll(torch.autograd.Function):
    """_all_to_all with its gradient: the gradient of each piece goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group):
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group), None, None, None


class _SumOverGroup(torch.autograd.Function):
    """Each rank's share of a result (0 where another rank's is) summed over the group; every rank computes
    the same loss from the sum, so the gradient of its own share is the sum's gradient, unchanged (an
    all-reduce of it would count the group's size times)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def varlen_options(varlen_attn, scale: float | None, head_dim: int, grouped: bool) -> dict:
    """varlen_attn's causal, scale and grouped-query arguments in the names this torch gives them: torch 2.13
    asks for enable_gqa=True before it takes fewer KV than query heads; 2.11 has no such argument (its kernel
    takes grouped KV heads as they are); 2.10 says is_causal where later ones take window_size (-1, 0)."""
    import inspect
    params = inspect.signature(varlen_attn).parameters
    out = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        out["scale"] = scale
    elif scale is not None and abs(scale - head_dim ** -0.5) > 1e-6 * head_dim ** -0.5:
        raise ValueError(f"this torch's varlen_attn takes no scale; the model's attention scale {scale} is not "
                         f"1/sqrt(head_dim): use --attn-implementation sdpa")
    if grouped and "enable_gqa" in params:
        out["enable_gqa"] = True
    return out


def _attend(query, key, value, cu_seqlens, max_seqlen, scaling, kernel: str, masks: dict | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence: [1, heads, L, D] (key/value: fewer heads, GQA) -> same.
    sdpa's mask is additive, made once per forward and kept in `masks` for every layer: given a boolean one,
    sdpa makes (and keeps for the backward) an [L, L] float copy in every layer (measured: 4 layers at 8192
    tokens held 1 GiB of masks, 36 MiB with one shared)."""
    if kernel == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, heads, D]
        out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                          **varlen_options(varlen_attn, scaling, query.shape[-1], query.shape[1] != key.shape[1]))
        return out.transpose(0, 1)[None]
    masks = {} if masks is None else masks
    if query.dtype not in masks:  # [L, L]: on CPU, and in the GPU check against varlen
        seq = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=query.device), cu_seqlens.diff())
        allowed = (seq[:, None] == seq[None, :]).tril()
        masks[query.dtype] = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~allowed, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=masks[query.dtype],
                                                            scale=scaling, enable_gqa=True)


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seqlens=None,
                     max_seqlen=0, sp_group=None, masks=None, kernel="sdpa", **kwargs):
    """transformers' attention interface: query [1, heads, S, D], key/value [1, kv_heads, S, D] ->
    ([1, S, heads, D], None). S is this rank's slice under --sp: the heads go out and the whole row comes in
    (KV heads repeated first when the group is larger than their number), and back after the kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if sp_group is not None:
        n = dist.get_world_size(sp_group)
        if key.shape[1] < n:  # each rank needs the KV head of its query heads
            key, value = (t.repeat_interleave(n // t.shape[1], 1) for t in (key, value))
        query, key, value = (_AllToAll.apply(t, 1, 2, sp_group) for t in (query, key, value))
    out = _attend(query, key, value, cu_seqlens, max_seqlen, scaling, kernel, masks)
    if sp_group is not None:
        out = _AllToAll.apply(out, 2, 1, sp_group)
    return out.transpose(1, 2).contiguous(), None


def _packed_mask(*args, attention_mask=None, **kwargs):
    """The mask for PACKED_KERNELS: none for a packed row (the kernel has its boundaries), sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


PACKED_KERNELS = {"ulorl_varlen": "varlen", "ulorl_sdpa": "sdpa"}  # registered name -> kernel


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    for name, kernel in PACKED_KERNELS.items():
        AttentionInterface.register(name, functools.partial(packed_attention, kernel=kernel))
        AttentionMaskInterface.register(name, _packed_mask)


def attention_name(implementation: str, sp: int) -> str:
    """What transformers is asked for: --attn-implementation varlen, and sdpa under --sp, are this file's."""
    if implementation == "varlen":
        return "ulorl_varlen"
    return "ulorl_sdpa" if sp > 1 and implementation == "sdpa" else implementation


register_attention()


# ------------------------------------------------------------------ Mixture-of-Experts routing replay
#
# In bf16 a rollout engine and the trainer often route the same token to different experts (reports: ~10% of
# router decisions on Qwen3-30B-A3B), and the importance ratio then measures router noise as much as policy
# change. Rollout routing replay (--routing-replay) trains each token through the experts the engine chose when
# it sampled the next token, with gate weights from the trainer's own router over those experts, so the router
# still learns. transformers' Qwen3MoeSparseMoeBlock.forward takes no routing argument: a forward hook on each
# layer's router (its `gate`) swaps the experts it chose, here and nowhere else.
#
# Which routing: position p of a sequence predicts token p + 1, and a segment's engine call returns every
# position of the sample under the current weights (its prefill re-reads the prompt and the earlier segments;
# vLLM's prefix cache is reset after each update, and within one weight version it serves a cached block's
# routing from the forward that computed it). A sample keeps the routing of the engine's latest
# forward over each position: [positions, layers, top_k] (uint8 ids, as vLLM returns them), replaced at every
# segment. That is exactly the forward that sampled its last segment, one policy version throughout; keeping
# each segment's own decode routing instead would mix versions and reproduce none of the engine's forwards
# after the first segment (the tiny MoE in fp32: largest engine/trainer gap 5e-7 -> 8e-4).


def routing_dtype(experts: int) -> torch.dtype:
    """Expert ids as stored: one byte each up to 256 experts (vLLM returns uint8 there too)."""
    return torch.uint8 if experts <= 256 else torch.int16


class Routing:
    """The experts each Mixture-of-Experts layer of `lm` routes each token to, recorded from its forwards or
    replayed into them. Tokens are the rows of the router's input, in order ([rows x positions] of the
    micro-batch). Set `replay` (use(): [layers, tokens, top_k] ids, -1 rows: the router's own choice) before a
    forward; it stays set until changed, so gradient checkpointing's recompute in the backward replays
    the same ids. `recorded`, when a list, gets each layer's ids as used, per forward. `swap` False: the replay
    ids are only compared with the router's own (`tally`), never used. `tally`, when set, is {"mask": [tokens]
    bool, "differ": 0, "compared": 0}: each layer adds the masked tokens whose own experts differ from the
    replayed ones. One Routing per module (Routing.of): the engine and the trainer may share it."""

    def __init__(self, lm):
        self.gates = [layer.mlp.gate for layer in lm.get_decoder().layers
                      if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
        if not self.gates:
            raise ValueError(f"{type(lm).__name__} has no Mixture-of-Experts layers: routing replay is for MoE models")
        self.replay: list[torch.Tensor] | torch.Tensor | None = None
        self.recorded: list | None = None
        self.swap, self.tally = True, None
        self.top_k, self.experts = self.gates[0].top_k, lm.config.num_experts
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(functools.partial(self._route, i))
        lm._ulorl_routing = self

    @classmethod
    def of(cls, lm) -> "Routing":
        return getattr(lm, "_ulorl_routing", None) or cls(lm)

    def use(self, replay: torch.Tensor | None, lo: int, n: int, tally: dict | None = None, versions=None) -> None:
        """Replay tokens lo .. lo + n of a micro-batch's [layers, tokens, top_k] ids (model.collate; -1 past its
        end: the padding --sp adds). `tally` with `versions`: count the tokens whose routing that policy version
        made (versions == tally["version"])."""
        if replay is None:
            self.replay = self.tally = None
            return
        if replay.shape[0] != len(self.gates) or replay.shape[2] != self.top_k:
            raise ValueError(f"routing of {replay.shape[0]} layers x top-{replay.shape[2]} for a model with "
                             f"{len(self.gates)} MoE layers x top-{self.top_k}: recorded by another model?")
        self.replay = replay.new_full((replay.shape[0], n, replay.shape[2]), -1)
        have = replay[:, lo:lo + n]
        self.replay[:, :have.shape[1]] = have
        if tally is not None:
            tally["mask"] = torch.zeros(n, dtype=torch.bool, device=versions.device)
            tally["mask"][:have.shape[1]] = versions[lo:lo + n] == tally["version"]
        self.tally = tally

    def _route(self, layer: int, gate, args, output):
        logits, weights, ids = output
        if self.replay is not None:
            chosen = self.replay[layer].to(ids.device).long()
            if self.tally is not None:
                mask = self.tally["mask"].to(ids.device) & (chosen[:, 0] >= 0)
                differ = (ids.sort(-1).values != chosen.sort(-1).values).any(-1) & mask
                self.tally["differ"] += int(differ.sum())
                self.tally["compared"] += int(mask.sum())
            if self.swap:
                ids = torch.where(chosen < 0, ids, chosen)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)  # its own router's
                if gate.norm_topk_prob:
                    weights = weights / weights.sum(-1, keepdim=True)
                weights = weights.to(logits.dtype)
        if self.recorded is not None:
            self.recorded.append(ids.detach())
        return logits, weights, ids


def routing_mismatch(own: torch.Tensor, replayed: torch.Tensor) -> float:
    """The fraction of (token, layer) decisions whose set of experts differs: [..., top_k] ids each."""
    return (own.sort(-1).values != replayed.sort(-1).values).any(-1).float().mean().item()


def replay_layout(samples: list, starts: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The replay ids of a micro-batch ([layers, tokens, top_k] int16, -1 where the trainer's router decides)
    and the policy version that made each position's routing ([tokens]; -1 none), from samples whose first
    sequence position sits at `starts` (collate). None when no sample carries routing."""
    first = next((s.routing for s in samples if s.routing is not None), None)
    if first is None:
        return None
    replay = torch.full((first.shape[1], tokens, first.shape[2]), -1, dtype=torch.int16)
    versions = torch.full((tokens,), -1, dtype=torch.long)
    for s, start in zip(samples, starts):
        if s.routing is not None and s.versions:  # positions 0 .. prompt + response - 2, by the last segment's call
            n = min(len(s.routing), len(s.prompt_ids) + len(s.tokens) - 1)
            replay[:, start:start + n] = s.routing[:n].transpose(0, 1).to(torch.int16)
            versions[start:start + n] = s.versions[-1]
    return replay, versions


class Policy(torch.nn.Module):
    """The trainer's forward as one module: micro-batch -> (log-probs, entropy) of its response tokens.
    DDP and FSDP2 act through a module's forward (gradient hooks; all-gathers of sharded parameters), so the
    whole computation, chunked lm_head included, runs inside this one. `lm` is the Hugging Face model."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self.lm, mb, temperature)


# ------------------------------------------------------------------------------ distributed training

def wrap(lm, parallel: str, trainable: bool = True, compute_dtype: torch.dtype | None = None, offload: bool = False):
    """The module the trainer calls. parallel "none": one process. "ddp": a full copy per rank, gradients
    all-reduced (averaged) in the backward. "fsdp": FSDP2, each decoder layer sharded on its own and then
    the root (embeddings, final norm, lm_head), so a forward holds one layer's full weights at a time;
    gradients are reduce-scattered (averaged). A frozen model (the reference) is sharded the same way under
    fsdp. compute_dtype (bf16 runs): under fsdp the fp32 shards are the master weights and each forward
    computes in this dtype (FSDP2's MixedPrecisionPolicy); under ddp the module already computes in it and
    MasterWeights keeps the fp32 copy, adds up its gradients and reduces them (in fp32, as FSDP2 does).
    offload (fsdp): FSDP2's CPUOffloadPolicy: the shards and their gradients stay in host memory (pinned on a
    GPU machine), each layer's are copied to the GPU for its all-gather, and the optimizer steps on the CPU."""
    policy = Policy(lm)
    if parallel == "none" or (parallel == "ddp" and not trainable):
        return policy
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(policy)
    if parallel == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
            else MixedPrecisionPolicy()
        where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        for layer in lm.get_decoder().layers:
            fully_shard(layer, mp_policy=mp, offload_policy=where)
        return fully_shard(policy, mp_policy=mp, offload_policy=where)
    raise ValueError(f"--parallel must be fsdp or ddp, got {parallel!r}")


class MasterWeights:
    """fp32 master weights of a module that computes in bf16, where FSDP2 does not keep them (one process,
    DDP): AdamW steps the masters and the module gets them rounded after every step. Applied to bf16 weights
    directly, an update at lr 1e-6 (~1e-6) is far below bf16's spacing near a weight of 0.05 (2.4e-4), and
    almost every update rounds away. `lm` is in fp32 when this is made: its storage becomes the masters (no
    copy) and the module gets a new one in `dtype`."""

    def __init__(self, lm, dtype: torch.dtype):
        self.pairs = []
        for p in lm.parameters():
            if p.requires_grad:
                self.pairs.append((p, torch.nn.Parameter(p.detach())))
                p.data = p.data.to(dtype)  # buffers (rotary frequencies) stay fp32, as from_pretrained keeps them

    def parameters(self) -> list[torch.nn.Parameter]:
        return [m for _, m in self.pairs]

    def take_grads(self) -> None:
        """The module's gradients (one micro-batch's) added to the masters' in fp32, and freed: summed in bf16
        over hundreds of micro-batches they would lose ~2% (FSDP2 adds them up in fp32 too)."""
        for p, m in self.pairs:
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def reduce_grads(self) -> None:
        """Under DDP (which the optimizer step's backwards skip, no_sync) the masters' gradients averaged over
        the trainer ranks, in fp32, in one all-reduce."""
        if world() == 1:
            return
        for m in self.parameters():  # one the rank's batch never reached (an expert no token chose) counts 0
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        grads = [m.grad for m in self.parameters()]
        flat = torch.cat([g.flatten() for g in grads]).div_(world())
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)


def grad_sync(policy, last: bool):
    """Reduce gradients only in the backward of an optimizer step's last micro-batch."""
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel) and not last:
        return policy.no_sync()
    if hasattr(policy, "set_requires_gradient_sync"):  # FSDP2
        policy.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


# Trainer ranks are torchrun's processes; one process is rank 0 of 1. (vLLM in-process creates a default
# group of world size 1 when none exists: these treat it as one process too.)
def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_sum(values: dict) -> dict:
    """Each key summed over the trainer ranks (float64)."""
    if world() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor summed over the trainer ranks (a histogram's counts)."""
    if world() == 1:
        return t
    out = t.to(_collective_device())
    dist.all_reduce(out)
    return out.cpu()


def all_max(value: float) -> float:
    if world() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_true(flag: bool) -> bool:
    return all_max(-float(flag)) == -1.0  # all true <=> max(-flag) == -1


# Waiting for rank 0's own work -- its rollout (UloRL: ~20 minutes a step at 128k), evaluation, the writing of a
# checkpoint -- goes through a gloo group of its own whose timeout never ends a run: on GPUs the default group
# is NCCL's, whose watchdog ends the job after --dist-timeout. A rank that dies still ends the job at once:
# its peers' sockets close, and torchrun's agent stops the others and names it.
LEAD_TIMEOUT = timedelta(days=36500)
_lead_group = None


def init_distributed(backend: str, timeout_s: float) -> None:
    """The trainer ranks' default group (`backend`; its collectives, the update's, time out after `timeout_s`)
    and the group that waits for rank 0 (broadcast, barrier)."""
    global _lead_group
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    _lead_group = dist.new_group(backend="gloo", timeout=LEAD_TIMEOUT)


def broadcast(obj):
    """Rank 0's object on every rank (pickled: the step's batch of samples, the stop flag), however long rank 0
    takes to get there."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_lead_group, device=torch.device("cpu"))
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank ([obj] in one process)."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj, group=_lead_group)  # a checkpoint's digests: after rank 0's writing
    return out


def barrier() -> None:
    """Every rank here: in practice the others waiting for rank 0's file work (no timeout, as broadcast)."""
    if world() > 1:
        dist.barrier(group=_lead_group)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------- weights in and out

def full_weights(lm, dtype: torch.dtype | None = None):
    """(HF name, full tensor) for every parameter, one at a time: an FSDP2 shard is all-gathered (a
    collective: every rank must walk this generator in step), a plain or DDP parameter is itself. A tied
    lm_head is listed once, as the embedding. Never more than one gathered parameter exists at a time.
    dtype: each shard cast before it is gathered."""
    for name, p in lm.named_parameters():
        yield name, full_tensor(p.detach().to(dtype or p.dtype))


def gather_only(lm, dtype: torch.dtype | None = None) -> None:
    """What a rank that receives nothing does while rank 0 takes full_weights(lm, dtype) or hf_weights(lm,
    dtype=dtype) (the same gathers, in the same order and dtype): its part of each gather."""
    for _ in full_weights(lm, dtype):
        pass


def layer_of(name: str) -> str | None:
    """"model.layers.3" for "model.layers.3.mlp.experts.7.down_proj.weight": the name up to its first
    number (None for embeddings, final norm, lm_head)."""
    parts = name.split(".")
    return next((".".join(parts[:i + 1]) for i, p in enumerate(parts) if p.isdigit()), None)


def layer_groups(names: list[str]) -> list[list[str]]:
    """Parameter names in order, cut where the decoder layer changes (embeddings, layer 0, layer 1, ...,
    final norm and lm_head): the unit in which weights are gathered, converted and sent."""
    groups, key = [], object()
    for name in names:
        layer = layer_of(name)
        if not groups or layer != key:
            groups.append([])
            key = layer
        groups[-1].append(name)
    return groups


def hf_weights(lm, on_meta: bool = False, dtype: torch.dtype | None = None):
    """(name, tensor) in the checkpoint's layout, what from_pretrained reads and vLLM loads: transformers keeps
    a Mixture-of-Experts layer's experts fused in one tensor, a checkpoint (and vLLM's loader) one per expert
    (transformers' revert_weight_conversion, as save_pretrained uses it; the identity for dense models).
    Gathered from the FSDP shards a decoder layer at a time: the same collectives, in the same order, as
    full_weights. on_meta: shapes and names only, nothing gathered (on the meta device). dtype: each shard cast
    before it is gathered (fp32 masters leave in bf16: half the traffic and the memory)."""
    from transformers.core_model_loading import revert_weight_conversion
    params = dict(lm.named_parameters())
    for group in layer_groups(list(params)):
        if on_meta:
            full = {n: torch.empty(params[n].shape, dtype=dtype or params[n].dtype, device="meta") for n in group}
        else:
            full = {n: full_tensor(params[n].detach().to(dtype or params[n].dtype)) for n in group}
        yield from revert_weight_conversion(lm, full).items()


class HashingWriter:
    """A file opened for writing whose bytes are hashed (sha256) as they pass: a checkpoint's manifest gets
    every file's digest without reading anything back (at 30B that would be ~120 GB more to read a save)."""

    def __init__(self, path: str):
        self.file, self.sha, self.size = open(path, "wb"), hashlib.sha256(), 0
        self.error: OSError | None = None  # the refused write, for a caller that gets it wrapped (torch.save)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += view.nbytes
        try:
            return self.file.write(view)
        except OSError as e:  # name the file (a full disk's error names none)
            self.error = OSError(e.errno, e.strerror, self.file.name)
            raise self.error from None

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def digest(self) -> dict:
        return {"size": self.size, "sha256": self.sha.hexdigest()}


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(tensors: dict[str, torch.Tensor], f, metadata: dict | None = None) -> None:
    """The safetensors format into the open file `f`, tensor by tensor: an 8-byte little-endian header size,
    a JSON header (each tensor's dtype, shape and byte range; padded with spaces to 8 bytes), then the raw
    bytes in that order. Written here rather than by safetensors.save_file so that its bytes can be hashed
    as they are written (HashingWriter) and a full disk raises an ordinary OSError."""
    header, offset = {"__metadata__": metadata} if metadata else {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for t in tensors.values():
        if t.numel():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy())


def save_weights(lm, weights, tokenizer, path: str, max_shard_bytes: int = 5 << 30,
                 dtype: torch.dtype | None = None) -> dict[str, dict]:
    """An HF-format checkpoint written as the (name, tensor) pairs stream in (hf_weights: a decoder layer at
    a time): safetensors shards of at most `max_shard_bytes` with model.safetensors.index.json (a single
    model.safetensors when all fits one), config, tokenizer; loadable by from_pretrained and vLLM. Host
    memory holds one shard and one layer, never the whole model. In a sharded run every rank walks
    hf_weights() (or gather_only) and only rank 0 calls this with it. Returns the size and sha256 of each
    weight file written, by its name in `path`, hashed as written. dtype: the weights' dtype as config.json
    states it (hf_weights(dtype=...) casts them; fp32 master weights are exported in the run's dtype)."""
    os.makedirs(path, exist_ok=True)
    shard, size, files, weight_map, digests = {}, 0, [], {}, {}

    def write():
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        with HashingWriter(os.path.join(path, files[-1])) as f:
            write_safetensors(shard, f, metadata={"format": "pt"})
        digests[files[-1]] = f.digest()
        weight_map.update(dict.fromkeys(shard, files[-1]))

    total = 0
    for name, t in weights:
        t = t.detach().to("cpu", copy=True).contiguous()
        if shard and size + t.nbytes > max_shard_bytes:
            write()
            shard, size = {}, 0
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes
    if shard or not files:
        write()
    # the total is known only now: the usual names carry it
    final = {files[0]: "model.safetensors"} if len(files) == 1 else \
        {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for f, g in final.items():
        os.replace(os.path.join(path, f), os.path.join(path, g))
    if len(files) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}},
                      f, indent=2)
    config = copy.deepcopy(lm.config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(path)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {final[f]: d for f, d in digests.items()}
