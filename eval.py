"""Evaluation: avg@k, pass@k and maj@k of a model on a benchmark, sampled with the engines (systems/engine.py) and
scored with the verifiers (reward.py, verifiers.py) that training uses. Writes a JSON report and prints a small table.

    python eval.py                                    # the shipped tiny checkpoint on the tiny held-out set
    python eval.py --model runs/tiny/step_000150      # a trained one, same problems
    python eval.py --preset ulorl --model Qwen/Qwen3-4B --data aime25.jsonl --engine vllm --device cuda \\
        --report aime25.json                          # UloRL's avg@32 at T 0.85, top_p 0.95, top_k 20

Metrics, over n = --k samples per problem:
  avg@k   mean accuracy over all samples (UloRL's headline number; ProRL's "pass@1 over 16 samples")
  pass@k  for k = 1, 2, 4, ... and n: the unbiased estimator 1 - C(n-c, k) / C(n, k) of the chance that
          at least one of k samples is correct, from c correct of n (Chen et al. 2021), averaged over problems
  maj@k   the answer most samples give (ties: the one seen first) is correct; a truncated sample or one
          without an extractable answer does not vote. Answers are compared as strings, so "0.5" and
          "1/2" are different votes.

A sample is *solved* when its reward is full marks (>= 1) after overlong handling "zero" (UloRL: a truncated
response scores 0): a program passing half its tests or a puzzle scored 0.5 counts toward the mean reward,
reported beside, not toward avg@k / pass@k / maj@k. train.py's held-out evaluation runs through `evaluate`
here too (k = 1, one segment). `--segments S` decodes every response in S segments of at most
max_response_len / S tokens, refilling the batch with new problems as samples finish
(segment_rollout.rollout_step, as in training), so one long response does not hold a whole batch. With the
weights fixed this changes only scheduling: the transformers engine draws each token's random number from
(seed, sample, position) alone, so the responses are the same as unsegmented decoding, sampled or greedy.
vLLM seeds a request once per call, so there segmented sampled responses are other draws from the same
distribution.
"""
import argparse
import functools
import json
import math
import os
import sys
import time
from collections import Counter

import torch
from tqdm import tqdm

import data
import model as model_lib
import registry
import reward
import verifiers
import tiny
from segment_rollout import Pools, Sample, rollout_step
from systems import engine as engine_lib
from systems import placement
from systems.engine import Sampling
from systems import workers

# The papers' evaluation settings (UloRL: avg@32; ProRL: pass@1 over 16); the flags override them.
PRESETS = {
    "tiny": dict(k=4, temperature=1.0, top_p=1.0, top_k=-1, max_response_len=64),
    "ulorl": dict(k=32, temperature=0.85, top_p=0.95, top_k=20, max_response_len=131072),  # UloRL: avg@32, 128k
    "prorl": dict(k=16, temperature=0.6, top_p=0.95, top_k=-1, max_response_len=8192),  # ProRL: pass@1 of 16
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # what to evaluate
    p.add_argument("--model", default=tiny.CKPT, help="hub name or local HF directory (a run's step_NNNNNN/ too)")
    p.add_argument("--data", default="tiny", help=registry.DATA_HELP + "; of tiny and rg:NAME, the held-out draw "
                                                  "(the one train.py evaluates on)")
    p.add_argument("--prompt-key", default="prompt", help="column holding the prompt (dotted paths reach nested columns)")
    p.add_argument("--answer-key", default="answer", help="column holding the reference answer")
    p.add_argument("--split", default="test", help="split of a Hugging Face dataset")
    p.add_argument("--n-problems", type=int, default=512, help="the first N rows of --data (the tiny task draws N); 0 = all")
    # sampling
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the papers' eval settings: tiny "
                   "(T 1, k 4), ulorl (T 0.85, top_p 0.95, top_k 20, avg@32), prorl (T 0.6, top_p 0.95, k 16)")
    p.add_argument("--k", type=int, default=None, help="samples per problem (preset: tiny 4, ulorl 32, prorl 16)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (overrides the preset)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (overrides the preset)")
    p.add_argument("--top-k", type=int, default=None, help="top-k, -1 = off (overrides the preset)")
    p.add_argument("--max-response-len", type=int, default=None, help="response cap; reaching it scores 0 "
                   "(preset: tiny 64, ulorl 131072, prorl 8192)")
    p.add_argument("--segments", type=int, default=1, help="decode each response in S segments (segment rollout)")
    p.add_argument("--batch", type=int, default=512, help="samples per engine call (unfinished ones included)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; the tiny task's problems are seed 10000 + seed")
    # engine
    p.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"],
                   help="hf (transformers), vllm, or auto (vllm when installed, off CPU)")
    p.add_argument("--device", default="auto", help="torch device: auto (the GPU when torch sees one), cpu, cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype")
    p.add_argument("--rollout-mem", type=float, default=0.0,
                   help="vLLM memory: GPU fraction, or GiB of KV cache on CPU; 0 = 0.9 on GPU, 0.25 on CPU")
    p.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per reward check (longer scores 0)")
    p.add_argument("--report", default="", help="write the JSON report here")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():  # the preset fills what the command line left unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    checks = {"k": (args.k >= 1, ">= 1"), "segments": (args.segments >= 1, ">= 1"), "batch": (args.batch >= 1, ">= 1"),
              "n_problems": (args.n_problems >= 0, ">= 0 (0 = all)"),
              "max_response_len": (args.max_response_len >= 1, ">= 1"),
              "temperature": (args.temperature > 0, "> 0 (1e-5 decodes almost greedily)"),
              "top_p": (0 < args.top_p <= 1, "in (0, 1]"), "top_k": (args.top_k >= -1, "-1 (off) or >= 1"),
              "reward_timeout": (args.reward_timeout > 0, "> 0"), "rollout_mem": (args.rollout_mem >= 0, ">= 0")}
    for name, (ok, allowed) in checks.items():
        if not ok:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be {allowed}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ------------------------------------------------------------------------------------------ metrics

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c correct of n samples: 1 - C(n-c, k) / C(n, k) (exact integers, then one division)."""
    assert 0 <= c <= n and 1 <= k <= n, f"pass_at_k({n=}, {c=}, {k=})"
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return ks + ([n] if ks[-1] != n else [])


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """maj@k of one problem: the most common non-None answer (ties: the first seen) decides, through the
    first sample that gave it. No answer at all: wrong."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return False
    best = max(counts.values())
    first = next(i for i, a in enumerate(answers) if a is not None and counts[a] == best)
    return bool(correct[first])


def summarize(per_problem: list[dict]) -> dict:
    """The report's numbers from per-problem records ({"correct", "rewards", "answers", "lengths", "truncated"})."""
    n = len(per_problem[0]["correct"])
    assert all(len(p["correct"]) == n for p in per_problem), "every problem needs the same number of samples"
    samples = [c for p in per_problem for c in p["correct"]]
    lengths = [x for p in per_problem for x in p["lengths"]]
    return {
        "avg@k": sum(samples) / len(samples),
        "mean_reward": sum(r for p in per_problem for r in p.get("rewards", p["correct"])) / len(samples),
        "pass@k": {str(k): sum(pass_at_k(n, sum(p["correct"]), k) for p in per_problem) / len(per_problem)
                   for k in ks_up_to(n)},
        "maj@k": sum(majority_correct(p["answers"], p["correct"]) for p in per_problem) / len(per_problem),
        "mean_length": sum(lengths) / len(lengths),
        "truncation_rate": sum(t for p in per_problem for t in p["truncated"]) / len(lengths),
    }


# ------------------------------------------------------------------------------------------ sampling

def sample_all(engine, prompt_ids: list[list[int]], rows: list[dict], k: int, max_len: int, segments: int,
               batch: int, sampling: Sampling, pools: Pools | None = None) -> list[list[Sample]]:
    """k samples per problem, in problem order. Each engine call decodes at most one segment for every
    unfinished sample plus as many new problems' k samples as fit in `batch` (at least one problem).
    `pools` sets where sample uids (the engine's random streams) start; a fresh Pools by default."""
    pools, segment_len = pools or Pools(), -(-max_len // segments)
    done, nxt = {}, 0
    first_group = pools.next_group
    # disable=None: a bar on a terminal only; piped, its carriage returns would glue it to the next line
    with tqdm(total=len(rows), desc="eval", unit="problem", leave=False, disable=None) as bar:
        while nxt < len(rows) or pools.unfinished:
            new = []
            while nxt < len(rows) and (len(pools.unfinished) + (len(new) + 1) * k <= batch
                                       or (not new and not pools.unfinished)):
                new.append(pools.new_group(prompt_ids[nxt], rows[nxt], k))
                nxt += 1
            rollout_step(engine, pools, new, segment_len, max_len, sampling, version=0)
            for group in pools.ready_groups(k):
                done[group[0].group - first_group] = pools.pop_group(group[0].group)
                bar.update(1)
    return [done[i] for i in range(len(rows))]


def score(groups: list[list[Sample]], tokenizer, max_len: int, timeout: float, overlong: str = "zero",
          overlong_buffer: int = 0, judge: reward.Judge | None = None) -> tuple[list[dict], dict]:
    """Reward every sample (reward.score_samples, as training does) and return per-problem records:
    correctness, rewards, final answers (verifiers.final_answer, for maj@k), lengths; and the reward metrics."""
    samples = [s for g in groups for s in g]
    texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
    metrics = reward.score_samples(workers.run, samples, texts, max_len, overlong, overlong_buffer, timeout, judge)
    out, i = [], 0
    for g in groups:
        recs = []
        for s in g:
            truncated = s.finish == "truncated"
            recs.append((s.reward >= 1, s.reward, None if truncated else verifiers.final_answer(s.row["verifier"], texts[i]),
                         len(s.tokens), truncated))
            i += 1
        correct, rewards, answers, lengths, truncated = map(list, zip(*recs))
        out.append({"prompt": g[0].row["prompt"], "answer": g[0].row["answer"], "correct": correct,
                    "rewards": rewards, "answers": answers, "lengths": lengths, "truncated": truncated})
    return out, metrics


def evaluate(engine, tokenizer, rows: list[dict], k: int, max_len: int, sampling: Sampling, segments: int = 1,
             batch: int = 512, timeout: float = 5.0, overlong: str = "zero", overlong_buffer: int = 0,
             judge: reward.Judge | None = None, pools: Pools | None = None) -> tuple[dict, list[dict], dict]:
    """Sample k responses per row and score them: (summary numbers, per-problem records, reward metrics)."""
    prompt_ids = [data.encode_prompt(tokenizer, r["prompt"]) for r in rows]
    groups = sample_all(engine, prompt_ids, rows, k, max_len, segments, batch, sampling, pools)
    per_problem, metrics = score(groups, tokenizer, max_len, timeout, overlong, overlong_buffer, judge)
    return summarize(per_problem), per_problem, metrics


def load_judge(name: str, mode: str = "second_opinion", max_tokens: int = 64, dtype: str = "float32",
               device: str = "cpu", seed: int = 0) -> reward.Judge:
    """A generative verifier (reward.Judge) from a hub name or local directory: the transformers engine on
    `device`, greedy."""
    lm, tok = model_lib.load(name, dtype, device)
    return reward.Judge(engine_lib.make_engine("hf", lm.eval(), tok, seed), functools.partial(data.encode_prompt, tok),
                        functools.partial(tok.batch_decode, skip_special_tokens=True),
                        Sampling(temperature=1.0, top_k=1), mode, max_tokens, reward.control_tokens(tok))


def print_table(report: dict) -> None:
    k = report["k"]
    print(f"{report['model']} on {report['data']}: {report['n_problems']} problems x {k} samples, "
          f"T {report['sampling']['temperature']} top_p {report['sampling']['top_p']} "
          f"top_k {report['sampling']['top_k']}, {report['time_s']:.1f}s")
    print(f"  {f'avg@{k}':<12}{report['avg@k']:.4f}")
    print(f"  {'mean reward':<12}{report['mean_reward']:.4f}")
    for kk, v in report["pass@k"].items():
        print(f"  {f'pass@{kk}':<12}{v:.4f}")
    print(f"  {f'maj@{k}':<12}{report['maj@k']:.4f}")
    print(f"  {'mean length':<12}{report['mean_length']:.1f}")
    print(f"  {'truncated':<12}{report['truncation_rate']:.4f}")


def main(args) -> dict:
    t0 = time.time()
    torch.manual_seed(args.seed)
    rows = data.load_prompts(args.data, args.seed, held_out=True, n=args.n_problems or None,
                             prompt_key=args.prompt_key, answer_key=args.answer_key, split=args.split)
    kind = engine_lib.engine_kind(args.engine, args.device)
    if kind == "vllm":  # vLLM loads the weights itself: only the tokenizer here
        from transformers import AutoTokenizer
        policy, tokenizer = None, AutoTokenizer.from_pretrained(args.model)
    else:
        policy, tokenizer = model_lib.load(args.model, args.dtype, args.device)
    longest = max(len(data.encode_prompt(tokenizer, r["prompt"])) for r in rows)
    placement.check_context(longest + args.max_response_len, f"the longest prompt ({longest} tokens) + "
                            f"--max-response-len {args.max_response_len}", args.model,
                            policy.config if policy is not None else model_lib.model_config(args.model),
                            "a shorter --max-response-len, or a model with YaRN in its config.json")
    engine = engine_lib.make_engine(kind, policy, tokenizer, args.seed, path=args.model,
                                    max_model_len=longest + args.max_response_len,
                                    mem=args.rollout_mem, device=args.device, dtype=args.dtype)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    summary, per_problem, reward_metrics = evaluate(engine, tokenizer, rows, args.k, args.max_response_len, sampling,
                                                    args.segments, args.batch, args.reward_timeout)
    report = {**summary, "k": args.k, "n_problems": len(rows), "model": args.model,
              "data": args.data, "sampling": vars(sampling), "reward_timeouts": reward_metrics["reward/timeouts"],
              "time_s": time.time() - t0, "args": vars(args), "per_problem": per_problem}
    print_table(report)
    if args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.report}")
    return report


if __name__ == "__main__":
    try:
        main(parse_args())
    except (ValueError, FileNotFoundError) as e:  # a user's mistake (a flag, a file, a model too short): the message says it
        sys.exit(f"error: {e}")
