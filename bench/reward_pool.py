"""`python -m bench reward`: seconds to score math answers with the reward pool (reward.score_batch: worker
processes, messages, a timeout per check) against the fastest single-process loop over the same pairs
(verifiers.math_reward called in this process, as a worker calls it: no protection from a hanging check)."""
import logging
import random
import time

# (prediction, reference) forms from random a, b: fractions, decimals, roots, equations, sets, intervals, and
# a polynomial value that is right about half the time
FORMS = [lambda a, b, rng: (rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}"),
         lambda a, b, rng: (f"{a / b:.4f}", rf"\frac{{{a}}}{{{b}}}"),
         lambda a, b, rng: (rf"\sqrt{{{a * a}}}", str(a)),
         lambda a, b, rng: (f"x = {a + b}", str(a + b)),
         lambda a, b, rng: (rf"\{{{a}, {b}\}}", rf"\{{{b}, {a}\}}"),
         lambda a, b, rng: (f"[{a}, {a + b})", f"[{a},{a + b})"),
         lambda a, b, rng: (f"{a}^{{2}} + {b}", str(a * a + b + rng.randint(0, 1)))]


def math_items(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (verifier, response, reference) triples of score_batch, each a boxed answer in one of FORMS."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        form = rng.choice(FORMS)
        prediction, reference = form(rng.randint(1, 99), rng.randint(1, 99), rng)
        items.append(("math", f"so the answer is \\boxed{{{prediction}}}.", reference))
    return items


def timed(fn):
    """(fn's result, its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_reward(args, _unused: list[str], timeout: float = 5.0) -> dict:
    import reward
    import verifiers
    from systems import workers
    items = math_items(args.n)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # as in the workers: no "timeout disabled" noise
    workers.IN_WORKER = True  # the loop checks in this process, as a single-process scorer would
    try:
        loop, loop_s = timed(lambda: [verifiers.math_reward(response, answer) for _, response, answer in items])
    finally:
        workers.IN_WORKER = False
    score = lambda: reward.score_batch(workers.run, items, timeout=timeout, workers=args.workers)
    _, cold_s = timed(score)  # includes starting the worker processes
    (pool, metrics), warm_s = timed(score)
    assert pool == loop, "the pool and the loop disagree"
    print(f"reward pool: {args.n} math answers, {args.workers} workers; loop {loop_s:.2f} s, pool {warm_s:.2f} s warm "
          f"/ {cold_s:.2f} s with worker start: {warm_s / loop_s:.2f} / {cold_s / loop_s:.2f} of the loop", flush=True)
    return {"bench": "reward", "n": args.n, "workers": args.workers, "loop_s": loop_s, "pool_cold_s": cold_s,
            "pool_warm_s": warm_s, "ratio_cold": cold_s / loop_s, "ratio_warm": warm_s / loop_s,
            "accuracy_of_pairs": sum(loop) / args.n, **metrics}


def add_parser(sub) -> None:
    w = sub.add_parser("reward", help="the reward pool's throughput on math answers against a single-process loop")
    w.add_argument("--n", type=int, default=1000, help="math answers to score")
    w.add_argument("--workers", type=int, default=2, help="worker processes")
    w.set_defaults(run=bench_reward)
