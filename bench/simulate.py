"""The rollout at the paper's scale without a model: drawn response lengths (long_tail) served by a stand-in
engine (LengthEngine) under the real scheduler (segment_rollout), step after step (segment_steps)."""
import math
import random


class LengthEngine:
    """A stand-in engine for the cost model's replay at the paper's scale: every sample's response length is
    drawn once (from `length(uid)`, in units of `unit` tokens) and the engine returns that many tokens, a
    segment at a time. The scheduling around it (segment_rollout.rollout_step, the pools) is the real one."""

    def __init__(self, length, calls: list):
        self.length, self.calls = length, calls

    def generate(self, prompts, max_tokens, sampling, keys):
        from systems.engine import Generation
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
