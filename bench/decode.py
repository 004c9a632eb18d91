"""`python -m bench decode`: the cost of a decode step against the rows busy in it, for both engines and two
model sizes, every (engine, model) point in a fresh process. scale.py samples from the same random models."""
import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time

import torch

from bench.common import point_process

DECODE_MODELS = "128x4,768x12"  # HIDDENxLAYERS: the tiny default's shape (0.8M parameters) and ~83M
DECODE_ROWS = "1,2,4,8,16,32,64,128"


def decode_model(spec: str, path: str) -> str:
    """A random dense Qwen3 of `spec` (HIDDENxLAYERS; heads of 32 below 256 wide, else of 64; MLP 3x; the tiny
    tokenizer) saved at `path`. Random weights are fine: the cost of a step does not depend on them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import tiny
    hidden, layers = map(int, spec.split("x"))
    head = 32 if hidden < 256 else 64
    tok = tiny.make_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // head,
                         num_key_value_heads=max(1, hidden // head // 2), head_dim=head, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, dtype="float32")
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def decode_point(point: str, rows: list[int], tokens: int, rounds: int, device: str = "cpu") -> dict:
    """One engine on one model, in this process: {rows: seconds a decode step}. A step's cost is (time of a call
    decoding `tokens` tokens a row - time of one decoding 1) / (tokens - 1), so the prefill cancels; no stop
    token ends a row early. The median of `rounds`. `device`: the transformers engine's (vLLM picks its own)."""
    kind, path = point.split(":", 1)
    if kind == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=path, dtype="float32", seed=0, max_model_len=256, enforce_eager=True,
                  kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=False)

        def call(n, t):
            params = SamplingParams(max_tokens=t, ignore_eos=True, detokenize=False)
            llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5, 6 + i % 8]) for i in range(n)], params,
                         use_tqdm=False)
    else:
        import model as model_lib
        from systems.engine import HFEngine, Sampling
        lm, tok = model_lib.load(path, device=device)
        eng = HFEngine(lm, [], tok.pad_token_id, seed=0)  # no stop id: every row decodes its whole budget

        def call(n, t):
            eng.generate([[3, 4, 5, 6 + i % 8] for i in range(n)], [t] * n, Sampling(1.0))
    call(max(rows), 2)  # warm-up
    out = {}
    for n in rows:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            call(n, tokens)
            t1 = time.perf_counter()
            call(n, 1)
            times.append((t1 - t0 - (time.perf_counter() - t1)) / (tokens - 1))
        out[n] = statistics.median(times)
    return out


def bench_decode(args, _unused: list[str]) -> dict:
    """The cost of one decode step against the rows busy in it, for both engines and each model, every point in
    a fresh process (vLLM in-process, one engine a process). Where a step with 128 rows costs about what one row
    costs, decoding is bound by reading the weights (the paper's GPU regime: fewer, fuller steps save time); where
    it grows with the rows, by compute (this CPU's, with small models: segments save little)."""
    work = args.dir or tempfile.mkdtemp(prefix="bench_decode_")
    os.makedirs(work, exist_ok=True)
    rows = [int(n) for n in args.rows.split(",")]
    engines = [e for e in ("hf", "vllm") if e == "hf" or importlib.util.find_spec("vllm") is not None]
    engines = engines if args.device == "cpu" else ["hf"]  # vLLM on CPU is the CPU build; off it, another machine
    print(f"decode bench in {work}: models {args.models}, engines {engines}, rows {rows}, {args.tokens} tokens a "
          f"call, median of {args.rounds}, torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for spec in args.models.split(","):
        path = decode_model(spec, os.path.join(work, spec))
        params = sum(p.numel() for p in __import__("model").load(path)[0].parameters())
        for kind in engines:
            proc = point_process(["decode", "--point", f"{kind}:{path}", "--rows", args.rows, "--tokens",
                                  str(args.tokens), "--rounds", str(args.rounds), "--device", args.device], capture_output=True, timeout=1800)
            if proc.returncode:
                raise RuntimeError(f"decode point {kind}:{spec} failed: {proc.stderr[-2000:]}")
            got = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
            results[f"{kind} {spec}"] = {"params_m": params / 1e6, "step_s": got}
            print(f"  {kind} {spec} ({params / 1e6:.1f}M): " + " ".join(f"{n}:{got[n] * 1e3:.1f}ms" for n in rows),
                  flush=True)
    print(f"\n{'engine, model':>18} | " + " | ".join(f"{n:>7}" for n in rows) + " | 128 rows / 1 row")
    for name, r in results.items():
        s = r["step_s"]
        print(f"{name:>18} | " + " | ".join(f"{s[n] * 1e3:5.1f}ms" for n in rows) +
              f" | {s[rows[-1]] / s[rows[0]]:6.1f}x")
    print("(ms a decode step; the last column: how much more a full step costs than a 1-row step -- 1x is the "
          "weight-bound GPU regime, where segments' fewer, fuller steps save time)")
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, r in results.items():
            ax.plot(rows, [r["step_s"][n] * 1e3 for n in rows], marker="o",
                    label=f"{name} ({r['params_m']:.1f}M)")
        ax.set(xscale="log", yscale="log", xlabel="rows busy in the decode step", ylabel="ms a decode step",
               title="Decode step cost on this CPU (fp32)")
        ax.set_xticks(rows, [str(n) for n in rows])
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")
    return {"bench": "decode", "rows": rows, "tokens": args.tokens, "threads": torch.get_num_threads(),
            "results": {k: {"params_m": round(v["params_m"], 2), "step_ms": [v["step_s"][n] * 1e3 for n in rows],
                            "full_over_one": v["step_s"][rows[-1]] / v["step_s"][rows[0]]} for k, v in results.items()}}


def add_parser(sub) -> None:
    d = sub.add_parser("decode", help="the cost of a decode step against the rows busy in it, both engines, two "
                                      "model sizes")
    d.add_argument("--models", default=DECODE_MODELS, help="comma-separated random dense Qwen3s, HIDDENxLAYERS")
    d.add_argument("--rows", default=DECODE_ROWS, help="comma-separated busy-row counts")
    d.add_argument("--tokens", type=int, default=17, help="tokens a row decodes a call (16 decode steps)")
    d.add_argument("--rounds", type=int, default=3, help="repeats of each point (the median is reported)")
    d.add_argument("--device", default="cpu", help="the transformers engine's torch device (cuda: the GPU regime)")
    d.add_argument("--figure", default="", help="write the curves to this PNG")
    d.add_argument("--dir", default="", help="working directory for the models (default: a fresh temporary one)")
    d.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one engine and model, this process
    d.set_defaults(run=bench_decode, point_run=lambda a: decode_point(a.point, [int(n) for n in a.rows.split(",")],
                                                                       a.tokens, a.rounds, a.device))
