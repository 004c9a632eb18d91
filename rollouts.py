"""Steps 1-4 of an RL step, as one object: `Rollouts.next()` returns the step's batch; `hand_over` and
`take_back` are what the loop calls around the update. `Overlapped` (--overlap 1) decodes the next step's
rollout in a thread while the trainers update, on the weights before the update, and ends it before the sync.

A round (segment_rollout.rollout_step) decodes one segment of every unfinished and new sample; groups whose
every member finished are rewarded (reward.score_samples) and, when informative, wait for the update (dynamic
sampling); rounds repeat until --train-groups groups are ready. Rank 0 only: the engine, the pools and the data
live there.
"""
import sys
import threading
import time
from dataclasses import dataclass

import data
import reward
import ulorl
from segment_rollout import Pools, Sample, Sampling, rollout_step
from ulorl import RunState

# The gap check's probe under --overlap: up to 1,024 tokens (a prompt a replica at least), a small share of a step's
# decoding. At 256, over a real model's bf16 noise of ~1e-3 KL a token, one outlier token 1.7 nats off beyond the
# two the KL leaves out made the mean 10x the median, and a healthy run stopped; now it adds a quarter of that.
PROBE_PROMPTS, PROBE_TOKENS = 4, 256


@dataclass
class Prefetched:
    """--overlap 1: the next step's rollout as far as it ran during the last update (its samples are in the pools
    and `ready`): what that step continues from, and what a checkpoint keeps of it (RunState.prefetched)."""
    record: dict  # the step's metrics.jsonl record so far
    rewards: list  # (verifier, reward) of every sample rewarded in it
    version: int  # the policy version whose weights decoded it


class EngineFailure(RuntimeError):
    """The rollout engine failed twice in a row."""


@dataclass
class Batch:
    """One step's rollout: the groups to train and its part of the step's metrics.jsonl record."""
    groups: list[list[Sample]]
    record: dict  # rollout counts; the update, evaluation and timing add theirs
    rewards: list  # (verifier, reward) of every sample rewarded on the way, trained or not
    probing: bool  # no trained token is of the current weights: the engine decodes a probe for the gap check


def new_record(pools: Pools) -> dict:
    """A step's metrics.jsonl record, before its rollout: counts it adds to."""
    return {"reward/timeouts": 0, "reward/errors": 0, "rollout/rounds": 0, "tokens/generated": 0,
            "dynamic/dropped_groups": 0, "rollout/unfinished": len(pools.unfinished)}


class Rollouts:
    """The rollout of every step (rank 0). `state.prefetched` carries an overlapped rollout into the next step
    and into checkpoints."""

    def __init__(self, engine, pools: Pools, rows: list[dict], state: RunState, tokenizer, sampling: Sampling,
                 cfg, judge: reward.Judge | None, run_checks):
        self.engine, self.pools, self.rows, self.state, self.tokenizer = engine, pools, rows, state, tokenizer
        self.sampling, self.cfg, self.judge = sampling, cfg, judge
        self.run_checks = run_checks  # where reward checks run (reward.score_batch): train.py's killable workers
        self.too_long: set = set()  # rows known to exceed --max-prompt-len (data.draw_prompts skips them)

    def next(self) -> Batch:
        """Steps 1-4: rounds until --train-groups informative groups are ready (after what the last update's overlap
        decoded), then the step's groups."""
        state, cfg = self.state, self.cfg
        ahead, state.prefetched = state.prefetched, None
        record = ahead.record if ahead else new_record(self.pools)
        rewards = ahead.rewards if ahead else []
        try:  # after a prefetched rollout, rounds run here only when the engine failed during it
            self.until_ready(record, rewards, state.version)
        except EngineFailure:
            if ahead:  # the part decoded during the last update stays this step's
                state.prefetched = Prefetched(record, rewards, ahead.version)
            raise
        groups, dropped = ulorl.take_groups(state, cfg)
        if dropped is not None:
            record["rollout/dropped_surplus_groups"] = dropped
        return Batch(groups, record, rewards, probing=False)

    def until_ready(self, record: dict, rewards: list, version: int) -> None:
        """Rounds by the weights of `version` until --train-groups groups are ready: at least one, so that unfinished
        samples always advance."""
        ran, cfg = False, self.cfg
        while record["rollout/rounds"] == 0 or len(self.state.ready) < cfg.train_groups:
            ran = True
            r = self.round(self.draw(record), version)  # 1-2. one segment of every unfinished and new sample
            record["rollout/rounds"] += 1
            record["tokens/generated"] += r["tokens/generated"]
            record["rollout/unfinished"] = r["rollout/unfinished"]
            # 3. reward the groups whose every member is finished
            complete = [self.pools.pop_group(g[0].group) for g in self.pools.ready_groups(cfg.group_size)]
            samples = [s for g in complete for s in g]
            texts = self.tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
            for k, v in reward.score_samples(self.run_checks, samples, texts, cfg.max_response_len,
                                             cfg.overlong, cfg.overlong_buffer,
                                             cfg.reward_timeout, self.judge, cfg.reward_batch_timeout).items():
                record[k] = record.get(k, 0) + v
            rewards += [(s.row["verifier"], s.reward) for s in samples]
            # 4. dynamic sampling: only informative groups wait for the update
            kept, dropped = ulorl.dynamic_sampling(complete, cfg.dynamic_sampling)
            self.state.ready += kept
            record["dynamic/dropped_groups"] += dropped
            if record["rollout/rounds"] > 100 * cfg.segments:
                mean_reward = sum(r for _, r in rewards) / max(len(rewards), 1)
                raise RuntimeError(f"no informative group after {record['rollout/rounds']} rollouts: every group's "
                                   f"rewards were all equal (mean reward {mean_reward:.3f}). "
                                   f"The task is too easy or too hard for this model; try --dynamic-sampling false")
        if ran:
            record.update(self.engine.round_metrics())

    def draw(self, record: dict) -> list:
        """New prompts x G: as many as fit beside the unfinished samples in --prompts-per-step x G rows."""
        cfg, pools = self.cfg, self.pools
        open_slots = cfg.prompts_per_step * cfg.group_size - len(pools.unfinished)  # rollout rows for new groups
        n_new = 0 if len(self.state.ready) >= cfg.train_groups else max(open_slots // cfg.group_size, 0)
        prompts, self.state.cursor, skipped = data.draw_prompts(self.rows, cfg.seed, self.state.cursor, n_new,
                                                                self.tokenizer, cfg.max_prompt_len, cfg.data,
                                                                self.too_long)
        if skipped:
            record["data/skipped_long_prompts"] = record.get("data/skipped_long_prompts", 0) + skipped
        return [pools.new_group(ids, row, cfg.group_size) for ids, row in prompts]

    def round(self, new: list, version: int) -> dict:
        """One segment of every unfinished and new sample, sorted into the pools; one retry (the new samples already
        wait in the unfinished pool)."""
        cfg = self.cfg
        segment_len = cfg.max_response_len // cfg.segments
        try:
            return rollout_step(self.engine, self.pools, new, segment_len, cfg.max_response_len, self.sampling,
                                version)
        except Exception as e:
            print(f"warning: the rollout engine failed ({type(e).__name__}: {e}); retrying once",
                  file=sys.stderr, flush=True)
            try:
                return rollout_step(self.engine, self.pools, [], segment_len, cfg.max_response_len, self.sampling,
                                    version)
            except Exception as e2:
                raise EngineFailure(f"the rollout engine failed twice: {type(e2).__name__}: {e2}; resume from the "
                                    f"newest checkpoint in {cfg.out} with --resume auto") from e2

    def hand_over(self, batch: Batch, step: int) -> None:
        """The trainers take `batch`: the engine pauses (vLLM sharing the trainer's GPU sleeps meanwhile)."""
        self.engine.pause()

    def take_back(self) -> dict:
        """After the update, before the weight sync: the engine resumes. Returns the step's record entries."""
        self.engine.resume()
        return {}


class Overlapped(Rollouts):
    """--overlap 1: the next step's rollout decodes in a thread while the trainers update (`start_next`), on the
    weights before the update, and ends before the weight sync (`join`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inflight = None  # (thread, the rollout decoding ahead, its probe)

    def next(self) -> Batch:
        """The step's batch, with how many versions behind the trainer's the weights that decoded it were, and
        whether it is probing: no trained token is of the current weights, so the gap check needs a probe."""
        ahead, version = self.state.prefetched, self.state.version
        batch = super().next()
        batch.record["staleness/engine_lag"] = version - (ahead.version if ahead else version)
        batch.probing = not any(v == version for g in batch.groups for s in g for v in s.versions)
        return batch

    def hand_over(self, batch: Batch, step: int) -> None:
        """The next step's rollout (the probe first) begins decoding beside the update."""
        self.start_next(batch, step)
        super().hand_over(batch, step)

    def take_back(self) -> dict:
        """The rollout decoding ahead ends (join), then the engine resumes; the trainer's wait is recorded."""
        waited = self.join()
        return {"time/engine_wait_s": waited, **super().take_back()}

    def start_next(self, batch: Batch, step: int) -> None:
        """--overlap 1: the next step's whole rollout begins now in a thread, decoded by the current weights while
        the trainers update them (the engine works in a process of its own; the update reads none of what the
        rollout writes: the pools, the ready groups, the data cursor). It draws exactly what a synchronous
        rollout would: its rounds depend on the weights and the pools, not on timing (a reward that overruns
        --reward-timeout aside). When `batch` is probing, the thread's first call is the gap check's probe
        (`probe`), which the update waits for after its own pass over the batch."""
        ahead = Prefetched(new_record(self.pools), [], self.state.version)
        done = {"probe": threading.Event()}

        def run():
            t0 = time.time()
            try:
                if batch.probing:
                    try:
                        done["samples"] = self.probe_samples(batch.groups, ahead.version, step)
                    finally:
                        done["probe"].set()
                self.until_ready(ahead.record, ahead.rewards, ahead.version)
            except BaseException as e:  # join() reports it on the main thread
                done["error"] = e
            ahead.record["time/rollout_ahead_s"] = time.time() - t0  # beside the update: not in time/rollout_s

        thread = threading.Thread(target=run, name="rollout", daemon=True)
        thread.start()
        self.inflight = thread, ahead, done

    def probe_samples(self, groups: list[list[Sample]], version: int, step: int) -> list[Sample]:
        """A step whose rollout was decoded during the last update trains no token of the current weights, so
        nothing in it measures the engine/trainer gap on them (a sync that left the engine behind would go
        unseen). The engines continue trained groups' prompts by PROBE_TOKENS tokens each on the weights just
        synced: the first PROBE_PROMPTS groups' prompts, dealt round the replicas (each gets one at least); the
        trainer compares its log-probs with theirs (ulorl.update's `probe`) and trains on none."""
        engines = self.engine.replicas()  # each directly: the replicas' split learns nothing from the probe
        firsts = [g[0] for g in groups][:max(PROBE_PROMPTS, len(engines))]  # stays as it was
        probes = []
        for i, e in enumerate(engines):
            idx = list(range(i, len(firsts), len(engines))) or [0]
            mine = [firsts[j] for j in idx]
            keys = [-(1 << 40) - step * 1024 - j for j in idx]  # apart from training's (0, 1, ...) and evaluation's
            gens = e.generate([s.prompt_ids for s in mine],  # (-1, -2, ...) random streams
                              [min(PROBE_TOKENS, self.cfg.max_response_len)] * len(mine), self.sampling, keys=keys)
            probes += [Sample(uid=-1, group=-1, prompt_ids=s.prompt_ids, row=s.row, tokens=g.tokens,
                              logprobs=g.logprobs, versions=[version] * len(g.tokens), seg_starts=[0], finish="eos",
                              reward=0.0, routing=g.routing) for s, g in zip(mine, gens)]
        return probes

    def probe(self) -> list[Sample] | None:
        """The probe start_next() began with, once decoded; None when the engine failed it (the step's gap goes
        unmeasured: rollout/engine_kl null)."""
        _, _, done = self.inflight
        done["probe"].wait()
        if "samples" not in done:
            print(f"warning: the engine failed the gap check's probe ({done.get('error')!r}); this step's "
                  f"engine/trainer gap goes unmeasured", file=sys.stderr, flush=True)
        return done.get("samples")

    def join(self) -> float:
        """End the rollout start_next() began (before the weight sync: new weights reach the engine between its
        calls), so that what it decoded is in the pools and `state.prefetched` (so in any checkpoint) before
        the step ends. An engine that failed (twice) leaves its samples in the unfinished pool: the next step's
        own rounds continue from there. Returns the seconds the trainer waited."""
        if self.inflight is None:
            return 0.0
        t0 = time.time()
        (thread, ahead, done), self.inflight = self.inflight, None
        thread.join()
        e = done.get("error")
        if isinstance(e, EngineFailure):
            print(f"warning: {e} during the update; the next step decodes its rounds itself",
                  file=sys.stderr, flush=True)
        elif e is not None:
            raise e
        self.state.prefetched = ahead
        return time.time() - t0
