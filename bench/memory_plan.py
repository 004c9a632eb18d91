"""`python -m bench plan`: the memory plan (systems/plan.py) against measured peaks on this CPU, host memory standing in
for the device's. `check` runs short trainings and compares train.py's memory/* records with the plan;
`load`, under torchrun, measures one rank's host-memory peak while loading the policy for FSDP2.

    python -m bench plan check [--only 150M]
    torchrun --nproc-per-node N -m bench plan load --model M [--whole]
"""
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile

from bench.common import ROOT
from systems import plan as plan_lib

BRIEF = [{"type": "min_words", "n": 1}, {"type": "max_words", "n": 4}]  # an ifeval answer: 1 to 4 words


def check_models(work: str, tok) -> dict:
    """{name: model directory} of the runs: the tiny dense checkpoint, and random models saved in `work` once."""
    import tiny
    from transformers import Qwen3Config, Qwen3ForCausalLM
    models = {"tiny dense": tiny.CKPT}
    for name, make in (("tiny MoE", lambda: tiny.make_moe_model(tok)),
                       ("150M dense", lambda: Qwen3ForCausalLM(Qwen3Config(
                           vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=256,
                           tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id))),
                       ("3M long-context", lambda: tiny.make_long_context_model(4096, tok))):
        path = os.path.join(work, name.replace(" ", "_"))
        if not os.path.exists(path):
            make().save_pretrained(path)
            tok.save_pretrained(path)
        models[name] = path
    return models


def check_cases(work: str) -> list[tuple[str, int, list[str]]]:
    """(model, ranks, train.py flags) of every run, with the data files they read written in `work`."""
    data = os.path.join(work, "data.jsonl")  # rewards that vary for any model: at most 4 words
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(200):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(2, 5))) + "="
            f.write(json.dumps({"prompt": prompt, "answer": BRIEF, "verifier": "ifeval"}) + "\n")
    long_data = os.path.join(work, "long.jsonl")  # ~950-token prompts: full 4096-token micro-batches whatever the
    with open(long_data, "w") as f:  # random model's responses (it stops after ~17 tokens)
        for _ in range(200):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(450, 475))) + "="
            f.write(json.dumps({"prompt": prompt, "answer": BRIEF, "verifier": "ifeval"}) + "\n")
    # smaller steps for the larger model, with micro-batches still full on each of 2 ranks (~700 tokens each)
    small = ["--prompts-per-step", "8", "--group-size", "4", "--train-groups", "8", "--max-response-len", "32",
             "--segments", "2", "--max-tokens-per-micro-batch", "512"]
    # samples of ~1000 tokens packed 4096 to a micro-batch: activations and attention dominate, which --sp splits
    long = ["--data", long_data, "--prompts-per-step", "4", "--group-size", "4", "--train-groups", "4",
            "--max-prompt-len", "1024", "--max-response-len", "64", "--segments", "1",
            "--max-tokens-per-micro-batch", "4096", "--pack", "true", "--engine", "hf"]
    return [("tiny dense", 1, []), ("tiny dense", 2, []), ("tiny MoE", 1, ["--data", data]),
            ("tiny MoE", 2, ["--data", data]), ("150M dense", 1, ["--data", data, *small]),
            ("150M dense", 2, ["--data", data, *small]),
            ("150M dense", 1, ["--data", data, *small, "--gradient-checkpointing", "true"]),
            ("150M dense", 2, ["--data", data, *small, "--offload-optimizer", "true"]),
            ("3M long-context", 2, long), ("3M long-context", 2, [*long, "--sp", "2"])]


def variant_label(flags: list[str]) -> str:
    return ("ckpt" if "--gradient-checkpointing" in flags else "sp2" if "--sp" in flags else
            "offload" if "--offload-optimizer" in flags else "")


def check_run(work: str, name: str, path: str, ranks: int, flags: list[str]) -> dict:
    """One run of 3 steps of train.py on the model at `path`: the plan's per-rank total against the measured
    high-water mark of its steps after the first."""
    variant = variant_label(flags)
    out = os.path.join(work, f"{name.replace(' ', '_')}_{ranks}{'_' + variant if variant else ''}")
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                                   if ranks > 1 else [])
    cmd = [*launcher, "train.py", "--model", path, "--steps", "3", "--eval-n", "64", "--dump-samples", "0",
           "--dynamic-sampling", "false", "--out", out, "--overwrite", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} x{ranks}: {proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    first = next(r for r in recs if "memory/plan_trainer_mib" in r)  # logged once, with the first record
    # (offloaded state is host memory, as everything is on CPU)
    planned = first["memory/plan_trainer_mib"] + first.get("memory/plan_offloaded_mib", 0)
    measured = max(r["memory/host_peak_mib"] for r in recs[1:])
    return {"model": name, "ranks": ranks, "variant": variant, "plan_mib": round(planned),
            "measured_mib": round(measured), "plan/measured": round(planned / measured, 3),
            "load_peak_mib": round(first["memory/load_host_mib"])}


def check(work: str, only: str = "") -> list[dict]:
    """`python -m bench plan check`: first the update item by item (check_update: 2 FSDP2 ranks, bf16 over fp32
    masters, a KL, packed micro-batches, four or eight a rank; --sp 2 and offload on and off); then the plan's
    total against the measured peak host memory (train.py's memory/* records: the high-water mark above the
    resident memory before loading) of short runs on this CPU: the tiny dense and Mixture-of-Experts models in one
    process and as 2 FSDP2 ranks, and a random dense model of ~150M parameters, a line per run. `only`: the cases
    and runs whose name contains it. Returns every row."""
    import tiny
    rows = check_update(work, only) if any(only in name for name in UPDATE_CASES) else []
    models = check_models(work, tiny.make_tokenizer())
    for name, ranks, flags in [c for c in check_cases(work) if only in f"{c[0]} x{c[1]} {variant_label(c[2])}"]:
        rows.append(check_run(work, name, models[name], ranks, flags))
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- the update, item by item

UPDATE_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
# 2 ranks, bf16 over fp32 masters, a KL, packed micro-batches of 1,024 tokens full of 256-token samples (64 + 192),
# four a rank in each of the two updates; then --sp 2 (one data rank: eight micro-batches) and offload
UPDATE_FLAGS = ["--dtype", "bfloat16", "--kl-coef", "0.001", "--pack", "true", "--max-prompt-len", "64",
                "--max-response-len", "192", "--max-tokens-per-micro-batch", "1024", "--train-groups", "8",
                "--group-size", "4"]
UPDATE_CASES = {"bf16 kl pack": [], "bf16 kl pack sp2": ["--sp", "2"],
                "bf16 kl pack offload": ["--offload-optimizer", "true"],
                "bf16 kl pack sp2 offload": ["--sp", "2", "--offload-optimizer", "true"]}
# what each measured item is, in the plan's items (`kept`: the activations the forward keeps, which autograd's
# saved-tensor hooks see; the rest of plan.activation_bytes, `backward`, is the gradients the backward holds)
ITEMS = {"weights, reference": ("weights", "reference", "compute copy (bf16)"),
         "AdamW moments": ("AdamW moments",),
         "micro-batches (collated)": ("micro-batches (collated)",),
         "gradients (between micro-batches)": ("gradients",),
         "saved for the backward": ("kept", "attention scores", "all-to-all (--sp)"),
         "the rest of a micro-batch's peak": ("gathered (FSDP)", "reduce-scatter (FSDP)", "backward",
                                              "attention backward", "lm_head chunks", "routing replay ids"),
         "the process's own growth": ()}
# Each item is within 25% of the plan, or 8 MiB (pages, allocator slack), but two: the rest of a micro-batch's peak,
# which the plan adds up as if all of it were held at once, is at most the plan; the process's own growth (kernels'
# caches, malloc's arenas, ~50 MiB on this CPU; a GPU's CUDA context and NCCL buffers) is what a GPU's RESERVE
# leaves room for, unplanned. The peak of everything is within 25% of the plan.
TOLERANCE, SLACK = 0.25, 8 << 20
UPPER_BOUND, UNPLANNED = "the rest of a micro-batch's peak", "the process's own growth"


def within(planned: float, measured: float, item: str) -> bool:
    """Whether a measured item holds to the plan as TOLERANCE says (bytes)."""
    if item == UNPLANNED:
        return True
    if item == UPPER_BOUND:
        return measured <= planned + SLACK
    return abs(measured - planned) <= max(TOLERANCE * planned, SLACK)


def resident() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def return_frees() -> None:
    """malloc hands back to the system what torch frees (blocks over 64 KiB are their own mappings, and the heap is
    trimmed at once), so that the resident bytes follow the bytes in use."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD


def planned_items(plan: plan_lib.Plan, kept_plan: plan_lib.Plan, shape, cfg) -> dict:
    """The plan of `cfg` in ITEMS' terms, in bytes. `kept_plan`: the same run's plan without offload, whose state
    items hold what offload moves to the host (on a CPU the same memory)."""
    c = plan_lib.BYTES[cfg.dtype]
    T = -(-max(cfg.max_tokens_per_micro_batch, cfg.max_prompt_len + cfg.max_response_len) // max(cfg.sp, 1))
    backward = shape.layer_activations(T) * c  # plan.activation_bytes' last term
    items = {**kept_plan.trainer, **{k: v for k, v in plan.trainer.items() if k not in kept_plan.trainer or v}}
    items["kept"], items["backward"] = items["activations"] - backward, backward
    out = {name: sum(items.get(k, 0) for k in keys) for name, keys in ITEMS.items()}
    out["peak (everything)"] = sum(v for k, v in plan.trainer.items() if "rollout" not in k) + \
        plan.host.get("offloaded optimizer state", 0)
    return out


def update_model(work: str, shape: dict = UPDATE_SHAPE) -> str:
    """A random dense Qwen3 of `shape` with the tiny tokenizer, saved in `work` once; its directory."""
    path = os.path.join(work, "update_model_" + "_".join(str(v) for v in shape.values()))
    if not os.path.exists(path):
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        import tiny
        tok = tiny.make_tokenizer()
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, **shape)).save_pretrained(path)
        tok.save_pretrained(path)
    return path


def full_groups(cfg, vocab: int) -> list[list]:
    """--train-groups groups of --group-size samples at full length (prompt and response), rewards 0 and 1, sampled
    by policy version 0 (the update is version 1's: no engine to compare with)."""
    import torch
    from segment_rollout import Sample
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=gen).tolist()  # noqa: E731
    n = cfg.max_response_len
    return [[Sample(g * cfg.group_size + i, g, ids(cfg.max_prompt_len), {"verifier": "tiny"}, ids(n), [-2.0] * n,
                    [0] * n, [0], "eos", float(i % 2)) for i in range(cfg.group_size)] for g in range(cfg.train_groups)]


def measure_update(model: str, flags: list[str]) -> list[dict]:
    """`torchrun --nproc-per-node 2 -m bench plan update --model M FLAGS`, one rank: the models loaded as train.py
    loads them, then two updates (ulorl.update) of a batch at full length, and what this rank holds, item by item
    (ITEMS). Counted: the bytes of the weights (and reference) and AdamW's moments this rank holds. Measured in the
    second update, in resident bytes with malloc returning what torch frees: the growth before its first training
    forward (the step's micro-batches and what the pass before the update adds to them), the growth at each later
    training forward (the gradients between micro-batches), what autograd saves in each training forward (its
    saved-tensor hooks: every storage but the parameters'), and each micro-batch's high-water mark above its start
    less that (the last's, which ends in the optimizer step, is not read); the resident growth no counted tensor
    explains after the first update; and the high-water mark of it all. Rank 0 returns every rank's planned and
    measured items, in MiB (the other ranks, none)."""
    import functools
    import torch
    import torch.distributed as dist
    import config
    import model as model_lib
    import ulorl
    from systems import distributed
    from systems import placement
    from systems import seqpar
    return_frees()
    cfg = config.parse_config(["--model", model, *flags])
    rank, world = placement.setup_distributed(cfg)
    model_config = model_lib.model_config(cfg.model)
    placement.fit_parallelism(cfg, world, model_config)
    plan = placement.memory_plan(cfg, world, model_config)
    kept_plan = placement.memory_plan(dataclasses.replace(cfg, offload_optimizer="false"), world, model_config)
    groups = full_groups(cfg, model_config.vocab_size)
    before = resident()
    plan_lib.reset_host_peak()
    policy, ref, lm, ref_lm, tokenizer, masters = placement.load_models(cfg, None, world)
    opt = torch.optim.AdamW(masters.parameters() if masters else policy.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(ulorl.lr_factor, cfg=cfg))
    update = functools.partial(ulorl.update, policy, ref, opt, sched, groups, 1, tokenizer.pad_token_id, cfg,
                               distributed.Ranks(policy, masters, seqpar.sp_size()))
    update()
    after_first = resident()
    starts, peaks, saved, seen, top = [], [], [], {}, []

    def at_forward(module, args):
        if not torch.is_grad_enabled():
            return
        now = resident()
        top.append(plan_lib.host_peak())  # the high-water mark so far, before it is reset
        if starts:
            peaks.append(top[-1] - starts[-1])
            saved.append(sum(seen.values()))
        seen.clear()
        starts.append(now)
        plan_lib.reset_host_peak()

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # a parameter (a gathered layer's) is not the forward's to keep
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hook = policy.register_forward_pre_hook(at_forward)
    start = resident()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        update()
    hook.remove()
    local = lambda tensors: sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)  # noqa
    weights = local([*policy.parameters(), *(ref.parameters() if ref is not None else ()),
                     *(masters.parameters() if masters else ())])
    moments = local(t for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.dim())
    measured = {"weights, reference": weights, "AdamW moments": moments,
                "micro-batches (collated)": starts[0] - start,
                "gradients (between micro-batches)": max(s - starts[0] for s in starts[1:]),
                "saved for the backward": max(saved),
                "the rest of a micro-batch's peak": max(p - k for p, k in zip(peaks, saved)),
                "the process's own growth": after_first - before - weights - moments,
                "peak (everything)": max(top + [plan_lib.host_peak()]) - before}
    planned = planned_items(plan, kept_plan, plan_lib.Shape.of(model_config), cfg)
    row = {"rank": rank, "ranks": world, "micro_batches": len(starts), "sp": cfg.sp,
            "offload": cfg.offload_optimizer, "planned_mib": {k: round(v / 2**20, 1) for k, v in planned.items()},
            "measured_mib": {k: round(v / 2**20, 1) for k, v in measured.items()}}
    rows = [None] * world if rank == 0 else None  # rank 0 prints them all: two ranks' lines never interleave
    dist.gather_object(row, rows)
    return rows or []


def check_update(work: str, only: str = "", shape: dict = UPDATE_SHAPE, flags: list[str] = UPDATE_FLAGS,
                 cases: dict = UPDATE_CASES) -> list[dict]:
    """`python -m bench plan check`'s first part: each of `cases` (name: flags beside `flags`) as 2 FSDP2 ranks of
    `bench plan update` on a random model of `shape`; prints each rank's items, planned against measured, and
    returns the rows (one a rank, with `ok`: every item within TOLERANCE)."""
    model = update_model(work, shape)
    rows = []
    for name, extra in cases.items():
        if only not in name:
            continue
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "bench", "plan", "update", "--model", model, *flags, *extra], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"bench plan update, {name}: {proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                planned, measured = row["planned_mib"], row["measured_mib"]
                row["case"] = name
                row["ok"] = all(within(planned[k] * 2**20, measured[k] * 2**20, k) for k in planned)
                rows.append(row)
    rows.sort(key=lambda r: (list(cases).index(r["case"]), r["rank"]))
    print(update_table(rows), flush=True)
    return rows


def update_table(rows: list[dict]) -> str:
    """The rows of check_update as a markdown table: an item a line, planned / measured MiB per case and rank."""
    head = [f"{r['case']}, rank {r['rank']} ({r['micro_batches']} micro-batches)" for r in rows]
    lines = ["| item (MiB a rank) | " + " | ".join(head) + " |", "|---" * (len(rows) + 1) + "|"]
    for item in rows[0]["planned_mib"]:
        cells = []
        for r in rows:
            p, m = r["planned_mib"][item], r["measured_mib"][item]
            mark = "" if within(p * 2**20, m * 2**20, item) else " **off**"
            cells.append(f"{p:.0f} / {m:.0f}{mark}")
        lines.append(f"| {item} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_load(model: str, whole: bool) -> list[dict]:
    """`torchrun ... -m bench plan load --model M [--whole]`: each rank's host-memory peak while loading the
    policy for FSDP2, the way train.py does (sharded: meta device, shard, fill this rank's shards a layer at a
    time), or (--whole) whole on every rank, then sharded. Rank 0 gets every rank's row (the others, none),
    so the lines print from one process and never interleave."""
    import torch.distributed as dist

    import model as model_lib
    from systems import placement
    dist.init_process_group("gloo")
    before = plan_lib.reset_host_peak()
    if whole:
        lm = model_lib.load(model)[0]
        placement.wrap(lm, "fsdp")
    else:
        lm = placement.load_sharded(model)[1]
    params = sum(p.numel() for p in lm.parameters())
    row = {"rank": dist.get_rank(), "ranks": dist.get_world_size(), "path": "whole" if whole else "sharded",
           "params": params, "load_peak_mib": round((plan_lib.host_peak() - before) / 2**20)}
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows)
    dist.destroy_process_group()
    return rows or []


def bench_plan(args, rest: list[str]) -> None:
    """Its own lines: check's one a run as each ends, load's and update's one a rank, all from rank 0."""
    if rest and args.command != "update":
        raise SystemExit(f"python -m bench plan {args.command}: unknown arguments {' '.join(rest)}")
    if args.command == "update":
        for row in measure_update(args.model, rest):
            print(json.dumps(row), flush=True)
    elif args.command == "load":
        for row in measure_load(args.model, args.whole):
            print(json.dumps(row), flush=True)
    else:
        check(args.dir or tempfile.mkdtemp(prefix="ulorl_plan_"), args.only)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the memory plan against measured peaks on CPU: `check` runs short trainings; "
                                    "`load` (under torchrun) measures one rank's loading peak")
    p.add_argument("command", choices=["check", "update", "load"])
    p.add_argument("--dir", default="", help="check: where the models and runs go (default: a temporary directory)")
    p.add_argument("--only", default="", help="check: only the update cases (e.g. 'sp2 offload') and the runs "
                                              "whose '<model> x<ranks> <variant>' contain this (e.g. 150M, 'x2 sp2')")
    p.add_argument("--model", default="", help="load: the model directory")
    p.add_argument("--whole", action="store_true", help="load: every rank loads the whole model, then shards")
    p.set_defaults(run=bench_plan, train_flags=True)  # update: train.py's flags after the model
