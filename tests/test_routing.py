"""Mixture-of-Experts rollout routing replay (--routing-replay), on a tiny qwen3_moe with 16 experts and top-4
routing: the transformers engine records the experts of every position it computes (what one full forward
routes, in fp32), segment after segment; vLLM's routed_experts array converts; every trainer forward of an
update (pi_old, the reference, the loss and checkpointing's recompute) uses exactly the engine's experts,
replaying the router's own choice changes nothing, the router's gradient still flows; a run with replay
resumes bit for bit; dense models and vLLM on CPU are refused.

    python -m pytest tests/test_routing.py      # ~15 seconds on 2 cores
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

import config
import model as model_lib
import tiny
import ulorl
from conftest import close_up_to_order, run, together, undocumented_metrics
from naive import PROMPTS, ids, make_row
from segment_rollout import Pools, rollout_step
from systems import placement
from systems.distributed import Ranks
from systems.engine_gap import Watch
from systems.routing import Routing, replay_layout, routing_mismatch
from systems.engine import HFEngine, Sampling, vllm_routing

BRIEF = [{"type": "min_words", "n": 1}, {"type": "max_words", "n": 4}]  # an ifeval answer: 1 to 4 words

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")


def moe():
    return tiny.make_moe_model(tiny.make_tokenizer(), experts=16, top_k=4)


IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5]])


def random_routes(layers, tokens, experts=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) for _ in range(layers)]


def test_replay_uses_the_given_experts_with_the_routers_weights():
    lm = moe()
    routing = Routing(lm)
    routing.recorded = []
    own_logits = lm(IDS).logits
    own = list(routing.recorded)
    assert len(own) == 2 and own[0].shape == (IDS.numel(), 4)
    routing.replay, routing.recorded = own, []  # the router's own choice, replayed: nothing changes
    assert torch.equal(lm(IDS).logits, own_logits)
    routes = random_routes(2, IDS.numel())
    routes[1][:3] = -1  # the first 3 tokens of layer 1 keep the router's own choice
    routing.replay, routing.recorded = routes, []
    replayed_logits = lm(IDS).logits
    used = routing.recorded
    assert torch.equal(used[0], routes[0]) and torch.equal(used[1][3:], routes[1][3:])
    assert not torch.equal(replayed_logits, own_logits)
    assert routing_mismatch(own[0], used[0]) > 0.5 and routing_mismatch(own[0], own[0]) == 0
    # the router still learns: its weight gets a gradient through the replayed experts' gate weights
    replayed_logits.sum().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in routing.gates)


def test_routing_mismatch_by_hand():
    own = torch.tensor([[1, 2], [3, 4], [5, 6]])
    other = torch.tensor([[2, 1], [3, 5], [5, 6]])  # the same set in another order counts as agreeing
    assert routing_mismatch(own, other) == pytest.approx(1 / 3)


def test_checkpointing_recomputes_with_the_replayed_experts():
    """The backward's recompute of each layer runs the router again; it must replay the same experts, or the
    gradients would belong to another forward."""
    routes = random_routes(2, IDS.numel(), seed=1)
    grads = []
    for checkpointing in (False, True):
        lm = moe()
        if checkpointing:
            lm.gradient_checkpointing_enable()
        lm.train()
        routing = Routing(lm)
        routing.replay = routes
        lm(IDS).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None]))
    assert close_up_to_order(grads[0], grads[1]), (grads[0] - grads[1]).abs().max()


def test_dense_models_are_refused():
    with pytest.raises(ValueError, match="no Mixture-of-Experts layers"):
        Routing(tiny.make_model(tiny.make_tokenizer()))


def own_routing(lm, tokens: list[int]) -> torch.Tensor:
    """What one full forward over `tokens` routes each position to: [positions, layers, top_k]."""
    routing = Routing.of(lm)
    saved, (routing.replay, routing.recorded) = routing.replay, (None, [])
    with torch.no_grad():
        lm(torch.tensor([tokens]))
    used, routing.recorded, routing.replay = routing.recorded, None, saved
    return torch.stack(used, 1)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def test_engine_records_every_positions_experts_segment_after_segment():
    """Prompts of different lengths (bucketed prefill, left padding), two segments: after each, a sample's
    routing covers prompt + response but the last token, and in fp32 equals one full forward's."""
    tok = tiny.make_tokenizer()
    lm = moe().eval()
    engine = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=3, routing=True)
    pools = Pools()
    new = [pools.new_group(ids(tok, p), make_row(p), 2) for p in PROMPTS]
    for version in range(2):
        rollout_step(engine, pools, new if version == 0 else [], 5, 10, Sampling(1.0), version)
        samples = pools.unfinished + [s for g in pools.experience.values() for s in g]
        assert any(len(s.seg_starts) == version + 1 and s.tokens for s in samples)
        for s in samples:
            context = s.prompt_ids + s.tokens
            assert s.routing.dtype == torch.uint8 and s.routing.shape == (len(context) - 1, 2, 4)
            assert same_experts(s.routing, own_routing(lm, context[:-1]))
    assert engine.routing.replay is None and engine.routing.recorded is None  # nothing left set


def test_vllm_routed_experts_convert():
    """vLLM's CompletionOutput.routed_experts: [positions, layers, top_k], uint8 up to 256 experts, uint16
    above; one row for every token it fed in (the context's, every new token but the last)."""
    ids8 = np.random.default_rng(0).integers(0, 128, (7 + 3 - 1, 48, 8), dtype=np.uint8)
    got = vllm_routing(ids8, 7, 3)
    assert got.dtype == torch.uint8 and torch.equal(got, torch.from_numpy(ids8))
    ids16 = np.full((4, 2, 8), 300, dtype=np.uint16)
    assert vllm_routing(ids16, 2, 3).dtype == torch.int16 and int(vllm_routing(ids16, 2, 3).max()) == 300
    with pytest.raises(RuntimeError, match="for 4 positions, expected 5"):
        vllm_routing(ids16, 3, 3)
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        vllm_routing(None, 3, 3)


def rolled_out(lm, tok, routes=None):
    """Two informative groups sampled with routing recorded; `routes` "random": each position's experts replaced
    by random ones, far from what the trainer's router would choose."""
    engine = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=1, routing=True)
    pools = Pools()
    rollout_step(engine, pools, [pools.new_group(ids(tok, p), make_row(p), 2) for p in PROMPTS[:2]], 8, 8,
                 Sampling(1.0), 0)
    groups = pools.ready_groups(2)
    g = torch.Generator().manual_seed(0)
    for group in groups:
        for i, s in enumerate(group):
            s.reward = float(i % 2)
            if routes == "random":
                s.routing = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(len(s.routing) * 2)]) \
                    .view(len(s.routing), 2, 4).to(torch.uint8)
    return groups


@pytest.mark.parametrize("routes", ["engine", "random"])
def test_every_trainer_forward_uses_the_engines_experts(routes):
    """One update with a reference and gradient checkpointing: each router call (pi_old, the reference, the
    loss's forward and its recompute) uses the sample's recorded experts at every position, and
    rollout/routing_mismatch is 0 for the engine's own fp32 routing, most decisions for random experts."""
    tok = tiny.make_tokenizer()
    lm, ref_lm = moe(), moe().eval().requires_grad_(False)
    groups = rolled_out(lm, tok, routes)
    lm.gradient_checkpointing_enable()
    cfg = config.parse_config(["--routing-replay", "true", "--mini-batch", "0", "--kl-coef", "0.01", "--pack", "true"])
    used = {}
    for name, module in (("policy", lm), ("reference", ref_lm)):
        Routing.of(module).recorded = used[name] = []
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    watch = Watch(cfg)
    watch.start(0, [])
    out = ulorl.update(placement.wrap(lm, "none", watch=watch), placement.wrap(ref_lm, "none", trainable=False), opt,
                       torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups, 0, tok.pad_token_id, cfg,
                       Ranks()) | watch.metrics()
    samples = [s for g in groups for s in g]
    mb = model_lib.collate(samples, tok.pad_token_id, pack=True)
    want = replay_layout(mb.samples, mb.starts)[0].long()  # [layers, tokens, top_k]
    assert (want >= 0).all(dim=-1).sum() == sum(len(s.prompt_ids) + len(s.tokens) - 1 for s in samples) * 2
    # the layers' router calls: pi_old, the loss's forward, the backward's recompute (last layer first); reference
    layers = {"policy": [0, 1, 0, 1, 1, 0], "reference": [0, 1]}
    for name, forwards in used.items():
        assert len(forwards) == len(layers[name])
        for layer, ids_used in zip(layers[name], forwards):
            mask = want[layer, :, 0] >= 0
            assert torch.equal(ids_used[mask], want[layer][mask]), (name, layer)
    if routes == "engine":
        assert out["rollout/routing_mismatch"] == 0.0
    else:
        assert out["rollout/routing_mismatch"] > 0.5
    assert all(g.weight.grad is None for g in Routing.of(lm).gates)  # zeroed after the step ...
    assert out["train/grad_norm"] > 0  # ... which had gradients


def test_replay_off_in_a_forward_without_routing():
    """A micro-batch without routing (the flag off, or a stand-in) runs the router's own choice."""
    tok = tiny.make_tokenizer()
    lm = moe()
    groups = rolled_out(lm, tok, "random")
    samples = [s for g in groups for s in g]
    policy = placement.wrap(lm, "none")  # the trainer's forward: through the engine's experts where it has them
    replayed = policy(model_lib.collate(samples, tok.pad_token_id), 1.0)[0]
    for s in samples:
        s.routing = None
    own = policy(model_lib.collate(samples, tok.pad_token_id), 1.0)[0]
    Routing.of(lm).replay = None
    plain = model_lib.response_logprobs(lm, model_lib.collate(samples, tok.pad_token_id), 1.0)[0]
    assert torch.equal(own, plain) and not torch.allclose(own, replayed)


def test_dense_models_and_vllm_on_cpu_are_refused(tmp_path):
    """Before anything loads (placement.start runs this check right after reading config.json)."""
    from systems import placement
    dense = config.parse_config(["--routing-replay", "true"])
    with pytest.raises(ValueError, match="--routing-replay true: --model tiny_ckpt has no Mixture-of-Experts layers"):
        placement.check_routing(dense, model_lib.model_config(dense.model))
    moe().save_pretrained(tmp_path / "moe")
    on_cpu = config.parse_config(["--routing-replay", "record", "--engine", "hf", "--model", str(tmp_path / "moe")])
    placement.check_routing(on_cpu, model_lib.model_config(on_cpu.model))  # the transformers engine records it
    on_cpu.engine = "vllm"
    if __import__("importlib").util.find_spec("vllm") is not None:
        with pytest.raises(ValueError, match="its CPU build lacks; on CPU use --engine hf"):
            placement.check_routing(on_cpu, model_lib.model_config(on_cpu.model))


@pytest.mark.slow
def test_a_run_with_replay_resumes_bit_for_bit(tmp_path):
    """bf16 (where the engine's and the trainer's routers disagree now and then), two segments: 4 steps straight
    against 2 + 2 resumed. The checkpoint keeps the unfinished samples' routing in routing.pt, not the JSON."""
    tok = tiny.make_tokenizer()
    moe().save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    data = tmp_path / "data.jsonl"  # a reward a random model sometimes earns: at most 4 words
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": BRIEF,
                                        "verifier": "ifeval"}) + "\n" for i in range(100)))
    args = ["--model", str(tmp_path / "moe"), "--data", str(data), "--eval-data", "", "--dtype", "bfloat16",
            "--routing-replay", "true", "--max-response-len", "32", "--segments", "2", "--train-groups", "4",
            "--prompts-per-step", "4", "--dump-samples", "0", "--save-every", "1", "--keep-last", "0",
            "--lr-final", "1"]

    def train(out, *extra):
        proc = run([sys.executable, "train.py", *args, "--out", str(out), *extra], cwd=ROOT, timeout=600,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out / "metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        assert undocumented_metrics(recs) == []  # docs/outputs.md lists every key a run writes
        return recs

    straight, _ = together(lambda: train(tmp_path / "straight", "--steps", "4"),  # independent: together
                           lambda: train(tmp_path / "resumed", "--steps", "2"))
    saved = tmp_path / "resumed" / "step_000002"
    routes = torch.load(saved / "routing.pt", weights_only=True)
    state = json.loads((saved / "ulorl_state.json").read_text())
    pools = state["pools"]
    kept = pools["unfinished"] + pools["experience"] + [s for g in pools["ready"] for s in g]
    assert pools["unfinished"] and set(routes) == {s["uid"] for s in kept}
    assert all("routing" not in s and routes[s["uid"]].shape[0] == len(s["prompt_ids"]) + len(s["tokens"]) - 1
               for s in kept)
    resumed = train(tmp_path / "resumed", "--steps", "4", "--resume", "auto")
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "tokens/per_s", "config"))}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]  # the first run's 2 records, then 2 more
    assert any(r["rollout/routing_mismatch"] for r in straight)  # bf16: replay had something to correct
    a, b = (torch.load(p / "step_000004" / "trainer_state_rank0.pt", weights_only=True)["masters"]
            for p in (tmp_path / "straight", tmp_path / "resumed"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
