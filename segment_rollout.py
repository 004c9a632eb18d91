"""Segment rollout, UloRL Algorithm 1: the `Sample` record, the unfinished and experience pools, and one
rollout step over any engine (systems/engine.py: anything with `generate(prompts, max_tokens, sampling, keys)`).

A response of up to `max_len` tokens is decoded at most `segment_len` tokens per RL step. A sample that
hits the segment cap waits in the unfinished pool and continues at the next step, possibly under newer
weights; so every token remembers the policy version that sampled it and that policy's (behaviour)
log-prob. Segment i of a sample is tokens[seg_starts[i]:seg_starts[i+1]].

A sample waits in one of three places (UloRL's Algorithm 1 has one "experience pool" for the second and
third; it is split because a group can be rewarded and filtered only once all G members are finished):

    unfinished pool --+
                      +--> batch --> engine: <= segment_len new tokens each --+--> EOS         --+
    new prompts x G --+                                                      +--> global cap  --+ (truncated)
                                                                             +--> segment cap --> unfinished pool
      +------------------------------------------------------------------------------------------+
      v
    Pools.experience: finished samples whose group still has unfinished members (group id -> members)
      |  the group's last member finishes (ready_groups): reward; dynamic sampling drops all-equal groups
      v
    RunState.ready (ulorl.py): complete, rewarded, informative groups waiting for an update; a step trains
      the oldest --train-groups of them and the rest carry over to the next step (not under --is-mode tois,
      which trains only tokens of the weights being updated: they are dropped)

1. `Pools.unfinished`: hit the segment cap; decoded further at the next step, possibly by newer weights.
2. `Pools.experience`: finished, but its group is not: GRPO's advantage needs every member's reward.
3. `RunState.ready`: the group is complete, scored and kept, so the rewards are computed once, when the group
   completes; a checkpoint saves all three.
"""
from dataclasses import dataclass, field


@dataclass
class Sampling:
    """How every engine draws a token."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k


@dataclass
class Sample:
    uid: int  # unique over the run; names the sample's random stream in the engine
    group: int  # unique id of the prompt draw; the G samples of one draw share it
    prompt_ids: list[int]
    row: dict  # the dataset row: prompt, answer, verifier
    tokens: list[int] = field(default_factory=list)  # response so far
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each response token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each response token
    seg_starts: list[int] = field(default_factory=list)  # index in `tokens` where each segment begins
    finish: str | None = None  # None while unfinished, then "eos" or "truncated"
    reward: float | None = None
    # --routing-replay (MoE): the experts the engine's last call routed each position to, prompt and response
    # but the last token, [positions, layers, top_k] uint8 (replaced every segment; routing.replay_layout)
    routing: object = None

    def segment_versions(self) -> list[int]:
        return [self.versions[s] for s in self.seg_starts if s < len(self.versions)]


@dataclass
class Pools:
    unfinished: list[Sample] = field(default_factory=list)
    experience: dict[int, list[Sample]] = field(default_factory=dict)  # group -> its finished members
    next_uid: int = 0
    next_group: int = 0
    count_down: bool = False  # uids -1, -2, ...: evaluation's random streams, apart from training's 0, 1, ...

    def new_group(self, prompt_ids: list[int], row: dict, size: int) -> list[Sample]:
        group, self.next_group = self.next_group, self.next_group + 1
        direction = -1 if self.count_down else 1
        samples = [Sample(self.next_uid + i * direction, group, prompt_ids, row) for i in range(size)]
        self.next_uid += size * direction
        return samples

    def ready_groups(self, size: int) -> list[list[Sample]]:
        """Complete groups (all `size` members finished), oldest first: only these can be scored as groups."""
        return [g for _, g in sorted(self.experience.items()) if len(g) == size]

    def pop_group(self, group: int) -> list[Sample]:
        return self.experience.pop(group)


def rollout_step(engine, pools: Pools, new_groups: list[list[Sample]], segment_len: int, max_len: int,
                 sampling, version: int) -> dict:
    """Decode at most one segment for every unfinished sample and every new sample, then sort each one into
    the experience pool (EOS or global cap) or back into the unfinished pool (segment cap). `sampling` is
    the engine's (Sampling); `version` is stamped on every token decoded now."""
    batch = pools.unfinished + [s for g in new_groups for s in g]
    pools.unfinished = batch  # new samples join the unfinished pool first: if the engine raises, nothing is lost
    budgets = [min(segment_len, max_len - len(s.tokens)) for s in batch]
    # each sample's prompt + response so far, its random stream named by its uid
    gens = engine.generate([s.prompt_ids + s.tokens for s in batch], budgets, sampling, keys=[s.uid for s in batch])
    pools.unfinished = []
    for s, g, budget in zip(batch, gens, budgets):
        if g.routing is not None:  # the engine's latest forward over the sample (routing.replay_layout)
            s.routing = g.routing
        s.seg_starts.append(len(s.tokens))
        s.tokens += g.tokens
        s.logprobs += g.logprobs
        s.versions += [version] * len(g.tokens)
        if g.finish == "stop":
            s.finish = "eos"
        elif len(s.tokens) >= max_len:
            s.finish = "truncated"
        elif len(g.tokens) < budget:
            raise RuntimeError(f"engine returned {len(g.tokens)} tokens with finish='length' but the segment "
                               f"allowed more: is max_model_len too small for prompt + response?")
        if s.finish is None:
            pools.unfinished.append(s)
        else:
            pools.experience.setdefault(s.group, []).append(s)
    return {"rollout/unfinished": len(pools.unfinished), "tokens/generated": sum(len(g.tokens) for g in gens)}
