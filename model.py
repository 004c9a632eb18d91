"""Loading the model and tokenizer, the trainer's forward pass to response log-probs, and HF-format
checkpoint weights (safetensors, loadable by `AutoModelForCausalLM.from_pretrained` and by vLLM).
"""
import os

import torch
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


def load(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False,
         rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0, attn_implementation: str = "sdpa"):
    """A hub name or a local directory. Weights are read from safetensors only (no pickle).
    rope_scaling_factor > 0 turns on YaRN (yarn_overrides)."""
    if os.path.sep in name_or_path and not os.path.isdir(name_or_path):
        raise FileNotFoundError(f"--model {name_or_path}: no such directory")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:  # base models often lack one; it is only used as padding here
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(name_or_path)
    for key, value in yarn_overrides(config, rope_scaling_factor, rope_original_max_positions).items():
        setattr(config, key, value)  # what vLLM does with hf_overrides
    model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=DTYPES[dtype],
                                                 use_safetensors=True, attn_implementation=attn_implementation)
    if gradient_checkpointing:  # recompute each decoder layer in the backward (non-reentrant checkpoint)
        model.gradient_checkpointing_enable()
    return model.to(device), tokenizer


def response_logprobs(model, mb: dict, temperature: float, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every response token of a micro-batch (ulorl.collate, packed or padded),
    as [b, T] (0 on padding). Only the N real response positions go through the lm_head, in chunks
    (loss.token_logprobs). use_cache=False matters for packed rows: with a KV cache transformers skips the
    packed-sequence mask and every sequence would attend to those before it in the row."""
    hidden = model.get_decoder()(input_ids=mb["input_ids"], attention_mask=mb.get("attention_mask"),
                                 position_ids=mb.get("position_ids"), use_cache=False).last_hidden_state
    h = hidden[mb["rows"], mb["cols"]]  # [N, H]: the positions that predict response tokens
    lp, ent = loss.token_logprobs(h, model.get_output_embeddings().weight, mb["targets"], temperature, chunk)
    shape = mb["resp_mask"].shape
    out_lp = torch.zeros(shape, dtype=lp.dtype, device=lp.device).masked_scatter(mb["resp_mask"], lp)
    out_ent = torch.zeros(shape, dtype=ent.dtype, device=ent.device).masked_scatter(mb["resp_mask"], ent)
    return out_lp, out_ent


# ------------------------------------------------------------------------------ distributed training

class Policy(torch.nn.Module):
    """The trainer's forward as one module: micro-batch -> (log-probs, entropy) of its response tokens.
    DDP and FSDP2 act through a module's forward (gradient hooks; all-gathers of sharded parameters), so the
    whole computation, chunked lm_head included, runs inside this one. `lm` is the Hugging Face model."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, mb: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self.lm, mb, temperature)


def wrap(lm, parallel: str, trainable: bool = True, mixed_bf16: bool = False):
    """The module the trainer calls. parallel "none": one process. "ddp": a full copy per rank, gradients
    all-reduced (averaged) in the backward. "fsdp": FSDP2, each decoder layer sharded on its own and then
    the root (embeddings, final norm, lm_head), so a forward holds one layer's full weights at a time;
    gradients are reduce-scattered (averaged). mixed_bf16 (GPU): bf16 compute over fp32 master weights,
    gradients reduced in fp32. A frozen model (the reference) is sharded the same way under fsdp."""
    policy = Policy(lm)
    if parallel == "none" or (parallel == "ddp" and not trainable):
        return policy
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(policy)
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_bf16 \
            else MixedPrecisionPolicy()
        for layer in lm.get_decoder().layers:
            fully_shard(layer, mp_policy=mp)
        return fully_shard(policy, mp_policy=mp)
    raise ValueError(f"--parallel must be fsdp or ddp, got {parallel!r}")


def full_weights(lm):
    """(HF name, full tensor) for every parameter, one at a time: an FSDP2 shard is all-gathered (a
    collective: every rank must walk this generator in step), a plain or DDP parameter is itself. A tied
    lm_head is listed once, as the embedding. Never more than one gathered parameter exists at a time."""
    from torch.distributed.tensor import DTensor
    for name, p in lm.named_parameters():
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def save_weights(lm, weights, tokenizer, path: str) -> None:
    """HF-format checkpoint from (name, tensor) pairs (full_weights): safetensors shards + config +
    tokenizer, loadable by from_pretrained and vLLM. In a sharded run every rank walks full_weights() and
    only rank 0 calls this with it."""
    from huggingface_hub import save_torch_state_dict
    state = {name: t.to("cpu", copy=True) for name, t in weights}
    os.makedirs(path, exist_ok=True)
    save_torch_state_dict(state, path)
    lm.config.save_pretrained(path)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
