"""The GPU check (tests/gpu/check.py) without a GPU: the commands its dry run prints for 1, 2, 4 and 8 GPUs have
the placement of each count and the headline run's shape (a 64-expert MoE by hub name, bf16, YaRN, a 32k
engine, the gap check at its defaults), the kernel check first on one GPU, packed rows through varlen under
FSDP2 and a second phase with sequence parallelism and the optimizer offloaded, then the routing pair (the
MoE colocated with --routing-replay true and record, two at once where two GPUs are free, one after the other on
one); on 2, 3, 4, 6 and 8 GPUs the overlap run (--overlap 1, one trainer process, two engine replicas of TP 1 on
3+ GPUs, one engine on 2) in the last phase or after it, and none on 1; train.py accepts every command's flags
(its --plan) and derives the replicas from them, and refuses the pair's on a CPU with vLLM; the pair's
comparison and the overlap run's criteria (engine_lag, replica_idle) pass and fail as they should; the kernel
check's comparison, run on the CPU with sdpa against its per-sequence reference, passes right boundaries and
catches wrong ones; and the Hugging Face cache it builds resolves the hub name offline.

The one-GPU check (tests/gpu/h200.py) without a GPU: its dry run lists every check with its commands and
planned seconds within the deadline, and the working tree and wheels within what may travel; the wheels follow
requirements.txt; the deadline skips, and a failing check's harness fails, as they should; weight_sync imports
without vLLM; Qwen3-30B-A3B's shape is checked; and its layers and FSDP checks run end to end at toy size on the CPU.

    python -m pytest tests/test_gpu_check.py      # ~1 minute on 2 cores (the one-GPU check's tests: ~35 s)
"""
import importlib.util
import json
import os
import shlex
import sys
import time
import uuid

import pytest

from conftest import ROOT, run

CHECK_ENV = dict(os.environ, PYTHON=sys.executable)  # check.sh runs the interpreter that runs the tests
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tests", "gpu", "check.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def dry_run(n: int) -> list[tuple[int, dict, list[str], dict]]:
    """(phase, env, command, flags) of each command `check.sh --dry-run --gpus n` prints: phase 0 is the kernel
    check (its flags are check.py's), then the phases of train.py runs in the order of their "# phase" lines;
    flags are train.py's."""
    proc = run(["bash", "tests/gpu/check.sh", "--dry-run", "--gpus", str(n)], timeout=60, env=CHECK_ENV)
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
    pair = [(i, c) for i, phase in enumerate(phases) for c in phase if c[2]["--routing-replay"] != "false"]
    # a second phase where there is an fsdp run; then the routing pair, in a phase of its own (two on one GPU);
    # then the overlap run, in a phase of its own on 2 and 4 GPUs, beside the pair on 8, none on 1
    assert len(phases) == (2 if n >= 4 else 1) + (2 if n == 1 else 1) + (1 if n in (2, 4) else 0)
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
    assert [flags["--routing-replay"] for _, (_, _, flags) in pair] == ["true", "record"], "replay first"
    if n == 1:  # one after the other, a phase each, on the one GPU
        assert [i for i, _ in pair] == [1, 2] and len(phases[1]) == len(phases[2]) == 1
    else:  # at once on two GPUs, after the other runs (none idle in the last phase of 2, 4 or 8 GPUs); on 8 the
        after = 2 if n >= 4 else 1  # overlap run beside them
        assert [i for i, _ in pair] == [after] * 2 and len(phases[after]) == (3 if n == 8 else 2)
        assert [env["CUDA_VISIBLE_DEVICES"] for _, (env, _, _) in pair] == ["0", "1"]
    (_, replay), (_, record) = pair
    for env, words, flags in (replay, record):  # the MoE colocated (the placement of every count), short
        assert flags["--model"] == check.HUB["moe"] and env["CUDA_VISIBLE_DEVICES"] in ("0", "1")
        assert not launcher(words)[0] and "--rollout-gpus" not in flags and "--rollout-tp" not in flags
        assert flags["--steps"] == str(check.ROUTING_STEPS) and check.ROUTING_STEPS < check.STEPS
        assert flags["--pack"] == "true" and flags["--attn-implementation"] == "varlen"
        assert flags["--engine"] == "vllm" and flags["--dtype"] == "bfloat16"
    assert replay[2]["--out"] != record[2]["--out"]
    same = ("--routing-replay", "--out")
    assert {k: v for k, v in replay[2].items() if k not in same} == {k: v for k, v in record[2].items() if k not in same}
    if n == 1:  # the first phase's run but for its steps, --out and routing
        colocated = phases[0][0][2]
        assert colocated["--routing-replay"] == "false"
        assert {k: v for k, v in colocated.items() if k not in (*same, "--steps")} == \
            {k: v for k, v in replay[2].items() if k not in (*same, "--steps")}
    for env, words, flags in phases[0]:  # packed rows through varlen, as the preset trains; padded ones when split
        split = not launcher(words)[0] and "--rollout-gpus" in flags
        assert flags["--pack"] == ("false" if split else "true")
        assert flags["--attn-implementation"] == ("sdpa" if split else "varlen")
        assert flags["--sp"] == "1" and flags["--offload-optimizer"] == "false", "never left to the memory plan"
    others = [c for phase in phases for c in phase if c[2]["--routing-replay"] == "false"]
    assert len(others) + 2 == sum(map(len, phases)), "routing only in the pair: the other runs check the default"
    overlapped = [c for phase in phases for c in phase if c[2]["--overlap"] != "0"]
    assert len(overlapped) == (0 if n == 1 else 1), "--overlap 1 only in the overlap run"
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
                     "--attn-implementation", "--sp", "--offload-optimizer", "--routing-replay", "--overlap"):
            assert flag in flags, f"{flag} is passed explicitly"
        assert flags["--eval-data"] == ""
        if launcher(words)[0]:
            assert flags["--dist-timeout"] == "600"


def test_routing_pair_placement():
    """On every GPU count the routing pair is the MoE colocated, one GPU each, replay then record: on 6-7 GPUs in
    the second phase, beside the fsdp run on the GPUs the dense run left; else in a phase after the others,
    both at once, or on one GPU in a phase each (the overlap run may follow it, or join its phase)."""
    for n in range(1, 9):
        phases = check.plan_runs([str(i) for i in range(n)], "/w")
        pair = [(i, r) for i, phase in enumerate(phases) for r in phase if r.variant in check.ROUTING_VARIANTS]
        assert [r.variant for _, r in pair] == ["replay", "record"], n
        assert all(r.placement == "colocated" and r.model == "moe" and len(r.gpus) == 1 for _, r in pair)
        assert all(r.steps == check.ROUTING_STEPS and f"--steps {r.steps} " in " ".join(r.cmd) for _, r in pair)
        for phase in phases:
            used = [g for r in phase for g in r.gpus]
            assert len(used) == len(set(used)), f"{n} GPUs: runs at once share no GPU"
        if n == 1:
            assert len(phases) == 3 and [i for i, _ in pair] == [1, 2]
        elif n in (6, 7):
            assert [i for i, _ in pair] == [1, 1] and [r.gpus for _, r in pair] == [["4"], ["5"]]
        else:
            after = 2 if n >= 4 else 1
            assert [i for i, _ in pair] == [after] * 2
            assert {r.variant for r in phases[after]} <= {*check.ROUTING_VARIANTS, "overlap"}
            assert [r.gpus for _, r in pair] == [["0"], ["1"]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_dry_run_overlap(n):
    """The overlap run in the commands of the dry run: the MoE model, one trainer process on the first of its GPUs
    with --overlap 1, OVERLAP_STEPS steps, packed rows, and the engines on its other GPUs: two replicas of TP 1
    (--rollout-gpus 1,2 --rollout-tp 1; train.py derives --rollout-replicas) on 3+ GPUs, one engine on 2. In the
    last phase, alone in a phase of its own, but on 8 GPUs beside the routing pair on the GPUs it leaves idle.
    None on one GPU, where the dry run says why."""
    commands = dry_run(n)
    assert all(c[3]["--overlap"] in ("0", "1") for c in commands if c[0]), "--overlap given to every run"
    runs = [c for c in commands if c[0] and c[3]["--overlap"] == "1"]
    if n == 1:  # --overlap refuses an engine on the trainer's GPU
        assert not runs
        proc = run(["bash", "tests/gpu/check.sh", "--dry-run", "--gpus", "1"], timeout=60, env=CHECK_ENV)
        assert "# no overlap run: --overlap needs the engine on GPUs of its own" in proc.stdout
        return
    [(phase, env, words, flags)] = runs
    want = {2: (3, "0,1", "1"), 3: (3, "0,1,2", "1,2"), 4: (4, "0,1,2", "1,2"), 6: (3, "0,1,2", "1,2"),
            8: (3, "2,3,4", "1,2")}[n]
    assert (phase, env["CUDA_VISIBLE_DEVICES"], flags["--rollout-gpus"]) == want
    assert phase == max(c[0] for c in commands), "the last phase"
    beside = [c for c in commands if c[0] == phase and c is not runs[0]]
    assert [c[3]["--routing-replay"] for c in beside] == (["true", "record"] if n == 8 else [])
    used = [g for c in commands if c[0] == phase for g in c[1]["CUDA_VISIBLE_DEVICES"].split(",")]
    assert len(used) == len(set(used)), "runs at once share no GPU"
    assert not launcher(words)[0], "one trainer process"
    assert flags["--rollout-tp"] == "1" and "--rollout-replicas" not in flags, "replicas derived from the GPUs and TP"
    assert flags["--model"] == check.HUB["moe"] and flags["--steps"] == str(check.OVERLAP_STEPS)
    assert flags["--pack"] == "true" and flags["--attn-implementation"] == "varlen"
    assert flags["--sp"] == "1" and flags["--offload-optimizer"] == "false" and flags["--routing-replay"] == "false"
    assert flags["--is-mode"] == "pois", "tois admits no token of the previous weights"
    assert flags["--engine"] == "vllm" and flags["--device"] == "cuda" and flags["--dtype"] == "bfloat16"
    # the routing pair's replay run's flags but for the overlap, its placement, steps, --out and routing
    [replay] = [c[3] for c in commands if c[0] and c[3]["--routing-replay"] == "true"]
    differ = ("--overlap", "--rollout-gpus", "--rollout-tp", "--steps", "--out", "--routing-replay")
    assert {k: v for k, v in flags.items() if k not in differ} == {k: v for k, v in replay.items() if k not in differ}


def test_overlap_run_placement():
    """On every GPU count from 2 the overlap run is the MoE model in the overlap placement (3 GPUs and two
    engines from 3 GPUs, 2 and one on 2), in the last phase: beside the runs before it where they leave its GPUs
    idle (5 and 8 GPUs), else alone after them; on one GPU there is none. engine_count reads the engines a run
    starts from its flags."""
    for n in range(1, 9):
        phases = check.plan_runs([str(i) for i in range(n)], "/w")
        runs = [(i, r) for i, phase in enumerate(phases) for r in phase if r.variant == "overlap"]
        assert all(check.engine_count(r) == 1 for phase in phases for r in phase if r.variant != "overlap")
        if n == 1:
            assert not runs and check.overlap_placement(1) is None
            continue
        [(i, r)] = runs
        assert r.placement == "overlap" and r.model == "moe" and r.steps == check.OVERLAP_STEPS
        assert "--overlap 1" in " ".join(r.cmd) and f"--steps {check.OVERLAP_STEPS} " in " ".join(r.cmd)
        assert check.engine_count(r) == (2 if n >= 3 else 1) and len(r.gpus) == (3 if n >= 3 else 2)
        assert i == len(phases) - 1
        if n in (5, 8):  # the routing pair's phase leaves 3 GPUs idle
            assert r.gpus == ["2", "3", "4"] and len(phases[i]) == 3
        else:
            assert r.gpus == [str(g) for g in range(len(r.gpus))] and phases[i] == [r]


# train.py's checks of each command's flags, in one process (train.py's imports take most of a run): every
# command's --plan, under its environment (torchrun's rank 0 for the fsdp ones); a JSON line each: what train.py
# printed, or the error it stops with
ACCEPTS = """if True:
    import contextlib, io, json, os, sys
    sys.path.insert(0, os.getcwd())
    import train
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    for label, env, flags in commands:
        for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
            os.environ.pop(key, None)
        os.environ.update(env)
        out, err, error, cfg = io.StringIO(), io.StringIO(), None, None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                cfg = train.parse_config(flags + ["--plan", "true"])
                train.main(cfg)  # places the engines: cfg.rollout_replicas as the run would have it
        except (ValueError, FileNotFoundError) as e:
            error = str(e)
        except SystemExit as e:  # argparse refused a flag
            error = f"exit {e.code}: {err.getvalue()}"
        print(json.dumps({"label": label, "stdout": out.getvalue(), "error": error,
                          "replicas": cfg and cfg.rollout_replicas, "overlap": cfg and cfg.overlap}), flush=True)
"""


@pytest.mark.slow
def test_train_accepts_the_commands(tmp_path):
    """Every kind of run the check starts (colocated, split, fsdp packed, fsdp with SP 2 and the optimizer
    offloaded, the routing pair, the overlap run with one engine and with two replicas) passes train.py's checks
    of its flags against the check's models: train.py --plan with them, as torchrun's rank 0 for the fsdp ones,
    and train.py makes as many engines of them as engine_count says (--rollout-replicas derived). A flag
    train.py refuses shows here, not on a GPU machine. The pair's flags on a CPU: refused with vLLM (its routed
    experts need the GPU build), accepted with the transformers engine."""
    check.make_models(str(tmp_path), ["moe"])
    check.make_data(str(tmp_path / "data.jsonl"))
    runs = {}
    for n in (1, 2, 3, 4):  # the first of each kind (3 GPUs: the overlap run's replicas)
        for r in (r for phase in check.plan_runs([str(i) for i in range(n)], str(tmp_path)) for r in phase):
            runs.setdefault((r.placement, r.variant, check.engine_count(r)), r)
    assert set(runs) == {("colocated", "packed", 1), ("split", "unpacked", 1), ("fsdp", "packed", 1),
                         ("fsdp", "sp2_offload", 1), ("colocated", "replay", 1), ("colocated", "record", 1),
                         ("overlap", "overlap", 1), ("overlap", "overlap", 2)}
    commands = []
    for (name, variant, engines), r in runs.items():
        env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"} if name == "fsdp" else {}
        commands.append((f"{name}/{variant}/{engines}", env, r.cmd[r.cmd.index("train.py") + 1:]))
    replay = runs["colocated", "replay", 1].cmd
    replay = replay[replay.index("train.py") + 1:]

    def on_cpu(flags, engine):  # sdpa: varlen is a GPU kernel
        out = list(flags)
        for flag, value in (("--device", "cpu"), ("--engine", engine), ("--attn-implementation", "sdpa")):
            out[out.index(flag) + 1] = value
        return out

    commands += [("cpu/vllm", {}, on_cpu(replay, "vllm")), ("cpu/hf", {}, on_cpu(replay, "hf"))]
    env = {**os.environ, **runs["colocated", "packed", 1].env, "CUDA_VISIBLE_DEVICES": ""}
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    proc = run([sys.executable, "-c", ACCEPTS, str(tmp_path / "commands.json")], timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {rec["label"]: rec for rec in map(json.loads, proc.stdout.strip().splitlines())}
    assert list(got) == [label for label, _, _ in commands]
    for (name, variant, engines), r in runs.items():
        rec = got[f"{name}/{variant}/{engines}"]
        assert rec["error"] is None, f"{name}/{variant}/{engines}: {rec['error']}"
        sp, offload = check.VARIANTS[variant]["--sp"], check.VARIANTS[variant]["--offload-optimizer"]
        assert f"--sp {sp}, --offload-optimizer {offload}" in rec["stdout"], rec["stdout"][:500]
        assert rec["replicas"] == engines and rec["overlap"] == int(check.VARIANTS[variant]["--overlap"])
    refused = "its CPU build lacks; on CPU use --engine hf" if importlib.util.find_spec("vllm") else \
        "vLLM is not installed"
    assert refused in (got["cpu/vllm"]["error"] or ""), got["cpu/vllm"]
    assert got["cpu/hf"]["error"] is None, got["cpu/hf"]["error"]


def routing_run(tmp_path, variant: str, recs: list[dict]) -> dict:
    """result()'s line for a routing-pair run that exited 0 having written `recs` to metrics.jsonl (finished_run)."""
    work = str(tmp_path / variant)
    return finished_run(check.make_run("colocated", "moe", ["0"], ["train.py"], variant, work, sys.executable,
                                       check.ROUTING_STEPS), recs)


def finished_run(r, recs: list[dict]) -> dict:
    """result()'s line for the run `r` (check.Run) that exited 0 having written `recs` to metrics.jsonl, with a
    stand-in model (one weight) released in the cache and moved by 1e-3 in its last checkpoint."""
    import torch
    from safetensors.torch import save_file
    repo = os.path.join(r.env["HF_HOME"], "hub", "models--" + check.HUB[r.model].replace("/", "--"))
    os.makedirs(os.path.join(repo, "snapshots", "c0"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("c0")
    save_file({"w": torch.zeros(4)}, os.path.join(repo, "snapshots", "c0", "model.safetensors"))
    os.makedirs(os.path.join(r.out, f"step_{r.steps:06d}"))
    save_file({"w": torch.full((4,), 1e-3)}, os.path.join(r.out, f"step_{r.steps:06d}", "model.safetensors"))
    with open(os.path.join(r.out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in [{"step": 0}, *recs])
    open(os.path.join(r.out, "stderr.log"), "w").close()
    return check.result(r, 0, False, 1.0, {}, 2.0, 60)


def gap(step: int, mismatch, kl, diff_max=0.1) -> dict:
    return {"step": step, "rollout/routing_mismatch": mismatch, "rollout/engine_kl": kl,
            "rollout/logprob_diff_max": diff_max, "rollout/logprob_diff_mean": 0.01, "rollout/logprob_diff_p99": 0.05}


def test_routing_comparison(tmp_path):
    """A pair run's line has the mean and largest over its steps of the mismatch and the gap; the comparison
    sets replay beside record, passes when replay's KL is within REPLAY_KL_RATIO of record's (or both under the
    floor), and fails on a failed or missing run, a mismatch never measured, and a replay that widens the gap."""
    replay = routing_run(tmp_path, "replay", [gap(1, 0.0, 1e-4), gap(2, 0.0, 2e-4), gap(3, 0.0, 3e-4, 0.3)])
    record = routing_run(tmp_path, "record", [gap(1, 0.04, 2e-4), gap(2, 0.02, 1e-4), gap(3, 0.03, 3e-4)])
    assert replay["ok"] and record["ok"], (replay["error"], record["error"])
    assert replay["flags"]["--routing-replay"] == "true" and record["flags"]["--routing-replay"] == "record"
    assert record["routing"]["rollout/routing_mismatch"] == pytest.approx({"mean": 0.03, "max": 0.04, "steps": 3})
    assert replay["routing"]["rollout/engine_kl"] == pytest.approx({"mean": 2e-4, "max": 3e-4, "steps": 3})
    assert replay["routing"]["rollout/logprob_diff_max"]["max"] == 0.3
    both = check.compare_routing([{"variant": "packed", "ok": True}, replay, record])
    assert both["ok"] and both["error"] is None and both["steps"] == check.ROUTING_STEPS
    assert set(both) >= set(check.ROUTING_KEYS)
    assert both["rollout/engine_kl"] == {"replay": replay["routing"]["rollout/engine_kl"],
                                         "record": record["routing"]["rollout/engine_kl"]}
    assert check.compare_routing([{"variant": "packed", "ok": False}]) is None, "no pair, no comparison"

    def kl(run, mean):
        return dict(run, routing={**run["routing"], "rollout/engine_kl": {"mean": mean, "max": mean, "steps": 3}})

    assert not check.compare_routing([kl(replay, 2.1 * 2e-4), record])["ok"]
    wider = check.compare_routing([kl(replay, 1e-3), record])
    assert "replay widened the engine/trainer gap" in wider["error"]
    noise = check.compare_routing([kl(replay, 1.9 * check.REPLAY_KL_FLOOR), kl(record, 1e-7)])
    assert noise["ok"], "under the floor both are bf16 noise"
    from systems import engine_gap
    assert check.REPLAY_KL_FLOOR == engine_gap.KL_FLOOR
    assert "the record run did not run" in check.compare_routing([replay])["error"]
    failed = check.compare_routing([replay, dict(record, ok=False, error="exit status 1")])
    assert not failed["ok"] and "the record run failed" in failed["error"]
    # a run whose engine returned no routing where the gap was measured, or none at all, fails on its own
    null = routing_run(tmp_path / "null", "record", [gap(1, 0.04, 2e-4), gap(2, None, 1e-4), gap(3, 0.03, 3e-4)])
    assert not null["ok"] and "routing_mismatch null at steps [2]" in null["error"]
    absent = routing_run(tmp_path / "absent", "replay", [
        {k: v for k, v in gap(i, 0.0, 1e-4).items() if k != "rollout/routing_mismatch"} for i in (1, 2, 3)])
    assert not absent["ok"] and "no rollout/routing_mismatch in the records of steps [1, 2, 3]" in absent["error"]
    assert absent["routing"]["rollout/routing_mismatch"] is None
    missing = check.compare_routing([dict(absent, ok=True), record])
    assert not missing["ok"] and "rollout/routing_mismatch missing from the replay run" in missing["error"]
    assert check.routing_unmeasured([gap(1, 0.1, None), gap(2, None, None)], "rollout/engine_kl") == \
        "rollout/routing_mismatch was never measured after a weight sync (null)"


def overlap_rec(step: int, lag, idle=0.1, wait=0.5) -> dict:
    """An overlap run's step record: the gap measured, its engine_lag, and (when not None) its replica_idle."""
    rec = {k: v for k, v in gap(step, None, 1e-4).items() if k != "rollout/routing_mismatch"}
    rec.update({check.OVERLAP_LAG: lag, check.ENGINE_WAIT: wait, "time/step_s": 2.0, "time/rollout_s": 1.0})
    if idle is not None:
        rec[check.REPLICA_IDLE] = idle
    return rec


def overlap_result(tmp_path, n: int, recs: list[dict]) -> dict:
    """result()'s line for the overlap run of `n` GPUs that exited 0 having written `recs` (finished_run)."""
    used, launcher = check.overlap_placement(n)
    return finished_run(check.make_run("overlap", "moe", [str(g) for g in range(used)], launcher, "overlap",
                                       str(tmp_path), sys.executable, check.OVERLAP_STEPS), recs)


def test_overlap_criteria(tmp_path):
    """The overlap run passes with engine_lag 0 on step 1 and 1 after it and, with replicas, replica_idle in
    [0, 1) on every step; its line has the largest lag, the mean engine wait and replica_idle and the step time,
    and the summary repeats them (or says there was no overlap run). It fails on a lag of 2 (tokens two
    versions old), on a lag never 1 (nothing decoded during an update was trained) or missing, and, with
    replicas, on a step without replica_idle or with one outside [0, 1); one engine needs none."""
    good = overlap_result(tmp_path / "good", 3, [overlap_rec(1, 0, 0.1, 0.2), overlap_rec(2, 1, 0.2, 0.4),
                                                 overlap_rec(3, 1, 0.3, 0.6)])
    assert good["ok"], good["error"]
    assert good["flags"]["--overlap"] == "1" and good["step_s"] == 2.0
    assert good["overlap"] == pytest.approx({"replicas": 2, "engine_lag_max": 1, "engine_wait_s": 0.4,
                                             "replica_idle": 0.2})
    summary = check.summarize_overlap([{"variant": "packed", "ok": True}, good])
    assert summary == {"ran": True, "ok": True, **good["overlap"], "step_s": 2.0}
    none = check.summarize_overlap([{"variant": "packed", "ok": True}])
    assert none["ran"] is False and "GPUs of its own" in none["why"]

    stale = overlap_result(tmp_path / "stale", 3, [overlap_rec(1, 0), overlap_rec(2, 1), overlap_rec(3, 2)])
    assert not stale["ok"] and "staleness/engine_lag over 1 (2 at step 3)" in stale["error"]
    assert stale["overlap"]["engine_lag_max"] == 2
    never = overlap_result(tmp_path / "never", 3, [overlap_rec(i, 0) for i in (1, 2, 3)])
    assert not never["ok"] and "staleness/engine_lag never 1 after step 1" in never["error"]
    absent = overlap_result(tmp_path / "absent", 3, [
        {k: v for k, v in overlap_rec(i, 1).items() if k != check.OVERLAP_LAG} for i in (1, 2, 3)])
    assert not absent["ok"] and "no staleness/engine_lag in the records of steps [1, 2, 3]" in absent["error"]
    assert absent["overlap"]["engine_lag_max"] is None

    idle_missing = overlap_result(tmp_path / "idle_missing", 3, [overlap_rec(1, 0), overlap_rec(2, 1, idle=None),
                                                                 overlap_rec(3, 1)])
    assert not idle_missing["ok"]
    assert "no rollout/replica_idle in the records of steps [2] (2 replicas)" in idle_missing["error"]
    idle_full = overlap_result(tmp_path / "idle_full", 3, [overlap_rec(1, 0), overlap_rec(2, 1, idle=1.0),
                                                           overlap_rec(3, 1)])
    assert not idle_full["ok"] and "rollout/replica_idle outside [0, 1): 1 at step 2" in idle_full["error"]
    one = overlap_result(tmp_path / "one", 2, [overlap_rec(1, 0, None), overlap_rec(2, 1, None),
                                               overlap_rec(3, 1, None)])
    assert one["ok"], one["error"]
    assert one["overlap"]["replicas"] == 1 and one["overlap"]["replica_idle"] is None


def test_kernel_comparison_on_cpu():
    """The kernel check's harness on the CPU (varlen needs a GPU): seqpar._attend's sdpa kernel on a packed row in
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


def test_the_fp32_reference_needs_no_kernel_cuda_lacks(monkeypatch):
    """torch 2.11 on CUDA has no fused sdpa kernel for fp32 with grouped query heads (flash takes no fp32, the
    others no enable_gqa): the kernel check's fp32 reference stopped with "No available kernel", and the check
    with it, before its 131072-token run. The CPU's flash kernel takes both, so sdpa here refuses what CUDA's
    refuse while the GPU's backends are the only ones allowed; the reference runs under them, as on a GPU."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gpu = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    real = torch.nn.functional.scaled_dot_product_attention

    def as_cuda(q, k, v, *args, enable_gqa=False, **kw):
        if enable_gqa and q.dtype == torch.float32 and not torch.backends.cuda.math_sdp_enabled():
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(q, k, v, *args, enable_gqa=enable_gqa, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", as_cuda)
    row = check.packed_row((5, 17, 42, 1), "cpu", torch.float32)
    with sdpa_kernel(gpu):  # what attend() allows on a GPU
        reference = check.attend(row, "per_sequence")
    got = check.attend(row, "sdpa")
    assert not check.disagreements(check.agreement(got, reference), "fp32"), check.agreement(got, reference)


@pytest.mark.slow
def test_a_check_cut_at_its_time_limit_leaves_no_process(tmp_path):
    """A check cut at its limit was killed by its process group: torchrun starts each worker in a session of its
    own, so a cut check's rank ran on (on the GPU, holding its memory through the checks after it)."""
    marker = f"ulorl-cut-{uuid.uuid4().hex}"
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script), marker]
    start = time.monotonic()
    rec = h200.run_json(cmd, {}, 15, str(tmp_path / "logs" / "cut"))
    assert rec["rc"] is None and "timed out after 15 s" in rec["error"] and time.monotonic() - start < 40
    assert "started" in (tmp_path / "logs" / "cut.stdout").read_text()  # the worker ran, then was cut

    def running() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
        return found
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == [], "torchrun's worker outlived the check"


@pytest.mark.slow
def test_kernel_check_without_a_gpu():
    """--kernel on a machine without a GPU prints its record, not ok, and exits 1 (as the whole check does)."""
    proc = run(["bash", "tests/gpu/check.sh", "--kernel"], timeout=120, env=CHECK_ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["check"] == "kernel" and rec["ok"] is False and rec["error"] == "no CUDA GPU"


def test_dry_run_needs_gpus():
    proc = run(["bash", "tests/gpu/check.sh", "--dry-run"], timeout=60, env=CHECK_ENV)
    assert proc.returncode != 0 and "--gpus" in proc.stderr


@pytest.mark.slow
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


@pytest.mark.slow
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


# ------------------------------------------------------------------- the one-GPU check (tests/gpu/h200.py)

h200_spec = importlib.util.spec_from_file_location("gpu_h200", os.path.join(ROOT, "tests", "gpu", "h200.py"))
h200 = importlib.util.module_from_spec(h200_spec)
h200_spec.loader.exec_module(h200)
H200_CHECKS = ["grad_memory", "qwen3_30b_layers", "kernel", "moe_train", "fsdp_offload", "decode", "segments"]


def shell_words(line: str) -> tuple[dict, list[str]]:
    """(environment, command) of one of check.shell_line's lines."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def tracked_bytes() -> int:
    """What git would hand the GPU machine, summed apart from h200.tree_bytes: tracked and unignored files."""
    out = run(["bash", "-c", "{ git ls-files; git ls-files --others --exclude-standard; } | sort -u | "
                             "while read -r f; do [ -f \"$f\" ] && stat -c %s \"$f\"; done"], timeout=60)
    return sum(int(n) for n in out.stdout.split())


def test_h200_dry_run():
    """The dry run lists every check once, in order, with its planned seconds and commands: the total with the
    set-up within the 480 s deadline; train.py with the transformers engine (never vLLM, which that machine lacks),
    bf16, packed rows through varlen, checkpointing, --routing-replay true and record; one torchrun rank; the
    benchmarks through BENCH from sys.executable; the wheels with their bytes, and those plus the working tree
    within the 64 MiB that may travel, adding up."""
    import config
    proc = run([sys.executable, "tests/gpu/h200.py", "--dry-run", "--work", "/w"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    checks = [r for r in lines if "check" in r]
    wheel_lines = [r for r in lines if "wheel" in r]
    [budget] = [r for r in lines if r.get("budget")]
    assert [r["check"] for r in checks] == H200_CHECKS == [c.name for c in h200.CHECKS]
    assert all(r["planned_s"] > 0 and r["commands"] for r in checks)
    assert budget["planned_s"] == budget["setup_s"] + sum(r["planned_s"] for r in checks)
    assert budget["planned_s"] <= 420 < budget["deadline_s"] == h200.DEADLINE_S <= 480 and budget["fits_time"]
    # the layers rows each card's free memory takes, by their plans: the 128k row needs more than an H100's 80 GiB
    [layers] = [r for r in checks if r["check"] == "qwen3_30b_layers"]
    assert layers["rows_on"] == {"H100 (80 GiB)": [32768], "H200 (141 GB)": [32768, 131072]}, layers
    assert 80 < layers["row_need_gib"]["131072"] < 139 and layers["row_need_gib"]["32768"] < 79
    commands = {r["check"]: [shell_words(c) for c in r["commands"]] for r in checks}
    for env, words in (c for cs in commands.values() for c in cs):
        assert words[0] == sys.executable and env["HF_HUB_OFFLINE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert "vllm" not in " ".join(words)
    flags = []
    for env, words in commands["moe_train"]:
        args = words[words.index("train.py") + 1:]
        given = [a for a in args if a.startswith("--")]
        assert len(given) == len(set(given)), "each flag once: check.py's values replaced, not repeated"
        flags.append(config.parse_config(args + ["--plan"]))
        assert env["HF_HOME"].startswith("/w")
    assert sorted(c.routing_replay for c in flags) == ["record", "true"]
    for c in flags:
        assert (c.engine, c.device, c.dtype, c.attn_implementation) == ("hf", "cuda", "bfloat16", "varlen")
        assert c.pack and c.gradient_checkpointing and c.model == check.HUB["moe"] and c.steps == check.ROUTING_STEPS
    [(_, fsdp), (_, offload)] = commands["fsdp_offload"]  # the part, then the optimizer step at all the cores
    assert offload[offload.index("--threads") + 1] == str(len(os.sched_getaffinity(0)))
    assert fsdp[1:3] == ["-m", "torch.distributed.run"] and fsdp[fsdp.index("--nproc-per-node") + 1] == "1"
    assert fsdp[fsdp.index("--part") + 1] == "fsdp_offload"
    for name in ("decode", "segments"):
        [(_, words)] = commands[name]
        bench = shlex.split(h200.BENCH)
        assert words[1:1 + len(bench)] == bench and words[1 + len(bench)] == name
    [(_, decode)] = commands["decode"]
    rows = [int(n) for n in decode[decode.index("--rows") + 1].split(",")]
    assert rows[0] == 1 and rows[-1] == 256 and decode[decode.index("--device") + 1] == "cuda"
    assert [w["wheel"] for w in wheel_lines] == [w[0] for w in h200.wheels.WHEELS]
    assert budget["wheels_listed_bytes"] == sum(w["bytes"] for w in wheel_lines) < 2**20
    if os.path.isdir(h200.wheels.FOLDER):  # all of the folder travels, the listed wheels among it
        assert budget["wheel_bytes"] >= sum(w["bytes"] for w in wheel_lines if w["present"])
    else:
        assert budget["wheel_bytes"] == budget["wheels_listed_bytes"]
    assert budget["tree_bytes"] == tracked_bytes()
    assert budget["total_bytes"] == budget["tree_bytes"] + budget["wheel_bytes"] <= budget["limit_bytes"] == 64 * 2**20
    assert budget["fits_size"] and budget["carry"] == ".whl"
    assert h200.unignored_files() == set(tracked_files())  # what a source archive would count: the same


def tracked_files() -> list[str]:
    out = run(["bash", "-c", "{ git ls-files; git ls-files --others --exclude-standard; } | sort -u"], timeout=60)
    return [f for f in out.stdout.split("\n") if f and os.path.isfile(os.path.join(ROOT, f))]


@pytest.mark.slow
def test_the_dry_run_works_outside_a_git_checkout(tmp_path):
    """The dry run counted bytes with `git ls-files`, which fails in a copy of the project that is no checkout
    (a source archive): the fast tier failed there. The working tree's files copied, as an archive holds them."""
    import shutil
    copy = tmp_path / "ulorl"
    for name in tracked_files():
        os.makedirs(copy / os.path.dirname(name), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), copy / name)
    proc = run([sys.executable, "tests/gpu/h200.py", "--dry-run", "--work", "/w"], timeout=120, cwd=copy, warm=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [budget] = [r for r in map(json.loads, proc.stdout.strip().splitlines()) if r.get("budget")]
    assert 0 < budget["tree_bytes"] <= budget["limit_bytes"]


def test_h200_wheels(tmp_path, monkeypatch):
    """The wheels carry requirements.txt's math-verify; their status gives the recorded bytes until downloaded,
    then the files'; without math_verify and without them the check says what to run."""
    wheels = h200.wheels
    assert wheels.WHEELS[0][:2] == ("math-verify", wheels.pinned("math-verify"))
    req = tmp_path / "requirements.txt"
    req.write_text("torch==2.13.0\nMath-Verify == 1.2.3  # a comment\n")
    assert wheels.pinned("math-verify", str(req)) == "1.2.3" and wheels.pinned("sympy", str(req)) is None
    assert [(w["present"], w["bytes"]) for w in wheels.status(str(tmp_path))] == [(False, w[3]) for w in wheels.WHEELS]
    (tmp_path / wheels.WHEELS[1][2]).write_bytes(b"x" * 10)
    assert [w["bytes"] for w in wheels.status(str(tmp_path))][1] == 10
    # where math_verify does not import and the wheels were not carried, the check stops saying what to run
    monkeypatch.setattr(wheels, "FOLDER", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    why = h200.install_wheels(h200.Ctx("cuda", str(tmp_path / "work")))
    assert "python tests/gpu/wheels.py" in why and wheels.WHEELS[0][2] in why and wheels.WHEELS[1][2] not in why


def test_h200_qwen3_30b_shape():
    """The layers check builds on tests/configs' Qwen3-30B-A3B, the ulorl preset's model, and refuses a config
    that is not its shape; the headline's plan fits what a trainer may use of an H200."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(h200.QWEN3_30B)
    assert h200.shape_problems(config) == []
    config.num_experts = 64
    assert h200.shape_problems(config) == ["num_experts: 64 where Qwen3-30B-A3B has 128"]
    plan = h200.headline_plan()
    assert (plan["sp"], plan["offload"]) == (1, "true")
    assert 80 < plan["trainer_gib"] < plan["budget_gib"] < 141e9 / 2**30


def test_h200_deadline(capsys):
    """run_checks: a check that fits what is left of the deadline runs (with at most 3x its plan); one that no
    longer fits is skipped, not failed; one whose harness raises fails with the reason, and the next still
    runs; one that says it cannot run here is skipped; a CUDA-only check is skipped on the CPU."""
    given = {}

    def ok(ctx, timeout):
        given["timeout"] = timeout
        return {"ok": True, "figure": 1}

    def boom(ctx, timeout):
        raise RuntimeError("no GPU memory left")

    checks = [h200.Check("a", 10, None, ok), h200.Check("b", 10_000, None, ok), h200.Check("c", 1, None, boom),
              h200.Check("d", 1, None, lambda ctx, t: {"skipped": True, "error": "no --device"}),
              h200.Check("e", 1, None, lambda ctx, t: {"ok": False, "error": "wrong"}),
              h200.Check("f", 1, None, ok, cpu="CUDA-only")]
    lines = h200.run_checks(h200.Ctx("cuda", "/w"), checks, deadline=100, t_start=h200.time.time())
    assert [r["status"] for r in lines] == ["ok", "skipped", "failed", "skipped", "failed", "ok"]
    assert given["timeout"] == 3 and lines[0]["figure"] == 1
    assert "it plans 10000 s" in lines[1]["why"] and "RuntimeError: no GPU memory left" in lines[2]["error"]
    assert lines[3]["why"] == "no --device" and lines[4]["error"] == "wrong"
    assert [json.loads(line)["check"] for line in capsys.readouterr().out.splitlines()] == list("abcdef")
    [cpu] = h200.run_checks(h200.Ctx("cpu", "/w"), checks[-1:], deadline=100, t_start=h200.time.time())
    assert cpu["status"] == "skipped" and cpu["why"] == "CUDA-only"
    summary = h200.summary(h200.Ctx("cpu", "/w"), lines, h200.time.time())
    assert not summary["ok"] and summary["failed"] == ["c", "e"] and summary["skipped"] == ["b", "d"]
    # one that runs out of its time (here 3x a plan of 0.5 s) is cut, not failed; on the CPU plans count 4x
    slow = h200.Check("g", 0.5, None, lambda ctx, t: (h200.time.sleep(t), {"ok": False, "error": "timed out"})[1])
    [cut] = h200.run_checks(h200.Ctx("cuda", "/w"), [slow], deadline=100, t_start=h200.time.time())
    assert cut["status"] == "cut" and cut["why"] == "cut at 2 s (3x its plan)" and 1.5 <= cut["wall_s"] < 2.5
    summary = h200.summary(h200.Ctx("cpu", "/w"), [cut], h200.time.time())
    assert summary["ok"] and summary["cut"] == ["g"] and summary["failed"] == []
    given.clear()
    h200.run_checks(h200.Ctx("cpu", "/w"), checks[:1], deadline=1000, t_start=h200.time.time())
    assert given["timeout"] == 3 * h200.CPU_SLOWER * 10


def test_h200_archive_holds_every_log_and_run_record(tmp_path):
    """What a device call brings back: the tail of every log and every run's metrics.jsonl, under the limit."""
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "moe_train.stdout").write_text("x" * 5000)
    (work / "runs" / "replay").mkdir(parents=True)
    (work / "runs" / "replay" / "metrics.jsonl").write_text('{"step": 1}\n')
    h200.archive_logs(str(work), str(tmp_path / "logs.tar.gz"))
    import tarfile
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert set(tar.getnames()) == {"logs/moe_train.stdout", "runs/replay/metrics.jsonl"}


@pytest.mark.slow
def test_h200_weight_sync_without_vllm():
    """Where vLLM is missing (the one-GPU machine), weight_sync still imports, with stand-ins for vLLM's types
    that then leave sys.modules, and HFSource gives the checkpoint's names, each tensor where it is asked to be."""
    probe = """if True:
        import json, sys
        sys.modules["vllm"] = None  # as if not installed: import vllm fails
        sys.path.insert(0, "tests/gpu")
        import h200, torch, tiny
        from systems import distributed
        ws = h200.import_weight_sync()
        lm = tiny.make_moe_model(tiny.make_tokenizer())
        sent = [(n, str(t.device), str(t.dtype)) for n, t in ws.HFSource(lm, torch.bfloat16, torch.device("cpu"))]
        print(json.dumps({"leftover": [m for m in sys.modules if m.startswith("vllm.")], "sent": sent,
                          "names": [n for n, _ in distributed.hf_weights(lm)]}))
    """
    proc = run([sys.executable, "-c", probe], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["leftover"] == []
    assert [n for n, _, _ in got["sent"]] == got["names"] and any(".experts.3." in n for n in got["names"])
    assert {(d, t) for _, d, t in got["sent"]} == {("cpu", "torch.bfloat16")}


@pytest.mark.slow
def test_h200_on_cpu(tmp_path):
    """--device cpu runs three checks' code end to end through the check's own processes, at toy size: grad_memory
    (one FSDP2 rank over gloo, what it holds between four micro-batches against its shard), the layers
    check (Qwen3-30B-A3B's config at toy width, one update a row through ulorl.update, the plan beside it) and
    fsdp_offload (one FSDP2 rank under torchrun, gloo here: sharded loading of check.py's MoE with the optimizer
    offloaded, one update, HFSource's tensors where the sender wants them, in the checkpoint's names); their
    lines and the summary, exit 0. (The other checks' CPU runs take minutes: docs/gpu.md gives the command.)"""
    proc = run([sys.executable, "tests/gpu/h200.py", "--device", "cpu", "--only",
                "grad_memory,qwen3_30b_layers,fsdp_offload", "--work", str(tmp_path / "work"), "--out-dir",
                str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    # --out-dir: what a device call brings back (at most 8 files of 16 MiB): the same lines, the summary, the logs
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "results.jsonl", "summary.json"]
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == lines
    assert json.loads((out / "summary.json").read_text()) == lines[-1]
    import tarfile
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/fsdp_offload.stderr", "logs/qwen3_30b_layers.stdout", "logs/grad_memory.stdout"} <= \
            set(tar.getnames())
    assert all(f.stat().st_size < 16 << 20 for f in out.iterdir())
    assert [r["check"] for r in lines] == ["setup", "grad_memory", "qwen3_30b_layers", "fsdp_offload", "h200"]
    _, gradients, layers, fsdp, summary = lines
    assert gradients["status"] == "ok" and len(gradients["held_mib"]) == 3 and gradients["held_over_shard"] < 1.25
    assert fsdp["status"] == "ok" and fsdp["optimizer_steps"] == 1 and fsdp["weights_moved"] >= check.LR / 2
    assert fsdp["offload_step"]["step_s_1"] > 0 and fsdp["offload_step"]["threads"] == len(os.sched_getaffinity(0))
    assert fsdp["shard_devices"] == {"cpu": sum(fsdp["shard_devices"].values())} and fsdp["off_device"] == []
    assert fsdp["sent_devices"] == {"cpu": fsdp["sent_tensors"]} and fsdp["sent_tensors"] > 2 * check.MOE["num_experts"]
    with open(fsdp["tensor_devices"]) as f:
        assert len(json.load(f)) == fsdp["sent_tensors"]
    assert layers["status"] == "ok" and layers["layers"] == 1
    assert sorted(map(int, layers["rows"])) == sorted(h200.SIZES["cpu"]["layer_rows"])
    for tokens, row in layers["rows"].items():
        assert row["optimizer_steps"] == 1 and sum(row["lengths"]) == int(tokens)
        assert row["plan_total_mib"] >= sum(row["plan_mib"].values()) - len(row["plan_mib"])
        assert {"weights", "AdamW moments", "activations", "lm_head chunks"} <= set(row["plan_mib"])
    assert summary["ok"] and summary["failed"] == [] and summary["device"] == "cpu"
