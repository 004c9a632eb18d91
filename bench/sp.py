"""`python -m bench sp`: --sp 2 against --sp 1 on 2 gloo ranks, step time and peak host memory at long
sequences."""
import json
import os
import statistics
import tempfile
import time

import torch

from bench.common import rotate


def _sp_worker(rank: int, world: int, port: int, lengths: list[int], rounds: int, out: str) -> None:
    """One of 2 gloo ranks: for each length L, each variant's step on two L-token sequences, timed between barriers
    (the slower rank's time), rounds in rotating order; and its peak host memory, each variant once more after
    a malloc_trim (so freed memory is not reused unseen). Variants: "data" (each rank one sequence, whole;
    --sp 1), "sp" (both ranks both sequences, each a half of every one; --sp 2)."""
    import ctypes

    import torch.distributed as dist

    import model as model_lib
    import tiny
    from segment_rollout import Sample
    from systems import seqpar
    from systems import plan as plan_lib
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seqpar.init_sequence_parallel(world)
    lm = tiny.make_long_context_model(max(lengths))
    lm.config._attn_implementation = seqpar.attention_name("sdpa", world)
    forwards = {"sp": model_lib.Policy(lm, seqpar.sliced(model_lib.response_tokens)),  # this rank's slice of a row
                "data": model_lib.Policy(lm, seqpar.sliced(model_lib.response_tokens, split=False))}  # whole rows

    def seq(i, n):
        g = torch.Generator().manual_seed(i)
        s = Sample(uid=i, group=0, prompt_ids=torch.randint(0, 64, (16,), generator=g).tolist(), row={})
        s.tokens = torch.randint(0, 64, (n - 16,), generator=g).tolist()
        s.logprobs, s.versions, s.reward = [0.0] * len(s.tokens), [0] * len(s.tokens), 1.0
        return s

    def step(variant, n):
        mbs = [[seq(0, n)], [seq(1, n)]] if variant == "sp" else [[seq(rank, n)]]
        for mb in mbs:
            lp, _ = forwards[variant](model_lib.collate(mb, 0, pack=True), 1.0)
            lp.sum().backward()
        lm.zero_grad(set_to_none=True)

    times = {(v, n): [] for v in ("data", "sp") for n in lengths}
    step("sp", 256), step("data", 256)  # warm-up
    for r in range(rounds):
        for n in lengths:
            for v in rotate(["data", "sp"], r):
                dist.barrier()
                t0 = time.perf_counter()
                step(v, n)
                dist.barrier()
                times[v, n].append(time.perf_counter() - t0)
    peaks = {}
    libc = ctypes.CDLL("libc.so.6")
    for n in lengths:
        for v in ("data", "sp"):
            libc.malloc_trim(0)
            before = plan_lib.reset_host_peak()
            step(v, n)
            peaks[v, n] = (plan_lib.host_peak() - before) / 2**20
    if rank == 0:
        with open(out, "w") as f:
            json.dump({f"{v}:{n}": {"seconds": statistics.median(times[v, n]), "peak_mib": peaks[v, n]}
                       for v, n in times}, f)
    dist.destroy_process_group()


def bench_sp(args, _unused: list[str]) -> dict:
    import socket

    import torch.multiprocessing as mp
    lengths = [int(x) for x in args.lengths.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="ulorl_sp_"), "sp.json")
    print(f"sequence parallelism: forward + backward of two L-token sequences on 2 gloo ranks, 1 thread each; "
          f"--sp 1 (one sequence a rank) vs --sp 2 (half of both on each), median of {args.rounds} interleaved "
          f"rounds; a random 3M-parameter dense Qwen3 (8 heads), sdpa with a block mask", flush=True)
    mp.spawn(_sp_worker, (2, port, lengths, args.rounds, out), nprocs=2)
    with open(out) as f:
        res = json.load(f)
    print(f"{'L':>6} | {'--sp 1 s':>9} | {'--sp 2 s':>9} | time sp/1 | {'--sp 1 MiB':>10} | {'--sp 2 MiB':>10} | memory sp/1")
    rows = []
    for n in lengths:
        a, b = res[f"data:{n}"], res[f"sp:{n}"]
        rows.append({"tokens": n, "sp1_s": a["seconds"], "sp2_s": b["seconds"], "time_ratio": b["seconds"] / a["seconds"],
                     "sp1_peak_mib": a["peak_mib"], "sp2_peak_mib": b["peak_mib"],
                     "memory_ratio": b["peak_mib"] / max(a["peak_mib"], 1e-9)})
        r = rows[-1]
        print(f"{n:6d} | {r['sp1_s']:9.2f} | {r['sp2_s']:9.2f} | {r['time_ratio']:9.2f} | {r['sp1_peak_mib']:10.0f} | "
              f"{r['sp2_peak_mib']:10.0f} | {r['memory_ratio']:.2f}", flush=True)
    return {"bench": "sp", "threads_per_rank": 1, "rounds": args.rounds, "rows": rows}


def add_parser(sub) -> None:
    q = sub.add_parser("sp", help="step time and peak memory of --sp 2 vs --sp 1 on 2 ranks at long sequences")
    q.add_argument("--lengths", default="2048,4096,8192", help="comma-separated sequence lengths L")
    q.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    q.set_defaults(run=bench_sp)
