"""`python -m bench memory`: peak memory of chunked (loss.token_logprobs) vs naive log-prob and entropy,
forward and backward, every (variant, length) point in a fresh process."""
import argparse
import json
import time

import torch

from bench.common import point_process


def naive_logprobs(hidden, weight, targets, temperature: float = 1.0):
    """The obvious implementation: the whole [N, V] logits at once (what loss.token_logprobs avoids)."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # [N, V], kept for backward
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_point(variant: str, n: int, vocab: int, hidden: int, limit_mb: float) -> dict:
    """One measurement, meant to run alone in a fresh process (`python -m bench memory --point ...`). `variant`
    is "naive" or "chunked:C" (loss.token_logprobs with chunk C). The address space is capped `limit_mb` above
    the current one, so a point that would exhaust the shared machine fails alone with a MemoryError."""
    import resource

    import loss
    torch.manual_seed(0)
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_(True)
    y = torch.randint(0, vocab, (n,))
    run = naive_logprobs if variant == "naive" else (
        lambda *a: loss.token_logprobs(*a, 1.0, int(variant.split(":")[1])))
    lp, ent = run(h[:8], w, y[:8])  # warm-up: lazy imports of the first checkpoint call hold ~150 MB
    (lp.sum() + 0 * ent.sum()).backward()
    h.grad = w.grad = lp = ent = None
    cap = _status_kb("VmSize") * 1024 + int(limit_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
        f.write("5")
    base = _status_kb("VmRSS")
    t0 = time.time()
    lp, ent = run(h, w, y)
    (lp.sum() + 0 * ent.sum()).backward()  # forward AND backward: the backward recomputes each chunk
    return {"variant": variant, "n": n, "peak_mb": (_status_kb("VmHWM") - base) / 1024, "seconds": time.time() - t0}


def bench_memory(args, _unused: list[str]) -> dict:
    sizes = [int(x) for x in args.sizes.split(",")] + ([8192] if args.big else [])
    variants = ["naive"] + [f"chunked:{c}" for c in args.chunk.split(",")]
    points = {}
    print(f"memory bench: forward + backward of token log-probs and entropy, vocab {args.vocab}, hidden "
          f"{args.hidden}, fp32, 1 process per point; peak RSS above the inputs (available now: "
          f"{_meminfo_mb('MemAvailable') / 1024:.1f} GB)", flush=True)
    for n in sizes:
        for variant in variants:
            chunk = n if variant == "naive" else min(n, int(variant.split(":")[1]))
            # measured peaks: naive ~3 [N, V] fp32 tensors, a chunk ~4 [chunk, V] (the backward's recomputation)
            need_mb = (3.2 if variant == "naive" else 4.2) * chunk * args.vocab * 4 / 2**20
            limit_mb = 0.85 * _meminfo_mb("MemAvailable")
            if need_mb > limit_mb:
                print(f"  skip {variant} n={n}: needs ~{need_mb / 1024:.1f} GB, {limit_mb / 1024:.1f} GB may be "
                      f"used now", flush=True)
                continue
            p = point_process(["memory", "--point", variant, "--sizes", str(n), "--vocab", str(args.vocab),
                               "--hidden", str(args.hidden), "--limit-mb", str(limit_mb)], capture_output=True)
            if p.returncode != 0:
                print(f"  {variant} n={n} failed:\n{p.stderr[-1500:]}", flush=True)
                continue
            points[variant, n] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"  {variant:>13} n={n:5d}: {points[variant, n]['peak_mb']:8.0f} MB "
                  f"({points[variant, n]['seconds']:.1f}s)", flush=True)
    print(f"\n{'tokens':>6} | " + " | ".join(f"{v + ' MB':>16}" for v in variants) + " | chunked / naive")
    table = {v: [points[v, n]["peak_mb"] if (v, n) in points else None for n in sizes] for v in variants}
    ratios = {v: [b / a if a and b and a > 0 and b > 0 else None for a, b in zip(table["naive"], table[v])]
              for v in variants[1:]}
    for i, n in enumerate(sizes):
        cells = " | ".join(f"{'-' if table[v][i] is None else f'{table[v][i]:.0f}':>16}" for v in variants)
        rs = ", ".join("-" if ratios[v][i] is None else f"1/{1 / ratios[v][i]:.1f}" for v in variants[1:])
        print(f"{n:6d} | {cells} | {rs}")
    return {"bench": "memory", "tokens": sizes, "vocab": args.vocab, "hidden": args.hidden,
            "peak_mb": table, "ratio": ratios}


def _meminfo_mb(field: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


def add_parser(sub) -> None:
    m = sub.add_parser("memory", help="peak memory of chunked vs naive log-prob/entropy, forward + backward")
    m.add_argument("--sizes", default="1024,2048,4096", help="comma-separated response token counts N")
    m.add_argument("--big", action="store_true", help="add N = 8192 (the naive variant needs ~15 GB; skipped "
                                                      "when the machine has less available)")
    m.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151,936)")
    m.add_argument("--hidden", type=int, default=128, help="hidden size (small: the [N, V] logits dominate)")
    m.add_argument("--chunk", default="2048,512", help="comma-separated chunk sizes of loss.token_logprobs to "
                                                     "measure (model.response_logprobs uses 512)")
    m.add_argument("--point", default="", help=argparse.SUPPRESS)  # internal: one measurement in this process
    m.add_argument("--limit-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    m.set_defaults(run=bench_memory, point_run=lambda a: memory_point(a.point, int(a.sizes), a.vocab, a.hidden,
                                                                       a.limit_mb))
