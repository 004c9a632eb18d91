"""ulorl's entry point: RL with verifiable rewards on ultra-long outputs (UloRL + ProRL's KL control).

    python train.py                                   # tiny built-in model + task: minutes on a laptop CPU
    python train.py --preset ulorl --model Qwen/Qwen3-4B --data dapo.parquet --out runs/q4b
    python train.py --help                            # every knob, with the paper it comes from
    torchrun --standalone --nproc-per-node 2 train.py --parallel fsdp   # trainer ranks: FSDP2 (or ddp)

Owns the run: loading, the RL loop in the papers' order (`main`, its steps numbered as in ulorl.py's index)
and the console line; systems/placement.py decides where everything runs. Under torchrun every process is a trainer
rank; rank 0 also owns the rollout engine, the pools, the data and the logs, and hands every rank the batch.
"""
from config import Config, parse_config

# the command line first: --help and a wrong flag answer before torch and transformers load (seconds)
FLAGS = parse_config(description=__doc__) if __name__ == "__main__" else None

import contextlib  # noqa: E402 (the imports below wait for the flags)
import dataclasses
import functools
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist

import data
import eval as eval_lib
import model as model_lib
import reward
import ulorl
from rollouts import EngineFailure, Overlapped, Rollouts
from segment_rollout import Pools, Sample
from ulorl import RunState
from systems import checkpoint
from systems import outdir
from systems import logs
from systems import distributed
from systems import seqpar
from systems.engine_gap import Watch
from systems.routing import Routing
from systems import placement
from systems import plan as plan_lib
from systems import sandbox
from systems import workers
from systems.engine import Sampling, SyncError


# ------------------------------------------------------------------------- models, engine, evaluation

def held_out(engine, tokenizer, rows: list[dict], cfg: Config, judge: reward.Judge | None) -> dict:
    """avg@1 on the held-out prompts (eval.evaluate), sampled like the training rollouts, in one segment of
    the full length. Sample uids count down from -1: the same draws at every evaluation, apart from training's.
    Judged as eval.py judges, whatever --overlong shapes the training reward: a truncated response is unsolved."""
    with engine.aside():
        summary, _, metrics = eval_lib.evaluate(engine, tokenizer, rows, 1, cfg.max_response_len,
                                                Sampling(cfg.temperature, cfg.top_p, cfg.top_k), segments=1,
                                                batch=256, timeout=cfg.reward_timeout, overlong="zero", judge=judge,
                                                pools=Pools(next_uid=-1, count_down=True))
    return {"eval/accuracy": summary["avg@k"], "eval/reward": summary["mean_reward"],
            "eval/mean_length": summary["mean_length"], "eval/truncation_rate": summary["truncation_rate"],
            "eval/reward_timeouts": metrics["reward/timeouts"]}


def evaluate_before_training(engine, tokenizer, eval_rows, cfg: Config, judge, state: RunState) -> dict:
    """Step 0's record: held-out accuracy before any update, also the baseline --ref-reset-on-stall improves on."""
    t0, ev = time.time(), held_out(engine, tokenizer, eval_rows, cfg, judge)
    ulorl.stalled(state, ev["eval/accuracy"], cfg.ref_reset_on_stall)
    print(f"step     0 | eval accuracy {ev['eval/accuracy']:.3f} (before training)", flush=True)
    return {"step": 0, "time/step_s": time.time() - t0, "reward/mean": None, "entropy/mean": None,
            "mpt/masked_frac": None, "rollout/unfinished": 0, "tokens/generated": 0, **ev}


def sync_weights(engine, lm, dtype: str, ranks, replicas: int = 1) -> None:
    """Step 7, the one place new weights reach the engine: rank 0's engine takes the module (systems/weight_sync.py),
    gathered from the shards a layer at a time in `dtype`; the other ranks join each of the `replicas` gathers."""
    if engine is not None:
        engine.update_weights(lm)
    else:
        for _ in range(replicas):
            ranks.gather_for_lead(lm, model_lib.DTYPES[dtype])


# ----------------------------------------------------------------------------------------- logging

def step_metrics(step: int, groups: list[list[Sample]], rewards: list, t_roll: float, record: dict) -> dict:
    """The step's rollout numbers: rewards (per verifier too), lengths, speed. `rewards`: (verifier, reward) of every
    sample the rollout rewarded."""
    trained = [s for g in groups for s in g]
    out = {}
    for v in sorted({v for v, _ in rewards}):
        rs = [r for w, r in rewards if w == v]
        out[f"reward/by_verifier/{v}"] = sum(rs) / len(rs)
    out.update({"step": step, "reward/mean": sum(r for _, r in rewards) / len(rewards) if rewards else None,
                "reward/trained_mean": sum(s.reward for s in trained) / len(trained),
                "response/mean_len": sum(len(s.tokens) for s in trained) / len(trained),
                "response/max_len": max(len(s.tokens) for s in trained),
                "response/truncated_frac": sum(s.finish == "truncated" for s in trained) / len(trained),
                "response/multi_segment_frac": sum(len(s.seg_starts) > 1 for s in trained) / len(trained),
                # (--overlap: the rollout's own time, most of it beside the last update)
                "tokens/per_s": record["tokens/generated"] / max(t_roll + record.get("time/rollout_ahead_s", 0),
                                                                 1e-9), "time/rollout_s": t_roll})
    return out


def log_line(record: dict, eta_s: float, threads: int) -> str:
    def num(key, form=".3f"):  # null (nothing measured) as "-"
        return "  -  " if record.get(key) is None else format(record[key], form)
    acc = f" | eval {record['eval/accuracy']:.3f}" if "eval/accuracy" in record else ""
    return (f"step {record['step']:5d} | reward {num('reward/mean')}{acc} | entropy {num('entropy/mean')} | "
            f"masked {num('mpt/masked_frac')} | unfinished {record['rollout/unfinished']:4d} | "
            f"tok/s {record['tokens/per_s']:7.0f} | {record['time/step_s']:.2f}s | eta {eta_s / 60:.1f}m | "
            f"{threads} thr")


def stop_on_signals(lead: bool, state: RunState) -> list[str]:
    """SIGTERM (schedulers, kill) and Ctrl-C finish the current step, save a checkpoint and exit; a second
    Ctrl-C exits at once. Returns the list the signal's name lands in (under torchrun rank 0's decides)."""
    stop: list[str] = []

    def on_signal(signum, frame):
        if stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)
        if lead:
            print(f"\n{stop[-1]}: finishing step {state.step + 1}, then saving a checkpoint", file=sys.stderr,
                  flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def load_data(cfg: Config, lead: bool) -> tuple[list[dict], list[dict]]:
    """Rank 0's training and held-out rows (other ranks: none), training's without any held-out prompt; a run
    whose rows run model output as code stops here when this machine cannot isolate it."""
    if not lead:
        return [], []
    keys = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, default_verifier=cfg.default_verifier)
    rows = data.load_prompts(cfg.data, cfg.seed, **keys)
    evaluating = bool(cfg.eval_data and cfg.eval_every)
    eval_rows = data.load_prompts(cfg.eval_data, cfg.seed, True, cfg.eval_n, **keys) if evaluating else []
    rows = data.without_held_out(rows, eval_rows, cfg.data, cfg.eval_data)
    if any(r["verifier"] in ("code", "rg") for r in rows + eval_rows) and (why := sandbox.available()):
        raise ValueError(why)  # model output that may run as code is never scored unisolated
    return rows, eval_rows


def replay_routing(cfg: Config, lm, ref_lm) -> None:
    """--routing-replay true: the trainer's forwards route as the engine did (record: they only compare)."""
    for module in (lm, ref_lm) if cfg.routing_replay != "false" else ():
        if module is not None:
            Routing.of(module).swap = cfg.routing_replay == "true"


def startup_metrics(load_peak_mib: float, plan: plan_lib.Plan) -> dict:
    """What the first metrics.jsonl record holds once: loading's host peak and the plan's totals."""
    out = {"memory/load_host_mib": load_peak_mib, "memory/plan_trainer_mib": plan.trainer_total / 2**20}
    if "offloaded optimizer state" in plan.host:
        out["memory/plan_offloaded_mib"] = plan.host["offloaded optimizer state"] / 2**20
    return out


def save_checkpoint(name: str, **kw) -> None:
    """checkpoint.save into the run's folder (`out`, held since the start), with a refused write (full disk,
    read-only --out) reported as what it is: the unfinished step_N.tmp is removed, and the message says what is
    safe."""
    out = kw["out"]
    try:
        checkpoint.save(name=name, **kw)
    except OSError as e:
        with contextlib.suppress(OSError, ValueError):
            out.remove(name + ".tmp")
        path = os.path.join(out.path, name)
        if (error := outdir.write_error(e, f"could not write checkpoint {path}", out)) is None:
            raise
        raise error from None


@dataclasses.dataclass
class Run:
    """What the loop works with, set up once: the trainer's side (every rank) and rank 0's engine, data and logs."""
    cfg: Config
    world: int
    lead: bool  # rank 0: the engine, the pools, the data and the logs
    threads: int
    policy: torch.nn.Module  # placement.wrap()ped: micro-batch -> (log-probs, entropy)
    ref: torch.nn.Module | None  # the KL reference, wrapped the same way (--kl-coef 0: none)
    lm: torch.nn.Module  # the Hugging Face model under `policy`
    ref_lm: torch.nn.Module | None
    tokenizer: object
    masters: object  # distributed.MasterWeights: the fp32 weights AdamW steps in a bf16 run outside FSDP (else None)
    ranks: distributed.Ranks  # what the update needs of the trainer ranks (ulorl.update)
    watch: Watch  # the engine/trainer gap check, on the policy's forwards (systems/engine_gap.py)
    opt: torch.optim.Optimizer
    sched: object
    state: RunState
    host_before: int  # the host memory peak before loading (memory/* metrics)
    engine: object = None
    rollouts: Rollouts | None = None
    judge: reward.Judge | None = None
    eval_rows: list = dataclasses.field(default_factory=list)
    log: logs.RunLog | None = None
    out: outdir.Folder | None = None  # --out, held since the start: every write of the run goes through it
    out_lock: object = None
    save: object = None  # save(name): the checkpoint `name` of everything, in `out`
    startup: dict = dataclasses.field(default_factory=dict)  # logged once, with the first record

    def reset_reference(self) -> None:  # ProRL: reference <- policy, fresh AdamW moments (--reset: or one alone)
        ulorl.reset_reference(self.lm, self.ref_lm, self.opt, self.ref, self.cfg.reset)

    def memory_peaks(self) -> dict:  # the memory/* metrics
        return placement.memory_peaks(self.cfg, self.host_before)


def claim_out(cfg: Config, lead: bool) -> tuple[str | None, outdir.Folder, object, str]:
    """--out before anything loads: the checkpoint --resume names (None: a fresh run), the folder held open for
    the run's life (every rank's own hold, each checked to be rank 0's folder), rank 0's lock, one run per
    --out until this process ends, and the run's id (outdir.begin_run: a resumed older checkpoint starts a new
    branch); --overwrite clears the old run first."""
    resume_from = outdir.find_resume(cfg.resume, cfg.out, cfg.overwrite)
    out = out_lock = run_id = None
    if lead:
        out = outdir.open_out(cfg.out)
        out_lock = outdir.lock_out(out)
        if cfg.overwrite and (gone := outdir.clear_run(out)):
            print(f"--overwrite: deleted {', '.join(gone)} from {cfg.out}", flush=True)
        new_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"  # unique in one process too
        run_id = outdir.begin_run(out, resume_from, new_id)
    distributed.barrier()
    out = out or outdir.Folder.at(cfg.out)  # made by rank 0
    outdir.same_folder(out, distributed.gather_objects(outdir.folder_identity(out)))
    return resume_from, out, out_lock, distributed.broadcast(run_id)


def set_up(cfg: Config) -> Run | None:
    """Checks, data, models, the engine, the optimizer and a resumed run's state; the held-out accuracy before
    training. None for --plan (printed; nothing started)."""
    rank, world, lead, threads, plan, engine_mem = placement.start(cfg)
    if plan is None:
        return None
    resume_from, out, out_lock, run_id = claim_out(cfg, lead)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed + rank)
    rows, eval_rows = load_data(cfg, lead)  # data before models: a bad row stops the run at once
    host_before = plan_lib.reset_host_peak()
    watch = Watch(cfg)
    policy, ref, lm, ref_lm, tokenizer, masters = placement.load_models(cfg, resume_from, world, watch)
    replay_routing(cfg, lm, ref_lm)
    load_peak = distributed.all_max(plan_lib.host_peak() - host_before) / 2**20  # MiB, the largest rank's
    opt = torch.optim.AdamW(masters.parameters() if masters else policy.parameters(), lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(ulorl.lr_factor, cfg=cfg))
    state = RunState(run_id=run_id)
    ranks = distributed.Ranks(policy, masters, seqpar.sp_size())
    run = Run(cfg, world, lead, threads, policy, ref, lm, ref_lm, tokenizer, masters, ranks, watch, opt, sched, state,
              host_before, eval_rows=eval_rows, out=out, out_lock=out_lock, startup=startup_metrics(load_peak, plan))
    pools = Pools()
    if lead:
        run.engine = placement.rollout_engine(cfg, lm, tokenizer, resume_from or cfg.model, world, engine_mem)
        if cfg.verifier_model and cfg.verifier_mode != "off":
            run.judge = eval_lib.load_judge(cfg.verifier_model, cfg.verifier_mode, cfg.verifier_max_tokens,
                                            cfg.dtype, cfg.device, cfg.seed)
    run.save = functools.partial(save_checkpoint, out=out, lm=lm, ref_lm=ref_lm, tokenizer=tokenizer, opt=opt,
                                 sched=sched, engine=run.engine, pools=pools, state=state, cfg=cfg, git=logs.git_hash())
    if resume_from:
        checkpoint.load(resume_from, opt, sched, run.engine, pools, state, masters)
        state.run_id = run_id  # the checkpoint's own, or a new branch's
    if lead:
        sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
        kind = Overlapped if cfg.overlap else Rollouts  # --overlap 1: the next rollout decodes during the update
        run.rollouts = kind(run.engine, pools, rows, state, tokenizer, sampling, cfg, run.judge, workers.run)
        if resume_from:
            print(f"resumed from {resume_from} at step {state.step} (run id {run_id})", flush=True)
        run.log = logs.RunLog(cfg, out, state.step if resume_from else None)
        if state.step == 0 and eval_rows:
            run.log.record({**evaluate_before_training(run.engine, tokenizer, eval_rows, cfg, run.judge, state),
                            **run.startup})
            run.startup = {}
    return run


def next_batch(run: Run):
    """Steps 1-4 on rank 0 (rollouts.Batch). A failed engine leaves a checkpoint in one process (under torchrun
    one needs every rank: the newest periodic one resumes)."""
    try:
        return run.rollouts.next()
    except EngineFailure:
        if run.world == 1:
            run.save(f"step_{run.state.step:06d}")
        raise


def finish_step(run: Run, step: int, batch, record: dict, t_roll: float, t0: float, step_times: list) -> None:
    """Step 8 before the checkpoint: the held-out evaluation (ProRL also resets when its accuracy stalls), then
    rank 0's metrics.jsonl record, samples and console line."""
    cfg, lead = run.cfg, run.lead
    if cfg.eval_data and cfg.eval_every and (step == cfg.steps or step % cfg.eval_every == 0):
        if lead:
            record.update(held_out(run.engine, run.tokenizer, run.eval_rows, cfg, run.judge))
        if run.ranks.from_lead(lead and ulorl.stalled(run.state, record["eval/accuracy"], cfg.ref_reset_on_stall)):
            run.reset_reference()
            record["train/ref_reset"] = 1
    if not lead:
        return
    record.update(step_metrics(step, batch.groups, batch.rewards, t_roll, record), **run.startup)
    run.startup = {}
    if cfg.dump_samples:
        run.log.dump_samples(batch.groups, step, run.tokenizer, cfg.dump_samples)
    record["time/step_s"] = time.time() - t0
    step_times.append(record["time/step_s"])
    run.log.record(record)  # before the checkpoint: every record up to a checkpoint's step exists
    print(log_line(record, sum(step_times) / len(step_times) * (cfg.steps - step), run.threads), flush=True)


# -------------------------------------------------------------------------------------------- main

def main(cfg: Config) -> None:
    """The run: set-up, then the RL loop, one step in the papers' order."""
    run = set_up(cfg)
    if run is None:  # --plan: printed, nothing started
        return
    state, lead, engine, rollouts = run.state, run.lead, run.engine, run.rollouts
    stop, step_times = stop_on_signals(lead, state), []
    while state.step < cfg.steps:
        t0, step = time.time(), state.step + 1

        # 1-4. rollout: segments of unfinished and new samples, rewards, dynamic sampling, until enough groups
        batch = next_batch(run) if lead else None
        t_roll = time.time() - t0
        if lead:  # the engine pauses, or (--overlap) decodes the next step's rollout during this update
            rollouts.hand_over(batch, step)
        groups, probing, stop_now = run.ranks.from_lead((batch.groups, batch.probing, stop[0] if stop else "")
                                                        if lead else None)
        record = batch.record if lead else {}  # the step's metrics.jsonl record: the rollout's counts first
        # every rank takes the probe when the update asks for it (after its own pass over the batch)
        probe = (lambda: run.ranks.from_lead(rollouts.probe() if lead else None)) if probing else None

        # 5-6. pi_old, reference log-probs and DMMPT mask, the clipped loss, the optimizer (each rank its share)
        run.watch.start(state.version, state.engine_kl)  # the engine/trainer gap on the tokens these weights sampled
        record.update(ulorl.update(run.policy, run.ref, run.opt, run.sched, groups, state.version,
                                   run.tokenizer.pad_token_id, cfg, run.ranks, probe))
        record.update(run.watch.metrics())
        record.update(run.memory_peaks())
        ulorl.after_update(record, state, cfg, warn=lead)  # the policy version advances if the weights changed
        if cfg.ref_reset_every and step % cfg.ref_reset_every == 0:
            run.reset_reference()  # ProRL: reference <- policy, fresh AdamW moments
            record["train/ref_reset"] = 1

        # 7. the new weights reach the engine (after the rollout decoding ahead ended); unfinished samples continue
        if lead:  # the rollout decoding ahead ends (--overlap), the engine resumes
            record.update(rollouts.take_back())
        if cfg.overlap:  # the other ranks wait for it here, with no timeout: in the sync's gathers NCCL's watchdog
            run.ranks.wait_for_lead()  # would end the run (--dist-timeout)
        if record["train/optimizer_steps"]:
            t_sync = time.time()
            sync_weights(engine, run.lm, cfg.dtype, run.ranks, cfg.rollout_replicas or 1)
            record["time/sync_s"] = time.time() - t_sync
        state.step = step

        # 8. evaluate, log, checkpoint
        finish_step(run, step, batch, record, t_roll, t0, step_times)
        stop_now = stop_now or (stop[0] if run.world == 1 and stop else "")
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop_now:
            run.save(f"step_{step:06d}")
        if stop_now:
            if lead:
                print(f"stopped by {stop_now} after step {step}; checkpoint saved (resume with --resume auto)",
                      flush=True)
            break
    if lead:
        run.log.close()
        run.out_lock.close()
    run.out.close()
    if run.world > 1:
        dist.destroy_process_group()


def cli() -> None:
    """`python train.py`: main, with a user's mistake, a full disk or a broken weight sync said in one line."""
    try:
        main(FLAGS or parse_config(description=__doc__))
    except SyncError as e:  # the sync's threads may wait in a broadcast for good: exit without them
        print(f"error: {e}", file=sys.stderr, flush=True)
        workers.close_pool()
        os._exit(1)  # under torchrun, the other ranks (in the sync's gathers) are ended by its agent
    except (ValueError, FileNotFoundError) as e:  # a user's mistake (a data row, an --out, a file): the message says it
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk or a read-only --out while writing the logs
        if e.errno not in outdir.WRITE_ERRORS:
            raise
        sys.exit(f"error: {e.strerror} ({e.filename}); the newest complete checkpoint in --out resumes with "
                 f"--resume auto once it can be written")


if __name__ == "__main__":
    cli()
