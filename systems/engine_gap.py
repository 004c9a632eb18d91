"""The engine/trainer gap check: a rollout engine that disagrees with the trainer about the tokens the very
same weights sampled is stale (a weight sync that did not land) or wrong (weights, kernels). A `Watch` wraps the
trainer's forward: the update's pass before the optimizer shows it each micro-batch's log-probs beside the
engine's (and, under --routing-replay, its routing); `check` stops the run (or warns) before the optimizer steps.
"""
import sys

import torch

from systems import distributed
from systems.routing import RoutingMismatch

GAP_BINS = (-12.0, 2.0, 280)  # log10 |trainer - engine log-prob| from 1e-12 to 100 nats, 20 bins a decade
# The engine/trainer KL leaves out its GAP_OUTLIERS largest tokens: one bf16 MoE token 3.5 nats off adds
# e^3.5 - 4.5 = 28.6 to the sum, 0.11 a token over --overlap's 256-token probe, past --max-engine-kl, while an
# engine that missed a sync is off on many (trimming 1% instead hid most of a stale tiny engine's KL: 30x -> 7x)
GAP_OUTLIERS = 2


def trimmed_kl(kl_sum: float, n: int, largest: list[float]) -> float | None:
    """The mean per-token KL of `n` tokens whose k3 values add up to `kl_sum`, without the GAP_OUTLIERS largest
    (`largest`: at least those); None without tokens."""
    if not n:
        return None
    k = min(GAP_OUTLIERS, len(largest)) if n > 2 * GAP_OUTLIERS else 0
    return max(kl_sum - sum(sorted(largest, reverse=True)[:k]), 0.0) / (n - k)


def quantile(hist: torch.Tensor, q: float) -> float:
    """The q-quantile of the gaps a GAP_BINS histogram counts, as its bin's upper edge (12% resolution)."""
    lo, hi, bins = GAP_BINS
    k = int(torch.searchsorted(hist.cumsum(0), q * hist.sum().item()))
    return 10 ** (lo + (hi - lo) * min(k + 1, bins) / bins)


class Gap:
    """How far the engine's behaviour log-probs are from the trainer's on the tokens the current weights sampled:
    step 5 feeds it each micro-batch (add), every rank's sums are combined (reduce), then it stops a run whose
    engine is stale (check) and reports the rollout/* metrics."""

    def __init__(self):
        self.abs_sum, self.n, self.kl_sum, self.largest = 0.0, 0, 0.0, 0.0
        self.hist, self.top = torch.zeros(GAP_BINS[2], dtype=torch.float64), torch.zeros(0, dtype=torch.float64)

    def add(self, trainer: torch.Tensor, engine: torch.Tensor) -> None:
        """Log-probs of the same tokens, [n] each."""
        d = trainer.double() - engine.double()  # log p_trainer - log p_engine
        if not d.numel():
            return
        self.largest = max(self.largest, d.abs().max().item())
        self.abs_sum += d.abs().sum().item()
        self.n += d.numel()
        k3 = d.clamp(max=30).exp() - 1 - d  # KL(engine || trainer) per token on the engine's samples: never negative
        self.kl_sum += k3.sum().item()
        self.top = torch.cat([self.top, k3.cpu()]).topk(min(GAP_OUTLIERS, self.top.numel() + k3.numel())).values
        self.hist += torch.histc(d.abs().clamp(1e-12, 99.0).log10().cpu(), GAP_BINS[2], *GAP_BINS[:2])

    def reduce(self) -> None:
        sums = distributed.all_sum({"abs_sum": self.abs_sum, "n": self.n, "kl_sum": self.kl_sum})
        self.abs_sum, self.n, self.kl_sum = sums["abs_sum"], sums["n"], sums["kl_sum"]
        self.largest, self.hist = distributed.all_max(self.largest), distributed.all_sum_tensor(self.hist)
        self.top = torch.tensor([x for rank_top in distributed.gather_objects(self.top.tolist()) for x in rank_top],
                                dtype=torch.float64)

    def kl(self) -> float | None:
        return trimmed_kl(self.kl_sum, self.n, self.top.tolist())

    def metrics(self) -> dict:
        """Unknown (null), not perfect, when no trained token came from the current weights."""
        seen = bool(self.n)
        return {"rollout/engine_kl": self.kl(),
                "rollout/logprob_diff_max": self.largest if seen else None,
                "rollout/logprob_diff_mean": self.abs_sum / self.n if seen else None,
                "rollout/logprob_diff_p99": min(quantile(self.hist, 0.99), self.largest) if seen else None}


KL_HISTORY = 10  # steps whose engine/trainer KL the jump check compares with (their median)
# ... and the least median it compares with: over a few hundred tokens a step bf16 noise swings from 1e-7 to
# 4e-5 (the tiny model: 246x between two healthy steps), so a jump is measured from at least this
KL_FLOOR = 5e-5


def check(kl: float, diff_max: float, cfg, recent: list) -> None:
    """A rollout engine that disagrees with the trainer about the tokens the very same weights sampled is stale
    (a weight sync that did not land) or wrong (weights, kernels), and every sample it makes trains on
    garbage: stop before the update, or warn. The statistic is the mean per-token KL between them, not the
    largest gap: bf16 engines and trainers differ by noise whose largest value grows with the tokens compared
    (3.5 nats have been reported on a MoE model) while its mean stays put. Its noise level depends on the
    model and the dtype (fp32 ~1e-12, the tiny model in bf16 ~3e-5, reports on 8-30B models in bf16 ~1e-3), so
    two tests: past --engine-kl-jump times the median of the last KL_HISTORY steps, or KL_FLOOR when that is
    less (an engine that stopped following the trainer; a fresh run has no history, and its first rollout
    comes from the weights both loaded), or past --max-engine-kl whatever the history. `recent` is that history;
    this step's value joins it."""
    baseline = max(sorted(recent)[len(recent) // 2], KL_FLOOR) if recent else None
    why = None
    if cfg.max_engine_kl and kl > cfg.max_engine_kl:
        why = f"past --max-engine-kl {cfg.max_engine_kl}: its weights or kernels are wrong"
    elif cfg.engine_kl_jump and baseline and kl > cfg.engine_kl_jump * baseline:
        why = (f"{kl / baseline:.0f}x the median of the last {len(recent)} steps (at least {KL_FLOOR:g}: "
               f"{baseline:.3g}), past --engine-kl-jump {cfg.engine_kl_jump}: the engine is stale (a weight sync "
               f"that did not land?)")
    recent[:] = (recent + [kl])[-KL_HISTORY:]
    if why is None:
        return
    message = (f"the rollout engine and the trainer disagree on the tokens the current weights sampled: mean KL "
               f"{kl:.3g} per token (rollout/engine_kl; largest log-prob gap {diff_max:.3g} nats), {why}")
    if cfg.on_engine_kl == "stop":
        raise RuntimeError(message + "; stopping before the update (--on-engine-kl warn trains on)")
    if distributed.rank() == 0:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


class Watch:
    """The engine/trainer gap check, applied to the trainer's forward where the model is built (placement.wrap):
    armed for a step by `start` (the policy version whose tokens it compares, and `recent`, RunState.engine_kl:
    the jump test's history), it sees each forward of the pass before the optimizer (no gradients): the routing
    the engine chose against the trainer's router (--routing-replay), and the log-probs of the tokens these very
    weights sampled. The step's first forward with gradients, the optimizer's, runs `check` first: every rank's
    sums combined, then a stale engine stops the run before any weight moves."""

    def __init__(self, cfg):
        self.cfg, self.version, self.recent, self.armed = cfg, 0, [], False
        self.gap, self.routes = Gap(), RoutingMismatch(0)

    def start(self, version: int, recent: list) -> None:
        self.version, self.recent, self.armed = version, recent, True
        self.gap, self.routes = Gap(), RoutingMismatch(version)

    def around(self, tokens):
        """`tokens` (model.response_tokens, as wrapped) watched."""
        def run(lm, mb, temperature):
            if not self.armed:
                return tokens(lm, mb, temperature)
            if torch.is_grad_enabled():  # the optimizer's pass begins
                self.check()
                return tokens(lm, mb, temperature)
            with self.routes.counting(lm, mb):
                logprobs, entropy = tokens(lm, mb, temperature)
            if mb.counted:
                self.add(mb, logprobs)
            return logprobs, entropy
        return run

    def add(self, mb, logprobs: torch.Tensor) -> None:
        """The trainer's log-probs of `mb`'s response tokens ([N], in order), beside the engine's."""
        sampled_now = mb.versions[mb.resp_mask] == self.version
        self.gap.add(logprobs[sampled_now], mb.behaviour[mb.resp_mask][sampled_now])

    def check(self) -> None:
        """Every rank's sums combined, then the check (every rank calls it)."""
        self.armed = False
        self.gap.reduce()
        if (kl := self.gap.kl()) is not None:
            check(kl, self.gap.largest, self.cfg, self.recent)

    def metrics(self) -> dict:
        """The step's rollout/* gap metrics (every rank calls it)."""
        if self.armed:  # a step with no optimizer pass
            self.check()
        out = self.gap.metrics()
        if self.cfg.routing_replay != "false":
            out.update(self.routes.metrics())
        return out
