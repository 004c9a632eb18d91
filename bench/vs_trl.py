"""`python -m bench trl`: TRL's GRPOTrainer against ulorl with 1 and 4 segments on identical settings, in
alternating chunks (TRL is optional: requirements-bench.txt)."""
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.common import add_run_flags, load_train, mean, rotate, run_chunk


def trl_reward(completions, answer, completion_ids, **kw):
    """TRL reward function: the tiny verifier on the decoded completion; counts generated tokens."""
    import verifiers
    TRL_STATS["tokens"] += sum(len(c) for c in completion_ids)
    rewards = [verifiers.tiny_reward(c, a) for c, a in zip(completions, answer)]
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
        print("python -m bench trl needs TRL, an optional benchmark dependency: pip install -r "
              "requirements-bench.txt -c requirements.txt (pins trl and accelerate, keeps this project's torch and "
              "transformers)",
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
    return trl_report(variants, times, rollout, tokens, rewards)


def trl_report(variants: list[str], times: dict, rollout: dict, tokens: dict, rewards: dict) -> dict:
    """The variants' table, TRL's median step over each, and the mode's figures."""
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


def add_parser(sub) -> None:
    t = sub.add_parser("trl", help="TRL's GRPOTrainer vs ulorl with 1 and 4 segments on identical settings",
                       description="Any other flag goes to train.py and, where TRL has it, to GRPOConfig.")
    t.add_argument("--rounds", type=int, default=4, help="rounds of one chunk per variant")
    t.add_argument("--chunk", type=int, default=4, help="steps per variant per round (the first is dropped)")
    add_run_flags(t)
    t.set_defaults(run=bench_trl, train_flags=True)
