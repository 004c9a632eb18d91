"""The GPU check (tests/gpu/check.py) without a GPU: the commands its dry run prints for 1, 2, 4 and 8 GPUs have
the placement of each count and the headline run's shape (a 64-expert MoE by hub name, bf16, YaRN, a 32k
engine, the gap check at its defaults), and the Hugging Face cache it builds resolves the hub name offline.

    python -m pytest tests/test_gpu_check.py -q      # ~20 s on 2 cores
"""
import importlib.util
import json
import os
import shlex
import sys

import pytest

from conftest import ROOT, run

spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tests", "gpu", "check.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def dry_run(n: int) -> list[tuple[dict, list[str], dict]]:
    """(env, command, train.py flags) of each command `check.sh --dry-run --gpus n` prints."""
    proc = run(["bash", "tests/gpu/check.sh", "--dry-run", "--gpus", str(n)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = []
    for line in proc.stdout.strip().splitlines():
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        args = words[words.index("train.py") + 1:]
        flags = {}
        for i, word in enumerate(args):
            if word.startswith("--"):
                assert word not in flags, f"{word} given twice: {line}"
                flags[word] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        out.append((env, words, flags))
    return out


def launcher(words: list[str]) -> tuple[bool, int]:
    """(under torchrun, its --nproc-per-node) of a command."""
    torchrun = "torchrun" in os.path.basename(words[0]) or "torch.distributed.run" in words
    return torchrun, int(words[words.index("--nproc-per-node") + 1]) if torchrun else 1


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_dry_run_placements(n):
    commands = dry_run(n)
    first_env, first, flags = commands[0]
    assert flags["--model"] == check.HUB["moe"], "the MoE model runs on every GPU count, first"
    torchrun, ranks = launcher(first)
    if n >= 4:  # the headline's: FSDP2 trainer ranks, the engine tensor-parallel on GPUs of its own
        assert torchrun and ranks == 2 and flags["--parallel"] == "fsdp"
        assert flags["--rollout-gpus"] == "2,3" and flags["--rollout-tp"] == "2"
        assert flags["--dist-timeout"] == "600"
        assert first_env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    elif n == 2:  # one trainer process, the engine on the other GPU
        assert not torchrun and flags["--rollout-gpus"] == "1"
        assert flags.get("--rollout-tp", "1") == "1"
        assert first_env["CUDA_VISIBLE_DEVICES"] == "0,1"
    else:  # colocated
        assert not torchrun and "--rollout-gpus" not in flags and "--rollout-tp" not in flags
        assert first_env["CUDA_VISIBLE_DEVICES"] == "0"
    used = [g for env, _, _ in commands for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert len(used) == len(set(used)) and set(used) <= {str(i) for i in range(n)}, "runs at once share no GPU"
    assert len(commands) == (2 if n == 8 else 1), "the dense model runs only on GPUs left idle"
    for env, words, flags in commands:
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == os.path.join(env["HF_HOME"], "hub")
        name = flags["--model"]
        assert "/" in name and not os.path.isabs(name) and not name.startswith("."), f"a hub-style name: {name}"
        assert flags["--engine"] == "vllm" and flags["--device"] == "cuda" and flags["--dtype"] == "bfloat16"
        assert float(flags["--rope-scaling-factor"]) > 1 and int(flags["--rope-original-max-positions"]) > 0
        positions = float(flags["--rope-scaling-factor"]) * int(flags["--rope-original-max-positions"])
        engine_len = int(flags["--max-prompt-len"]) + int(flags["--max-response-len"])
        assert engine_len >= 32768 and positions >= engine_len
        assert int(flags["--max-response-len"]) % int(flags["--segments"]) == 0
        assert not [f for f in flags if "engine-kl" in f or "logprob-gap" in f or f == "--rollout-mem"], \
            "the engine/trainer gap check and the engine's memory stay at their defaults"
        for flag in ("--preset", "--lr", "--steps", "--group-size", "--prompts-per-step", "--train-groups",
                     "--max-prompt-len", "--eval-data", "--out", "--data", "--seed", "--temperature"):
            assert flag in flags, f"{flag} is passed explicitly"
        assert flags["--eval-data"] == ""
        if launcher(words)[0]:
            assert flags["--dist-timeout"] == "600"


def test_dry_run_needs_gpus():
    proc = run(["bash", "tests/gpu/check.sh", "--dry-run"], timeout=60)
    assert proc.returncode != 0 and "--gpus" in proc.stderr


def test_hub_cache_resolves_offline(tmp_path):
    """The cache the check builds holds the MoE model under its hub name: transformers, huggingface_hub and
    (when installed) vLLM find it with HF_HUB_OFFLINE=1, with 64 experts, top-8 routing and YaRN-able positions."""
    hf_home = check.make_models(str(tmp_path), ["moe"])
    probe = """if True:
        import importlib.util, json, sys
        from huggingface_hub import snapshot_download
        from transformers import AutoConfig, AutoTokenizer
        name = sys.argv[1]
        c = AutoConfig.from_pretrained(name)
        out = dict(model_type=c.model_type, experts=c.num_experts, top_k=c.num_experts_per_tok,
                   positions=c.max_position_embeddings, rope=c.rope_parameters, heads=c.num_attention_heads,
                   kv_heads=c.num_key_value_heads, eos=c.eos_token_id,
                   tokenizer_eos=AutoTokenizer.from_pretrained(name).eos_token_id,
                   snapshot=snapshot_download(name, local_files_only=True), vllm=None)
        if importlib.util.find_spec("vllm"):
            from vllm.transformers_utils.repo_utils import get_model_path
            out["vllm"] = get_model_path(name)
        print(json.dumps(out))
    """
    env = {**os.environ, "HF_HOME": hf_home, "HF_HUB_CACHE": os.path.join(hf_home, "hub"), "HF_HUB_OFFLINE": "1"}
    proc = run([sys.executable, "-c", probe, check.HUB["moe"]], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    snapshot = check.snapshot_dir(hf_home, check.HUB["moe"])
    assert got["snapshot"] == snapshot and os.path.isfile(os.path.join(snapshot, "model.safetensors"))
    assert got["vllm"] in (None, snapshot)
    assert got["model_type"] == "qwen3_moe" and got["experts"] == 64 and got["top_k"] == 8
    assert got["heads"] % 2 == 0 and got["kv_heads"] % 2 == 0, "TP 2 splits the heads"
    assert got["rope"]["rope_theta"] and got["positions"] == check.SHAPE["max_position_embeddings"]
    assert got["positions"] * check.YARN >= check.PROMPT_LEN + check.RESPONSE_LEN >= 32768
    assert got["eos"] == got["tokenizer_eos"]


def test_runs_are_watched_and_killed(tmp_path):
    """execute: the seconds to a run's first step record, the stderr tail of a failed run, and a run past its
    time limit killed with what it started (stand-ins for train.py, which the check runs with cwd the project)."""
    writes_a_step = ("import json, sys, time; time.sleep(0.5); "
                     "open(sys.argv[1] + '/metrics.jsonl', 'w').write(json.dumps({'step': 1}) + chr(10)); "
                     "sys.exit('boom')")
    hangs = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(600)']); open(sys.argv[1] + '/child', 'w').write(str(child.pid)); time.sleep(600)")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    runs = [check.Run("colocated", "moe", ["0"], [sys.executable, "-c", writes_a_step, a], {}, a),
            check.Run("split", "dense", ["1"], [sys.executable, "-c", hangs, b], {}, b)]
    failed, hung = check.execute(runs, timeout=3)
    assert not failed["ok"] and "boom" in failed["error"] and failed["steps"] == 1
    assert 0.5 <= failed["first_step_s"] < 3
    assert not hung["ok"] and hung["error"].startswith("timed out") and hung["first_step_s"] is None
    with open(os.path.join(b, "child")) as f:
        child = int(f.read())
    try:  # gone, or a zombie waiting for init to reap it
        with open(f"/proc/{child}/stat") as f:
            assert f.read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        pass
