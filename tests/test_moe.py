"""The headline model's architecture, end to end on CPU: a tiny random Mixture-of-Experts model (qwen3_moe:
4 experts, top-2 routing, untied embeddings; tiny.make_moe_model) through vLLM's engine (weights through
vLLM's weight-transfer API, in-process and to two replicas in processes of their own), the trainer in one process
and as 2 FSDP2 ranks, exact resume, HF-format checkpoints that transformers and vLLM load, eval.py, and YaRN.
The task rewards a response of at most 4 words (an instruction-following constraint), which a random model
meets about half the time: rewards vary, so every update really moves the weights.

    python -m pytest tests/test_moe.py          # ~1.5 minutes on 2 cores; vLLM parts skip without vLLM
"""
import json
import os
import random
import sys

import pytest

import torch
from safetensors.torch import load_file

from conftest import run, together
import model as model_lib
import tiny

BRIEF = [{"type": "min_words", "n": 1}, {"type": "max_words", "n": 4}]  # an ifeval answer: 1 to 4 words

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # MoE runs with vLLM and torchrun: -m "not slow" skips them
RUN = ["--eval-data", "", "--max-response-len", "32", "--segments", "2", "--train-groups", "4",
       "--prompts-per-step", "4", "--dump-samples", "0", "--save-every", "1", "--keep-last", "0",
       "--lr-final", "1"]  # a constant learning rate: a 2-step run resumed to 4 is compared with a 4-step one
HAS_VLLM = __import__("importlib").util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(model directory, data file)."""
    d = tmp_path_factory.mktemp("moe")
    tok = tiny.make_tokenizer()
    model = tiny.make_moe_model(tok)
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    rng = random.Random(0)
    with open(d / "data.jsonl", "w") as f:
        for _ in range(200):
            prompt = "+".join(str(rng.randint(1, 9)) for _ in range(rng.randint(2, 5))) + "="
            f.write(json.dumps({"prompt": prompt, "answer": BRIEF, "verifier": "ifeval"}) + "\n")
    return d / "model", d / "data.jsonl"


def train(out, model_dir, data, *extra, ranks=1):
    # nobind (vLLM runs): vLLM's CPU worker keeps OMP_NUM_THREADS' one thread instead of binding one to every
    # core, so runs started together share the cores instead of each spinning on both
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    proc = run([*launcher, "train.py", *RUN, "--model", str(model_dir), "--data", str(data), "--out", str(out),
               *extra], cwd=ROOT, timeout=900,
               env=dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(out, step):
    return load_file(os.path.join(out, f"step_{step:06d}", "model.safetensors"))


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_moe_trains_with_vllm_in_one_process_and_two_fsdp_ranks(moe, tmp_path):
    """vLLM in this process (one trainer), and under torchrun in processes of their own: rank 0 starts two,
    --rollout-replicas 2, each decoding its share of every round, and new weights reach both through vLLM's
    weight-transfer API (systems/weight_sync.py's gloo backend), gathered from the FSDP2 shards a layer at a time, once
    per replica. The same rollouts and weights as one process (a request's draws do not depend on the replica),
    and after every sync the engines' log-probs of the current weights' tokens equal the trainer's (1e-4), also
    for samples continued from the last step: a replica left out of a sync would be off by the update, experts
    reloaded in a layout vLLM's CPU path no longer reads 1.5-3.4 nats, a stale prefix cache by the old weights."""
    one, two = together(lambda: train(tmp_path / "one", *moe, "--steps", "3", "--engine", "vllm"),
                        lambda: train(tmp_path / "two", *moe, "--steps", "3", "--engine", "vllm", "--parallel", "fsdp",
                                      "--rollout-replicas", "2", ranks=2))
    for recs in (one, two):
        gaps = [r["rollout/logprob_diff_max"] for r in recs]
        assert all(g is not None and g < 1e-4 for g in gaps), gaps
        assert all(r["train/grad_norm"] > 0 for r in recs)
    assert [r["tokens/generated"] for r in one] == [r["tokens/generated"] for r in two]
    assert [r["reward/trained_mean"] for r in one] == [r["reward/trained_mean"] for r in two]
    assert all(0 <= r["rollout/replica_idle"] < 1 for r in two) and "rollout/replica_idle" not in one[0]
    a, b = weights(tmp_path / "one", 3), weights(tmp_path / "two", 3)
    assert a.keys() == b.keys() and "model.layers.0.mlp.experts.3.gate_proj.weight" in a  # one tensor per expert
    assert max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a) < 1e-4
    start = load_file(os.path.join(moe[0], "model.safetensors"))
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # the weights really moved


def test_moe_resumes_exactly_and_its_checkpoint_loads_and_evaluates(moe, tmp_path):
    # independent runs go together (one thread each, two cores): the straight run beside the first half, and
    # eval.py on the straight run's checkpoint beside the resumed second half
    together(lambda: train(tmp_path / "straight", *moe, "--steps", "4"),
             lambda: train(tmp_path / "resumed", *moe, "--steps", "2"))
    ckpt = tmp_path / "straight" / "step_000004"
    proc = together(lambda: train(tmp_path / "resumed", *moe, "--steps", "4", "--resume", "auto"),
                    lambda: run([sys.executable, "eval.py", "--model", str(ckpt), "--data", str(moe[1]), "--n-problems",
                                 "8", "--k", "2", "--max-response-len", "32", "--report", str(tmp_path / "r.json")],
                                cwd=ROOT, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")))[1]
    a, b = weights(tmp_path / "straight", 4), weights(tmp_path / "resumed", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert loaded.config.model_type == "qwen3_moe" and not loaded.config.tie_word_embeddings
    trained = dict(loaded.named_parameters())
    assert torch.equal(trained["model.layers.1.mlp.experts.down_proj"][2], a["model.layers.1.mlp.experts.2.down_proj.weight"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["n_problems"] == 8 and 0 < report["mean_reward"] <= 1


def test_moe_under_yarn_flags(moe):
    """YaRN reaches the MoE model's rope like the dense one's (tests/test_yarn.py has its numbers)."""
    yarn, tok = model_lib.load(str(moe[0]), rope_scaling_factor=4.0, rope_original_max_positions=64)
    plain = model_lib.load(str(moe[0]))[0]
    assert yarn.config.max_position_embeddings == 256 and yarn.config.rope_parameters["rope_type"] == "yarn"
    seq = tok("+".join("123456789" * 12) + "=").input_ids[:160]
    with torch.no_grad():
        a, b = yarn(torch.tensor([seq])).logits[0], plain(torch.tensor([seq])).logits[0]
    assert (a[100:] - b[100:]).abs().max() > 1e-3
