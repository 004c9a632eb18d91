"""A cost model of segment rollout on GPUs (GPUCost: a model, not a measurement), its calibration from a
published batch-1 figure, and its predictions for recorded or simulated engine calls."""
import dataclasses
import heapq

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
    for forward and backward, + 1 forward for pi_old (ulorl.old_ref_and_masks's pass), + 1 for the reference when `kl`,
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
