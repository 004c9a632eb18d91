"""The GPU check: a few RL steps of small random models (dense Qwen3 and qwen3_moe) in bf16 with every
placement this machine allows, through the real entry point (train.py, --engine vllm):

  colocated  one GPU: vLLM shares the trainer's GPU and sleeps during the update; weights by CUDA IPC
  split      two GPUs or more: the trainer on cuda:0, vLLM on cuda:1 in a process of its own; NCCL

Each run must keep the engine/trainer log-prob gap on freshly sampled tokens small at every step (the
engine follows the trainer's new weights) while training moves the weights. Prints one JSON line: per run
the mean generated tokens/s, the mean weight-sync seconds, the largest gap, and each GPU's peak memory.

    bash tests/gpu/check.sh            # needs a CUDA GPU and vllm==0.32.0 (pip install vllm==0.32.0)
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import tiny  # noqa: E402

GAP = 0.25  # bf16 engine vs bf16 trainer: ~1e-2 typical, a stale or wrong engine is off by far more


def make_models(work: str) -> dict:
    """Random models big enough to exercise the GPU paths (~30M parameters), saved with the tiny tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    tok = tiny.make_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, bos_token_id=None,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    models = {"dense": Qwen3ForCausalLM(Qwen3Config(intermediate_size=1536, tie_word_embeddings=True, **common)),
              "moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=1536, moe_intermediate_size=256,
                                                        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                                        mlp_only_layers=[], tie_word_embeddings=False,
                                                        output_router_logits=False, **common))}
    paths = {}
    for name, model in models.items():
        paths[name] = os.path.join(work, name)
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    return paths


def make_data(path: str) -> str:
    """Prompts whose reward (at most 4 words) a random model meets about half the time: the updates move."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(500):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(2, 6))) + "="
            f.write(json.dumps({"prompt": prompt, "answer": [{"type": "max_words", "n": 4}], "verifier": "ifeval"}) + "\n")
    return path


def gpu_memory_peaks(stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            for line in out.strip().splitlines():
                i, used = (int(x) for x in line.split(","))
                peaks[i] = max(peaks.get(i, 0), used)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
        time.sleep(0.5)


def run(placement: str, model: str, data: str, out: str) -> dict:
    args = ["train.py", "--model", model, "--data", data, "--eval-data", "", "--engine", "vllm", "--device", "cuda",
            "--dtype", "bfloat16", "--steps", "4", "--segments", "2", "--max-response-len", "64", "--lr", "1e-4",
            "--train-groups", "8", "--prompts-per-step", "8", "--max-logprob-gap", "0", "--out", out,
            "--rollout-mem", "0.3"]
    if placement == "split":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args,
               "--rollout-gpus", "1"]
    else:
        cmd = [sys.executable, *args]
    stop, peaks = threading.Event(), {}
    watcher = threading.Thread(target=gpu_memory_peaks, args=(stop, peaks), daemon=True)
    watcher.start()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    stop.set()
    result = {"placement": placement, "model": os.path.basename(model), "ok": proc.returncode == 0,
              "wall_s": round(time.time() - t0, 1), "peak_mib_per_gpu": peaks}
    if proc.returncode != 0:
        return {**result, "error": proc.stderr[-3000:]}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    gaps = [r["rollout/logprob_diff_max"] for r in recs if r.get("rollout/logprob_diff_max") is not None]
    start, end = load_file(os.path.join(model, "model.safetensors")), load_file(os.path.join(out, "step_000004",
                                                                                              "model.safetensors"))
    moved = max((start[k].float() - end[k].float()).abs().max().item() for k in start)
    result.update(tokens_per_s=round(sum(r["tokens/per_s"] for r in recs) / len(recs)),
                  sync_s=round(sum(r.get("time/sync_s", 0) for r in recs) / len(recs), 3),
                  gap_max=max(gaps), weights_moved=moved)
    result["ok"] = bool(gaps) and max(gaps) < GAP and moved > 1e-3
    return result


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "ran": False, "why": "no CUDA GPU"}))
        return 1
    n = torch.cuda.device_count()
    work = tempfile.mkdtemp(prefix="ulorl_gpu_check_")
    models, data = make_models(work), make_data(os.path.join(work, "data.jsonl"))
    placements = ["colocated"] + (["split"] if n >= 2 else [])
    results = [run(p, models[m], data, os.path.join(work, f"{p}_{m}")) for p in placements for m in ("dense", "moe")]
    print(json.dumps({"check": "gpu", "gpus": n, "name": torch.cuda.get_device_name(0), "runs": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
