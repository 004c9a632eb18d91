"""Ulysses sequence parallelism (--sp) and the packed-attention kernels on CPU: the kernels on a packed row's
sequence boundaries give transformers' own packed forward; N gloo ranks, each holding a slice of the row,
give one process's log-probs and (summed) gradients, dense and Mixture-of-Experts, with KV heads split and
replicated; whole runs under torchrun with --sp 2 end where one process ends and resume exactly.

    python -m pytest tests/test_sequence_parallel.py      # ~25 seconds on 2 cores
"""
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import model as model_lib
import tiny
from conftest import close_up_to_order, free_port, run, spawn, together
from test_distributed import records, rel_diff, weights
from segment_rollout import Sample
from systems.routing import Routing
from systems import placement
from systems import seqpar

BRIEF = [{"type": "min_words", "n": 1}, {"type": "max_words", "n": 4}]  # an ifeval answer: 1 to 4 words

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def samples(lengths=((5, 9), (3, 14), (7, 4), (4, 11), (6, 1)), routed: bool = False) -> list[Sample]:
    """Finished samples of random tokens: (prompt, response) lengths; the packed row is 64 tokens. `routed`: with
    random experts to replay (--routing-replay; the MoE of make(): 2 layers, 8 experts, top-2)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(lengths):
        s = Sample(uid=i, group=0, prompt_ids=torch.randint(3, 17, (p,), generator=g).tolist(), row={})
        s.tokens = torch.randint(3, 17, (r,), generator=g).tolist()
        s.logprobs, s.versions, s.reward, s.finish = [0.0] * r, [0] * r, float(i % 2), "eos"
        if routed:
            s.routing = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * (p + r - 1))]) \
                .view(p + r - 1, 2, 2).to(torch.uint8)
        out.append(s)
    return out


def make(moe: bool, attention: str):
    tok = tiny.make_tokenizer()
    lm = tiny.make_moe_model(tok, experts=8, top_k=2) if moe else tiny.make_model(tok)  # 4 heads, 2 KV heads
    lm.config._attn_implementation = attention
    if moe == "replay":
        Routing.of(lm)
    return lm


def forward_backward(lm, mb):
    """Response log-probs and entropy, and the gradients of a loss that weighs every token differently."""
    lp, ent = placement.wrap(lm, "none")(mb, 0.9)  # the trainer's forward: the packed kernels, --sp's slice
    (lp * torch.linspace(-1, 2, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), ent, torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])


def test_sequence_bounds_of_a_packed_row():
    cu, longest = seqpar.sequence_bounds(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4


@pytest.mark.parametrize("moe", [False, True])
def test_packed_kernel_gives_transformers_packed_forward(moe):
    """The kernel on cu_seqlens (sdpa with a block-diagonal mask, what --sp runs between its all-to-alls on CPU)
    against transformers' sdpa, which finds the sequences from the position resets itself; and against padded
    rows: the same log-probs, entropy and gradients."""
    mb = model_lib.collate(samples(), 0, pack=True)
    ours = forward_backward(make(moe, "ulorl_sdpa"), mb)
    theirs = forward_backward(make(moe, "sdpa"), mb)
    padded = forward_backward(make(moe, "sdpa"), model_lib.collate(samples(), 0, pack=False))
    for a, b, c in zip(ours, theirs, padded):  # the padded forward adds in another order
        assert close_up_to_order(a, b) and close_up_to_order(a, c), ((a - b).abs().max(), (a - c).abs().max())
    assert ours[0].abs().sum() > 0 and ours[2].abs().sum() > 0
    # without cu_seqlens (generation with a KV cache, padded rows) the registered name is sdpa itself
    lm = make(moe, "ulorl_sdpa")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(lm(ids).logits, make(moe, "sdpa")(ids).logits)


def test_varlen_is_called_as_each_torch_names_its_arguments(monkeypatch):
    """The kernel is CUDA-only; its call is checked against the signatures torch has had: 2.13's (enable_gqa for
    grouped KV heads), 2.11's (no enable_gqa: the kernel takes them as they are) and 2.10's (is_causal, no
    scale). Each stand-in takes exactly its version's arguments, as the real one does."""
    import torch.nn.attention.varlen as varlen
    calls = []

    def v213(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
             enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append({"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
        return torch.zeros_like(q)

    def v211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        calls.append({"scale": scale, "window_size": window_size})
        return torch.zeros_like(q)

    def v210(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append({"is_causal": is_causal})
        return torch.zeros_like(q)

    q, kv = torch.randn(1, 4, 9, 32), torch.randn(1, 2, 9, 32)  # 4 query heads, 2 KV heads
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for fake in (v213, v211, v210):
        monkeypatch.setattr(varlen, "varlen_attn", fake)
        out = seqpar._attend(q, kv, kv, cu, 5, 32 ** -0.5, "varlen")
        assert out.shape == q.shape
    assert calls == [{"scale": 32 ** -0.5, "window_size": (-1, 0), "enable_gqa": True},
                     {"scale": 32 ** -0.5, "window_size": (-1, 0)}, {"is_causal": True}]
    with pytest.raises(ValueError, match="takes no scale"):
        seqpar._attend(q, kv, kv, cu, 5, 0.5, "varlen")


def _sp_worker(rank, world, port, kinds, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        seqpar.init_sequence_parallel(world)
        results = []
        for moe in kinds:  # one process group for every kind: a spawn of `world` processes costs seconds
            lm = make(moe, seqpar.attention_name("sdpa", world))
            lp, ent, grads = forward_backward(lm, model_lib.collate(samples(routed=moe == "replay"), 0, pack=True))
            dist.all_reduce(grads)  # each rank's part of the gradient; DDP/FSDP sum them (they average x world)
            results.append((lp, ent, grads))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kinds, sp", [((False, "replay"), 2), ((True,), 4)], ids=["dense+replay-2", "moe-4"])
def test_ranks_holding_slices_give_the_whole_forward_and_backward(tmp_path, sp, kinds):
    """sp 2: each rank gets one of the 2 KV heads; sp 4: the 2 KV heads are replicated for 4 ranks. The packed
    row (64 tokens) is cut in sp slices mid-sequence; every rank returns all the log-probs, and the ranks'
    gradients add up to one process's. Dense, MoE, and MoE whose routers replay given experts (--routing-replay:
    each rank its slice of the row's)."""
    out = tmp_path / "sp.pt"
    spawn(_sp_worker, sp, free_port(), kinds, str(out))
    for moe, (lp, ent, grads) in zip(kinds, torch.load(out), strict=True):
        one = forward_backward(make(moe, "sdpa"), model_lib.collate(samples(routed=moe == "replay"), 0, pack=True))
        if moe == "replay":  # the replayed experts changed the forward
            assert not torch.allclose(one[0], forward_backward(make(True, "sdpa"), model_lib.collate(samples(), 0))[0])
        assert close_up_to_order(lp, one[0]) and close_up_to_order(ent, one[1]), moe
        assert close_up_to_order(grads, one[2]), (moe, (grads - one[2]).abs().max())


def test_sequence_parallel_refuses_what_it_cannot_split(monkeypatch, capsys):
    """In process: the checks train.py runs first (parse_config's, whose argparse error exits 2, and
    placement.start's, whose ValueError train.py prints and exits 1 with, as tests/test_placement.py checks)."""
    import config
    from systems import placement
    with pytest.raises(SystemExit) as refused:
        config.parse_config(["--sp", "2"])
    assert refused.value.code == 2
    assert "--sp 2: sequence parallelism splits packed rows; add --pack true" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="--sp 3: a sequence-parallel size divides the 3 trainer rank"
                                         r"\(s\) and the model's 4 attention heads"):
        placement.start(config.parse_config(["--sp", "3", "--pack", "--plan"]))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit) as cpu:
        config.parse_config(["--attn-implementation", "varlen", "--pack"])
    assert cpu.value.code == 2 and "--attn-implementation varlen: FlashAttention's kernels" in capsys.readouterr().err


# ------------------------------------------------------------------------------ whole runs, torchrun

ARGS = ["--eval-data", "", "--train-groups", "4", "--prompts-per-step", "4", "--max-response-len", "32",
        "--segments", "4", "--dump-samples", "0", "--save-every", "1", "--keep-last", "0", "--lr-final", "1",
        "--pack", "true"]


def train(out, *extra, ranks=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    proc = run([*launcher, "train.py", *ARGS, "--out", str(out), *extra], cwd=ROOT, timeout=600,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def moe_run_args(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    tok = tiny.make_tokenizer()
    tiny.make_moe_model(tok, experts=8, top_k=2).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    data = d / "data.jsonl"  # a reward a random model sometimes earns: at most 4 words
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": BRIEF,
                                        "verifier": "ifeval"}) + "\n" for i in range(100)))
    return ["--model", str(d / "model"), "--data", str(data), "--dynamic-sampling", "false", "--routing-replay", "true"]


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory):
    """3 steps in one process and with --sp 2 on 2 ranks, side by side: the dense runs the tests below read."""
    d = tmp_path_factory.mktemp("dense")
    together(lambda: train(d / "one", "--steps", "3"), lambda: train(d / "sp", "--steps", "3", "--sp", "2", ranks=2))
    return d


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_ranks_with_sp_2_train_the_weights_of_one_process(tmp_path, kind, request):
    """One sequence-parallel group of 2 ranks (each packed micro-batch split in half) against one process on
    the same rollouts (rank 0 samples as the single process does): after 3 steps every weight tensor is within
    1e-5 of one process's, relative (in norm), and no weight is a tenth of an AdamW step (lr 3e-4) away. The MoE
    replays the engine's routing (rank 0 samples, every rank replays what it broadcast). (The
    gradients agree to ~1e-7; AdamW's first step, g / (sqrt(g^2) + eps), turns a rounding-level difference in a
    near-zero gradient into a visible one: 7.6e-6 on one weight of a random MoE.)"""
    extra = [] if kind == "dense" else request.getfixturevalue("moe_run_args")
    if kind == "dense":
        one, sp = (request.getfixturevalue("dense_runs") / run for run in ("one", "sp"))
    else:
        one, sp = tmp_path / "one", tmp_path / "sp"
        together(lambda: train(one, "--steps", "3", *extra),
                 lambda: train(sp, "--steps", "3", "--sp", "2", *extra, ranks=2))
    a, b = records(one), records(sp)
    assert [r["tokens/generated"] for r in a] == [r["tokens/generated"] for r in b]
    assert [r["reward/trained_mean"] for r in a] == [r["reward/trained_mean"] for r in b]
    for r, s in zip(a, b):
        assert abs(r["loss/policy"] - s["loss/policy"]) <= 1e-5 * abs(r["loss/policy"])
        assert r.get("rollout/routing_mismatch") == s.get("rollout/routing_mismatch")  # each slice counted once
        assert (r.get("rollout/routing_mismatch") is not None) == (kind == "moe")
        assert r["mpt/masked_frac"] == s["mpt/masked_frac"]
    moved = rel_diff(weights(one, 3), load_file(os.path.join(
        extra[1] if extra else os.path.join(ROOT, "tiny_ckpt"), "model.safetensors")))
    a, b = weights(one, 3), weights(sp, 3)
    norm = max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)
    largest = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-4 and norm < 1e-5 and largest < 0.1 * 3e-4, (kind, norm, largest, moved)


@pytest.mark.slow
def test_sequence_parallel_run_resumes_exactly(dense_runs, tmp_path):
    """The 3-step run resumed from its step-2 checkpoint into another --out ends where it ended."""
    sp_run, resumed = dense_runs / "sp", tmp_path / "resumed"
    train(resumed, "--steps", "3", "--sp", "2", "--resume", str(sp_run / "step_000002"), ranks=2)
    a, b = weights(sp_run, 3), weights(resumed, 3)
    assert all(torch.equal(a[k], b[k]) for k in a), rel_diff(a, b)
    drop = {"time/step_s", "time/rollout_s", "time/sync_s", "tokens/per_s", "config"}
    clean = lambda recs: [{k: v for k, v in r.items() if k not in drop and not k.startswith("memory/")} for r in recs]
    assert [r["step"] for r in records(resumed)] == [3]
    assert clean(records(resumed)) == clean(records(sp_run)[2:])
