"""The headline command as people will type it: where the engine goes for each GPU count and world size, a hub
model name taking UloRL's settings (and refusing the tiny task), the context the ulorl preset needs and the
error when a model cannot reach a context, the memory vLLM is given, and what --routing-replay costs. Pure
functions and --plan runs on a local copy of Qwen3-30B-A3B's config.json in a Hugging Face cache layout: nothing
is downloaded or loaded.

    python -m pytest -n 0 tests/test_placement.py   # ~25 s
"""
import dataclasses
import os
import sys

import pytest
import torch

from conftest import ROOT, hub_cache, run, run_many
import model as model_lib
from config import engine_placement, parse_config
from systems.routing import routing_dtype
from systems import placement
from systems import plan as plan_lib

QWEN3_30B = os.path.join(ROOT, "tests", "configs", "Qwen3-30B-A3B")  # 32 attention heads, 4 KV heads
H200 = 141 * 10**9


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    """The environment of a Hugging Face cache holding Qwen3-30B-A3B's and ProRL's model's config.json (no weights)
    under their hub names, offline, and WORLD_SIZE 6: torchrun --nproc-per-node 6 on 8 GPUs, as --plan sees it."""
    d = tmp_path_factory.mktemp("hub")
    hub_cache(d, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", os.path.join(ROOT, "tests", "configs",
                                                                        "DeepSeek-R1-Distill-Qwen-1.5B"))
    return dict(os.environ, **hub_cache(d, "Qwen/Qwen3-30B-A3B", QWEN3_30B), WORLD_SIZE="6")


def gpu_cfg(*flags):
    cfg = parse_config(["--preset", "ulorl", "--data", "x.jsonl", "--plan", *flags])  # --plan: no GPU needed to parse
    cfg.device = "cuda"
    return cfg


@pytest.mark.parametrize("gpus, ranks, want", [
    (8, 6, ([6, 7], 2)),        # the headline: torchrun --nproc-per-node 6 on 8 GPUs
    (8, 4, ([4, 5, 6, 7], 4)),
    (8, 1, ([1, 2, 3, 4], 4)),  # 7 free, but 32 heads split over 4 at most of them
    (4, 2, ([2, 3], 2)),
    (2, 1, ([1], 1)),
    (1, 1, ([], 1)),            # one GPU: the engine shares it and sleeps during the update
    (3, 1, ([1, 2], 2)),
])
def test_free_gpus_serve(gpus, ranks, want):
    assert engine_placement(gpu_cfg(), gpus, ranks, 32, 4, vllm=True) == want


def test_placement_refusals_and_explicit_gpus(capsys):
    with pytest.raises(ValueError, match=r"every GPU of this machine \(8\) is a trainer rank.*--nproc-per-node 6"):
        engine_placement(gpu_cfg(), 8, 8, 32, 4, vllm=True)
    assert engine_placement(gpu_cfg("--rollout-gpus", "6,7"), 8, 6, 32, 4, vllm=True) == ([6, 7], 2)
    assert engine_placement(gpu_cfg("--rollout-gpus", "2"), 8, 6, 32, 4, vllm=True) == ([6, 7], 2)
    with pytest.raises(ValueError, match=r"trainer process\(es\) use cuda:0, .*, cuda:6; leave those to training"):
        engine_placement(gpu_cfg("--rollout-gpus", "6,7"), 8, 7, 32, 4, vllm=True)
    third = gpu_cfg()
    third.device = "cuda:3"  # one process on GPU 3: the engine takes free ones, never the trainer's
    assert engine_placement(third, 8, 1, 32, 4, vllm=True) == ([0, 1, 2, 4], 4)
    with pytest.raises(ValueError, match=r"cannot split 32 attention heads \(4 KV heads\) over 3 GPUs; an engine takes "
                                         r"1 or 2 of them"):
        engine_placement(gpu_cfg("--rollout-gpus", "5,6,7"), 8, 5, 32, 4, vllm=True)
    # data-parallel replicas: 4 GPUs as 2 engines of TP 2, said either way; 3 GPUs make no 2 equal replicas
    assert engine_placement(gpu_cfg("--rollout-gpus", "4,5,6,7", "--rollout-tp", "2"), 8, 4, 32, 4, vllm=True) == \
        engine_placement(gpu_cfg("--rollout-gpus", "4", "--rollout-replicas", "2"), 8, 4, 32, 4, vllm=True) == \
        ([4, 5, 6, 7], 2)
    with pytest.raises(ValueError, match=r"3 GPUs are not 2 engine\(s\) of tensor-parallel size 2"):
        engine_placement(gpu_cfg("--rollout-gpus", "5,6,7", "--rollout-tp", "2", "--rollout-replicas", "2"), 8, 5,
                         32, 4, vllm=True)
    with pytest.raises(ValueError, match=r"3 GPUs are not a whole number of engines of tensor-parallel size 2"):
        engine_placement(gpu_cfg("--rollout-gpus", "5,6,7", "--rollout-tp", "2"), 8, 5, 32, 4, vllm=True)
    with pytest.raises(ValueError, match=r"1 GPUs are not 2 engine\(s\) of one size"):  # a plan, no GPUs
        engine_placement(gpu_cfg("--rollout-gpus", "1", "--rollout-replicas", "2"), 0, 1, 32, 4, vllm=True)
    for flags, why in ((["--rollout-replicas", "2"], "replicas are vLLM engines; add --engine vllm"),
                       (["--rollout-replicas", "2", "--engine", "vllm", "--device", "cuda", "--plan"],
                        "on GPU the replicas need GPUs of their own")):
        with pytest.raises(SystemExit):
            parse_config(flags)
        assert why in capsys.readouterr().err
    assert engine_placement(gpu_cfg(), 8, 6, 32, 4, vllm=False) == ([], 1)  # the transformers engine: rank 0
    cpu = gpu_cfg()
    cpu.device = "cpu"
    assert engine_placement(cpu, 0, 2, 32, 4, vllm=True) == ([], 1)
    assert engine_placement(gpu_cfg("--rollout-gpus", "6,7"), 0, 6, 32, 4, vllm=True) == ([6, 7], 2)  # a plan, no GPUs


@pytest.mark.slow
def test_a_hub_name_takes_ulorl_settings_and_a_local_directory_the_tiny_ones(hub_env):
    hub = parse_config(["--model", "Qwen/Qwen3-30B-A3B", "--data", "train.parquet", "--plan"])
    assert (hub.preset, hub.lr, hub.max_response_len, hub.dtype) == ("ulorl", 1e-6, 131072, "bfloat16")
    local = parse_config(["--model", QWEN3_30B, "--data", "tiny"])
    assert (local.preset, local.lr, local.max_response_len, local.device) == ("tiny", 3e-4, 64, "cpu")
    assert parse_config(["--model", "Qwen/Qwen3-4B", "--preset", "tiny", "--data", "tiny"]).lr == 3e-4
    refused = run([sys.executable, "train.py", "--model", "Qwen/Qwen3-30B-A3B"], timeout=60, env=hub_env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "without --preset it trains with UloRL's settings" in refused.stderr and "--data train.parquet" in refused.stderr
    assert "--preset prorl" in refused.stderr


@pytest.mark.slow
def test_the_ulorl_preset_reaches_its_context_and_a_short_model_is_an_error(hub_env):
    cfg = parse_config(["--preset", "ulorl", "--data", "x.jsonl", "--plan"])
    config = model_lib.model_config(QWEN3_30B, cfg.rope_scaling_factor, cfg.rope_original_max_positions)
    assert config.max_position_embeddings == 133120 == cfg.max_prompt_len + cfg.max_response_len
    assert config.rope_parameters["original_max_position_embeddings"] == 32768  # Qwen3's native length
    headline = ["--preset", "ulorl", "--model", "Qwen/Qwen3-30B-A3B", "--rollout-gpus", "6,7", "--plan"]
    plan, short = run_many("train.py", [headline, headline + ["--rope-scaling-factor", "0"]], timeout=120, env=hub_env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "memory plan (6 trainer rank(s), cuda; --sp 1," in plan.stdout and "KV cache, 1 sample" in plan.stdout
    assert short.returncode == 1 and "Traceback" not in short.stderr
    assert ("--max-prompt-len 2048 + --max-response-len 131072 = 133120 positions, but --model Qwen/Qwen3-30B-A3B "
            "takes 40960") in short.stderr and "--rope-scaling-factor 3.25" in short.stderr


def test_engine_memory_follows_the_placement():
    """GPUs of its own: 0.9 of each (a fixed 0.25 left an H200's engine 32.8 GiB, short of the 34.5 its weights and
    one 133k-token sample need); sharing the trainer's GPU: what the trainer's state leaves, less 5%."""
    from transformers import AutoConfig
    shape = plan_lib.Shape.of(AutoConfig.from_pretrained(QWEN3_30B))
    split = gpu_cfg("--rollout-gpus", "6,7")
    split.rollout_tp = 2
    plan = plan_lib.make_plan(shape, split, 6, 2, True)
    assert plan_lib.engine_memory(plan, split, H200) == 0.9
    assert plan_lib.engine_concurrency(plan, H200, 0.9) == 14  # (0.9 x 141 GB - 30.5 GB) / 6.5 GB per sample
    assert not [p for p in plan_lib.problems(plan, split, H200, colocated=False) if "vLLM engine" in p]
    split.rollout_mem = 0.25
    (why,) = [p for p in plan_lib.problems(plan, split, H200, colocated=False) if "vLLM engine" in p]
    assert "more than its 0.25 of 131.3 GiB (gpu_memory_utilization; --rollout-mem)" in why
    small = parse_config(["--preset", "prorl", "--data", "x.jsonl", "--plan"])  # ProRL's 1.5B, one GPU
    small.device = "cuda"
    from transformers import Qwen2Config
    shape = plan_lib.Shape.of(Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936))
    plan = plan_lib.make_plan(shape, small, 1, 1, True)
    state = sum(v for k, v in plan.trainer.items() if k in ("weights", "AdamW moments", "compute copy (bf16)", "reference"))
    fraction = plan_lib.engine_memory(plan, small, H200)
    assert fraction == int((0.95 - state / H200) * 100) / 100 and 0.5 < fraction < 0.95


@pytest.mark.slow
def test_a_plan_for_a_target_gpu_from_any_machine(hub_env):
    """--device-memory (decimal GB, as vendors state it) gives the verdict a machine without the GPU cannot. The
    ulorl preset leaves --sp and --offload-optimizer at auto, and the plan picks: on 8 H200s (6 trainer ranks),
    the optimizer state in host memory (sequence parallelism over 2 ranks alone falls 2.3 GiB short); on 8 x 80 GB,
    both; ProRL's 1.5B at 16k needs neither. Without it a laptop cannot say."""
    headline = ["--preset", "ulorl", "--model", "Qwen/Qwen3-30B-A3B", "--rollout-gpus", "6,7", "--plan"]
    h200, h100, fixed, unknown, small = run_many("train.py", [
        headline + ["--device-memory", "141"],
        headline + ["--device-memory", "80"],
        headline + ["--device-memory", "141", "--sp", "1", "--offload-optimizer", "false"],  # fixed by hand
        headline,
        ["--preset", "prorl", "--max-response-len", "16384", "--rollout-gpus", "6,7", "--plan", "--device-memory", "80"],
    ], timeout=120, env=hub_env)
    assert h200.returncode == 0, h200.stderr[-2000:]
    assert "--sp 1, --offload-optimizer true, --attn-implementation varlen" in h200.stdout
    assert "verdict: fits in 131.3 GiB" in h200.stdout, h200.stdout
    assert h100.returncode == 0 and "--sp 2, --offload-optimizer true," in h100.stdout
    assert "verdict: fits in 74.5 GiB" in h100.stdout and "offloaded optimizer state" in h100.stdout, h100.stdout
    # the same flags fixed by hand: without sequence parallelism or offload 128k does not fit, and the plan says what would
    assert fixed.returncode == 0 and "verdict: the trainer needs 160.8 GiB per GPU, more than the 124.8 GiB it may " \
                                     "use of 131.3 GiB: try" in fixed.stdout, fixed.stdout
    assert "--offload-optimizer true" in fixed.stdout and "--sp N" in fixed.stdout
    assert "give it, e.g. --device-memory 141" in unknown.stdout
    assert small.returncode == 0 and "--sp 1, --offload-optimizer false" in small.stdout
    assert "verdict: fits in 74.5 GiB" in small.stdout, small.stdout


def test_the_plan_chooses_the_least_that_fits():
    """plan.choose: sequence-parallel sizes in order without offload, then with it; the first that fits."""
    from transformers import AutoConfig
    shape = plan_lib.Shape.of(AutoConfig.from_pretrained(QWEN3_30B))
    cfg = gpu_cfg("--preset", "ulorl", "--rollout-gpus", "6,7")
    cfg.rollout_tp = 2
    make = lambda c: plan_lib.make_plan(shape, c, 6, 2, True)
    assert plan_lib.choose(make, cfg, H200, [1, 2], True) == (1, "true")
    assert plan_lib.choose(make, cfg, 160 * 10**9, [1, 2], True) == (2, "false")
    assert plan_lib.choose(make, cfg, 80 * 10**9, [1, 2], True) == (2, "true")
    assert plan_lib.choose(make, cfg, 40 * 10**9, [1, 2], True) == (2, "true")  # nothing fits: the most; it says why
    assert plan_lib.choose(make, cfg, 80 * 10**9, [1, 2], False) == (2, "false")  # no FSDP: no offload
    assert plan_lib.choose(make, cfg, None, [1, 2], True) == (1, "false")
    sp2 = make(dataclasses.replace(cfg, sp=2, offload_optimizer="false"))
    one = make(dataclasses.replace(cfg, sp=1, offload_optimizer="false"))
    assert sp2.trainer["activations"] < 0.51 * one.trainer["activations"]
    off = make(dataclasses.replace(cfg, sp=2, offload_optimizer="true"))
    assert off.trainer["AdamW moments"] == 0 and off.host["offloaded optimizer state"] == 4 * sp2.trainer["weights"]


@pytest.mark.slow
def test_routing_replay_at_the_papers_scale(hub_env):
    """--routing-replay on Qwen3-30B-A3B (48 MoE layers, top-8 of 128 experts) under the ulorl preset, by hand:
    rank 0's host keeps 48 x 8 x 1 byte = 384 bytes a token (uint8 ids) of the 1024 samples in flight at 133120
    tokens, every rank the step's batch's twice (held, pickled) and, for the running micro-batch's whole row,
    48 x 8 x 2 + 8 = 776 bytes a token (int16 ids, an int64 version) and the router's copy of its 66560-token
    slice (--sp 2); the GPU only the running layer's slice (int64). Past 256 experts ids take two bytes; a dense model or the flag off adds
    nothing. The headline's plan chooses as without it: an H200 with offload, and 80 GB with offload and --sp 2."""
    from transformers import AutoConfig, Qwen2Config
    shape = plan_lib.Shape.of(AutoConfig.from_pretrained(QWEN3_30B))
    cfg = gpu_cfg("--rollout-gpus", "6,7", "--routing-replay", "true", "--sp", "2", "--offload-optimizer", "true")
    cfg.rollout_tp = 2
    plan = plan_lib.make_plan(shape, cfg, 6, 2, True)
    full = 2048 + 131072
    assert shape.layers * shape.experts_per_token == 384 and routing_dtype(shape.experts).itemsize == 1
    assert plan.host["routing records (rank 0)"] == 1024 * full * 384 == 48.75 * 2**30
    assert plan.host["batch's routing (every rank)"] == 2 * 1024 * full * 384
    assert plan.host["routing replay ids (every rank)"] == full * 776 + 66560 * 768  # 147 MiB
    assert plan.trainer["routing replay ids"] == 66560 * 8 * 8
    wide = plan_lib.make_plan(dataclasses.replace(shape, experts=512), cfg, 6, 2, True)
    assert routing_dtype(512).itemsize == 2 and wide.host["routing records (rank 0)"] == 1024 * full * 768
    off = plan_lib.make_plan(shape, dataclasses.replace(cfg, routing_replay="false"), 6, 2, True)
    assert off.trainer_total == plan.trainer_total - plan.trainer["routing replay ids"]
    assert not [k for k in (*off.trainer, *off.host) if "routing" in k]
    dense = plan_lib.Shape.of(Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936))
    dense_plan = plan_lib.make_plan(dense, cfg, 6, 2, True)
    assert not [k for k in (*dense_plan.trainer, *dense_plan.host) if "routing" in k]
    assert not plan_lib.problems(plan, cfg, H200, colocated=False)
    auto = dataclasses.replace(cfg, sp=0, offload_optimizer="auto")
    make = lambda c: plan_lib.make_plan(shape, c, 6, 2, True)
    assert plan_lib.choose(make, auto, 80 * 10**9, [1, 2], True) == (2, "true")
    assert plan_lib.choose(make, auto, H200, [1, 2], True) == (1, "true")
    h200 = run([sys.executable, "train.py", "--preset", "ulorl", "--model", "Qwen/Qwen3-30B-A3B", "--rollout-gpus",
                "6,7", "--plan", "--device-memory", "141", "--routing-replay", "true", "--sp", "2"], timeout=120,
               env=hub_env)
    assert h200.returncode == 0, h200.stderr[-2000:]
    assert "--sp 2, --offload-optimizer true," in h200.stdout and "verdict: fits in 131.3 GiB" in h200.stdout
    assert "routing replay ids (every rank)    0.144 GiB" in h200.stdout
    assert "routing records (rank 0)         48.750 GiB" in h200.stdout, h200.stdout


@pytest.mark.parametrize("omp, torchrun, ranks, threads", [
    (None, False, 1, 8), (None, True, 2, 4), ("1", True, 2, 4), ("1", True, 1, 1), ("1", False, 2, 1),
    ("3", True, 2, 3)])
def test_each_rank_takes_its_share_of_the_cores_unless_the_user_said(monkeypatch, omp, torchrun, ranks, threads):
    """--threads 0 on 8 idle cores: the machine's ranks share them. OMP_NUM_THREADS=1 under torchrun with several
    ranks a machine is torchrun's own default (it sets it when unset), not the user's, and is shared out too;
    any other value, or a 1 outside torchrun or on one rank, is the user's. --threads always wins."""
    saved = torch.get_num_threads()
    monkeypatch.setattr(placement, "busy_cores", lambda: 0.0)
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(8)))
    for name, value in (("OMP_NUM_THREADS", omp), ("TORCHELASTIC_RUN_ID", "r1" if torchrun else None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    try:
        if omp is not None:
            torch.set_num_threads(int(omp))  # as the variable set it at start
        assert placement.set_threads(0, ranks) == threads and torch.get_num_threads() == threads
        assert placement.set_threads(2, ranks) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
