"""Distributed training under torchrun: the FSDP2/DDP wrap (offload), fp32 master weights, the collectives the
update and the loop use, gathering full weights (for the engine and checkpoints), sharded loading and the one
longest-first balancing function. One process: every call is a no-op or the identity.
"""
import contextlib
import copy
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor



# ------------------------------------------------------------------------------ distributed training

def wrap(module, layers, parallel: str, trainable: bool = True, compute_dtype: torch.dtype | None = None,
         offload: bool = False):
    """`module` as the trainer calls it (`layers`: its decoder layers). parallel "none": one process. "ddp": a
    full copy per rank, gradients all-reduced (averaged) in the backward. "fsdp": FSDP2, each decoder layer sharded on its own and then
    the root (embeddings, final norm, lm_head), so a forward holds one layer's full weights at a time;
    gradients are reduce-scattered (averaged). A frozen model (the reference) is sharded the same way under
    fsdp. compute_dtype (bf16 runs): under fsdp the fp32 shards are the master weights and each forward
    computes in this dtype (FSDP2's MixedPrecisionPolicy); under ddp the module already computes in it and
    MasterWeights keeps the fp32 copy, adds up its gradients and reduces them (in fp32, as FSDP2 does).
    offload (fsdp): FSDP2's CPUOffloadPolicy: the shards and their gradients stay in host memory (pinned on a
    GPU machine), each layer's are copied to the GPU for its all-gather, and the optimizer steps on the CPU."""
    if parallel == "none" or (parallel == "ddp" and not trainable):
        return module
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(module)
    if parallel == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
            else MixedPrecisionPolicy()
        where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
        for layer in layers:
            fully_shard(layer, mp_policy=mp, offload_policy=where)
        return fully_shard(module, mp_policy=mp, offload_policy=where)
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
    """DDP all-reduces gradients only in the backward of an optimizer step's last micro-batch (no_sync before it:
    each rank holds full-size gradients anyway). FSDP2 reduce-scatters every micro-batch's, as torchtitan and verl
    do, so that between micro-batches a rank holds its shard of the gradients only: with the sync off, FSDP2 keeps
    every parameter's gradient unsharded (in fp32 under mixed precision) until the last one, ~4 bytes x all
    parameters on every rank (114 GiB at 30B, beside everything the memory plan counts)."""
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel) and not last:
        return policy.no_sync()
    return contextlib.nullcontext()


class Ranks:
    """What the update needs of the trainer ranks, as one object the trainer hands it (the algorithm's file imports
    nothing of the systems): this rank's share of a batch, sums and maxima over ranks, what wraps a micro-batch's
    backward (the gradient sync; a bf16 run's fp32 masters take the gradients), the gradient norm clip and what
    follows an optimizer step. `Ranks()`: one process, every call the identity.
    policy: the wrapped module (DDP's no_sync); masters: MasterWeights (a bf16 run outside FSDP), else None;
    sp: --sp, groups of consecutive ranks that train the same share, each a slice of its rows."""

    def __init__(self, policy=None, masters=None, sp: int = 1):
        self.policy, self.masters, self.sp = policy, masters, sp
        self.world = world()

    def from_lead(self, obj):
        """Rank 0's `obj` on every rank (pickled): the step's batch, the probe, the stop and reset verdicts."""
        return broadcast(obj)

    def wait_for_lead(self) -> None:
        """Every rank waits here until rank 0 arrives (no timeout)."""
        barrier()

    def gather_for_lead(self, lm, dtype: torch.dtype) -> None:
        """This rank's part of the gathers while rank 0 sends the full weights to its engine."""
        gather_only(lm, dtype)

    @property
    def data_world(self) -> int:
        """How many shares a batch is split into: one per sequence-parallel group."""
        return self.world // self.sp

    @property
    def data_rank(self) -> int:
        return rank() // self.sp

    @property
    def counted(self) -> bool:
        """Whether this rank's tokens count in sums over ranks (token counts, metrics): the first rank of its
        sequence-parallel group; the others hold the same micro-batches and would count them again."""
        return rank() % self.sp == 0

    def share(self, lengths: list[int]) -> list[int]:
        """The indices of this rank's share of a batch of sequences of these lengths (balanced by tokens; every
        rank computes the same split)."""
        return balance(lengths, self.data_world)[self.data_rank]

    def most(self, n: int) -> int:
        return int(all_max(n))

    def sum(self, values: dict) -> dict:
        return all_sum(values)

    def max(self, value: float) -> float:
        return all_max(value)

    def all_true(self, flag: bool) -> bool:
        return all_true(flag)

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Around one micro-batch's forward and backward (`last`: the optimizer step's last): the gradient sync,
        then the fp32 masters add up the gradients (bf16 outside FSDP: in fp32, reduced after the last)."""
        with grad_sync(self.policy, last and self.masters is None):
            yield
        if self.masters is not None:
            self.masters.take_grads()

    def clip_grads(self, params: list, max_norm: float) -> torch.Tensor:
        """The gradients reduced (the masters'), clipped to `max_norm`; returns their norm before clipping."""
        if self.masters is not None:
            self.masters.reduce_grads()
        return full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def after_step(self) -> None:
        """After an optimizer step: the module gets the masters' new weights (bf16 outside FSDP)."""
        if self.masters is not None:
            self.masters.copy_to_model()


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


def balance(expected: list[float], n: int) -> list[list[int]]:
    """Indices of `expected` in `n` parts of near-equal sums: longest first, each to the part with the least so
    far (ties: the lower part). Each part keeps its indices in order. Trainer ranks split a mini-batch by
    tokens with it (every rank computes the same split), engine replicas a rollout by expected work."""
    parts, loads = [[] for _ in range(n)], [0.0] * n
    for i in sorted(range(len(expected)), key=lambda i: -expected[i]):
        j = loads.index(min(loads))
        parts[j].append(i)
        loads[j] += expected[i]
    return [sorted(p) for p in parts]


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



# ------------------------------------------------------------------------------- sharded loading

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


