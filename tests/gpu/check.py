"""The GPU check: the headline run (`torchrun --nproc-per-node 6 train.py --preset ulorl --model Qwen/Qwen3-30B-A3B
--rollout-gpus 6,7`) at small size, through the real entry point, with the placement the GPUs present allow.
Not run on a GPU yet: its time estimates are guesses until it has.

Placements, by the number N of GPUs used (those visible; --gpus N takes the first N):
  fsdp       N >= 4: torchrun, 2 FSDP2 trainer ranks on cuda:0,1 (fp32 masters, bf16 compute) and vLLM
             tensor-parallel over cuda:2,3 in a process of its own; weights by NCCL broadcast from rank 0.
             Checks sharded loading from a hub name, the per-layer gathers, NCCL sync into a TP engine.
  split      N = 2-3: one trainer process on cuda:0, vLLM on the others (TP 2 on 3 GPUs, 1 on 2); NCCL.
             Checks the engine on GPUs of its own without torchrun.
  colocated  N = 1: one trainer process, vLLM on the same GPU, asleep during the update; CUDA IPC.
             Checks sleep/wake and IPC sync with a long-context KV cache beside the trainer.
The MoE model runs in N's placement. The dense model (tied embeddings) runs only where it costs no time: on
the GPUs that placement leaves idle (N >= 5), at the same time, in the spare count's placement.

Every run has the headline's shape: a random qwen3_moe with 64 experts and top-8 routing, loaded by a hub
name (ulorl-check/moe64) from a Hugging Face cache this script builds (HF_HUB_OFFLINE=1); YaRN over 8192
positions x 4 = 32768, the engine's max_model_len (64 prompt + 32704 response tokens in 64 segments);
bf16; --preset ulorl with every value the run depends on passed as a flag; the engine/trainer gap check
(the KL between their log-probs on freshly sampled tokens) at its defaults. A run passes when train.py exits 0 (it stops itself when the check fails), the gap was
measured after a weight sync and stayed under the default stop threshold, and training moved the weights.

Prints one JSON line per run (gap statistics, sync seconds, tokens/s, peak MiB per GPU, seconds to the first
step, how far the weights moved), then a summary line; exits 1 when a run fails.

    bash tests/gpu/check.sh                       # every visible GPU; needs vllm==0.32.0
    bash tests/gpu/check.sh --gpus 1              # the colocated placement alone: under 10 minutes (--timeout 540 a run)
    bash tests/gpu/check.sh --dry-run --gpus 8    # the commands for 8 GPUs, one a line; no GPU, no models
"""
import argparse
import dataclasses
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HUB = {"moe": "ulorl-check/moe64", "dense": "ulorl-check/dense"}  # hub-style names, served from the local cache
# Small, but with the headline's routing (qwen3_moe, 64 experts, top-8, normalised top-k weights) and heads
# that split over TP 2 (Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts).
SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             rope_theta=1e6, max_position_embeddings=8192)
MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, intermediate_size=768,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
           output_router_logits=False)
DENSE = dict(intermediate_size=768, tie_word_embeddings=True)
YARN = 4  # x 8192 = 32768 positions
PROMPT_LEN, RESPONSE_LEN, SEGMENTS = 64, 32704, 64  # 64 + 32704 = 32768: a sample at the cap fits the engine
TEMPERATURE, LR, STEPS = 0.85, 1e-5, 4  # at 1e-4 one AdamW step reshapes a random model
MEAN_LEN = 256  # eos_bias sets P(EOS) ~ 1/MEAN_LEN a token: responses of ~MEAN_LEN tokens on average, geometric
GAP_KEYS = ("rollout/engine_kl", "rollout/logprob_diff_mean", "rollout/logprob_diff_p99", "rollout/logprob_diff_max")


# ----------------------------------------------------------------------------- placements and commands

@dataclasses.dataclass
class Run:
    placement: str
    model: str  # "moe" or "dense"
    gpus: list[str]  # CUDA_VISIBLE_DEVICES entries of this run
    cmd: list[str]
    env: dict  # what the run needs over the check's own environment
    out: str


def engine_tp(engine_gpus: int) -> int:
    """The largest tensor-parallel size up to `engine_gpus` that divides both models' attention and KV heads."""
    return max(t for t in range(1, engine_gpus + 1)
               if SHAPE["num_attention_heads"] % t == 0 and SHAPE["num_key_value_heads"] % t == 0)


def placement(n: int) -> tuple[str, int, list[str]]:
    """(name, GPUs used, trainer launcher + placement flags) of the placement for `n` GPUs; the trainer
    command follows the launcher."""
    if n >= 4:
        return "fsdp", 4, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
                           "--parallel", "fsdp", "--rollout-gpus", "2,3", "--rollout-tp", "2", "--dist-timeout", "600"]
    if n >= 2:
        tp = engine_tp(n - 1)
        return "split", 1 + tp, ["train.py", "--rollout-gpus", ",".join(str(g) for g in range(1, 1 + tp)),
                                 "--rollout-tp", str(tp)]
    return "colocated", 1, ["train.py"]


def train_flags(model: str, data: str, out: str) -> list[str]:
    """train.py's flags past the placement: the ulorl preset at small size, every value the run depends on
    given (a hub name alone implies the preset). The gap flags and --rollout-mem are left to their
    defaults on purpose: the check is of those."""
    return ["--preset", "ulorl", "--model", HUB[model], "--engine", "vllm", "--device", "cuda", "--dtype", "bfloat16",
            "--data", data, "--prompt-key", "prompt", "--answer-key", "answer", "--default-verifier", "ifeval",
            "--eval-data", "", "--eval-every", "0", "--out", out, "--seed", "0", "--steps", str(STEPS),
            "--rope-scaling-factor", str(YARN), "--rope-original-max-positions", str(SHAPE["max_position_embeddings"]),
            "--max-prompt-len", str(PROMPT_LEN), "--max-response-len", str(RESPONSE_LEN), "--segments", str(SEGMENTS),
            # as many groups trained as in flight: every step trains tokens the newest weights sampled, so the
            # gap is measured after each sync (fewer would leave steps that train only groups made before it)
            "--group-size", "8", "--prompts-per-step", "8", "--train-groups", "8", "--mini-batch", "0",
            "--temperature", str(TEMPERATURE), "--lr", str(LR), "--lr-final", "1", "--warmup-steps", "0",
            "--weight-decay", "0", "--grad-clip", "1", "--eps-low", "0.2", "--eps-high", "0.2", "--clip-ratio-c", "3",
            "--is-mode", "pois", "--mpt", "dynamic", "--mpt-tau", "0.99", "--mpt-sigma", "0.2", "--kl-coef", "0",
            "--tis-cap", "0", "--overlong", "zero", "--dynamic-sampling", "true",
            "--max-tokens-per-micro-batch", "65536", "--gradient-checkpointing", "true", "--pack", "false",
            "--attn-implementation", "sdpa", "--save-every", "0", "--dump-samples", "16", "--report-to", "none"]


def plan_runs(visible: list[str], work: str, python: str = sys.executable) -> list[Run]:
    """The runs on the GPUs `visible` (CUDA_VISIBLE_DEVICES entries): the MoE model in their count's
    placement, the dense model in the placement of those left idle, if any. Their GPUs never overlap, so
    they run at the same time."""
    runs, free = [], list(visible)
    for model in ("moe", "dense"):
        if not free:
            break
        name, used, launcher = placement(len(free))
        gpus, free = free[:used], free[used:]
        out = os.path.join(work, "runs", f"{name}_{model}")
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # nvidia-smi's numbering
               "HF_HOME": os.path.join(work, "hf"), "HF_HUB_CACHE": os.path.join(work, "hf", "hub"),
               "HF_HUB_OFFLINE": "1"}
        runs.append(Run(name, model, gpus, [python, *launcher, *train_flags(model, os.path.join(work, "data.jsonl"),
                                                                            out)], env, out))
    return runs


def shell_line(run: Run) -> str:
    """The run as one shell line from the project's root: its environment, then its command, quoted."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in run.env.items()] + [shlex.quote(c) for c in run.cmd])


# ----------------------------------------------------------------------------------- models and data

def eos_bias(model, eos_id: int, vocab: int) -> None:
    """Give a random model a per-token EOS probability of about 1 / MEAN_LEN at TEMPERATURE, so that response
    lengths are geometric: most groups finish within one or two 511-token segments and a tail runs over
    several (a random model's EOS has p ~ 1/vocabulary, here 1/17: every response would end in one segment).
    Residual dimension 0 carries a constant (every token embedding's entry 0), which no layer reads (their
    norms weigh it 0) or writes (the rows of o_proj and down_proj that add to it are 0), and the final norm
    passes on; the EOS row of the lm_head reads it, so the EOS logit hardly depends on the context. That
    row's weight is found by bisection over random contexts."""
    import torch
    lm_head, inner, hidden = model.get_output_embeddings().weight, model.model, model.config.hidden_size
    with torch.no_grad():
        inner.embed_tokens.weight[:, 0] = 1.0
        for layer in inner.layers:
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
            for name, w in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    assert w.shape[-2] == hidden, f"{name} {tuple(w.shape)}: its output rows are not dimension -2"
                    w.select(-2, 0).zero_()  # [out, in] or [experts, out, in]
        ids = torch.randint(0, vocab - 1, (2, 128))
        ids = ids + (ids >= eos_id).long()  # any token but EOS: a response never holds one before its end
        h = inner(input_ids=ids).last_hidden_state.float()  # [B, T, H], after the final norm
        assert h[..., 0].min() > 0, "the constant of residual dimension 0 did not reach the lm_head"
        logits = h @ lm_head.float().T  # [B, T, V]
        others = torch.cat([logits[..., :eos_id], logits[..., eos_id + 1:]], -1) / TEMPERATURE
        base = logits[..., eos_id] - h[..., 0] * lm_head[eos_id, 0].float()  # the EOS logit without its dim-0 term

        def p_eos(w: float) -> float:  # mean P(EOS) with weight w at dimension 0 of the EOS row
            eos = (base + w * h[..., 0]) / TEMPERATURE
            return torch.sigmoid(eos - torch.logsumexp(others, -1)).mean().item()

        lo, hi = -100.0, 100.0  # h[..., 0] > 0 everywhere: P(EOS) rises with w
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if p_eos(mid) < 1 / MEAN_LEN else (lo, mid)
        lm_head[eos_id, 0] = (lo + hi) / 2


def make_models(work: str, which=("moe", "dense")) -> str:
    """The random models under their hub names in a Hugging Face cache at `work`/hf (the hub's layout:
    hub/models--ORG--NAME/snapshots/<commit>/ and refs/main), bf16 like a released checkpoint, with the tiny
    tokenizer. Returns that HF_HOME."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    sys.path.insert(0, ROOT)
    import tiny
    tok = tiny.make_tokenizer()
    hf_home = os.path.join(work, "hf")
    for kind in which:
        torch.manual_seed(0)
        common = dict(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **SHAPE)
        model = (Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, **common)) if kind == "moe" else
                 Qwen3ForCausalLM(Qwen3Config(**DENSE, **common)))
        eos_bias(model.eval(), tok.eos_token_id, len(tok))
        repo = os.path.join(hf_home, "hub", "models--" + HUB[kind].replace("/", "--"))
        staging = os.path.join(repo, "staging")
        shutil.rmtree(staging, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(staging)
        tok.save_pretrained(staging)
        digest = hashlib.sha1()  # the commit: 40 hex digits, here a hash of the files
        for name in sorted(os.listdir(staging)):
            with open(os.path.join(staging, name), "rb") as f:
                digest.update(name.encode() + f.read())
        commit = digest.hexdigest()
        snapshot = os.path.join(repo, "snapshots", commit)
        shutil.rmtree(snapshot, ignore_errors=True)
        os.makedirs(os.path.dirname(snapshot), exist_ok=True)
        os.replace(staging, snapshot)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(commit)
    return hf_home


def snapshot_dir(hf_home: str, name: str) -> str:
    """The folder refs/main names in the cache: the files transformers and vLLM load for `name`."""
    repo = os.path.join(hf_home, "hub", "models--" + name.replace("/", "--"))
    with open(os.path.join(repo, "refs", "main")) as f:
        return os.path.join(repo, "snapshots", f.read().strip())


def make_data(path: str) -> str:
    """Prompts rewarded for starting with one of 4 of the tokens (a quarter point): a group of 8 random
    responses rarely agrees, so updates move, and the reward does not touch the length, so the long tail
    stays (a length reward taught the random model to stop at once within one step)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(256):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(2, 6))) + "="
            starts = [{"type": "starts_with", "phrase": d} for d in rng.sample("0123456789", 4)]
            f.write(json.dumps({"prompt": prompt, "answer": starts, "verifier": "ifeval"}) + "\n")
    return path


def gpu_memory(used: dict) -> None:
    """Every GPU's memory in use now (MiB) into `used`, by nvidia-smi index and UUID, keeping the largest."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for line in out.strip().splitlines():
        try:
            index, uuid, mib = (x.strip() for x in line.split(","))
            for key in (index, uuid):
                used[key] = max(used.get(key, 0), int(mib))
        except ValueError:
            pass


def first_step(metrics: str) -> bool:
    """Whether metrics.jsonl holds a training step's record yet (step >= 1; step 0 is the evaluation)."""
    try:
        with open(metrics) as f:
            return any(json.loads(line).get("step", 0) >= 1 for line in f if line.endswith("\n"))
    except (OSError, ValueError):
        return False


def execute(runs: list[Run], timeout: float) -> list[dict]:
    """Start the runs together (their GPUs are disjoint), each in a process group of its own, killed whole at
    `timeout` seconds, when it ends (what it left behind: vLLM's engine, reward workers) or when the check is
    interrupted; meanwhile watch GPU memory and each run's first step record. Returns their results."""
    procs, peaks, first, ended, timed_out = {}, {}, {}, {}, set()
    t0 = time.time()
    try:
        for r in runs:
            shutil.rmtree(r.out, ignore_errors=True)  # a --work used before: train.py would refuse the old --out
            os.makedirs(r.out)
            with open(os.path.join(r.out, "stdout.log"), "w") as out, \
                    open(os.path.join(r.out, "stderr.log"), "w") as err:
                procs[r.out] = subprocess.Popen(r.cmd, cwd=ROOT, env={**os.environ, **r.env}, stdout=out, stderr=err,
                                                start_new_session=True)
        while len(ended) < len(runs):
            gpu_memory(peaks)
            for r in runs:
                if r.out in ended:
                    continue
                done = procs[r.out].poll() is not None  # before the look at metrics.jsonl: its last record counts
                if r.out not in first and first_step(os.path.join(r.out, "metrics.jsonl")):
                    first[r.out] = time.time() - t0
                if done:
                    ended[r.out] = time.time() - t0
                    kill_group(procs[r.out])
                elif time.time() - t0 > timeout:
                    timed_out.add(r.out)
                    kill_group(procs[r.out])
            time.sleep(0.5)
    finally:
        for p in procs.values():
            kill_group(p)
    return [result(r, procs[r.out].returncode, r.out in timed_out, first.get(r.out), peaks, ended[r.out], timeout)
            for r in runs]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group: torchrun's ranks, vLLM's engine processes, reward workers."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def gap_stop() -> tuple[str, float]:
    """(metric, threshold): the engine/trainer statistic train.py stops on, and its ceiling's default."""
    sys.path.insert(0, ROOT)
    import config
    return "rollout/engine_kl", {f.name: f.default for f in dataclasses.fields(config.Config)}["max_engine_kl"]


def weights_moved(hf_home: str, run: Run) -> float | None:
    """The largest change of any weight between the model as released and the run's last checkpoint."""
    import glob
    from safetensors.torch import load_file
    start, end = {}, {}
    for tensors, folder in ((start, snapshot_dir(hf_home, HUB[run.model])),
                            (end, os.path.join(run.out, f"step_{STEPS:06d}"))):
        for path in glob.glob(os.path.join(folder, "*.safetensors")):
            tensors.update(load_file(path))
    common = start.keys() & end.keys()
    if not common:
        return None
    return max((start[k].float() - end[k].float()).abs().max().item() for k in common)


def result(run: Run, rc: int, timed_out: bool, first_step_s, peaks: dict, wall: float, timeout: float) -> dict:
    """One run's JSON line, with why it failed (`error`: the stderr tail when train.py did)."""
    out = {"placement": run.placement, "model": HUB[run.model], "gpus": run.gpus, "ok": False, "error": None}
    try:
        with open(os.path.join(run.out, "metrics.jsonl")) as f:
            recs = [r for r in map(json.loads, f) if r.get("step", 0) >= 1]
    except (OSError, ValueError):
        recs = []

    def values(key):
        return [r[key] for r in recs if isinstance(r.get(key), (int, float))]

    gaps = {k: max(values(k)) for k in GAP_KEYS if values(k)}  # the worst step's
    syncs, speeds, trainer_peaks = values("time/sync_s"), values("tokens/per_s"), values("memory/gpu_peak_mib")
    out.update(steps=len(recs), gap=gaps, sync_s=round(sum(syncs) / len(syncs), 3) if syncs else None,
               tokens_per_s=round(sum(speeds) / len(speeds)) if speeds else None,
               peak_mib_per_gpu={g: peaks.get(g) for g in run.gpus},
               trainer_peak_mib=round(max(trainer_peaks)) if trainer_peaks else None,
               first_step_s=round(first_step_s, 1) if first_step_s is not None else None, wall_s=round(wall, 1),
               weights_moved=None)
    with open(os.path.join(run.out, "stderr.log"), errors="replace") as f:
        tail = f.read()[-3000:]
    if timed_out:
        out["error"] = f"timed out after {timeout:.0f} s (--timeout); stderr tail:\n{tail}"
    elif rc != 0:
        out["error"] = f"exit status {rc}; stderr tail:\n{tail}"
    else:
        hf_home = run.env["HF_HOME"]
        out["weights_moved"] = moved = weights_moved(hf_home, run)
        key, limit = gap_stop()
        if len(recs) < STEPS:
            out["error"] = f"train.py exited 0 after {len(recs)} of {STEPS} steps"
        elif moved is None:
            out["error"] = f"no weight of {HUB[run.model]} in the checkpoint step_{STEPS:06d} to compare"
        elif moved < LR / 2:  # one AdamW step moves a weight with a gradient by about the learning rate
            out["error"] = f"training did not move the weights: the largest change is {moved:.3g} < lr/2"
        elif not any(r.get(key) is not None for r in recs if r["step"] >= 2):
            out["error"] = f"the engine/trainer gap was never measured after a weight sync ({key} null)"
        elif limit and gaps[key] > limit:
            out["error"] = f"{key} {gaps[key]:.3g} over the default stop threshold {limit}"
        else:
            out["ok"] = True
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use, the first N visible (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, one a line, and exit: no GPU needed")
    p.add_argument("--work", default="", help="folder for the models, data and runs (default: a new temporary one)")
    p.add_argument("--timeout", type=float, default=540, help="seconds a run may take before it is killed")
    args = p.parse_args()
    if args.dry_run:
        if args.gpus < 1:
            p.error("--dry-run needs --gpus N (N >= 1)")
        work = args.work or os.path.join(tempfile.gettempdir(), "ulorl_gpu_check")
        for run in plan_runs([str(i) for i in range(args.gpus)], work):
            print(shell_line(run))
        return 0
    import torch
    detected = torch.cuda.device_count()
    if not detected:
        print(json.dumps({"check": "gpu", "ran": False, "why": "no CUDA GPU"}))
        return 1
    if not 0 <= args.gpus <= detected:
        p.error(f"--gpus {args.gpus}: this machine shows {detected} GPU(s)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [g.strip() for g in visible.split(",")][:detected] if visible else [str(i) for i in range(detected)]
    visible = visible[:args.gpus or detected]
    work = args.work or tempfile.mkdtemp(prefix="ulorl_gpu_check_")
    runs = plan_runs(visible, work)
    t0 = time.time()
    make_models(work, [r.model for r in runs])
    make_data(os.path.join(work, "data.jsonl"))
    build_s = time.time() - t0
    results = execute(runs, args.timeout)
    for r in results:
        print(json.dumps(r), flush=True)
    failed = [f"{r['placement']}/{r['model']}" for r in results if not r["ok"]]
    print(json.dumps({"check": "gpu", "gpus": len(visible), "name": torch.cuda.get_device_name(0),
                      "ok": not failed, "failed": failed, "runs": len(results), "build_s": round(build_s, 1),
                      "wall_s": round(time.time() - t0, 1), "work": work}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
