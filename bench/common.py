"""What several benchmarks share: train.py run in resumable chunks around a counting engine, their interleaved
order, the statistics and the JSON rounding of every mode's last line, and fresh processes of this package."""
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time

PAPER = {1: 1.0, 2: 1240 / 774, 4: 1240 / 601}  # UloRL section 3.1: 1240 s, 774 s, 601 s per step (64k outputs)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: train.py and the modules


class CountingEngine:
    """The real engine, plus counters of generated tokens and static-batch decode slots. Attributes other
    than `generate` (update_weights, rng_state, ...) go straight to the real engine; extra keyword arguments
    of generate (e.g. a future `keys=`) pass through untouched."""

    def __init__(self, inner, counts: dict):
        self.inner, self.counts = inner, counts

    def generate(self, prompts, max_tokens, sampling, **kw):
        t0 = time.time()
        gens = self.inner.generate(prompts, max_tokens, sampling, **kw)
        self.counts["generate_s"] += time.time() - t0
        DURATIONS.append(time.time() - t0)
        n = [len(g.tokens) for g in gens]
        self.counts["tokens"] += sum(n)
        self.counts["slots"] += len(n) * max(n, default=0)  # rows x decode steps of this call
        self.counts["decode_steps"] += max(n, default=0)
        self.counts["calls"] += 1
        self.counts["prefill"] += len(prompts) * max(map(len, prompts), default=0)  # left-padded context
        CALLS.append(([len(p) for p in prompts], n))  # the batch's composition, for the GPU cost model
        return gens

    def __getattr__(self, name):
        return getattr(self.inner, name)


COUNTS = {"tokens": 0, "slots": 0, "decode_steps": 0, "calls": 0, "prefill": 0, "generate_s": 0.0}  # per variant
CALLS: list = []  # (context lengths, generated lengths) of every engine call
DURATIONS: list = []  # seconds of every engine call


@functools.cache
def load_train():
    """train.py, imported here rather than at the top, so that `memory`'s measuring processes start without
    transformers (~6 s each on a busy machine)."""
    import train
    import transformers
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars at every chunk drown the tables
    return train


def run_chunk(flags: list[str], out: str, steps: int, log, bucket: bool = True) -> list[dict]:
    """Advance the run in `out` to `steps` steps (resuming from its newest checkpoint) and return the
    metrics.jsonl records of the steps it ran. train.py's own stdout goes to `log`."""
    train = load_train()
    path = os.path.join(out, "metrics.jsonl")
    done = 0
    if os.path.exists(path):
        with open(path) as f:
            done = max((json.loads(line)["step"] for line in f if line.strip()), default=0)
    cfg = train.parse_config(flags + ["--out", out, "--steps", str(steps), "--resume", "auto"])
    from systems import placement
    make = placement.rollout_engine
    placement.rollout_engine = lambda *a, **kw: CountingEngine(unbucketed(make(*a, **kw), bucket), COUNTS)
    try:
        with contextlib.redirect_stdout(log):
            train.main(cfg)
    finally:
        placement.rollout_engine = make
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r["step"] > done]


def unbucketed(engine, bucket: bool):
    """The transformers engine with length-bucketed prefill turned off (bucket False): every call left-pads
    its whole batch to the widest context."""
    if not bucket:
        engine.bucket = False
    return engine


def chunk_rounds(variants: list[str], args):
    """(round, variant, steps to reach) in interleaved order: every variant advanced --chunk steps a round, the
    order rotated each round; round 0 (--warmup steps) is not measured. Reports each round's end."""
    t_start = time.time()
    for r in range(args.rounds + 1):
        for v in rotate(variants, r):
            yield r, v, args.warmup + r * args.chunk
        print(f"  round {r}/{args.rounds} done ({time.time() - t_start:.0f}s)", flush=True)


def add_run_flags(parser) -> None:
    """--seed and --dir of the modes that run train.py."""
    parser.add_argument("--seed", type=int, default=0, help="seed of every run")
    parser.add_argument("--dir", default="", help="working directory for the runs (default: a fresh temporary one)")


def point_process(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`python -m bench ARGS` in a fresh process (one measuring point), text output; the project is put on its
    PYTHONPATH so that it imports this package wherever it starts."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "bench", *args], env=dict(os.environ, PYTHONPATH=path), text=True,
                          **kw)


def clean(x):
    """JSON has no NaN: None instead, and floats rounded: 4 decimals, or 4 significant digits below 1 (fp32's
    log-prob gaps are ~1e-6)."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return None if x != x else round(x, 4) if abs(x) >= 1 else float(f"{x:.4g}")
    return x


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def div(a, b):
    return a / b if b else float("nan")


def sem(xs):
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")


def rotate(xs: list, r: int) -> list:
    return xs[r % len(xs):] + xs[:r % len(xs)]
