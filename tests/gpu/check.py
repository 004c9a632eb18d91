"""The GPU check: the attention kernels the trainer runs on packed rows, then the headline run (`torchrun
--nproc-per-node 6 train.py --preset ulorl --model Qwen/Qwen3-30B-A3B --rollout-gpus 6,7`) at small size, through
the real entry point, with the placement the GPUs present allow. Not run on a GPU yet: its time estimates are
guesses until it has.

The kernel check comes first, on the first GPU, in a process of its own (its CUDA memory is gone before the runs
start; seconds of GPU time). On one packed row of 1000 + 3000 + 12000 tokens with Qwen3-30B-A3B's attention
(32 query heads, 4 KV heads of 128, bf16), seqpar._attend's varlen kernel (torch's FlashAttention for packed
sequences, what the trainer runs on GPU) against its sdpa one (a block-diagonal causal [L, L] mask, the CPU
path): the output and the gradients of q, k and v (the backward of a random projection of the output) agree
within 2e-2 (KERNEL_RTOL), both as the largest difference over the reference's largest magnitude and in norm.
Then varlen alone on a row of 131072 tokens, where the mask alone would take 16 GiB: it must run, its extra peak
memory stay under that mask's size, and it must agree with sdpa run on each sequence by itself (causal, no mask).
Each kernel's peak CUDA memory above its inputs and its seconds (forward + backward) are reported.

Placements of the training runs, by the number N of GPUs used (those visible; --gpus N takes the first N):
  fsdp       N >= 4: torchrun, 2 FSDP2 trainer ranks on cuda:0,1 (fp32 masters, bf16 compute) and vLLM
             tensor-parallel over cuda:2,3 in a process of its own; weights by NCCL broadcast from rank 0.
             Packed rows through the varlen kernel, as the ulorl preset trains.
             Checks sharded loading from a hub name, the per-layer gathers, NCCL sync into a TP engine.
  split      N = 2-3: one trainer process on cuda:0, vLLM on the others (TP 2 on 3 GPUs, 1 on 2); NCCL.
             Checks the engine on GPUs of its own without torchrun. Unpacked rows through sdpa.
  colocated  N = 1: one trainer process, vLLM on the same GPU, asleep during the update; CUDA IPC.
             Checks sleep/wake and IPC sync with a long-context KV cache beside the trainer. Packed rows
             through the varlen kernel (a one-GPU machine trains as the preset does).
  overlap    the overlap run alone (see below), N >= 2: one trainer process on cuda:0 with --overlap 1, and on
             GPUs of their own two data-parallel vLLM engines of TP 1 on cuda:1,2 (N >= 3: --rollout-gpus 1,2
             --rollout-tp 1, which train.py makes --rollout-replicas 2) or one on cuda:1 (N = 2); NCCL. Packed
             rows through the varlen kernel. None on N = 1: --overlap refuses an engine on the trainer's GPU.
The MoE model runs in N's placement. The dense model (tied embeddings) runs only where it costs no time: on
the GPUs that placement leaves idle (N >= 5), at the same time, in the spare count's placement.

On N >= 4 a second phase follows the first: its fsdp runs again, in the same placement, with --sp 2 (Ulysses
sequence parallelism: the two trainer ranks form one group, each holding half of every packed row; attention
between all-to-alls) and --offload-optimizer true (FSDP2's CPUOffloadPolicy: masters, gradients and AdamW in
host memory). Checks that the all-to-alls, the group's sums and the host-memory optimizer train as the first
phase does, and what they cost in step time against what they save in GPU memory.

Then rollout routing replay: the MoE model's colocated run, shorter (ROUTING_STEPS steps), twice, with
--routing-replay true (vLLM returns every token's experts, through its V2 model runner; the trainer's forwards
use them) and --routing-replay record (the same routing kept and compared, never replayed: the baseline without
replay, its mismatch still measured). Colocated is the placement every GPU count has, so the comparison is the
same on all; the two run at the same time on two GPUs the last phase leaves idle (N = 6-7: no time added),
else in a phase of their own after it (N >= 2), else one after the other on the one GPU (a phase each). Each
run's line has the mean and largest over its steps of rollout/routing_mismatch (the share of (token, layer)
decisions where the trainer's router picks other experts than the engine's), rollout/engine_kl and
rollout/logprob_diff_max; the summary has them side by side, and the comparison fails when either run does,
when the mismatch was not measured, or when replay's engine_kl is over REPLAY_KL_RATIO times record's.

Last, the overlap run: the MoE model in the overlap placement, OVERLAP_STEPS steps, with --overlap 1 (while the
trainer updates, the engine decodes the next step's rollout with the weights before the update, so its
tokens are one version old; it ends before the weight sync). Checks rollout
overlapped with training on GPUs, and on 3+ GPUs engine replicas (each round's samples split over two engines,
every weight sync reaching both). Its GPUs' count is set by N alone (3 on N >= 3, 2 on N = 2), so that every
machine that can run replicas does; it runs in the last phase when that leaves as many GPUs idle (N = 5, 8: no
time added), else in a phase of its own after it (N = 2-4, 6-7). Besides the common criteria (below) it passes
when staleness/engine_lag (in every step's record: how many versions behind the trainer's the weights that
decoded the step's rounds were) is at most 1 on every step and 1 on a step after the first (step 1 decodes its
rollout itself), and with replicas when rollout/replica_idle (the share of the replicas' time spent waiting
for the slowest) is in every step's record and in [0, 1). Its line has the largest engine_lag, the mean
time/engine_wait_s (how long the trainer waited for the engine's rollout after its update) and the mean
replica_idle beside its step_s; the summary repeats them, or says why there was no overlap run.

Every run has the headline's shape: a random qwen3_moe with 64 experts and top-8 routing, loaded by a hub
name (ulorl-check/moe64) from a Hugging Face cache this script builds (HF_HUB_OFFLINE=1); YaRN over 8192
positions x 4 = 32768, the engine's max_model_len (64 prompt + 32704 response tokens in 64 segments);
bf16; --preset ulorl with every value the run depends on passed as a flag; the engine/trainer gap check
(the KL between their log-probs on freshly sampled tokens) at its defaults. A run passes when train.py exits 0 (it stops itself when the check fails), the gap was
measured after a weight sync and stayed under the default stop threshold, and training moved the weights (the
routing pair and the overlap run have criteria of their own on top).

Prints the kernel check's JSON line, then one per run (gap statistics, sync seconds, tokens/s, seconds a step
and of it outside rollout and sync, peak MiB per GPU, seconds to the first step, how far the weights moved),
then a summary line (the routing-replay comparison and the overlap run's figures in it); exits 1 when the
kernel check, a run or the comparison fails.

    bash tests/gpu/check.sh                       # every visible GPU; needs vllm==0.32.0; on 4+ GPUs 3 phases
                                                  # (4 on 4 GPUs), the routing pair and the overlap run among them:
                                                  # up to ~30 minutes (--timeout 540 a run)
    bash tests/gpu/check.sh --gpus 1              # the colocated placement alone, then the routing-replay pair one
                                                  # after the other, no overlap run: under 15 minutes
    bash tests/gpu/check.sh --dry-run --gpus 8    # the commands for 8 GPUs, one a line; no GPU, no models
    bash tests/gpu/check.sh --kernel              # the kernel check alone (one GPU, seconds)
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
# The trainer's rows, parallelism, routing and overlap, by variant (always given: the ulorl preset leaves --sp
# and --offload-optimizer to the memory plan). "unpacked": padded rows through sdpa (split). "packed": packed
# rows through the varlen kernel, as the preset trains (fsdp, colocated). "sp2_offload": that with Ulysses sequence parallelism
# over the two trainer ranks and FSDP2's optimizer offload (fsdp, second phase). "replay" and "record": packed,
# with the engine's experts replayed in the trainer's forwards, or only kept and compared (the routing pair).
# "overlap": packed, with the next step's rollout decoded during the update (the overlap run).
PACKED = {"--pack": "true", "--attn-implementation": "varlen", "--sp": "1", "--offload-optimizer": "false"}
VARIANTS = {
    "unpacked": {"--pack": "false", "--attn-implementation": "sdpa", "--sp": "1", "--offload-optimizer": "false",
                 "--routing-replay": "false", "--overlap": "0"},
    "packed": {**PACKED, "--routing-replay": "false", "--overlap": "0"},
    "sp2_offload": {"--pack": "true", "--attn-implementation": "varlen", "--sp": "2", "--offload-optimizer": "true",
                    "--routing-replay": "false", "--overlap": "0"},
    "replay": {**PACKED, "--routing-replay": "true", "--overlap": "0"},
    "record": {**PACKED, "--routing-replay": "record", "--overlap": "0"},
    "overlap": {**PACKED, "--routing-replay": "false", "--overlap": "1"},
}
# The routing pair: its variants (replay first), its steps (step 1 on the weights both engine and trainer loaded,
# the others after a weight sync: the routing the engine returns must follow the synced weights) and what its
# lines and the summary compare.
ROUTING_VARIANTS, ROUTING_STEPS = ("replay", "record"), 3
ROUTING_KEYS = ("rollout/routing_mismatch", "rollout/engine_kl", "rollout/logprob_diff_max")
# Replay must not widen the engine/trainer gap: the comparison fails when replay's mean engine_kl is over
# REPLAY_KL_RATIO times record's (or over that times REPLAY_KL_FLOOR, when record's is below it). Replaying the
# engine's experts removes the routing part of the gap (where the trainer's router, at a near-tie in bf16, picks
# other top-8 experts than the engine's, the token goes through other MLPs) and leaves the rest (bf16 rounding in
# attention and the matmuls) as it is, so replay's KL should be record's or less. The two runs sample the same
# first step (same seed and weights) but differ after the first update, and a few steps' KL is noisy (its tail
# tokens dominate it): 2x leaves room for that, while replayed experts that are wrong (off by a position, a layer
# or a sample) give a random model's MLP output on those tokens, a KL many times record's. Below the floor
# (engine_gap.KL_FLOOR, bf16 noise's reach on a small model) both are noise, and their ratio says nothing.
REPLAY_KL_RATIO, REPLAY_KL_FLOOR = 2.0, 5e-5
# The overlap run's steps: step 1 decodes its rollout itself (engine_lag 0); steps 2 and 3 train the rollout
# decoded during the update before them, one version old (engine_lag 1), and the gap check measures the probe each
# engine decodes on the weights synced after that update. Then the step records' metrics its criteria and figures
# read: the lag, the trainer's wait for that rollout, the replicas' idle share.
OVERLAP_STEPS = 3
OVERLAP_LAG, ENGINE_WAIT, REPLICA_IDLE = "staleness/engine_lag", "time/engine_wait_s", "rollout/replica_idle"


# ----------------------------------------------------------------------------- placements and commands

@dataclasses.dataclass
class Run:
    placement: str
    model: str  # "moe" or "dense"
    gpus: list[str]  # CUDA_VISIBLE_DEVICES entries of this run
    cmd: list[str]
    env: dict  # what the run needs over the check's own environment
    out: str
    variant: str = ""  # a key of VARIANTS
    steps: int = STEPS  # its --steps


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


def train_flags(model: str, data: str, out: str, variant: str, steps: int = STEPS) -> list[str]:
    """train.py's flags past the placement: the ulorl preset at small size, every value the run depends on
    given (a hub name alone implies the preset), the rows, parallelism and routing of `variant` (VARIANTS). The
    gap flags and --rollout-mem are left to their defaults on purpose: the check is of those."""
    return ["--preset", "ulorl", "--model", HUB[model], "--engine", "vllm", "--device", "cuda", "--dtype", "bfloat16",
            "--data", data, "--prompt-key", "prompt", "--answer-key", "answer", "--default-verifier", "ifeval",
            "--eval-data", "", "--eval-every", "0", "--out", out, "--seed", "0", "--steps", str(steps),
            "--rope-scaling-factor", str(YARN), "--rope-original-max-positions", str(SHAPE["max_position_embeddings"]),
            "--max-prompt-len", str(PROMPT_LEN), "--max-response-len", str(RESPONSE_LEN), "--segments", str(SEGMENTS),
            # as many groups trained as in flight: every step trains tokens the newest weights sampled, so the
            # gap is measured after each sync (fewer would leave steps that train only groups made before it)
            "--group-size", "8", "--prompts-per-step", "8", "--train-groups", "8", "--mini-batch", "0",
            "--temperature", str(TEMPERATURE), "--lr", str(LR), "--lr-final", "1", "--warmup-steps", "0",
            "--weight-decay", "0", "--grad-clip", "1", "--eps-low", "0.2", "--eps-high", "0.2", "--clip-ratio-c", "3",
            "--is-mode", "pois", "--mpt", "dynamic", "--mpt-tau", "0.99", "--mpt-sigma", "0.2", "--kl-coef", "0",
            "--tis-cap", "0", "--overlong", "zero", "--dynamic-sampling", "true",
            "--max-tokens-per-micro-batch", "65536", "--gradient-checkpointing", "true", "--save-every", "0",
            "--dump-samples", "16", "--report-to", "none", *(w for kv in VARIANTS[variant].items() for w in kv)]


def plan_runs(visible: list[str], work: str, python: str = sys.executable) -> list[list[Run]]:
    """The runs on the GPUs `visible` (CUDA_VISIBLE_DEVICES entries), in phases that run one after the other.
    Phase 1: the MoE model in their count's placement, the dense model in the placement of those left idle, if
    any; their GPUs never overlap, so they run at the same time. Phase 2, where phase 1 has fsdp runs: those
    again on the same GPUs with sequence parallelism and the optimizer in host memory (sp2_offload). Then the
    routing pair (routing_pair), then the overlap run (overlap_run)."""
    first, free = [], list(visible)
    for model in ("moe", "dense"):
        if not free:
            break
        name, used, launcher = placement(len(free))
        gpus, free = free[:used], free[used:]
        first.append(make_run(name, model, gpus, launcher, "unpacked" if name == "split" else "packed", work, python))
    second = [make_run(r.placement, r.model, r.gpus, placement(len(r.gpus))[2], "sp2_offload", work, python)
              for r in first if r.placement == "fsdp"]
    phases = routing_pair([first, second] if second else [first], visible, work, python)
    return overlap_run(phases, visible, work, python)


def routing_pair(phases: list[list[Run]], visible: list[str], work: str, python: str) -> list[list[Run]]:
    """`phases` with the routing pair added where it costs least: the MoE model's colocated run (one GPU each),
    ROUTING_STEPS steps, with --routing-replay true and record. Both in the last phase when it leaves two of
    `visible` idle, else both at once in a phase of their own, else (one GPU) one phase each, replay first."""
    name, _, launcher = placement(1)
    busy = {g for r in phases[-1] for g in r.gpus}
    idle = [g for g in visible if g not in busy]

    def pair(gpus):
        return [make_run(name, "moe", [g], launcher, v, work, python, ROUTING_STEPS)
                for g, v in zip(gpus, ROUTING_VARIANTS)]

    if len(idle) >= 2:
        return phases[:-1] + [phases[-1] + pair(idle)]
    if len(visible) >= 2:
        return phases + [pair(visible)]
    return phases + [[r] for r in pair(visible * len(ROUTING_VARIANTS))]


def overlap_placement(n: int) -> tuple[int, list[str]] | None:
    """(GPUs used, trainer launcher + placement flags) of the overlap run on `n` GPUs: one trainer process on
    the first, the engines on the next: two replicas of TP 1 (train.py derives --rollout-replicas 2 from
    --rollout-gpus and --rollout-tp) when n >= 3, one engine when n = 2. None on one GPU: --overlap needs the
    engine on GPUs of its own (a colocated one sleeps through the update)."""
    if n < 2:
        return None
    used = 3 if n >= 3 else 2
    return used, ["train.py", "--rollout-gpus", ",".join(str(g) for g in range(1, used)), "--rollout-tp", "1"]


def overlap_run(phases: list[list[Run]], visible: list[str], work: str, python: str) -> list[list[Run]]:
    """`phases` with the overlap run added where it costs least: the MoE model in overlap_placement, with
    --overlap 1, OVERLAP_STEPS steps. Its GPU count follows `visible` alone (so replicas run wherever 3 GPUs
    are); it goes in the last phase when that leaves as many of `visible` idle, else in a phase of its own after
    it. `phases` unchanged on one GPU."""
    plan = overlap_placement(len(visible))
    if plan is None:
        return phases
    used, launcher = plan
    busy = {g for r in phases[-1] for g in r.gpus}
    idle = [g for g in visible if g not in busy]

    def run(gpus):
        return make_run("overlap", "moe", gpus, launcher, "overlap", work, python, OVERLAP_STEPS)

    if len(idle) >= used:
        return phases[:-1] + [phases[-1] + [run(idle[:used])]]
    return phases + [[run(visible[:used])]]


def engine_count(run: Run) -> int:
    """How many vLLM engines a run starts: its --rollout-gpus over its --rollout-tp (as train.py derives
    --rollout-replicas), 1 without --rollout-gpus (colocated)."""
    if "--rollout-gpus" not in run.cmd:
        return 1
    gpus = len(run.cmd[run.cmd.index("--rollout-gpus") + 1].split(","))
    return gpus // int(run.cmd[run.cmd.index("--rollout-tp") + 1]) if "--rollout-tp" in run.cmd else 1


def make_run(name: str, model: str, gpus: list[str], launcher: list[str], variant: str, work: str,
             python: str, steps: int = STEPS) -> Run:
    """One training run: its GPUs (CUDA_VISIBLE_DEVICES), the offline Hugging Face cache, an --out of its own."""
    out = os.path.join(work, "runs", f"{name}_{variant}_{model}")
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # nvidia-smi's numbering
           "HF_HOME": os.path.join(work, "hf"), "HF_HUB_CACHE": os.path.join(work, "hf", "hub"), "HF_HUB_OFFLINE": "1"}
    cmd = [python, *launcher, *train_flags(model, os.path.join(work, "data.jsonl"), out, variant, steps)]
    return Run(name, model, gpus, cmd, env, out, variant, steps)


def kernel_command(gpu: str, python: str = sys.executable) -> tuple[dict, list[str]]:
    """(environment, command) of the kernel check: this script with --kernel, on the GPU `gpu` alone."""
    return ({"CUDA_VISIBLE_DEVICES": gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            [python, os.path.join("tests", "gpu", "check.py"), "--kernel"])


def shell_line(env: dict, cmd: list[str]) -> str:
    """A command as one shell line from the project's root: its environment, then its words, quoted."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(c) for c in cmd])


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
    """SIGKILL `proc`, its process group and every process below it: vLLM's engine processes, reward workers, and
    torchrun's ranks, which it starts in sessions of their own (a group kill left a cut check's rank on the GPU)."""
    if os.path.join(ROOT, "tests") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
    import warm  # tests/warm.py, the standard library only: its kill() walks /proc
    warm.kill(proc.pid)


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
                            (end, os.path.join(run.out, f"step_{run.steps:06d}"))):
        for path in glob.glob(os.path.join(folder, "*.safetensors")):
            tensors.update(load_file(path))
    common = start.keys() & end.keys()
    if not common:
        return None
    return max((start[k].float() - end[k].float()).abs().max().item() for k in common)


def result(run: Run, rc: int, timed_out: bool, first_step_s, peaks: dict, wall: float, timeout: float) -> dict:
    """One run's JSON line, with why it failed (`error`: the stderr tail when train.py did)."""
    out = {"placement": run.placement, "variant": run.variant, "model": HUB[run.model], "gpus": run.gpus,
           "flags": VARIANTS.get(run.variant), "ok": False, "error": None}
    try:
        with open(os.path.join(run.out, "metrics.jsonl")) as f:
            recs = [r for r in map(json.loads, f) if r.get("step", 0) >= 1]
    except (OSError, ValueError):
        recs = []

    def values(key):
        return [r[key] for r in recs if isinstance(r.get(key), (int, float))]

    gaps = {k: max(values(k)) for k in GAP_KEYS if values(k)}  # the worst step's
    syncs, speeds, trainer_peaks = values("time/sync_s"), values("tokens/per_s"), values("memory/gpu_peak_mib")
    steps = values("time/step_s")
    # a step's seconds outside the rollout and the weight sync: old/reference log-probs and the update (evaluation
    # is off; the sample dump is small), where sequence parallelism and the offloaded optimizer cost their time
    trains = [r["time/step_s"] - r["time/rollout_s"] - (r.get("time/sync_s") or 0) for r in recs
              if isinstance(r.get("time/step_s"), (int, float)) and isinstance(r.get("time/rollout_s"), (int, float))]
    out.update(steps=len(recs), gap=gaps, sync_s=round(sum(syncs) / len(syncs), 3) if syncs else None,
               tokens_per_s=round(sum(speeds) / len(speeds)) if speeds else None,
               step_s=round(sum(steps) / len(steps), 2) if steps else None,
               train_s=round(sum(trains) / len(trains), 2) if trains else None,
               peak_mib_per_gpu={g: peaks.get(g) for g in run.gpus},
               trainer_peak_mib=round(max(trainer_peaks)) if trainer_peaks else None,
               first_step_s=round(first_step_s, 1) if first_step_s is not None else None, wall_s=round(wall, 1),
               weights_moved=None)
    if run.variant in ROUTING_VARIANTS:  # the pair's figures: mean and largest over the steps that measured them
        out["routing"] = {k: {"mean": sum(values(k)) / len(values(k)), "max": max(values(k)), "steps": len(values(k))}
                          if values(k) else None for k in ROUTING_KEYS}
    replicas = engine_count(run)
    if run.variant == "overlap":  # over the steps that logged them; None where none did
        waits, idles = values(ENGINE_WAIT), values(REPLICA_IDLE)
        out["overlap"] = {"replicas": replicas, "engine_lag_max": max(values(OVERLAP_LAG), default=None),
                          "engine_wait_s": round(sum(waits) / len(waits), 3) if waits else None,
                          "replica_idle": round(sum(idles) / len(idles), 3) if idles else None}
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
        if len(recs) < run.steps:
            out["error"] = f"train.py exited 0 after {len(recs)} of {run.steps} steps"
        elif moved is None:
            out["error"] = f"no weight of {HUB[run.model]} in the checkpoint step_{run.steps:06d} to compare"
        elif moved < LR / 2:  # one AdamW step moves a weight with a gradient by about the learning rate
            out["error"] = f"training did not move the weights: the largest change is {moved:.3g} < lr/2"
        elif not any(r.get(key) is not None for r in recs if r["step"] >= 2):
            out["error"] = f"the engine/trainer gap was never measured after a weight sync ({key} null)"
        elif limit and gaps[key] > limit:
            out["error"] = f"{key} {gaps[key]:.3g} over the default stop threshold {limit}"
        elif run.variant in ROUTING_VARIANTS and (why := routing_unmeasured(recs, key)):
            out["error"] = why
        elif run.variant == "overlap" and (why := overlap_unmet(recs)):
            out["error"] = why
        elif replicas > 1 and (why := replicas_unmet(recs, replicas)):
            out["error"] = why
        else:
            out["ok"] = True
    return out


def routing_unmeasured(recs: list[dict], gap_key: str) -> str | None:
    """Why the step records `recs` of a routing-pair run lack rollout/routing_mismatch, or None. It is in every
    step's record under --routing-replay true or record, and a number wherever the gap (`gap_key`) is: both
    are of the positions the current weights sampled, where the engine returned its routing."""
    key = ROUTING_KEYS[0]
    if absent := [r["step"] for r in recs if key not in r]:
        return f"no {key} in the records of steps {absent}: the run did not keep the engine's routing"
    if null := [r["step"] for r in recs if r[key] is None and r.get(gap_key) is not None]:
        return f"{key} null at steps {null}, where {gap_key} was measured: the engine returned no routing"
    if not any(r[key] is not None for r in recs if r["step"] >= 2):
        return f"{key} was never measured after a weight sync (null)"
    return None


def overlap_unmet(recs: list[dict]) -> str | None:
    """Why the step records `recs` of the overlap run fail its criteria, or None: staleness/engine_lag in every
    step's record (train.py logs it under --overlap), never over 1 (one step's rollout in flight: its tokens one
    version old), and 1 on a step after the first (a rollout decoded during an update was trained)."""
    if absent := [r["step"] for r in recs if not isinstance(r.get(OVERLAP_LAG), (int, float))]:
        return f"no {OVERLAP_LAG} in the records of steps {absent}: the run did not overlap"
    if over := [f"{r[OVERLAP_LAG]} at step {r['step']}" for r in recs if r[OVERLAP_LAG] > 1]:
        return f"{OVERLAP_LAG} over 1 ({', '.join(over)}): tokens more than one version old were trained"
    if not any(r[OVERLAP_LAG] == 1 for r in recs if r["step"] >= 2):
        return f"{OVERLAP_LAG} never 1 after step 1: no rollout decoded during an update was trained"
    return None


def replicas_unmet(recs: list[dict], replicas: int) -> str | None:
    """Why the step records `recs` of a run with `replicas` engines lack a right rollout/replica_idle, or None:
    train.py logs it on every step with 2+ replicas, the share of their time spent waiting for the slowest,
    in [0, 1) (the slowest never waits)."""
    if absent := [r["step"] for r in recs if not isinstance(r.get(REPLICA_IDLE), (int, float))]:
        return f"no {REPLICA_IDLE} in the records of steps {absent} ({replicas} replicas)"
    if bad := [f"{r[REPLICA_IDLE]:.3g} at step {r['step']}" for r in recs if not 0 <= r[REPLICA_IDLE] < 1]:
        return f"{REPLICA_IDLE} outside [0, 1): {', '.join(bad)}"
    return None


def summarize_overlap(results: list[dict]) -> dict:
    """The summary's view of the overlap run (results' lines): ok, its figures and step_s; or that there was
    none (one GPU)."""
    run = next((r for r in results if r["variant"] == "overlap"), None)
    if run is None:
        return {"ran": False, "why": "--overlap needs the engine on GPUs of its own: 2 or more GPUs"}
    return {"ran": True, "ok": run["ok"], **(run.get("overlap") or {}), "step_s": run.get("step_s")}


def compare_routing(results: list[dict]) -> dict | None:
    """The routing pair's runs (results' lines) side by side: for each of ROUTING_KEYS, replay's figures and
    record's; ok when both runs are, each measured the mismatch, and replay's mean engine_kl is within
    REPLAY_KL_RATIO of record's (see there). None when `results` holds no routing-pair run."""
    runs = {r["variant"]: r for r in results if r["variant"] in ROUTING_VARIANTS}
    if not runs:
        return None
    figures = {v: (runs[v].get("routing") or {}) if v in runs else {} for v in ROUTING_VARIANTS}
    out = {"ok": False, "error": None, "steps": ROUTING_STEPS,
           **{k: {v: figures[v].get(k) for v in ROUTING_VARIANTS} for k in ROUTING_KEYS}}
    problems = [f"the {v} run " + ("did not run" if v not in runs else "failed") for v in ROUTING_VARIANTS
                if not runs.get(v, {}).get("ok")]
    problems += [f"{ROUTING_KEYS[0]} missing from the {v} run" for v in ROUTING_VARIANTS
                 if v in runs and not figures[v].get(ROUTING_KEYS[0])]
    kl = {v: (figures[v].get("rollout/engine_kl") or {}).get("mean") for v in ROUTING_VARIANTS}
    if None in kl.values():
        problems.append("rollout/engine_kl missing: " + ", ".join(v for v, x in kl.items() if x is None))
    elif kl["replay"] > REPLAY_KL_RATIO * max(kl["record"], REPLAY_KL_FLOOR):
        problems.append(f"replay widened the engine/trainer gap: mean rollout/engine_kl {kl['replay']:.3g} against "
                        f"record's {kl['record']:.3g}, over {REPLAY_KL_RATIO:g}x (floor {REPLAY_KL_FLOOR:g})")
    out["ok"] = not problems
    out["error"] = "; ".join(problems) or None
    return out


# ------------------------------------------------------------------------------------------- the kernel check

KERNEL_ROW = (1000, 3000, 12000)  # one packed row of 16000 tokens, where sdpa's [L, L] mask still fits
KERNEL_LONG_ROW = (2048, 30720, 98304)  # 131072 tokens: that mask alone (bool) would take 16 GiB
KERNEL_SHAPE = dict(heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B's attention
# The bf16 tolerance, for the largest difference over the reference's largest magnitude and for the difference's
# norm over the reference's. Two right kernels that accumulate in fp32 differ by the bf16 rounding of their
# outputs and of the probabilities they multiply the values by: a few 1e-3 (on the CPU, sdpa's math backend in
# bf16 is 4e-3 from fp32 at 4800 tokens; its flash backend, which sums gradients in bf16, 2.4e-2). One that
# attends across a sequence boundary or past the causal edge is off by about the output's own size (0.5-1).
KERNEL_RTOL = 2e-2


def packed_row(lengths, device: str, dtype, seed: int = 0) -> dict:
    """One packed row of sequences of `lengths`: random query, key and value in the layout the model hands its
    attention ([1, heads, L, D], views of [1, L, heads, D]), a random projection of the output (the loss is
    their dot product, so the output's gradient is the projection), and the row's sequence boundaries from its
    position ids, by seqpar.sequence_bounds as the trainer finds them."""
    import torch
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from systems import seqpar
    heads, kv_heads, dim = KERNEL_SHAPE["heads"], KERNEL_SHAPE["kv_heads"], KERNEL_SHAPE["head_dim"]
    n = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(h):
        return torch.randn(1, n, h, dim, generator=gen, device=device, dtype=dtype).transpose(1, 2)

    pos = torch.cat([torch.arange(k, device=device) for k in lengths])[None]
    cu, longest = seqpar.sequence_bounds(pos)
    return dict(q=draw(heads), k=draw(kv_heads), v=draw(kv_heads), proj=draw(heads), cu=cu, longest=longest,
                lengths=list(lengths))


def reference_backends():
    """The sdpa kernels the reference may use on a GPU: the fused ones, never the math backend, which would hold
    [heads, L, L] scores."""
    from torch.nn.attention import SDPBackend
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def attend(row: dict, kernel: str) -> dict:
    """Forward and backward of one kernel over `row`: the output, the gradients of q, k and v, the peak memory
    above what was allocated before it (MiB; None on the CPU) and the seconds. kernel: "varlen" or "sdpa"
    (seqpar._attend's), or "per_sequence": sdpa on each sequence alone with is_causal, a reference that needs no
    mask (on a GPU never the math backend, which would hold [heads, L, L] scores)."""
    import contextlib
    import torch
    from torch.nn.attention import sdpa_kernel
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from systems import seqpar
    cuda = row["q"].is_cuda
    q, k, v = (row[name].detach().requires_grad_() for name in "qkv")
    scale = KERNEL_SHAPE["head_dim"] ** -0.5
    before = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.time()
    if kernel == "per_sequence":
        bounds = row["cu"].tolist()
        # key and value heads repeated for each query head's group, not enable_gqa: of the fused kernels only
        # flash attention takes grouped heads, and it takes no fp32 (torch 2.11 on CUDA: "No available kernel"
        # for the fp32 reference, which also ended the check before its 131072-token run)
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(reference_backends()) if cuda else contextlib.nullcontext():
            out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], is_causal=True, scale=scale)
                for a, b in zip(bounds, bounds[1:])], 2)
    else:
        out = seqpar._attend(q, k, v, row["cu"], row["longest"], scale, kernel)
    (out * row["proj"]).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.time() - t0
    peak = round((torch.cuda.max_memory_allocated() - before) / 2**20) if cuda else None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "peak_mib": peak,
            "seconds": round(seconds, 3)}


def agreement(got: dict, want: dict) -> dict:
    """{output or gradient: figures} of `got` (attend's) against the reference `want`: the largest difference
    (max_abs), that over the reference's largest magnitude (max_rel), and the difference's norm over the
    reference's (rel_l2), in fp32."""
    out = {}
    for key in ("out", "dq", "dk", "dv"):
        a, b = got[key].float(), want[key].float()
        diff = a - b
        largest, norm = b.abs().max().item(), b.norm().item()
        max_abs = diff.abs().max().item()
        out[key] = {"max_abs": float(f"{max_abs:.3g}"), "max_rel": float(f"{max_abs / max(largest, 1e-30):.3g}"),
                    "rel_l2": float(f"{diff.norm().item() / max(norm, 1e-30):.3g}")}
        del a, b, diff
    return out


def disagreements(diff: dict, what: str) -> list[str]:
    """What in agreement()'s figures is over KERNEL_RTOL (or not a number)."""
    return [f"{what}: {key} differs by {d['max_rel']:.3g} of its largest magnitude and {d['rel_l2']:.3g} in norm "
            f"(tolerance {KERNEL_RTOL})" for key, d in diff.items()
            if not (d["max_rel"] <= KERNEL_RTOL and d["rel_l2"] <= KERNEL_RTOL)]


def kernel_check() -> dict:
    """The kernel check on this process's GPU (see the module's docstring): its JSON record, ok when the kernels
    agree, varlen runs at KERNEL_LONG_ROW's length and holds less there than sdpa's mask would."""
    import torch
    rec = {"check": "kernel", "ok": False, "error": None, **KERNEL_SHAPE, "dtype": "bfloat16", "rtol": KERNEL_RTOL}
    if not torch.cuda.is_available():
        rec["error"] = "no CUDA GPU"
        return rec
    rec.update(name=torch.cuda.get_device_name(0), torch=torch.__version__)
    bf16, problems = torch.bfloat16, []
    try:
        for kernel in ("varlen", "sdpa", "per_sequence"):  # the first calls load the kernels: not in the figures
            attend(packed_row((128, 384), "cuda", bf16), kernel)
        row = packed_row(KERNEL_ROW, "cuda", bf16)
        rec["cu_seqlens"] = f"{row['cu'].dtype} on {row['cu'].device}"
        if row["cu"].dtype != torch.int32 or not row["cu"].is_cuda:
            problems.append(f"seqpar.sequence_bounds gave cu_seqlens {rec['cu_seqlens']}: varlen takes int32 on the GPU")
        varlen = attend(row, "varlen")
        sdpa = attend(row, "sdpa")
        diff = agreement(varlen, sdpa)
        rec["row"] = {"lengths": row["lengths"], "tokens": sum(row["lengths"]), "diff": diff,
                      "peak_mib": {"varlen": varlen["peak_mib"], "sdpa": sdpa["peak_mib"]},
                      "seconds": {"varlen": varlen["seconds"], "sdpa": sdpa["seconds"]}}
        problems += disagreements(diff, f"varlen against sdpa at {sum(row['lengths'])} tokens")
        # figures only: each against fp32 (sdpa per sequence), to tell which kernel is off should they disagree
        exact = attend(dict(row, **{name: row[name].float() for name in ("q", "k", "v", "proj")}), "per_sequence")
        rec["row"]["diff_fp32"] = {"varlen": agreement(varlen, exact), "sdpa": agreement(sdpa, exact)}
        del row, varlen, sdpa, exact
        torch.cuda.empty_cache()
        row = packed_row(KERNEL_LONG_ROW, "cuda", bf16)
        tokens = sum(row["lengths"])
        mask_mib = round(tokens * tokens / 2**20)
        rec["long"] = {"lengths": row["lengths"], "tokens": tokens, "sdpa_mask_mib": mask_mib}
        varlen = attend(row, "varlen")
        rec["long"].update(peak_mib={"varlen": varlen["peak_mib"]}, seconds={"varlen": varlen["seconds"]})
        if varlen["peak_mib"] >= mask_mib:
            problems.append(f"varlen took {varlen['peak_mib']} MiB over its inputs at {tokens} tokens: no less than "
                            f"sdpa's [L, L] mask alone ({mask_mib} MiB)")
        reference = attend(row, "per_sequence")
        rec["long"]["peak_mib"]["per_sequence"] = reference["peak_mib"]
        rec["long"]["seconds"]["per_sequence"] = reference["seconds"]
        rec["long"]["diff"] = diff = agreement(varlen, reference)
        problems += disagreements(diff, f"varlen against sdpa on each sequence at {tokens} tokens")
    except Exception as e:  # out of memory, or a kernel refusing its arguments: the check failed, with why
        problems.append(f"{type(e).__name__}: {e}")
    rec["ok"] = not problems
    rec["error"] = "; ".join(problems) or None
    return rec


def run_kernel_check(env: dict, cmd: list[str], timeout: float) -> dict:
    """The kernel check in a process of its own (kernel_command), so that its CUDA memory is gone before the runs
    start: its JSON record, or one that says why there was none."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"check": "kernel", "ok": False, "error": f"timed out after {timeout:.0f} s (--timeout)"}
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("check") == "kernel":
            return rec
    return {"check": "kernel", "ok": False,
            "error": f"exit status {proc.returncode}, no result; stderr tail:\n{proc.stderr[-3000:]}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use, the first N visible (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, one a line, and exit: no GPU needed")
    p.add_argument("--work", default="", help="folder for the models, data and runs (default: a new temporary one)")
    p.add_argument("--timeout", type=float, default=540, help="seconds a run (or the kernel check) may take before "
                                                              "it is killed")
    p.add_argument("--kernel", action="store_true", help="the kernel check alone, on the first visible GPU: its "
                                                         "JSON line; exit 1 when it fails")
    args = p.parse_args()
    if args.kernel:
        rec = kernel_check()
        print(json.dumps(rec), flush=True)
        return 0 if rec["ok"] else 1
    if args.dry_run:
        if args.gpus < 1:
            p.error("--dry-run needs --gpus N (N >= 1)")
        work = args.work or os.path.join(tempfile.gettempdir(), "ulorl_gpu_check")
        visible = [str(i) for i in range(args.gpus)]
        print("# the kernel check: varlen against sdpa on packed rows, on one GPU in a process of its own")
        print(shell_line(*kernel_command(visible[0])))
        for i, phase in enumerate(plan_runs(visible, work), 1):
            after = f", after phase {i - 1}" if i > 1 else ""
            print(f"# phase {i}{after}: {len(phase)} run(s) at the same time, on GPUs of their own")
            for run in phase:
                print(shell_line(run.env, run.cmd))
        if overlap_placement(len(visible)) is None:
            print("# no overlap run: --overlap needs the engine on GPUs of its own (2 or more GPUs)")
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
    phases = plan_runs(visible, work)
    t0 = time.time()
    kernel = run_kernel_check(*kernel_command(visible[0]), args.timeout)
    print(json.dumps(kernel), flush=True)
    t1 = time.time()
    make_models(work, list(dict.fromkeys(r.model for phase in phases for r in phase)))
    make_data(os.path.join(work, "data.jsonl"))
    build_s = time.time() - t1
    results = []
    for phase in phases:  # one after the other: a phase's runs share no GPU, the phases do
        for r in execute(phase, args.timeout):
            print(json.dumps(r), flush=True)
            results.append(r)
    routing = compare_routing(results)
    failed = ([] if kernel["ok"] else ["kernel"]) + \
        [f"{r['placement']}/{r['variant']}/{r['model']}" for r in results if not r["ok"]] + \
        (["routing_replay"] if routing and not routing["ok"] else [])
    print(json.dumps({"check": "gpu", "gpus": len(visible), "name": torch.cuda.get_device_name(0),
                      "ok": not failed, "failed": failed, "runs": len(results), "phases": len(phases),
                      "routing_replay": routing, "overlap": summarize_overlap(results),
                      "kernel_s": round(t1 - t0, 1), "build_s": round(build_s, 1),
                      "wall_s": round(time.time() - t0, 1), "work": work}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
