"""`python -m bench plan`: the memory plan (plan.py) against measured peaks on this CPU, host memory standing in
for the device's. `check` runs short trainings and compares train.py's memory/* records with the plan;
`load`, under torchrun, measures one rank's host-memory peak while loading the policy for FSDP2.

    python -m bench plan check [--only 150M]
    torchrun --nproc-per-node N -m bench plan load --model M [--whole]
"""
import json
import os
import random
import subprocess
import sys
import tempfile

import plan as plan_lib
from bench.common import ROOT


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
            f.write(json.dumps({"prompt": prompt, "answer": [{"type": "max_words", "n": 4}], "verifier": "ifeval"}) + "\n")
    long_data = os.path.join(work, "long.jsonl")  # ~950-token prompts: full 4096-token micro-batches whatever the
    with open(long_data, "w") as f:  # random model's responses (it stops after ~17 tokens)
        for _ in range(200):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(450, 475))) + "="
            f.write(json.dumps({"prompt": prompt, "answer": [{"type": "max_words", "n": 4}], "verifier": "ifeval"}) + "\n")
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
    """`python -m bench plan check`: the plan against the measured peak host memory (train.py's memory/*
    records: the high-water mark above the resident memory before loading) of short runs on this CPU: the tiny
    dense and Mixture-of-Experts models in one process and as 2 FSDP2 ranks, and a random dense model of
    ~150M parameters. Prints one line per run and returns them."""
    import tiny
    models = check_models(work, tiny.make_tokenizer())
    rows = []
    for name, ranks, flags in [c for c in check_cases(work) if only in f"{c[0]} x{c[1]} {variant_label(c[2])}"]:
        rows.append(check_run(work, name, models[name], ranks, flags))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_load(model: str, whole: bool) -> list[dict]:
    """`torchrun ... -m bench plan load --model M [--whole]`: each rank's host-memory peak while loading the
    policy for FSDP2, the way train.py does (sharded: meta device, shard, fill this rank's shards a layer at a
    time), or (--whole) whole on every rank, then sharded. Rank 0 gets every rank's row (the others, none),
    so the lines print from one process and never interleave."""
    import torch.distributed as dist

    import model as model_lib
    import placement
    dist.init_process_group("gloo")
    before = plan_lib.reset_host_peak()
    if whole:
        lm = model_lib.load(model)[0]
        model_lib.wrap(lm, "fsdp")
    else:
        lm = placement.load_sharded(model)[1]
    params = sum(p.numel() for p in lm.parameters())
    row = {"rank": dist.get_rank(), "ranks": dist.get_world_size(), "path": "whole" if whole else "sharded",
           "params": params, "load_peak_mib": round((plan_lib.host_peak() - before) / 2**20)}
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows)
    dist.destroy_process_group()
    return rows or []


def bench_plan(args, _unused: list[str]) -> None:
    """Its own lines: check's one a run as each ends, load's one a rank from rank 0."""
    if args.command == "load":
        for row in measure_load(args.model, args.whole):
            print(json.dumps(row), flush=True)
    else:
        check(args.dir or tempfile.mkdtemp(prefix="ulorl_plan_"), args.only)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the memory plan against measured peaks on CPU: `check` runs short trainings; "
                                    "`load` (under torchrun) measures one rank's loading peak")
    p.add_argument("command", choices=["check", "load"])
    p.add_argument("--dir", default="", help="check: where the models and runs go (default: a temporary directory)")
    p.add_argument("--only", default="", help="check: only the runs whose '<model> x<ranks> <variant>' contains "
                                              "this (e.g. 150M, 'x2 sp2')")
    p.add_argument("--model", default="", help="load: the model directory")
    p.add_argument("--whole", action="store_true", help="load: every rank loads the whole model, then shards")
    p.set_defaults(run=bench_plan)
