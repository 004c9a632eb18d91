"""Loading the model and tokenizer, the trainer's forward pass to response log-probs, and HF-format
checkpoint weights (safetensors, loadable by `AutoModelForCausalLM.from_pretrained` and by vLLM).
"""
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False):
    """A hub name or a local directory. Weights are read from safetensors only (no pickle)."""
    if os.path.sep in name_or_path and not os.path.isdir(name_or_path):
        raise FileNotFoundError(f"--model {name_or_path}: no such directory")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:  # base models often lack one; it is only used as padding here
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], use_safetensors=True)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device), tokenizer


def response_logprobs(model, mb: dict, temperature: float, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every response token of a micro-batch, as [b, T] (0 on padding).
    Only the N real response positions go through the lm_head, in chunks (loss.token_logprobs)."""
    hidden = model.get_decoder()(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).last_hidden_state
    h = hidden[mb["rows"], mb["cols"]]  # [N, H]: the positions that predict response tokens
    lp, ent = loss.token_logprobs(h, model.get_output_embeddings().weight, mb["targets"], temperature, chunk)
    shape = mb["resp_mask"].shape
    out_lp = torch.zeros(shape, dtype=lp.dtype, device=lp.device).masked_scatter(mb["resp_mask"], lp)
    out_ent = torch.zeros(shape, dtype=ent.dtype, device=ent.device).masked_scatter(mb["resp_mask"], ent)
    return out_lp, out_ent


def save(model, tokenizer, path: str) -> None:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
