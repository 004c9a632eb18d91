"""`python -m bench offload`: the optimizer step of --offload-optimizer (FSDP2's CPU offload: the fp32 shards,
their gradients and AdamW's moments in host memory, the step on the CPU) with 1 thread against N, rounds
alternating in one process. Under torchrun every rank got OMP_NUM_THREADS=1, so this step ran on one core a rank
while the node's others idled; placement.set_threads now gives each rank its share."""
import statistics
import time


def bench_offload(args, _unused: list[str]) -> dict:
    import torch
    torch.manual_seed(0)
    # decoder-layer-like tensors: args.millions of parameters in args.tensors pieces
    size = args.millions * 10**6 // args.tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn(size)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01)  # as train.py builds it
    opt.step()  # the moments exist from here on, as after a run's first step
    counts = [1, args.threads]
    times = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            torch.set_num_threads(n)
            start = time.perf_counter()
            opt.step()
            times[n].append(time.perf_counter() - start)
    median = {n: statistics.median(t) for n, t in times.items()}
    print(f"AdamW step on the CPU, {args.millions}M fp32 parameters in {args.tensors} tensors, {args.rounds} rounds: "
          f"1 thread {median[1]:.3f} s, {args.threads} threads {median[args.threads]:.3f} s "
          f"({median[1] / median[args.threads]:.2f}x)", flush=True)
    return {"bench": "offload", "millions": args.millions, "threads": args.threads, "step_s_1": median[1],
            f"step_s_{args.threads}": median[args.threads], "speedup": median[1] / median[args.threads]}


def add_parser(sub) -> None:
    w = sub.add_parser("offload", help="the offloaded optimizer step (AdamW on the CPU): 1 thread against N")
    w.add_argument("--millions", type=int, default=100, help="parameters, in millions (the 30B model's rank "
                                                             "share is ~5000 on 6 ranks)")
    w.add_argument("--tensors", type=int, default=20, help="how many tensors they are split into")
    w.add_argument("--threads", type=int, default=2, help="the thread count set against 1")
    w.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians reported)")
    w.set_defaults(run=bench_offload)
