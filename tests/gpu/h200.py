"""The GPU check for a machine of ONE GPU without vLLM (an H200, ~139 GiB; Python 3.12, torch 2.11, transformers
5.17 and their neighbours preinstalled; no network). What one GPU can show of the trainer's GPU path without
the engine: the gradients a rank holds between micro-batches, the packed-attention kernel, train.py with the transformers engine on a 64-expert MoE, one FSDP2
rank with its optimizer in host memory and the tensors the weight sync would send, Qwen3-30B-A3B's decoder
layers on 32k and 128k-token rows against the memory plan, and two benchmarks. Not run on a GPU yet: the
planned seconds are estimates until it has.

    python tests/gpu/wheels.py              # here, once: the wheels it carries, into .whl/ (ignored by git)
    python3 tests/gpu/h200.py               # on the GPU machine (its python3), .whl/ carried along: ~7 minutes
    python tests/gpu/h200.py --dry-run      # anywhere: the checks, their commands and planned seconds, the
                                            # wheels and the 64 MiB the working tree and wheels may take
    python tests/gpu/h200.py --device cpu   # here: the same code at toy sizes on the CPU, CUDA-only parts
                                            # skipped (~1.5 minutes on 2 cores)
    python tests/gpu/h200.py --only kernel,fsdp_offload     # some of the checks

Every check runs in processes of its own (the GPU's memory is free again for the next) and prints one JSON line:
its status (ok, failed, cut or skipped), its planned and measured seconds and its figures; a summary line
follows, and the exit status is 1 when a check failed. A global deadline (--deadline, 480 s from the start; on
the CPU 4x) skips the checks that no longer fit in what is left of it (skipped, not failed), and cuts one that
runs into it (cut: out of time, not failed). The layers check sizes its rows from the memory the GPU reports
free: a row its plan says cannot fit is skipped with the reason, never run into an out-of-memory error (an
H100's 80 GiB takes the 32k row, an H200 both; --dry-run lists them for each card).

The checks, in the order they run, that of what they teach (planned seconds on one H200, start-up
included: CHECKS; the deadline cuts the last first):
  grad_memory       GRADIENT_SHAPE's 42M-parameter model (its parameters nearly all in its layers) under FSDP2 on one
                    torchrun rank, bf16 over fp32 masters: two updates, one micro-batch then four, and what the
                    rank holds on the GPU between micro-batches against its shard of the fp32 gradients (FSDP2
                    reduce-scatters every micro-batch: with the sync off it kept every gradient unsharded). One
                    GPU shows no sharding (the shard is the whole model): tests/test_distributed.py measures it
                    on 2 gloo ranks
  qwen3_30b_layers  LAYERS decoder layers in Qwen3-30B-A3B's shapes (tests/configs: hidden 2048, 32 / 4 heads of
                    128, 128 experts top-8 of 768, vocabulary 151936; YaRN as the ulorl preset), one update
                    each on one packed row of 32768 and of 131072 tokens, bf16 over fp32 masters, varlen,
                    checkpointing: the measured peak against the plan of the same model and row, and the gap
                    (the plan counts no FlashAttention backward workspace); the headline's plan beside it
  kernel            tests/gpu/check.py's kernel check (varlen against masked sdpa on a packed 16k-token row:
                    output and q/k/v gradients; varlen alone at 131072 tokens), and there its extra memory
                    within what the plan gives attention in a layer: q, k, v, their copies and the output, and
                    as much for their gradients (plan.Shape.layer_activations' attention terms)
  moe_train         train.py in one process, twice at once: --routing-replay true and record, on check.py's
                    64-expert qwen3_moe with the transformers engine (--engine hf), bf16 over fp32 masters,
                    packed rows through varlen, gradient checkpointing, ROUTING_STEPS steps. Passes as
                    check.py's runs do (weights moved, the engine/trainer gap measured and under the stop
                    threshold) and as its routing pair does (replay's KL within 2x record's); reports the
                    mismatch and the KL of each, and the measured GPU peak against the plan's
  fsdp_offload      one FSDP2 rank (torchrun --nproc-per-node 1) over cpu:gloo,cuda:nccl with the optimizer in
                    host memory (CPUOffloadPolicy): sharded loading of that MoE, one update (ulorl.update), and
                    every tensor the weight sync would send (weight_sync.HFSource, as the NCCL sender gets
                    them): each must be on the GPU, whatever host memory its shard was gathered in; then the
                    benchmarks' offload mode on the node's CPU: AdamW's step with 1 thread against all its cores
  decode            the decode-step cost against busy rows 1-256 for a random 1.4B dense Qwen3 (2048 x 28,
                    Qwen3-1.7B's width and depth) with the transformers engine: the benchmarks' decode mode
                    (BENCH) with --device cuda
  segments          the benchmarks' segments mode on the tiny task's long tail, 1 / 2 / 4 segments, on a random
                    150M dense Qwen3 on the GPU (bf16, transformers engine), not 1-3B: every chunk of that
                    benchmark ends in a checkpoint of 14 bytes a parameter (bf16 weights, fp32 masters and AdamW
                    moments), and with one kept per variant and one being written, 1B alone would take 56 GB of
                    the machine's 64 GiB disk

The machine's Python lacks what train.py imports at start-up for the rewards (math-verify and two of its needs):
tests/gpu/wheels.py downloads them here into .whl/, which git ignores, so whatever copies the project to the GPU
machine must carry it too; this script installs them into its work folder when math_verify does not import.
"""
import argparse
import dataclasses
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, HERE):  # the project's modules, and check.py / wheels.py beside this file
    if path not in sys.path:
        sys.path.insert(0, path)

import check  # noqa: E402  (tests/gpu/check.py: the kernel check, the MoE model and data, the run harness)
import wheels  # noqa: E402

BENCH = "-m bench"  # the benchmarks' entry point, as `python BENCH MODE ...` runs them (from the project's root)
DEADLINE_S = 480  # the whole check, start-up included, on a machine lent for ~11 minutes (420 s planned)
TREE_LIMIT = 64 * 2**20  # what travels to the GPU machine: the working tree and the carried wheels
QWEN3_30B = os.path.join(ROOT, "tests", "configs", "Qwen3-30B-A3B")
# Qwen3-30B-A3B's config.json, as the ulorl preset's model: what the layers check builds on
QWEN3_30B_SHAPE = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       vocab_size=151936, model_type="qwen3_moe")
DECODE_ROWS = "1,2,4,8,16,32,64,128,256"
# What each device runs. cuda: the sizes the planned seconds are for. cpu: toy sizes of the same code (--device
# cpu), to run it here before it first runs on a GPU.
SIZES = {
    "cuda": dict(train_steps=check.ROUTING_STEPS, threads=4,
                 # 512 tokens a segment: a random model's ~256-token responses in one or two, the tail in more
                 train=["--max-response-len", "4096", "--segments", "8"],
                 layers=2, layer_rows={32768: (4096, 12288, 16384), 131072: check.KERNEL_LONG_ROW},
                 layer_shape={}, fsdp_rows=(2048, 1024, 512, 512), offload=["--millions", "100", "--rounds", "3"],
                 decode=["--models", "2048x28", "--rows", DECODE_ROWS, "--tokens", "17", "--rounds", "3"],
                 segments_shape=(1024, 12), segments=["--segments", "1,2,4", "--warmup", "4", "--rounds", "1",
                                                      "--chunk", "4"]),
    "cpu": dict(train_steps=2, threads=1,
                train=["--max-response-len", "128", "--segments", "2", "--group-size", "4", "--prompts-per-step",
                       "2", "--train-groups", "2", "--attn-implementation", "sdpa"],
                layers=1, layer_rows={1024: (256, 768), 2048: (512, 512, 1024)},
                layer_shape=dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=2048),
                fsdp_rows=(128, 64, 64, 32), offload=["--millions", "2", "--tensors", "4", "--rounds", "2"],
                decode=["--models", "64x2", "--rows", "1,2", "--tokens", "3", "--rounds", "1"],
                segments_shape=(64, 2), segments=["--segments", "1,2", "--warmup", "1", "--rounds", "1",
                                                  "--chunk", "1"]),
}


@dataclasses.dataclass
class Ctx:
    """Where and how big the checks run."""
    device: str  # "cuda" or "cpu"
    work: str  # models, data, runs, logs
    python: str = sys.executable
    out_dir: str = ""  # --out-dir: the JSON lines, the summary and the logs' archive, as the check goes

    def emit(self, rec: dict) -> None:
        """One JSON line: printed, and with --out-dir appended to results.jsonl at once (a run cut short still
        leaves every line it printed), the logs' archive renewed beside it."""
        print(json.dumps(rec), flush=True)
        if self.out_dir:
            with open(os.path.join(self.out_dir, "results.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            archive_logs(self.work, os.path.join(self.out_dir, "logs.tar.gz"))

    @property
    def size(self) -> dict:
        return SIZES[self.device]

    def part(self, name: str) -> list[str]:
        """This script's command for one of its parts, in a process of its own."""
        return [self.python, os.path.join("tests", "gpu", "h200.py"), "--part", name, "--device", self.device,
                "--work", self.work]

    def bench(self, mode: str, *args: str) -> list[str]:
        return [self.python, *shlex.split(BENCH), mode, *args]


@dataclasses.dataclass
class Check:
    name: str
    planned_s: float  # on one H200, its processes' start-up included
    commands: object  # Ctx -> [(environment, command)]: what it runs (the dry run prints them)
    run: object  # (Ctx, timeout) -> its record: ok, error, figures
    cpu: str = ""  # why it cannot run on the CPU, where it cannot


# ------------------------------------------------------------------------------------------ processes

def run_json(cmd: list[str], env: dict, timeout: float, log: str, key: tuple[str, str] | None = None) -> dict:
    """Run `cmd` from the project's root in a process group of its own (killed whole when it ends or at
    `timeout`), its output to `log`.stdout/.stderr; returns its last JSON line (the last with key[0] ==
    key[1] when given) with "rc", or {"ok": False, "error": why} when there is none."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log + ".stdout", "w") as out, open(log + ".stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            check.kill_group(proc)
            proc.wait()
    with open(log + ".stdout", errors="replace") as f:
        lines = f.read().strip().splitlines()
    with open(log + ".stderr", errors="replace") as f:
        tail = f.read()[-3000:]
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and (key is None or rec.get(key[0]) == key[1]):
            return {**rec, "rc": rc}
    why = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
    return {"ok": False, "rc": rc, "error": f"{why}, no result; stderr tail:\n{tail}"}


def base_env(ctx: Ctx) -> dict:
    """What every process of the check gets: nothing from a hub, the wheels' folder, one GPU."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    site = os.path.join(ctx.work, "site")
    if os.path.isdir(site):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    if ctx.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]  # the first GPU
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ------------------------------------------------------------------------------------------ the checks

def kernel_commands(ctx: Ctx) -> list:
    env, cmd = check.kernel_command(base_env(ctx)["CUDA_VISIBLE_DEVICES"], ctx.python)
    return [({**base_env(ctx), **env}, cmd)]


def attention_allowance(tokens: int) -> int:
    """Bytes the plan gives the attention of one layer at `tokens` tokens (the kernel check's heads: Qwen3-30B-A3B's)
    while it is recomputed in the backward: its share of plan.Shape.layer_activations (q, k, v, their normed and
    rotated copies, the output: a shape with no hidden and no MLP leaves only those), in bf16, and as much again
    for their gradients, as the plan counts a layer's activations."""
    from systems import plan
    attention = plan.Shape(layers=1, hidden=0, vocab=0, heads=check.KERNEL_SHAPE["heads"],
                           kv_heads=check.KERNEL_SHAPE["kv_heads"], head_dim=check.KERNEL_SHAPE["head_dim"],
                           intermediate=0)
    return 2 * attention.layer_activations(tokens) * plan.BYTES["bfloat16"]


def kernel_run(ctx: Ctx, timeout: float) -> dict:
    """check.py --kernel, then its 131072-token figure against attention_allowance."""
    [(env, cmd)] = kernel_commands(ctx)
    rec = run_json(cmd, env, timeout, os.path.join(ctx.work, "logs", "kernel"), ("check", "kernel"))
    rec.pop("check", None)
    long = rec.get("long") or {}
    peak = (long.get("peak_mib") or {}).get("varlen")
    if peak is not None:
        allowed = round(attention_allowance(long["tokens"]) / 2**20)
        long["plan_attention_mib"] = allowed
        if peak > allowed:
            rec["ok"] = False
            rec["error"] = "; ".join(filter(None, [rec.get("error"), f"varlen took {peak} MiB over its inputs at "
                                                   f"{long['tokens']} tokens, more than the plan gives a layer's "
                                                   f"attention ({allowed} MiB)"]))
    return rec


def set_flags(cmd: list[str], flags: list[str]) -> list[str]:
    """`cmd` with each --flag of `flags` (pairs: flag, value) given that value: in place where it has one, else
    added at the end."""
    cmd = list(cmd)
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = value
        else:
            cmd += [flag, value]
    return cmd


def moe_runs(ctx: Ctx) -> list:
    """check.py's routing pair as train.py runs in one process on the one GPU, with the transformers engine."""
    runs = []
    for variant in check.ROUTING_VARIANTS:
        run = check.make_run("one_gpu", "moe", ["0"], ["train.py"], variant, ctx.work, ctx.python,
                             ctx.size["train_steps"])
        run.cmd = set_flags(run.cmd, ["--engine", "hf", "--device", ctx.device, "--threads", str(ctx.size["threads"]),
                                      *ctx.size["train"]])
        run.env = {**base_env(ctx), **run.env, "CUDA_VISIBLE_DEVICES": base_env(ctx)["CUDA_VISIBLE_DEVICES"]}
        runs.append(run)
    return runs


def first_plan_mib(out: str) -> float | None:
    """memory/plan_trainer_mib of a run's metrics.jsonl (logged once, with the first step's record)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return next((r["memory/plan_trainer_mib"] for r in map(json.loads, f) if "memory/plan_trainer_mib" in r),
                        None)
    except (OSError, ValueError):
        return None


def moe_train_run(ctx: Ctx, timeout: float) -> dict:
    """Both runs at once (check.execute), judged as check.py judges them (check.result, compare_routing)."""
    runs = moe_runs(ctx)
    results = check.execute(runs, timeout)
    lines = []
    for run, r in zip(runs, results):
        plan_mib = first_plan_mib(run.out)
        keep = ("variant", "ok", "error", "steps", "gap", "routing", "weights_moved", "trainer_peak_mib",
                "step_s", "first_step_s", "wall_s")
        lines.append({**{k: r.get(k) for k in keep}, "plan_trainer_mib": round(plan_mib) if plan_mib else None,
                      "peak_over_plan": round(r["trainer_peak_mib"] / plan_mib, 3)
                      if plan_mib and r.get("trainer_peak_mib") else None})
    routing = check.compare_routing(results)
    problems = [f"{r['variant']}: {r['error']}" for r in results if not r["ok"]]
    if routing and not routing["ok"]:
        problems.append(f"routing pair: {routing['error']}")
    return {"ok": not problems, "error": "; ".join(problems) or None, "runs": lines, "routing_replay": routing}


def fsdp_commands(ctx: Ctx, part: str = "fsdp_offload") -> list:
    torchrun = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd = [*torchrun, *ctx.part(part)[1:]]
    return [(base_env(ctx), cmd)]


gradient_commands = functools.partial(fsdp_commands, part="grad_memory")


def offload_commands(ctx: Ctx) -> list:
    """fsdp_offload's part, then the offloaded optimizer step on the node's CPU with 1 thread against all its cores
    (the benchmarks' offload mode): what torchrun's OMP_NUM_THREADS=1 cost a rank before each took its share."""
    cores = str(len(os.sched_getaffinity(0)))
    return fsdp_commands(ctx) + [(base_env(ctx), ctx.bench("offload", "--threads", cores, *ctx.size["offload"]))]


def offload_run(ctx: Ctx, timeout: float) -> dict:
    """fsdp_offload's record, with the optimizer step's threads figure beside it (a failed benchmark fails it)."""
    start = time.time()
    rec = part_run("fsdp_offload", fsdp_commands, ctx, timeout)
    [_, (env, cmd)] = offload_commands(ctx)
    step = run_json(cmd, env, max(1.0, timeout - (time.time() - start)), os.path.join(ctx.work, "logs", "offload"),
                    ("bench", "offload"))
    if step.get("bench") != "offload":
        rec.update(ok=False, error="; ".join(filter(None, [rec.get("error"), f"offload step: {step.get('error')}"])))
    rec["offload_step"] = {k: v for k, v in step.items() if k not in ("bench", "rc")}
    return rec


def layers_commands(ctx: Ctx) -> list:
    return [(base_env(ctx), ctx.part("qwen3_30b_layers"))]


def part_run(name: str, commands, ctx: Ctx, timeout: float) -> dict:
    """A check that is one of this script's parts (PARTS), run by its one command: the part's JSON line."""
    [(env, cmd)] = commands(ctx)
    rec = run_json(cmd, env, timeout, os.path.join(ctx.work, "logs", name), ("part", name))
    rec.pop("part", None)
    return rec


def decode_commands(ctx: Ctx) -> list:
    return [(base_env(ctx), ctx.bench("decode", *ctx.size["decode"], "--dir", os.path.join(ctx.work, "decode"),
                                      "--device", ctx.device))]


def decode_run(ctx: Ctx, timeout: float) -> dict:
    [(env, cmd)] = decode_commands(ctx)
    rec = run_json(cmd, env, timeout, os.path.join(ctx.work, "logs", "decode"), ("bench", "decode"))
    if rec.get("bench") != "decode":
        return rec
    results = rec.get("results") or {}
    hf = next((v for k, v in results.items() if k.startswith("hf ")), None)
    # a figure for every row; its sign is not judged: a step's cost is the difference of two timings, which a
    # toy model on a busy CPU can make negative
    ok = rec["rc"] == 0 and hf is not None and len(hf["step_ms"]) == len(rec.get("rows") or [None])
    return {"ok": ok, "error": None if ok else f"no transformers engine figures (exit status {rec['rc']})",
            "rows": rec.get("rows"), "results": results}


def segments_model(ctx: Ctx) -> str:
    return os.path.join(ctx.work, "segments_model")


def segments_commands(ctx: Ctx) -> list:
    flags = ["--model", segments_model(ctx), "--device", ctx.device, "--dtype", "bfloat16", "--engine", "hf",
             # a random model never solves the task: with dynamic sampling every group would be dropped
             "--dynamic-sampling", "false", "--threads", str(ctx.size["threads"])]
    return [(base_env(ctx), ctx.bench("segments", *ctx.size["segments"], "--dir", os.path.join(ctx.work, "segments"),
                                      *flags))]


def segments_run(ctx: Ctx, timeout: float) -> dict:
    [(env, cmd)] = segments_commands(ctx)
    rec = run_json(cmd, env, timeout, os.path.join(ctx.work, "logs", "segments"), ("bench", "segments"))
    if rec.get("bench") != "segments":
        return rec
    keep = ("segments", "speedup", "step_s", "rollout_s", "generate_s", "decode_steps", "utilisation", "reward",
            "steps_measured")
    ok = rec["rc"] == 0 and len(rec.get("speedup") or []) == len(rec.get("segments") or [None])
    return {"ok": ok, "error": None if ok else f"exit status {rec['rc']}", **{k: rec.get(k) for k in keep}}


def train_commands(ctx: Ctx) -> list:
    return [(r.env, r.cmd) for r in moe_runs(ctx)]


# in the order of what they teach, should the deadline cut the last ones
CHECKS = [
    Check("grad_memory", 35, gradient_commands, functools.partial(part_run, "grad_memory", gradient_commands)),
    Check("qwen3_30b_layers", 80, layers_commands, functools.partial(part_run, "qwen3_30b_layers", layers_commands)),
    Check("kernel", 30, kernel_commands, kernel_run, cpu="varlen is CUDA-only (tests/test_gpu_check.py runs the "
                                                         "harness on CPU with sdpa)"),
    Check("moe_train", 100, train_commands, moe_train_run),
    Check("fsdp_offload", 45, offload_commands, offload_run),
    Check("decode", 45, decode_commands, decode_run),
    Check("segments", 65, segments_commands, segments_run),
]
SETUP_S = 20  # the wheels' install, the MoE model and data, the segments model


# ------------------------------------------------------------------------------- parts (own processes)

def import_weight_sync():
    """weight_sync, which imports vLLM's weight-transfer interfaces at its top. Where vLLM is not installed (the
    one-GPU machine) those names get stand-ins first: empty types, a named tuple for ParamMeta. HFSource, what
    the check runs, is the project's code and calls none of vLLM's. The stand-ins leave sys.modules after the
    import, so nothing else mistakes them for vLLM."""
    try:
        import vllm.distributed.weight_transfer  # noqa: F401
    except ImportError:
        import collections
        import types
        names = ["vllm", "vllm.distributed", "vllm.distributed.weight_transfer",
                 "vllm.distributed.weight_transfer.base", "vllm.distributed.weight_transfer.packed_tensor"]
        mods = {n: types.ModuleType(n) for n in names}
        transfer, base = mods[names[2]], mods[names[3]]

        class Factory:
            @staticmethod
            def register_engine(name, cls):
                pass

        transfer.ParamMeta = collections.namedtuple("ParamMeta", "name dtype shape")
        transfer.WeightTransferEngineFactory = transfer.WeightTransferTrainerFactory = Factory
        for module, kinds in ((transfer, ("TrainerWeightTransferEngine", "WeightSource", "WeightTransferEngine")),
                              (base, ("TrainerInitInfo", "WeightTransferInitInfo", "WeightTransferUpdateInfo"))):
            for kind in kinds:
                setattr(module, kind, type(kind, (), {}))
        mods[names[4]].DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
        sys.modules.update(mods)
        try:
            from systems import weight_sync
        finally:
            for n in names:
                sys.modules.pop(n, None)
        return weight_sync
    from systems import weight_sync
    return weight_sync


def update_config(device: str, tokens: int, prompt: int, *extra: str):
    """config.py's Config of an update on packed rows of up to `tokens` tokens, bf16 over fp32 masters,
    checkpointing, varlen on a GPU (sdpa on the CPU); the engine/trainer gap check off (no engine sampled the
    made-up samples it trains on)."""
    import config
    return config.parse_config(["--device", device, "--dtype", "bfloat16", "--pack", "true", "--attn-implementation",
                                "varlen" if device == "cuda" else "sdpa", "--gradient-checkpointing", "true",
                                "--max-tokens-per-micro-batch", str(tokens), "--max-prompt-len", str(prompt),
                                "--max-response-len", str(tokens - prompt), "--segments", "1", "--mini-batch", "0",
                                "--lr-final", "1", "--max-engine-kl", "0", "--engine-kl-jump", "0",
                                "--eval-data", "", *extra])


def made_up_group(lengths, vocab: int, prompt: int, seed: int = 0) -> list[list]:
    """One group of samples of `lengths` tokens (prompt + response) with random ids, alternating rewards (so
    every advantage is non-zero) and behaviour log-probs of -1, as if sampled by the current weights."""
    import random
    from segment_rollout import Sample
    rng = random.Random(seed)
    group = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(vocab) for _ in range(n)]
        group.append(Sample(uid=i, group=0, prompt_ids=ids[:prompt], row={}, tokens=ids[prompt:],
                            logprobs=[-1.0] * (n - prompt), versions=[0] * (n - prompt), seg_starts=[0],
                            finish="eos", reward=float(i % 2 == 0)))
    return [group]


def shape_problems(config) -> list[str]:
    """Where `config` is not Qwen3-30B-A3B's (QWEN3_30B_SHAPE), and whether the ulorl preset trains that model."""
    import config as config_lib
    out = [f"{k}: {getattr(config, k, None)} where Qwen3-30B-A3B has {v}" for k, v in QWEN3_30B_SHAPE.items()
           if getattr(config, k, None) != v]
    if config_lib.PRESETS["ulorl"]["model"] != "Qwen/Qwen3-30B-A3B":
        out.append(f"the ulorl preset trains {config_lib.PRESETS['ulorl']['model']}, not Qwen/Qwen3-30B-A3B")
    return out


def headline_plan() -> dict:
    """The ulorl preset's trainer plan for Qwen3-30B-A3B on an H200 (141 GB), as the docs state it: 6 FSDP2
    ranks and 2 engine GPUs, --sp and offload as the plan chooses them. Those, its total and what a trainer may
    use, GiB."""
    import config
    import model as model_lib
    from systems import plan
    cfg = config.parse_config(["--preset", "ulorl", "--model", QWEN3_30B, "--plan", "--rollout-gpus", "6,7",
                               "--attn-implementation", "varlen"])
    shape = plan.Shape.of(model_lib.model_config(QWEN3_30B, cfg.rope_scaling_factor, cfg.rope_original_max_positions))
    make = lambda c: plan.make_plan(shape, c, 6, 2, True)  # noqa: E731
    cfg.sp, cfg.offload_optimizer = plan.choose(make, cfg, int(141e9), [1, 2], True)
    return {"sp": cfg.sp, "offload": cfg.offload_optimizer, "trainer_gib": round(make(cfg).trainer_total / 2**30, 2),
            "budget_gib": round(141e9 * (1 - plan.RESERVE) / 2**30, 2)}


def layers_config(ctx: Ctx):
    """The layers check's model: Qwen3-30B-A3B's config.json with the ulorl preset's YaRN, cut to LAYERS layers
    (at toy width on the CPU)."""
    from transformers import AutoConfig
    import config as config_lib
    import model as model_lib
    config = AutoConfig.from_pretrained(QWEN3_30B)
    preset = config_lib.PRESETS["ulorl"]
    for key, value in model_lib.yarn_overrides(config, preset["rope_scaling_factor"],
                                               preset["rope_original_max_positions"]).items():
        setattr(config, key, value)
    for key, value in {"num_hidden_layers": ctx.size["layers"], "output_router_logits": False,
                       **ctx.size["layer_shape"]}.items():
        setattr(config, key, value)
    return config


NEED_OVER_PLAN = 1.25  # what a layers row may take over its plan (the plan's own tolerance) before it runs
CARDS = {"H100 (80 GiB)": 79.2 * 2**30, "H200 (141 GB)": 139.8 * 2**30}  # what mem_get_info leaves free on each


def row_needs(ctx: Ctx) -> dict[int, float]:
    """Bytes each layers row may take: the plan of its model and row, NEED_OVER_PLAN times."""
    from systems import plan
    shape = plan.Shape.of(layers_config(ctx))
    return {tokens: NEED_OVER_PLAN * plan.make_plan(shape, update_config(ctx.device, tokens, 64, "--plan"), 1, 1,
                                                  True).trainer_total
            for tokens in sorted(ctx.size["layer_rows"])}


def part_layers(ctx: Ctx) -> dict:
    """qwen3_30b_layers, in this process (see the module's docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    import ulorl
    from systems import distributed
    from systems import placement
    from systems import plan
    from systems import seqpar
    from systems.engine_gap import Watch
    cuda = ctx.device == "cuda"
    out = {"part": "qwen3_30b_layers", "ok": False, "error": None}
    if problems := shape_problems(AutoConfig.from_pretrained(QWEN3_30B)):
        out["error"] = "; ".join(problems)
        return out
    config, needs = layers_config(ctx), row_needs(ctx)
    cfg0 = update_config(ctx.device, max(ctx.size["layer_rows"]), 64)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(ctx.device):  # random weights made where they live: a GPU draws 1.9B in a second
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              attn_implementation=seqpar.attention_name(cfg0.attn_implementation, 1))
    lm.gradient_checkpointing_enable()
    masters = distributed.MasterWeights(lm, torch.bfloat16)
    watch = Watch(cfg0)  # the engine/trainer gap, measured (its check off: no engine sampled these)
    policy = placement.wrap(lm, "none", compute_dtype=torch.bfloat16, watch=watch)
    opt = torch.optim.AdamW(masters.parameters(), lr=cfg0.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    out.update(layers=config.num_hidden_layers, params_b=round(sum(p.numel() for p in lm.parameters()) / 1e9, 3),
               build_s=round(time.time() - t0, 1), rows={})
    shape = plan.Shape.of(config)
    for tokens, lengths in sorted(ctx.size["layer_rows"].items()):
        cfg = update_config(ctx.device, tokens, 64)
        if cuda:
            free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_allocated()  # the model's own counts in its plan
            if needs[tokens] > free:
                out["rows"][str(tokens)] = {"lengths": list(lengths), "skipped": (
                    f"needs ~{needs[tokens] / 2**30:.1f} GiB (its plan x{NEED_OVER_PLAN}), {free / 2**30:.1f} free")}
                continue
        groups = made_up_group(lengths, config.vocab_size, 64, seed=tokens)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        row = {"lengths": list(lengths)}
        try:
            watch.start(0, [])
            metrics = ulorl.update(policy, None, opt, sched, groups, 0, 0, cfg, distributed.Ranks(policy, masters))
            watch.metrics()
            row["optimizer_steps"] = metrics["train/optimizer_steps"]
        except torch.OutOfMemoryError as e:  # the figures up to here still say how far it got
            row.update(optimizer_steps=0, error=f"out of memory: {str(e)[:300]}")
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        row["seconds"] = round(time.time() - t0, 2)
        planned = plan.make_plan(shape, cfg, 1, 1, True).trainer  # vllm=True: no engine beside the trainer here
        row["plan_mib"] = {k: round(v / 2**20) for k, v in planned.items() if v}
        row["plan_total_mib"] = round(sum(planned.values()) / 2**20)
        if cuda:
            row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
            row["reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20)
            row["gap_mib"] = row["peak_mib"] - row["plan_total_mib"]  # + : the plan leaves out that much
        out["rows"][str(tokens)] = row
        del groups
    out["headline_plan"] = headline_plan()
    bad = [f"{t} tokens: {r.get('error') or 'no optimizer step (a NaN/inf loss or gradient)'}"
           for t, r in out["rows"].items() if "skipped" not in r and r["optimizer_steps"] != 1]
    out["ok"] = not bad
    out["error"] = "; ".join(bad) or None
    return out


def part_fsdp(ctx: Ctx) -> dict:
    """fsdp_offload, in this torchrun rank (see the module's docstring)."""
    import collections
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    import ulorl
    from systems import distributed
    from systems import placement
    from systems import seqpar
    from systems.engine_gap import Watch
    cuda = ctx.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"  # train.py's, with the optimizer offloaded
    distributed.init_distributed(backend, 600)
    weight_sync = import_weight_sync()
    out = {"part": "fsdp_offload", "ok": False, "error": None, "backend": backend}
    path = check.snapshot_dir(os.path.join(ctx.work, "hf"), check.HUB["moe"])
    cfg = update_config(ctx.device, sum(ctx.size["fsdp_rows"]), 32, "--lr", str(check.LR), "--parallel", "fsdp",
                        "--offload-optimizer", "true")
    t0 = time.time()
    watch = Watch(cfg)
    policy, lm, tok = placement.load_sharded(path, "float32", f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
                                             True, check.YARN, check.SHAPE["max_position_embeddings"],
                                             seqpar.attention_name(cfg.attn_implementation, 1),
                                             compute_dtype=torch.bfloat16, offload=True, watch=watch)
    out["load_s"] = round(time.time() - t0, 2)
    with torch.no_grad():
        before = [p.to_local().clone() for p in lm.parameters()]
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    t0 = time.time()
    watch.start(0, [])
    metrics = ulorl.update(policy, None, opt, sched, made_up_group(ctx.size["fsdp_rows"], len(tok), 32), 0,
                           tok.pad_token_id, cfg, distributed.Ranks(policy))
    watch.metrics()
    out["step_s"] = round(time.time() - t0, 2)
    out["optimizer_steps"] = metrics["train/optimizer_steps"]
    with torch.no_grad():  # (read after the update: FSDP2 may give a parameter new local storage as it pins it)
        shards = [p.to_local() for p in lm.parameters()]
        out["weights_moved"] = max((s - b).abs().max().item() for s, b in zip(shards, before))
    out["shard_devices"] = dict(collections.Counter(str(s.device) for s in shards))
    out["shards_pinned"] = all(s.is_pinned() for s in shards) if cuda else None  # a figure: copies' speed only
    if cuda:
        out["gpu_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    # what the sync's gathers give (host memory under offload), then what the NCCL sender gets (HFSource)
    gathered = collections.Counter(str(t.device) for _, t in distributed.hf_weights(lm, dtype=torch.bfloat16))
    want = weight_sync.sender_device("nccl" if cuda else "gloo")
    t0 = time.time()
    sent = {name: str(t.device) for name, t in weight_sync.HFSource(lm, torch.bfloat16, want)}
    out["sync_s"] = round(time.time() - t0, 2)
    expected = str(want) if want is not None else "cpu"
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    listing = os.path.join(ctx.work, "fsdp_offload_sync_tensors.json")
    with open(listing, "w") as f:
        json.dump(sent, f, indent=0)
    out.update(gathered_devices=dict(gathered), sent_devices=dict(collections.Counter(sent.values())),
               sent_tensors=len(sent), off_device=[n for n, d in sent.items() if d != expected][:20],
               tensor_devices=listing)
    problems = []
    if out["optimizer_steps"] != 1:
        problems.append("no optimizer step (a NaN/inf loss or gradient)")
    if out["weights_moved"] < check.LR / 2:
        problems.append(f"the update did not move the weights: the largest change is {out['weights_moved']:.3g}")
    if set(out["shard_devices"]) != {"cpu"}:
        problems.append(f"shards on {out['shard_devices']}: the optimizer offload keeps them in host memory")
    if out["off_device"]:
        problems.append(f"{len([d for d in sent.values() if d != expected])} of {len(sent)} tensors the sync sends "
                        f"are not on {expected}, e.g. {out['off_device'][:3]}")
    if set(sent) != keys:
        problems.append(f"the sync's names are not the checkpoint's: {sorted(set(sent) ^ keys)[:5]}")
    out["ok"] = not problems
    out["error"] = "; ".join(problems) or None
    dist.destroy_process_group()
    return out


# a 42M-parameter Qwen3 whose parameters are nearly all in its 12 decoder layers, as a large model's are
GRADIENT_SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=False)


def gradient_memory(device: str, world: int, parallel: str, compute_dtype=None, keep=None) -> dict:
    """Two updates (ulorl.update) of GRADIENT_SHAPE's model on a fixed batch of 16 samples of 64 tokens, split
    over the `world` trainer ranks (the process group is the caller's): one micro-batch a rank, then four. What the
    rank holds between micro-batches: the memory at the start of each training forward but the first, above the
    first's (a GPU: CUDA's allocated bytes; a CPU: the resident bytes, with malloc set to hand back what torch
    frees), against its shard of the fp32 gradients. `keep(lm)` is called before and after the updates."""
    import ctypes
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import config
    import ulorl
    from segment_rollout import Sample
    from systems import distributed
    from systems import placement
    from systems.engine_gap import Watch
    if device == "cuda":
        measure = torch.cuda.memory_allocated
    else:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: what torch frees goes back to the system
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
        measure = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(Qwen3Config(**GRADIENT_SHAPE)).to(device)
    if keep:
        keep(lm)
    watch = Watch(config.Config(on_engine_kl="warn"))
    policy = placement.wrap(lm, parallel, compute_dtype=compute_dtype, watch=watch)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    gen = torch.Generator().manual_seed(1)
    vocab = GRADIENT_SHAPE["vocab_size"]
    groups = [[Sample(4 * g + i, g, prompt, {"verifier": "tiny"}, torch.randint(0, vocab, (48,), generator=gen).tolist(),
                      [-7.0] * 48, [0] * 48, [0], "eos", float(i % 2)) for i in range(4)]
              for g, prompt in enumerate(torch.randint(0, vocab, (4, 16), generator=gen).tolist())]
    at_forward = []
    policy.register_forward_pre_hook(lambda module, args: at_forward.append(measure()) if torch.is_grad_enabled()
                                     else None)
    held = {}
    for micro_tokens, n in ((4096, 1), (128, 4)):  # 8 samples of 64 tokens a rank of 2: one micro-batch, then four
        cfg = config.Config(max_tokens_per_micro_batch=micro_tokens * 2 // world, device=device, kl_coef=0.0,
                            on_engine_kl="warn")
        at_forward.clear()
        watch.start(0, [])
        ulorl.update(policy, None, opt, sched, groups, 0, 0, cfg, distributed.Ranks(policy))
        watch.metrics()
        held[n] = [b - at_forward[0] for b in at_forward[1:]]
    if keep:
        keep(lm)
    shard = sum(distributed.full_tensor(p).numel() for p in lm.parameters()) * 4 // world
    return {"held": held, "shard": shard}


def part_gradients(ctx: Ctx) -> dict:
    """grad_memory, in this torchrun rank (see the module's docstring)."""
    import torch
    import torch.distributed as dist
    from systems import distributed
    cuda = ctx.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    distributed.init_distributed("nccl" if cuda else "gloo", 600)
    t0 = time.time()
    got = gradient_memory(ctx.device, dist.get_world_size(), "fsdp", torch.bfloat16 if cuda else None)
    dist.destroy_process_group()
    held = max(got["held"][4])
    out = {"part": "grad_memory", "held_mib": [round(b / 2**20, 1) for b in got["held"][4]],
           "shard_mib": round(got["shard"] / 2**20, 1), "held_over_shard": round(held / got["shard"], 3),
           "seconds": round(time.time() - t0, 1)}
    ok = len(got["held"][4]) == 3 and held < 1.25 * got["shard"]
    return {**out, "ok": ok, "error": None if ok else f"a rank held {held / got['shard']:.2f}x its shard of the "
                                                      f"gradients between micro-batches"}


PARTS = {"qwen3_30b_layers": part_layers, "fsdp_offload": part_fsdp, "grad_memory": part_gradients}


# ------------------------------------------------------------------------------------------ the whole

def tree_bytes() -> int:
    """Bytes of what the device machine gets of the project: git's tracked files and the untracked ones it does
    not ignore; outside a git checkout (a source archive), every file but what .gitignore names (ignored)."""
    names = set()
    try:
        for args in (["ls-files", "-z"], ["ls-files", "-z", "--others", "--exclude-standard"]):
            names.update(n for n in subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                                   check=True).stdout.split("\0") if n)
    except (OSError, subprocess.CalledProcessError):
        names = unignored_files()
    return sum(os.path.getsize(os.path.join(ROOT, n)) for n in names if os.path.isfile(os.path.join(ROOT, n)))


def unignored_files() -> set[str]:
    """The project's files that .gitignore's patterns (this project's: names, globs, folders, rooted with /) do
    not name, relative to ROOT."""
    import fnmatch
    with open(os.path.join(ROOT, ".gitignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]

    def ignored(rel: str) -> bool:
        for pattern in patterns:
            bare = pattern.strip("/")
            if pattern.startswith("/") and fnmatch.fnmatch(rel, bare):
                return True
            if not pattern.startswith("/") and fnmatch.fnmatch(os.path.basename(rel), bare):
                return True
        return False
    out = set()
    for d, dirs, files in os.walk(ROOT):
        rel_dir = os.path.relpath(d, ROOT)
        dirs[:] = [x for x in dirs if x != ".git" and not ignored(os.path.normpath(os.path.join(rel_dir, x)))]
        out.update(rel for name in files  # a git worktree's .git is a file naming the repository: not the project's
                   if name != ".git" and not ignored(rel := os.path.normpath(os.path.join(rel_dir, name))))
    return out


def budget(selected: list[Check]) -> dict:
    """The dry run's accounting: planned seconds against the deadline, bytes against what may travel (the
    working tree, and the wheels' folder as it is, or the listed wheels' bytes before they are downloaded)."""
    listed = sum(w["bytes"] for w in wheels.status(wheels.FOLDER))
    if os.path.isdir(wheels.FOLDER):  # all of it travels, whatever else lies there
        wheel = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(wheels.FOLDER) for f in files)
    else:
        wheel = listed
    tree, planned = tree_bytes(), SETUP_S + sum(c.planned_s for c in selected)
    return {"budget": True, "setup_s": SETUP_S, "planned_s": planned, "deadline_s": DEADLINE_S,
            "fits_time": planned <= DEADLINE_S, "tree_bytes": tree, "wheels_listed_bytes": listed,
            "wheel_bytes": wheel, "total_bytes": tree + wheel, "limit_bytes": TREE_LIMIT,
            "fits_size": tree + wheel <= TREE_LIMIT, "carry": os.path.relpath(wheels.FOLDER, ROOT)}


def dry_run(ctx: Ctx, selected: list[Check]) -> None:
    for c in selected:
        line = {"check": c.name, "planned_s": c.planned_s,
                "commands": [check.shell_line(env, cmd) for env, cmd in c.commands(ctx)]}
        if ctx.device == "cpu" and c.cpu:
            line["runs"], line["why"] = False, c.cpu
        if c.name == "qwen3_30b_layers" and ctx.device == "cuda":  # the rows each card's free memory takes
            needs = row_needs(ctx)
            line["rows_on"] = {card: [t for t, need in needs.items() if need <= free] for card, free in CARDS.items()}
            line["row_need_gib"] = {t: round(need / 2**30, 1) for t, need in needs.items()}
        print(json.dumps(line), flush=True)
    for w in wheels.status(wheels.FOLDER):
        print(json.dumps(w), flush=True)
    print(json.dumps(budget(selected)), flush=True)


def install_wheels(ctx: Ctx) -> str | None:
    """math-verify and its missing needs from .whl/ into the work folder, when math_verify does not import
    here; why not, when they are not there."""
    import importlib.util
    if importlib.util.find_spec("math_verify") is not None:
        return None
    missing = [w["file"] for w in wheels.status(wheels.FOLDER) if not w["present"]]
    if missing:
        return (f"math_verify does not import and .whl/ lacks {missing}: run `python tests/gpu/wheels.py` where "
                f"pip can download, and carry .whl with the project")
    site = os.path.join(ctx.work, "site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", site, *[os.path.join(wheels.FOLDER, w[2]) for w in wheels.WHEELS]],
                          capture_output=True, text=True)
    if proc.returncode:
        return f"pip could not install the wheels: {proc.stderr[-2000:]}"
    sys.path.insert(0, site)
    return None


def set_up(ctx: Ctx, selected: list[Check]) -> None:
    """What the checks share, made once: the MoE model and data (check.py's), the segments benchmark's model."""
    names = {c.name for c in selected}
    if names & {"moe_train", "fsdp_offload"}:
        check.make_models(ctx.work, ["moe"])
        check.make_data(os.path.join(ctx.work, "data.jsonl"))
    if "segments" in names:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        import tiny
        hidden, layers = ctx.size["segments_shape"]
        head = 64 if hidden >= 256 else 32
        tok = tiny.make_tokenizer()
        torch.manual_seed(0)
        shape = dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers, head_dim=head,
                     num_attention_heads=hidden // head, num_key_value_heads=max(1, hidden // head // 2),
                     tie_word_embeddings=True, max_position_embeddings=512, vocab_size=len(tok), bos_token_id=None,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16).save_pretrained(segments_model(ctx))
        tok.save_pretrained(segments_model(ctx))


LOG_TAIL = 1 << 20  # the last bytes of each log the archive keeps
ARCHIVE_LIMIT = 15 << 20  # a device call brings back at most 8 files of 16 MiB each from its folder


def archive_logs(work: str, path: str) -> None:
    """The tail of every log under `work`/logs and every run's records (metrics.jsonl) under `work`, gzipped into
    `path`, kept under ARCHIVE_LIMIT (tails halved until it fits)."""
    import io
    import tarfile
    logs = os.path.join(work, "logs")
    names = sorted(os.path.join(d, f) for d, _, files in os.walk(logs) for f in files) if os.path.isdir(logs) else []
    names += sorted(os.path.join(d, "metrics.jsonl") for d, _, files in os.walk(work)
                    if "metrics.jsonl" in files and not d.startswith(logs))
    tail = LOG_TAIL
    while True:
        with tarfile.open(path + ".tmp", "w:gz") as tar:
            for name in names:
                with open(name, "rb") as f:
                    f.seek(max(0, os.path.getsize(name) - tail))
                    data = f.read()
                info = tarfile.TarInfo(os.path.relpath(name, work))
                info.size, info.mtime = len(data), int(os.path.getmtime(name))
                tar.addfile(info, io.BytesIO(data))
        if os.path.getsize(path + ".tmp") <= ARCHIVE_LIMIT or tail < 1024:
            break
        tail //= 2
    os.replace(path + ".tmp", path)


CPU_SLOWER = 4  # --device cpu: its toy sizes on 2 cores, beside another busy process, against a GPU's plan


def run_checks(ctx: Ctx, selected: list[Check], deadline: float, t_start: float) -> list[dict]:
    """Each check in turn, one JSON line each: skipped when what is left of the deadline is less than it
    plans, cut (its own status: it ran out of time, nothing it measured was wrong) at the deadline or at 3x its
    plan. On the CPU every plan counts CPU_SLOWER times."""
    lines = []
    for c in selected:
        left = deadline - (time.time() - t_start)
        planned = c.planned_s * (CPU_SLOWER if ctx.device == "cpu" else 1)
        rec = {"check": c.name, "planned_s": c.planned_s}
        t0 = time.time()
        if ctx.device == "cpu" and c.cpu:
            rec.update(status="skipped", ok=None, why=c.cpu)
        elif left < planned:
            rec.update(status="skipped", ok=None, why=f"{left:.0f} s left of the {deadline:.0f} s deadline, it plans "
                                                    f"{planned:.0f} s")
        else:
            limit = min(left, 3 * planned)
            try:
                got = c.run(ctx, limit)
            except Exception as e:  # the check's own harness failed: say so, go on with the next
                got = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if got.pop("skipped", False):
                rec.update(status="skipped", ok=None, why=got.get("error"))
            elif not got.get("ok") and time.time() - t0 >= limit - 1:
                why = f"cut at {limit:.0f} s ({'the deadline' if limit == left else '3x its plan'})"
                rec.update({**got, "status": "cut", "ok": None, "why": why})
            else:
                rec.update(status="ok" if got.get("ok") else "failed", **got)
        rec["wall_s"] = round(time.time() - t0, 1)
        ctx.emit(rec)
        lines.append(rec)
    return lines


def summary(ctx: Ctx, lines: list[dict], t_start: float, deadline: float = DEADLINE_S) -> dict:
    import torch
    import transformers
    return {"check": "h200", "ok": all(r["status"] != "failed" for r in lines),
            "failed": [r["check"] for r in lines if r["status"] == "failed"],
            "cut": [r["check"] for r in lines if r["status"] == "cut"],
            "skipped": [r["check"] for r in lines if r["status"] == "skipped"],
            "planned_s": SETUP_S + sum(r["planned_s"] for r in lines), "wall_s": round(time.time() - t_start, 1),
            "deadline_s": deadline,
            "device": torch.cuda.get_device_name(0) if ctx.device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "work": ctx.work}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the checks, commands, planned seconds, wheels and "
                                                          "the size budget as JSON lines; run nothing")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: the check; cpu: its code at toy sizes, CUDA-only parts skipped")
    p.add_argument("--only", default="", help="comma-separated checks to run (default: all): "
                                              + ", ".join(c.name for c in CHECKS))
    p.add_argument("--deadline", type=float, default=0.0, help="seconds for everything; a check that no longer fits "
                                                               f"is skipped (default {DEADLINE_S}; --device cpu: "
                                                               f"{CPU_SLOWER}x that)")
    p.add_argument("--work", default="", help="folder for models, runs and logs (default: a new temporary one)")
    p.add_argument("--out-dir", default="", help="folder for what to bring back, written as the check goes: "
                                                 "results.jsonl (every JSON line), summary.json and logs.tar.gz (the "
                                                 "tail of every log), three files under 16 MiB each")
    p.add_argument("--part", default="", choices=["", *PARTS], help=argparse.SUPPRESS)  # one check's own process
    args = p.parse_args()
    only = [n for n in args.only.split(",") if n]
    if unknown := sorted(set(only) - {c.name for c in CHECKS}):
        p.error(f"--only {args.only}: no check {', '.join(unknown)}; the checks: {', '.join(c.name for c in CHECKS)}")
    selected = [c for c in CHECKS if not only or c.name in only]
    if args.deadline < 0:
        p.error(f"--deadline {args.deadline}: must be > 0 seconds")
    args.deadline = args.deadline or DEADLINE_S * (CPU_SLOWER if args.device == "cpu" else 1)
    ctx = Ctx(args.device, os.path.abspath(args.work or (os.path.join(tempfile.gettempdir(), "ulorl_h200") if
                                                         args.dry_run else tempfile.mkdtemp(prefix="ulorl_h200_"))))
    if args.part:
        print(json.dumps(PARTS[args.part](ctx)), flush=True)
        return 0
    if args.dry_run:
        dry_run(ctx, selected)
        return 0
    t_start = time.time()
    os.makedirs(ctx.work, exist_ok=True)
    if args.out_dir:
        ctx.out_dir = os.path.abspath(args.out_dir)
        os.makedirs(ctx.out_dir, exist_ok=True)
    if why := install_wheels(ctx):
        ctx.emit({"check": "setup", "status": "failed", "ok": False, "error": why})
        return 1
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        ctx.emit({"check": "setup", "status": "failed", "ok": False,
                  "error": "no CUDA GPU: --device cpu runs the code at toy sizes on the CPU"})
        return 1
    set_up(ctx, selected)
    ctx.emit({"check": "setup", "status": "ok", "ok": True, "planned_s": SETUP_S,
              "wall_s": round(time.time() - t_start, 1), "work": ctx.work})
    lines = run_checks(ctx, selected, args.deadline, t_start)
    out = summary(ctx, lines, t_start, args.deadline)
    ctx.emit(out)
    if ctx.out_dir:
        with open(os.path.join(ctx.out_dir, "summary.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
