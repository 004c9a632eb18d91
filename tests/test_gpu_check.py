"""The GPU check (tests/gpu/check.py) without a GPU: the commands its dry run prints for 1, 2, 4 and 8 GPUs have
the placement of each count and the headline run's shape (a 64-expert MoE by hub name, bf16, YaRN, a 32k
engine, the gap check at its defaults), the kernel check first on one GPU, packed rows through varlen under
FSDP2 and a second phase with sequence parallelism and the optimizer offloaded; train.py accepts every command's
flags (its --plan); the kernel check's comparison, run on the CPU with sdpa against its per-sequence reference,
passes right boundaries and catches wrong ones; and the Hugging Face cache it builds resolves the hub name offline.

    python -m pytest tests/test_gpu_check.py -q      # ~60 s on 2 cores
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


def dry_run(n: int) -> list[tuple[int, dict, list[str], dict]]:
    """(phase, env, command, flags) of each command `check.sh --dry-run --gpus n` prints: phase 0 is the kernel
    check (its flags are check.py's), then the phases of train.py runs in the order of their "# phase" lines;
    flags are train.py's."""
    proc = run(["bash", "tests/gpu/check.sh", "--dry-run", "--gpus", str(n)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    out, phase = [], 0
    for line in proc.stdout.strip().splitlines():
        if line.startswith("#"):
            if line.startswith("# phase "):
                phase += 1
                assert line.startswith(f"# phase {phase}"), line
            continue
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        args = words[words.index("train.py" if phase else "tests/gpu/check.py") + 1:]
        flags = {}
        for i, word in enumerate(args):
            if word.startswith("--"):
                assert word not in flags, f"{word} given twice: {line}"
                flags[word] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        out.append((phase, env, words, flags))
    return out


def launcher(words: list[str]) -> tuple[bool, int]:
    """(under torchrun, its --nproc-per-node) of a command."""
    torchrun = "torchrun" in os.path.basename(words[0]) or "torch.distributed.run" in words
    return torchrun, int(words[words.index("--nproc-per-node") + 1]) if torchrun else 1


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_dry_run_placements(n):
    commands = dry_run(n)
    kernel = [c for c in commands if c[0] == 0]
    assert len(kernel) == 1 and commands[0] is kernel[0], "the kernel check comes first, once"
    _, kernel_env, kernel_cmd, kernel_flags = kernel[0]
    assert kernel_env["CUDA_VISIBLE_DEVICES"] == "0", "on one GPU"
    assert "train.py" not in kernel_cmd and "--kernel" in kernel_flags
    phases = [[c[1:] for c in commands if c[0] == p] for p in range(1, max(c[0] for c in commands) + 1)]
    assert len(phases) == (2 if n >= 4 else 1), "a second phase where there is an fsdp run"
    first_env, first, flags = phases[0][0]
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
    for phase in phases:
        used = [g for env, _, _ in phase for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
        assert len(used) == len(set(used)) and set(used) <= {str(i) for i in range(n)}, "runs at once share no GPU"
    assert len(phases[0]) == (2 if n == 8 else 1), "the dense model runs only on GPUs left idle"
    for env, words, flags in phases[0]:  # packed rows through varlen, as the preset trains; padded ones when split
        split = not launcher(words)[0] and "--rollout-gpus" in flags
        assert flags["--pack"] == ("false" if split else "true")
        assert flags["--attn-implementation"] == ("sdpa" if split else "varlen")
        assert flags["--sp"] == "1" and flags["--offload-optimizer"] == "false", "never left to the memory plan"
    if n >= 4:  # the fsdp runs again, same GPUs and placement, with SP over both ranks and the optimizer offloaded
        again = [c for c in phases[0] if launcher(c[1])[0]]
        assert len(phases[1]) == len(again) == (2 if n == 8 else 1)
        for (env, words, flags), (env1, words1, flags1) in zip(phases[1], again):
            assert env == env1 and launcher(words) == launcher(words1) == (True, 2)
            assert flags["--sp"] == "2" and flags["--offload-optimizer"] == "true"
            assert flags["--pack"] == "true" and flags["--attn-implementation"] == "varlen"
            assert flags["--out"] != flags1["--out"]
            assert {k: v for k, v in flags.items() if k not in ("--sp", "--offload-optimizer", "--out")} == \
                {k: v for k, v in flags1.items() if k not in ("--sp", "--offload-optimizer", "--out")}
    outs = [flags["--out"] for phase in phases for _, _, flags in phase]
    assert len(outs) == len(set(outs)), "every run has an --out of its own"
    for env, words, flags in (c for phase in phases for c in phase):
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
                     "--max-prompt-len", "--eval-data", "--out", "--data", "--seed", "--temperature", "--pack",
                     "--attn-implementation", "--sp", "--offload-optimizer"):
            assert flag in flags, f"{flag} is passed explicitly"
        assert flags["--eval-data"] == ""
        if launcher(words)[0]:
            assert flags["--dist-timeout"] == "600"


def test_train_accepts_the_commands(tmp_path):
    """Every kind of run the check starts (colocated, split, fsdp packed, fsdp with SP 2 and the optimizer
    offloaded) passes train.py's checks of its flags against the check's models: train.py --plan with them, as
    torchrun's rank 0 for the fsdp ones. A flag train.py refuses shows here, not on a GPU machine."""
    check.make_models(str(tmp_path), ["moe"])
    check.make_data(str(tmp_path / "data.jsonl"))
    runs = {(r.placement, r.variant): r for n in (1, 2, 4) for phase in check.plan_runs(
        [str(i) for i in range(n)], str(tmp_path)) for r in phase}
    assert set(runs) == {("colocated", "packed"), ("split", "unpacked"), ("fsdp", "packed"),
                         ("fsdp", "sp2_offload")}
    for (name, variant), r in runs.items():
        env = {**os.environ, **r.env, "CUDA_VISIBLE_DEVICES": ""}
        if name == "fsdp":
            env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="0")
        flags = r.cmd[r.cmd.index("train.py") + 1:]
        proc = run([sys.executable, "train.py", *flags, "--plan", "true"], timeout=120, env=env)
        assert proc.returncode == 0, f"{name}/{variant}: {proc.stderr[-3000:]}"
        sp, offload = check.VARIANTS[variant]["--sp"], check.VARIANTS[variant]["--offload-optimizer"]
        assert f"--sp {sp}, --offload-optimizer {offload}" in proc.stdout, proc.stdout[:500]


def test_kernel_comparison_on_cpu():
    """The kernel check's harness on the CPU (varlen needs a GPU): model._attend's sdpa kernel on a packed row in
    bf16 agrees with sdpa run on each sequence alone within KERNEL_RTOL; with the row's boundaries wrong (a
    sequence run into the next) it does not; and a NaN counts as a disagreement."""
    import torch
    row = check.packed_row((5, 17, 42, 1), "cpu", torch.bfloat16)
    assert row["cu"].tolist() == [0, 5, 22, 64, 65] and row["cu"].dtype == torch.int32 and row["longest"] == 42
    assert row["q"].shape == (1, 32, 65, 128) and not row["q"].is_contiguous(), "the model's layout: a view"
    reference = check.attend(row, "per_sequence")
    got = check.attend(row, "sdpa")
    assert got["peak_mib"] is None and got["seconds"] >= 0
    diff = check.agreement(got, reference)
    assert set(diff) == {"out", "dq", "dk", "dv"} and not check.disagreements(diff, "sdpa"), diff
    wrong = check.attend(dict(row, cu=torch.tensor([0, 5, 64, 65], dtype=torch.int32)), "sdpa")
    found = check.disagreements(check.agreement(wrong, reference), "wrong")
    assert len(found) == 4 and all(f.startswith("wrong: ") for f in found), found
    nan = {**diff, "dq": {"max_abs": float("nan"), "max_rel": float("nan"), "rel_l2": float("nan")}}
    assert len(check.disagreements(nan, "nan")) == 1


def test_kernel_check_without_a_gpu():
    """--kernel on a machine without a GPU prints its record, not ok, and exits 1 (as the whole check does)."""
    proc = run(["bash", "tests/gpu/check.sh", "--kernel"], timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["check"] == "kernel" and rec["ok"] is False and rec["error"] == "no CUDA GPU"


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
