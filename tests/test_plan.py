"""Memory at scale, checked at tiny scale: the plan's parameter counts against real models, a run that cannot
fit stopping before it loads anything, sharded loading under 2 FSDP2 ranks giving exactly the weights
from_pretrained gives, and checkpoints written a layer at a time (several safetensors shards and an index)
that transformers and vLLM load. The plan against measured peaks: test_distributed.py and `python -m bench plan check`.

    python -m pytest tests/test_plan.py          # ~40 seconds on 2 cores; the vLLM part skips without vLLM
"""
import dataclasses
import json
import os
import sys

import pytest

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from conftest import run, together
import tiny
from systems import checkpoint
from systems import distributed
from systems.distributed import Ranks
from systems.routing import Routing, replay_layout, routing_dtype
from systems import placement
from systems import plan as plan_lib

BRIEF = [{"type": "min_words", "n": 1}, {"type": "max_words", "n": 4}]  # an ifeval answer: 1 to 4 words

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_VLLM = __import__("importlib").util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe") / "model"
    tok = tiny.make_tokenizer()
    tiny.make_moe_model(tok).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_plan_counts_the_parameters_of_real_models(moe_dir):
    """Shape.of(config).params() against the parameters transformers builds: dense with tied embeddings, and
    Mixture-of-Experts with untied ones (the router and every expert counted)."""
    for path in (tiny.CKPT, moe_dir):
        lm = AutoModelForCausalLM.from_pretrained(path)
        shape = plan_lib.Shape.of(lm.config)
        assert shape.params() == sum(p.numel() for p in lm.parameters()), path
        layer = sum(p.numel() for n, p in lm.named_parameters() if n.startswith("model.layers.0."))
        assert shape.layer_params() == layer, path


def huge_config(tmp_path):
    """A config.json (and tokenizer) of a ~70B dense model, with no weights at all."""
    d = tmp_path / "huge"
    tok = tiny.make_tokenizer()
    Qwen3Config(vocab_size=len(tok), hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.slow
def test_a_run_that_cannot_fit_stops_before_loading(tmp_path):
    """The huge model has no weight files: had anything been loaded, the error would be a missing file. The
    plan (--plan) prints its items, and the run stops with the total against this machine's memory."""
    d = huge_config(tmp_path)
    train = lambda out, *extra: run([sys.executable, "train.py", "--model", str(d), "--eval-data", "",  # noqa: E731
                                     "--out", str(tmp_path / out), "--engine", "hf", *extra],
                                    cwd=ROOT, timeout=300)
    shown, stopped = together(lambda: train("plan", "--plan"), lambda: train("out"))  # independent: together
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "AdamW moments" in shown.stdout and "activations" in shown.stdout
    assert "checkpoint: ~" in shown.stdout and "--keep-last 3 needs" in shown.stdout
    weights_gib = float(next(line.split()[-2] for line in shown.stdout.splitlines() if line.strip().startswith("weights")))
    P = plan_lib.Shape.of(Qwen3Config.from_pretrained(d)).params()
    assert abs(weights_gib - P * 4 / 2**30) < 0.01  # fp32 on CPU
    assert stopped.returncode == 1
    assert "cannot fit" in stopped.stderr and "GiB" in stopped.stderr and "more than its" in stopped.stderr
    assert "safetensors" not in stopped.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_plan_items_follow_the_flags(tmp_path):
    """Sharding divides weights, gradients and AdamW by the trainer ranks; checkpointing keeps only each
    layer's input; flash attention keeps no scores; a vLLM engine's weights split over --rollout-tp."""
    import config
    shape = plan_lib.Shape.of(Qwen3Config.from_pretrained(huge_config(tmp_path)))
    base = ["--preset", "tiny", "--model", "x", "--eval-data", "", "--max-tokens-per-micro-batch", "8192", "--max-response-len", "8000"]
    one = plan_lib.make_plan(shape, config.parse_config(base), 1, 1, False)
    eight = plan_lib.make_plan(shape, config.parse_config(base + ["--parallel", "fsdp"]), 8, 1, False)
    assert eight.trainer["AdamW moments"] == one.trainer["AdamW moments"] // 8 == 2 * shape.params() * 4 // 8
    ckpt = plan_lib.make_plan(shape, config.parse_config(base + ["--gradient-checkpointing", "true"]), 1, 1, False)
    assert ckpt.trainer["activations"] < one.trainer["activations"] / 10
    flash = plan_lib.make_plan(shape, config.parse_config(base + ["--attn-implementation", "flash_attention_2"]), 1, 1, False)
    assert flash.trainer["attention scores"] == 0 < one.trainer["attention scores"]
    cfg = config.parse_config(base)
    assert plan_lib.make_plan(shape, cfg, 1, 4, True).engine["weights"] == shape.params() * 4 // 4


def test_a_checkpoints_size_and_what_keep_last_needs_are_known_before_the_run():
    """The headline's checkpoints are ~430 GB (61 GB of bf16 weights; six ranks' fp32 masters and AdamW moments,
    sharded), and --keep-last 3 needs four of them: nothing said so before a disk filled at step 40. Counted from
    the parameters by hand; the tiny checkpoint's own size: test_run_files."""
    import config
    from transformers import AutoConfig
    shape = plan_lib.Shape.of(AutoConfig.from_pretrained(os.path.join(ROOT, "tests", "configs", "Qwen3-30B-A3B")))
    cfg = config.parse_config(["--preset", "ulorl", "--model", "x", "--data", "x.jsonl", "--plan"])
    sizes = plan_lib.checkpoint_bytes(shape, cfg, 6)
    P = shape.params()
    extra = 6 * plan_lib.STATE_EXTRA  # each rank's scheduler and RNG streams
    assert sizes["weights"] == 2 * P and sizes["optimizer states"] == 3 * 4 * P + extra  # bf16: masters, 2 moments
    assert 425e9 < sum(sizes.values()) < 440e9, sum(sizes.values()) / 1e9
    assert f"--keep-last 3 needs ~{4 * sum(sizes.values()) / 2**30:.1f} GiB" in plan_lib.disk_line(sizes, cfg)
    ddp = config.parse_config(["--preset", "ulorl", "--model", "x", "--data", "x.jsonl", "--plan", "--parallel", "ddp",
                               "--kl-coef", "0.01"])
    sizes = plan_lib.checkpoint_bytes(shape, ddp, 6)  # every rank saves the whole optimizer state; a reference
    assert sizes["weights"] == 2 * 2 * P and sizes["optimizer states"] == 6 * 3 * 4 * P + extra


@pytest.mark.slow
def test_plan_is_within_a_quarter_of_the_measured_peak(moe_dir, tmp_path):
    """Two steps of the tiny default (micro-batches full, as the plan assumes) on the dense and the MoE model:
    the plan's per-rank total against the host-memory high-water mark from before loading to the end of the
    step (train.py's memory/* records; on CPU host memory is the device's)."""
    data = tmp_path / "data.jsonl"  # a reward a random model sometimes earns: at most 4 words
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": BRIEF,
                                        "verifier": "ifeval"}) + "\n" for i in range(100)))
    models = (("dense", []), ("moe", ["--model", str(moe_dir), "--data", str(data)]))
    # the two runs together (one thread each; each measures its own process's peak)
    procs = together(*(lambda out=tmp_path / name, extra=extra: run(
        [sys.executable, "train.py", "--steps", "2", "--eval-n", "64", "--dump-samples", "0",
         "--dynamic-sampling", "false", "--out", str(out), *extra], cwd=ROOT,
        timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")) for name, extra in models))
    for (name, _), proc in zip(models, procs):
        out = tmp_path / name
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        planned = next(r["memory/plan_trainer_mib"] for r in recs if "memory/plan_trainer_mib" in r)
        measured = max(r["memory/host_peak_mib"] for r in recs if "memory/host_peak_mib" in r)
        assert abs(planned / measured - 1) < 0.25, (name, planned, measured)


@pytest.mark.slow
def test_sharded_loading_gives_the_pretrained_weights(moe_dir):
    """Two FSDP2 ranks build the model on the meta device and fill their shards from the checkpoint; gathered,
    every parameter and buffer equals from_pretrained's (dense tied, and MoE whose per-expert tensors on disk
    become transformers' fused ones). One launch loads both, one after the other."""
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(tiny.CKPT), str(moe_dir)], cwd=ROOT, timeout=300,
               env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.splitlines().count(f"equal {tiny.CKPT}") == 1, proc.stdout
    assert proc.stdout.splitlines().count(f"equal {moe_dir}") == 1, proc.stdout


def test_streamed_checkpoint_loads_in_transformers(moe_dir, tmp_path):
    """Written a layer at a time into shards of at most 200 kB: several files and an index, each tensor in
    the first file with room; from_pretrained gives back exactly the model that was saved."""
    lm = AutoModelForCausalLM.from_pretrained(moe_dir)
    checkpoint.save_weights(lm, distributed.hf_weights(lm), tiny.make_tokenizer(), str(tmp_path / "ckpt"), 200_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / "ckpt" / f).stat().st_size <= 200_000 + 50_000 for f in files[:-1])  # + header
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    want = dict(lm.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in again.named_parameters())


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.slow
def test_streamed_checkpoint_loads_in_vllm(tmp_path):
    """The same sharded layout through vLLM's loader: eval.py on it gives the same greedy answers as on the
    single-file original."""
    lm = AutoModelForCausalLM.from_pretrained(tiny.CKPT)
    checkpoint.save_weights(lm, distributed.hf_weights(lm), tiny.make_tokenizer(), str(tmp_path / "ckpt"), 1_000_000)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    paths = (tiny.CKPT, tmp_path / "ckpt")
    # both evaluations together (one thread each)
    procs = together(*(lambda i=i, path=path: run(
        [sys.executable, "eval.py", "--model", str(path), "--engine", "vllm", "--n-problems", "16", "--k", "1",
         "--temperature", "1e-5", "--report", str(tmp_path / f"{i}.json")], cwd=ROOT,
        timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")) for i, path in enumerate(paths)))
    answers = []
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads((tmp_path / f"{i}.json").read_text())
        answers.append([(p["answers"], p["lengths"]) for p in report["per_problem"]])
    assert answers[0] == answers[1]


if __name__ == "__main__":  # one rank of test_sharded_loading_gives_the_pretrained_weights, for each path given
    import torch.distributed as dist
    dist.init_process_group("gloo")
    for path in sys.argv[1:]:
        lm = placement.load_sharded(path)[1]
        want = AutoModelForCausalLM.from_pretrained(path)
        params, buffers = dict(want.named_parameters()), dict(want.named_buffers())
        bad = [n for n, p in lm.named_parameters() if not torch.equal(distributed.full_tensor(p).detach(), params[n])]
        bad += [n for n, b in lm.named_buffers() if not torch.equal(b, buffers[n])]
        assert lm.named_parameters() and not bad, (path, bad)
        if dist.get_rank() == 0:
            print("equal", path, flush=True)
    dist.destroy_process_group()


def test_host_bytes_per_token_are_what_a_sample_holds():
    """The plan's host items count HOST_BYTES_PER_TOKEN a token for a sample's lists and PICKLED_BYTES_PER_TOKEN
    for the step's broadcast: measured on a 200k-token sample of a 151,936-token vocabulary (Qwen3's)."""
    import pickle
    import tracemalloc
    from segment_rollout import Sample
    n = 200_000
    tracemalloc.start()
    try:
        sample = Sample(uid=0, group=0, prompt_ids=[1], row={}, tokens=torch.randint(0, 151936, (n,)).tolist(),
                        logprobs=torch.randn(n).tolist(), versions=[7] * n)
        held = tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()
    assert abs(held / plan_lib.HOST_BYTES_PER_TOKEN - 1) < 0.25, held
    assert abs(len(pickle.dumps(sample)) / n / plan_lib.PICKLED_BYTES_PER_TOKEN - 1) < 0.25


def test_routing_replay_items_are_what_the_step_holds(moe_dir):
    """--routing-replay's items against the tensors themselves, on the tiny MoE (2 layers, top-2 of 4 experts) at
    full length: a forward's host holds the running micro-batch's int16 replay ids and int64 versions
    (routing.replay_layout, never moved to the device) plus the router's copy of them; a sample's routing is
    layers x top_k bytes a position, pickled whole for the broadcast."""
    import dataclasses
    import pickle
    import config
    import ulorl
    from segment_rollout import Sample
    lm = AutoModelForCausalLM.from_pretrained(moe_dir)
    shape = plan_lib.Shape.of(lm.config)
    cfg = config.parse_config(["--model", str(moe_dir), "--eval-data", "", "--routing-replay", "true", "--group-size",
                               "2", "--train-groups", "3", "--max-prompt-len", "8", "--max-response-len", "24",
                               "--max-tokens-per-micro-batch", "64"])
    full, routed = 8 + 24, shape.layers * shape.experts_per_token
    samples = [Sample(uid=i, group=i // 2, prompt_ids=[1] * 8, row={}, tokens=[2] * 24, logprobs=[0.0] * 24,
                      versions=[0] * 24, finish="truncated", reward=float(i % 2),
                      routing=torch.randint(0, 4, (full - 1, shape.layers, 2), dtype=routing_dtype(4)))
               for i in range(6)]
    plan = plan_lib.make_plan(shape, cfg, 1, 1, False)
    mbs = [mb for mini in ulorl.plan_micro_batches(samples, torch.zeros(6), 0, cfg, Ranks()) for mb in mini]
    layouts = [replay_layout(mb.samples, mb.starts) for mb in mbs]
    held = max(ids.nbytes + versions.nbytes for ids, versions in layouts)
    T = max(cfg.max_tokens_per_micro_batch, full)
    assert held == 2 * full * (routed * 2 + 8) <= T * (routed * 2 + 8)  # two samples a micro-batch of 64 tokens
    assert plan.host["routing replay ids (every rank)"] == T * (routed * 2 + 8) + T * routed * 2
    assert plan.trainer["routing replay ids"] == T * 2 * 8  # the running layer's [tokens, top_k] int64 slice
    routing = Routing(lm)
    placement.wrap(lm, "none")(mbs[0], 1.0)
    assert routing.replay.nbytes == mbs[0].input_ids.numel() * routed * 2 <= T * routed * 2
    slots = cfg.prompts_per_step * cfg.group_size
    assert plan.host["routing records (rank 0)"] == slots * full * routed  # uint8: one byte an id
    assert plan.host["batch's routing (every rank)"] == 2 * 6 * full * routed
    assert samples[0].routing.nbytes == (full - 1) * routed
    bare = dataclasses.replace(samples[0], routing=None)
    assert 0 <= len(pickle.dumps(samples[0])) - len(pickle.dumps(bare)) - samples[0].routing.nbytes < 1000


@pytest.mark.parametrize("pack", [True, False])
def test_collated_micro_batches_are_what_the_update_holds(pack):
    """The plan's collated micro-batches against the tensors the update keeps on the device for the whole step:
    the micro-batches ulorl.plan_micro_batches collates at full length, with what the pass before the update adds
    (pi_old, the reference's log-probs, the two masks), on the tiny model with a KL, packed and padded."""
    import config
    import ulorl
    from segment_rollout import Sample
    lm = AutoModelForCausalLM.from_pretrained(tiny.CKPT)
    cfg = config.parse_config(["--eval-data", "", "--group-size", "2", "--train-groups", "3", "--max-prompt-len", "8",
                               "--max-response-len", "24", "--max-tokens-per-micro-batch", "64", "--kl-coef", "0.01",
                               "--pack", str(pack).lower()])
    samples = [Sample(uid=i, group=i // 2, prompt_ids=[5] * 8, row={}, tokens=[6] * 24, logprobs=[-1.0] * 24,
                      versions=[0] * 24, finish="eos", reward=float(i % 2)) for i in range(6)]
    minis = ulorl.plan_micro_batches(samples, torch.zeros(6), 0, cfg, Ranks())
    policy = placement.wrap(lm, "none")
    ulorl.old_ref_and_masks(policy, policy, minis, 1, cfg, ulorl.Tally())
    held = sum(v.nbytes for mb in (m for mini in minis for m in mini) for k, v in vars(mb).items()
               if torch.is_tensor(v) and not k.startswith("replay"))
    planned = plan_lib.make_plan(plan_lib.Shape.of(lm.config), cfg, 1, 1, True).trainer["micro-batches (collated)"]
    assert plan_lib.rank_samples(cfg, 1, 1) == 6
    # (the [b] tensors, advantages, rewards and the truncation flags, ~13 bytes a sample, are left out)
    assert 0 <= held - planned <= 6 * 13, (held, planned)


def bf16_is_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere oneDNN emulates it: the
    check below took 875 s on 2 cores of such a machine, against ~60 s with it. ONEDNN_MAX_CPU_ISA=AVX2 (with
    ATEN_CPU_CAPABILITY=avx2) makes a machine that has it behave as one that does not, and counts as not."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
        return False
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.slow
def test_the_update_holds_to_the_plan_item_by_item(tmp_path):
    """`python -m bench plan check`'s first part at its own size, one case: 2 FSDP2 ranks with --sp 2 and the
    optimizer state offloaded, bf16 over fp32 masters, a KL, packed micro-batches of 1,024 tokens, eight a rank.
    Every item of each rank holds to the plan within the check's stated tolerance: the weights and AdamW's
    moments counted, the gradients between micro-batches (a rank's shard: half the model's fp32 gradients),
    what autograd saves, and the high-water mark measured. On a CPU without bf16 instructions the same case runs
    in fp32 (50 s there instead of ~900; `python -m bench plan check` runs the bf16 cases anywhere)."""
    from bench import memory_plan
    flags = memory_plan.UPDATE_FLAGS
    if not bf16_is_native():
        flags = [("float32" if f == "bfloat16" else f) for f in flags]
    rows = memory_plan.check_update(str(tmp_path), cases={"sp2 offload": ["--sp", "2", "--offload-optimizer", "true"]},
                                    flags=flags)
    assert [r["rank"] for r in rows] == [0, 1] and all(r["micro_batches"] == 8 for r in rows)
    for row in rows:
        planned, measured = row["planned_mib"], row["measured_mib"]
        assert row["ok"], row
        assert planned["gradients (between micro-batches)"] > 30  # a shard of the fp32 gradients, not its noise


def test_the_attention_backward_counts_grouped_key_value_gradients_at_the_query_heads():
    """The kernel's backward holds fp32 sums of dq and each row's softmax (heads x (D + 1) x 4 bytes a token), and,
    with grouped-query attention, the key and value gradients at the query heads' count in the compute dtype before
    each group is summed (2 x heads x D x c): Qwen3-30B-A3B's 32 query heads on 4 at 128k tokens, 2.04 + 2.04 GiB
    in bf16; with every head its own key and value (the same shape with 32 on 32) there is no such term. --sp 2
    halves the heads a rank holds."""
    from config import parse_config
    from transformers import AutoConfig
    cfg = parse_config(["--preset", "ulorl", "--data", "x.jsonl", "--plan"])
    moe = plan_lib.Shape.of(AutoConfig.from_pretrained(os.path.join(ROOT, "tests", "configs", "Qwen3-30B-A3B")))
    L = 133120
    assert (moe.heads, moe.kv_heads, moe.head_dim) == (32, 4, 128)
    for sp in (1, 2):
        heads = 32 // sp
        assert plan_lib.attention_backward_bytes(moe, cfg, L, sp, 2) == L * heads * 129 * 4 + 2 * L * heads * 128 * 2
    full = dataclasses.replace(moe, kv_heads=moe.heads)
    assert plan_lib.attention_backward_bytes(full, cfg, L, 1, 2) == L * 32 * 129 * 4
    assert plan_lib.attention_backward_bytes(moe, cfg, L, 1, 2) / 2**30 == pytest.approx(2.04 + 2.03, abs=0.02)
