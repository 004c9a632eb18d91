"""Mixture-of-Experts routing replay (--routing-replay): the router hook, the trainer's forward through the
engine's experts (`replayed`, which placement.wrap applies), the replay layout of a micro-batch, the engines'
routing conversion and the mismatch count.
"""
import contextlib
import functools

import torch

from systems import distributed

# ------------------------------------------------------------------ Mixture-of-Experts routing replay
#
# In bf16 a rollout engine and the trainer often route the same token to different experts (reports: ~10% of
# router decisions on Qwen3-30B-A3B), and the importance ratio then measures router noise as much as policy
# change. Rollout routing replay (--routing-replay) trains each token through the experts the engine chose when
# it sampled the next token, with gate weights from the trainer's own router over those experts, so the router
# still learns. transformers' Qwen3MoeSparseMoeBlock.forward takes no routing argument: a forward hook on each
# layer's router (its `gate`) swaps the experts it chose, here and nowhere else.
#
# Which routing: position p of a sequence predicts token p + 1, and a segment's engine call returns every
# position of the sample under the current weights (its prefill re-reads the prompt and the earlier segments;
# vLLM's prefix cache is reset after each update, and within one weight version it serves a cached block's
# routing from the forward that computed it). A sample keeps the routing of the engine's latest
# forward over each position: [positions, layers, top_k] (uint8 ids, as vLLM returns them), replaced at every
# segment. That is exactly the forward that sampled its last segment, one policy version throughout; keeping
# each segment's own decode routing instead would mix versions and reproduce none of the engine's forwards
# after the first segment (the tiny MoE in fp32: largest engine/trainer gap 5e-7 -> 8e-4).


class RoutingMismatch:
    """rollout/routing_mismatch: of the (token, layer) decisions the current weights (policy `version`) made in
    the engine, the share the trainer's router makes differently. Forwards count into it inside `counting`; a
    model without routing replay counts nothing."""

    def __init__(self, version: int):
        self.version, self.differ, self.compared = version, 0, 0

    @contextlib.contextmanager
    def counting(self, lm, mb):
        """Around a forward of `lm` (its routers) on micro-batch `mb`."""
        if (routing := getattr(lm, "_ulorl_routing", None)) is None or mb.empty:
            yield
            return
        routing.counting = count = {"version": self.version, "differ": 0, "compared": 0}
        try:
            yield
        finally:
            self.differ, self.compared = self.differ + count["differ"], self.compared + count["compared"]
            routing.counting = None

    def metrics(self) -> dict:
        """Every rank's counts (each rank its own slice under --sp); every rank calls it."""
        n = distributed.all_sum({"differ": self.differ, "compared": self.compared})
        return {"rollout/routing_mismatch": n["differ"] / n["compared"] if n["compared"] else None}


def routing_dtype(experts: int) -> torch.dtype:
    """Expert ids as stored: one byte each up to 256 experts (vLLM returns uint8 there too)."""
    return torch.uint8 if experts <= 256 else torch.int16


class Routing:
    """The experts each Mixture-of-Experts layer of `lm` routes each token to, recorded from its forwards or
    replayed into them. Tokens are the rows of the router's input, in order ([rows x positions] of the
    micro-batch). Set `replay` (use(): [layers, tokens, top_k] ids, -1 rows: the router's own choice) before a
    forward; it stays set until changed, so gradient checkpointing's recompute in the backward replays
    the same ids. `recorded`, when a list, gets each layer's ids as used, per forward. `swap` False: the replay
    ids are only compared with the router's own (`tally`), never used. `tally`, when set, is {"mask": [tokens]
    bool, "differ": 0, "compared": 0}: each layer adds the masked tokens whose own experts differ from the
    replayed ones; `counting` (RoutingMismatch), when set, is the tally each replayed forward starts from. One
Routing per module (Routing.of): the engine and the trainer may share it."""

    def __init__(self, lm):
        self.gates = [layer.mlp.gate for layer in lm.get_decoder().layers
                      if hasattr(getattr(layer.mlp, "gate", None), "top_k")]
        if not self.gates:
            raise ValueError(f"{type(lm).__name__} has no Mixture-of-Experts layers: routing replay is for MoE models")
        self.replay: list[torch.Tensor] | torch.Tensor | None = None
        self.recorded: list | None = None
        self.swap, self.tally, self.counting = True, None, None
        self.top_k, self.experts = self.gates[0].top_k, lm.config.num_experts
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(functools.partial(self._route, i))
        lm._ulorl_routing = self

    @classmethod
    def of(cls, lm) -> "Routing":
        return getattr(lm, "_ulorl_routing", None) or cls(lm)

    def use(self, replay: torch.Tensor | None, lo: int, n: int, versions=None) -> None:
        """Replay tokens lo .. lo + n of a micro-batch's [layers, tokens, top_k] ids (replay_layout; -1 past its
        end: the padding --sp adds). While `counting`, with `versions`: count the tokens whose routing that policy
        version made (versions == counting["version"])."""
        tally = self.counting
        if replay is None:
            self.replay = self.tally = None
            return
        if replay.shape[0] != len(self.gates) or replay.shape[2] != self.top_k:
            raise ValueError(f"routing of {replay.shape[0]} layers x top-{replay.shape[2]} for a model with "
                             f"{len(self.gates)} MoE layers x top-{self.top_k}: recorded by another model?")
        self.replay = replay.new_full((replay.shape[0], n, replay.shape[2]), -1)
        have = replay[:, lo:lo + n]
        self.replay[:, :have.shape[1]] = have
        if tally is not None:
            tally["mask"] = torch.zeros(n, dtype=torch.bool, device=versions.device)
            tally["mask"][:have.shape[1]] = versions[lo:lo + n] == tally["version"]
        self.tally = tally

    def _route(self, layer: int, gate, args, output):
        logits, weights, ids = output
        if self.replay is not None:
            chosen = self.replay[layer].to(ids.device).long()
            if self.tally is not None:
                mask = self.tally["mask"].to(ids.device) & (chosen[:, 0] >= 0)
                differ = (ids.sort(-1).values != chosen.sort(-1).values).any(-1) & mask
                self.tally["differ"] += int(differ.sum())
                self.tally["compared"] += int(mask.sum())
            if self.swap:
                ids = torch.where(chosen < 0, ids, chosen)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)  # its own router's
                if gate.norm_topk_prob:
                    weights = weights / weights.sum(-1, keepdim=True)
                weights = weights.to(logits.dtype)
        if self.recorded is not None:
            self.recorded.append(ids.detach())
        return logits, weights, ids


def replayed(tokens):
    """A micro-batch forward (model.response_tokens) whose Mixture-of-Experts layers route as the engine did: the
    experts its samples carry (replay_layout) are set into the routers first, and stay set for gradient
    checkpointing's recompute. A model without a Routing (no --routing-replay) runs as it is."""
    def run(lm, mb, temperature):
        if (routing := getattr(lm, "_ulorl_routing", None)) is not None:
            replay, versions = replay_layout(mb.samples, mb.starts) or (None, None)
            routing.use(replay, mb.offset, mb.input_ids.numel(), versions)
        return tokens(lm, mb, temperature)
    return run


def routing_mismatch(own: torch.Tensor, replayed: torch.Tensor) -> float:
    """The fraction of (token, layer) decisions whose set of experts differs: [..., top_k] ids each."""
    return (own.sort(-1).values != replayed.sort(-1).values).any(-1).float().mean().item()


def replay_layout(samples: list, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The replay ids of a micro-batch ([layers, tokens, top_k] int16, -1 where the trainer's router decides)
    and the policy version that made each position's routing ([tokens]; -1 none), from samples whose first
    sequence position sits at `starts` (MicroBatch.starts), up to the last sample's end. Made for each forward
    in host memory (Routing.use keeps its slice); None when no sample carries routing."""
    first = next((s.routing for s in samples if s.routing is not None), None)
    if first is None:
        return None
    tokens = max(start + len(s.prompt_ids) + len(s.tokens) for s, start in zip(samples, starts))
    replay = torch.full((first.shape[1], tokens, first.shape[2]), -1, dtype=torch.int16)
    versions = torch.full((tokens,), -1, dtype=torch.long)
    for s, start in zip(samples, starts):
        if s.routing is not None and s.versions:  # positions 0 .. prompt + response - 2, by the last segment's call
            n = min(len(s.routing), len(s.prompt_ids) + len(s.tokens) - 1)
            replay[:, start:start + n] = s.routing[:n].transpose(0, 1).to(torch.int16)
            versions[start:start + n] = s.versions[-1]
    return replay, versions


def vllm_routing(routed_experts, context: int, n: int) -> torch.Tensor:
    """vLLM's CompletionOutput.routed_experts -> Generation.routing. vLLM's array is [positions, layers, top_k]
    (uint8 up to 256 experts, else uint16), one row for every token it fed through the model: the context's,
    then each new token but the last (which nothing has read yet)."""
    if routed_experts is None or routed_experts.shape[0] != context + n - 1:
        got = None if routed_experts is None else routed_experts.shape[0]
        raise RuntimeError(f"vLLM returned routed experts for {got} positions, expected {context + n - 1} (a context "
                           f"of {context} and {n} new tokens): was it started with enable_return_routed_experts?")
    return torch.from_numpy(routed_experts.astype("uint8" if routed_experts.dtype.itemsize == 1 else "int16"))
