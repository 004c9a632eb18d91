"""`python -m bench scale`: segment rollout on a random 85M model with long-tail response lengths enforced,
both engines, each in a fresh process: rollout only, the real scheduler around the real engine."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import PAPER, mean, point_process, rotate, sem
from bench.decode import decode_model
from bench.simulate import long_tail, segment_steps


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
    from systems.engine import Generation, HFEngine, Sampling, mix64
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
        raise SystemExit(f"python -m bench scale --engines {args.engines}: hf and/or vllm")
    if any(args.cap % int(s) for s in args.segments.split(",")):
        raise SystemExit(f"python -m bench scale: --cap {args.cap} is not a multiple of every segment count ({args.segments})")
    engines = [e for e in args.engines.split(",") if e == "hf" or importlib.util.find_spec("vllm") is not None]
    at_cap = sum(long_tail(args.seed, args.cap, args.median, args.sigma)(u) == args.cap for u in range(10_000)) / 1e4
    print(f"scale bench in {work}: {args.shape}, engines {engines}, segments {args.segments}, {args.prompts} prompts "
          f"x {args.group}, lengths lognormal (median {args.median}, sigma {args.sigma}, {at_cap:.1%} at the cap of "
          f"{args.cap}), {args.steps} measured steps each, torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for kind in engines:
        flags = [f"--{k}={getattr(args, k)}" for k in ("segments", "cap", "median", "sigma", "prompts", "group",
                                                        "steps", "warmup", "seed")]
        proc = point_process(["scale", "--point", f"{kind}:{path}", *flags], stdout=subprocess.PIPE, timeout=3600)
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


def add_parser(sub) -> None:
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
    c.set_defaults(run=bench_scale, point_run=lambda a: scale_point(a.point, a))
