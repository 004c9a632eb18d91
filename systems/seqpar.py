"""Ulysses sequence parallelism (--sp) and the packed-attention kernels the trainer's module attends with:
`sliced` wraps the trainer's forward (placement.wrap); the registered kernel names are what transformers attends
with. The update's split of the batch over groups is distributed.Ranks's (consecutive ranks form a group).
"""
import dataclasses
import functools

import torch
import torch.distributed as dist

from systems import distributed

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
    if distributed.world() % size:
        raise ValueError(f"--sp {size}: must divide the {distributed.world()} trainer ranks")
    for first in range(0, distributed.world(), size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= distributed.rank() < first + size:
            _sp_group = group


def sp_size() -> int:
    return dist.get_world_size(_sp_group) if _sp_group is not None else 1


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of a packed row [1, L]: where each sequence starts (its position is 0), and L."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    return cu, int(cu.diff().max())


def sequence_slice(ids: torch.Tensor, pos: torch.Tensor, split: bool = True) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """(this rank's input_ids, position_ids, its first column, the attention's arguments) of a packed row. Under
    --sp N the row is padded to a multiple of N (a last sequence of padding, attending only to itself) and cut
    in N; the attention's arguments are the whole row's sequence boundaries and the group. split False: N = 1."""
    n = sp_size() if split else 1
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


def sliced(tokens, split: bool = True):
    """A micro-batch forward (model.response_tokens: [N] log-probs and entropy) run with the packed kernels
    (PACKED_KERNELS) on a packed row: the decoder gets the row's sequence boundaries, and under --sp this rank
    runs it on its slice of the row only and computes the response tokens that fall in it; the others' are
    summed in from the group, so every rank of it returns all N. Padded rows, and other kernels, run as they are.
    split False: the whole row on this rank, whatever --sp (bench/sp.py's data-parallel side)."""
    def run(lm, mb, temperature):
        if lm.config._attn_implementation not in PACKED_KERNELS or mb.position_ids is None:
            return tokens(lm, mb, temperature)
        ids, pos, lo, attention = sequence_slice(mb.input_ids, mb.position_ids, split)
        if "sp_group" not in attention:
            return tokens(lm, dataclasses.replace(mb, input_ids=ids, position_ids=pos, attention=attention), temperature)
        mine = (mb.cols >= lo) & (mb.cols < lo + ids.shape[1])  # the response tokens predicted from this slice
        part = dataclasses.replace(mb, input_ids=ids, position_ids=pos, rows=mb.rows[mine], cols=mb.cols[mine] - lo,
                                   targets=mb.targets[mine], attention=attention, offset=lo)
        # this rank's tokens in place, 0 elsewhere; summed over the group
        return tuple(_SumOverGroup.apply(torch.zeros(mine.shape, dtype=x.dtype, device=x.device).masked_scatter(mine, x),
                                         _sp_group) for x in tokens(lm, part, temperature))
    return run


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


