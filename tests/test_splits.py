"""Every split gives the same update: one step's samples cut into 1, 2 and 3 micro-batches, in one process or over
2 gloo ranks, give the same gradients (one plain SGD step at lr 1 moves every weight by minus its gradient; AdamW's
first step, ~lr x sign(g), would hide a wrong scale), the same gradient norm and the same loss, in every update path:
one process in fp32, bf16 over fp32 master weights, DDP (fp32 and bf16), FSDP2 (fp32, bf16, optimizer offload) and
--sp 2. The batch is tests/harness.py's stale groups under SAIS with a narrow clip (0.05), so that the clip, the
DMMPT masks and the global token denominator all act. The ranked paths share one 2-rank launch (one thread a rank),
which also shows the flags that act only under torchrun reaching their functions (tests/test_flags.py's RANKED).

    python -m pytest tests/test_splits.py        # ~25 s on 2 cores
"""
import os

import pytest
import torch
import torch.distributed as dist

import config
import harness
import model as model_lib
import ulorl
from conftest import free_port, spawn
from systems import distributed
from systems import placement
from systems import seqpar
from systems.engine_gap import Watch

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["--device", "cpu", "--eval-data", "", "--is-mode", "sais", "--eps-low", "0.05", "--eps-high", "0.05",
        "--grad-clip", "1e9", "--max-engine-kl", "0"]
ONE = {"fp32": [], "bf16": ["--dtype", "bfloat16"]}  # one process
RANKED_PATHS = {"ddp": ["--parallel", "ddp"], "ddp bf16": ["--parallel", "ddp", "--dtype", "bfloat16"],
                "fsdp": ["--parallel", "fsdp"], "fsdp bf16": ["--parallel", "fsdp", "--dtype", "bfloat16"],
                "fsdp offload": ["--parallel", "fsdp", "--offload-optimizer", "true"],
                "sp 2": ["--parallel", "fsdp", "--sp", "2", "--pack", "true"]}
SPLITS = (1, 2, 3)  # micro-batches on the rank with the most
VERSION = 2  # the stale groups' newest policy version: the weights being updated
# flag: (value, what the launch observes of it); its default's observable is what each of them reads without it
RANKED_PROBES = {"parallel": ("ddp", "the wrapped module's class"),
                 "offload_optimizer": ("true", "FSDP2's offload policy of the wrapped module"),
                 "sp": ("2", "the size of this rank's sequence-parallel group"),
                 "dist_timeout": ("123", "the default process group's timeout")}


def budget(samples: list, pack: bool, world: int, sp: int, target: int) -> int:
    """The largest --max-tokens-per-micro-batch under which the rank with the most micro-batches has `target` of
    them (every rank computes the same)."""
    lengths = [len(s.prompt_ids) + len(s.tokens) for s in samples]
    shares = distributed.balance(lengths, world // sp)
    for tokens in range(len(lengths) * max(lengths), 0, -1):
        most = max(len(model_lib.micro_batches([samples[i] for i in share], tokens, pack)) for share in shares)
        if most == target:
            return tokens
    raise ValueError(f"no budget gives {target} micro-batches")


def sgd_step(flags: list[str], split: int, groups: list, world: int = 1, sp: int = 1) -> dict:
    """One update of `groups` by plain SGD at lr 1 through the trainer's own loading, wrapping and update for
    `flags`, its batch cut so that the busiest rank runs `split` micro-batches. Returns what it moved each weight by
    (the fp32 masters where there are some), the gradient norm the update reports and that of the gradients the
    optimizer stepped with, the loss and how many tokens the engine/trainer gap was measured on (every rank's)."""
    samples = [s for g in groups for s in g]
    cfg = config.parse_config([*BASE, *flags])
    cfg.max_tokens_per_micro_batch = budget(samples, cfg.pack, world, sp, split)
    watch = Watch(cfg)  # the engine/trainer gap, on the tokens these weights sampled
    policy, ref, lm, ref_lm, tok, masters = placement.load_models(cfg, None, world, watch)
    params = masters.parameters() if masters else list(policy.parameters())
    opt, stepped = torch.optim.SGD(params, lr=1.0), []
    # the norm of the gradients the optimizer steps with (FSDP2: every rank's shards)
    opt.register_step_pre_hook(lambda *_: stepped.append(distributed.full_tensor(
        torch.nn.utils.get_total_norm([p.grad for p in params])).item()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def weights():
        tensors = [m.detach() for m in masters.parameters()] if masters else [t for _, t in distributed.full_weights(lm)]
        return torch.cat([t.float().flatten() for t in tensors])

    before = weights()
    watch.start(VERSION, [])
    out = ulorl.update(policy, ref, opt, sched, groups, VERSION, tok.pad_token_id, cfg,
                       distributed.Ranks(policy, masters, sp))
    watch.metrics()
    return {"moved": weights() - before, "grad_norm": out["train/grad_norm"], "loss": out["loss/policy"],
            "gap_tokens": watch.gap.n, "stepped_norm": stepped[0]}


def _ranked(rank: int, world: int, port: int, groups_path: str, out: str) -> None:
    """One rank of the launch: torchrun's environment, the process group placement.setup_distributed makes for
    --dist-timeout 123 --sp 2, then every ranked path at every split."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    placement.setup_distributed(config.parse_config([*BASE, "--dist-timeout", "123", "--sp", "2", "--pack", "true"]))
    groups = torch.load(groups_path, weights_only=False)
    try:
        seen = {"dist_timeout": dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
                .options._timeout.total_seconds(), "sp": seqpar.sp_size()}
        for parallel in ("fsdp", "ddp"):
            cfg = config.parse_config([*BASE, "--parallel", parallel])
            seen[f"parallel {parallel}"] = type(placement.load_models(cfg, None, world)[0]).__name__
        for offload in ("false", "true"):
            policy = placement.load_models(config.parse_config([*BASE, "--offload-optimizer", offload]), None, world)[0]
            seen[f"offload {offload}"] = repr(policy._get_fsdp_state()._fsdp_param_group.offload_policy)
        group, results = seqpar._sp_group, {}
        for name, flags in RANKED_PATHS.items():
            sp = 2 if name == "sp 2" else 1
            seqpar._sp_group = group if sp == 2 else None  # the other paths' rows are not sliced
            results[name] = {split: sgd_step(flags, split, groups, world, sp) for split in SPLITS}
        seqpar._sp_group = None
        seen["reset"] = reset_under_fsdp(groups, world)
        if rank == 0:
            torch.save({"seen": seen, "results": results}, out)
    finally:
        dist.destroy_process_group()


def reset_under_fsdp(groups: list, world: int) -> tuple[bool, bool, bool]:
    """ProRL's reset under FSDP2 after an update with a KL reference (whose forward leaves its root unsharded):
    (the policy kept its weights, the reference took them, AdamW forgot its moments)."""
    cfg = config.parse_config([*BASE, "--parallel", "fsdp", "--kl-coef", "0.05"])
    policy, ref, lm, ref_lm, tok, _ = placement.load_models(cfg, None, world)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ulorl.update(policy, ref, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), groups, VERSION,
                 tok.pad_token_id, cfg, distributed.Ranks(policy))
    trained = [t.clone() for _, t in distributed.full_weights(lm)]
    assert opt.state and any(not torch.equal(a, b) for a, (_, b) in zip(trained, distributed.full_weights(ref_lm)))
    ulorl.reset_reference(lm, ref_lm, opt, ref)
    return (all(torch.equal(a, b) for a, (_, b) in zip(trained, distributed.full_weights(lm))),
            all(torch.equal(a, b) for a, (_, b) in zip(trained, distributed.full_weights(ref_lm))), not opt.state)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return harness.stale_groups()


@pytest.fixture(scope="module")
def one_process(groups):
    return {name: {split: sgd_step(flags, split, groups) for split in SPLITS} for name, flags in ONE.items()}


@pytest.fixture(scope="module")
def launch(groups, tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    torch.save(groups, d / "groups.pt")
    spawn(_ranked, 2, free_port(), str(d / "groups.pt"), str(d / "out.pt"), timeout=300)
    return torch.load(d / "out.pt", weights_only=False)


def gap(a: dict, b: dict) -> float:
    """How far step `a` is from step `b`: the largest weight difference over the largest move, and the gradient
    norms' and losses' relative differences, whichever is largest."""
    return max(((a["moved"] - b["moved"]).abs().max() / b["moved"].abs().max()).item(),
               abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"], abs(a["loss"] - b["loss"]) / abs(b["loss"]))


# fp32 paths add the same terms in other orders (micro-batches, ranks, padding): <= 1e-5 measured. bf16 paths are
# held to one process in bf16: they round each forward's activations, whose micro-batch shapes differ (<= 1.4e-2
# measured; a bf16 step is ~35% from an fp32 one, ratios near the narrow clip's bounds falling on the other side).
# A split that loses or doubles a micro-batch's or a rank's share is off by 1/3 or more.
FP32_TOL, BF16_TOL = 1e-4, 5e-2


def reference(one_process: dict, name: str) -> tuple[dict, float]:
    """The one-process step, in one micro-batch, that path `name` must give, and within what."""
    return (one_process["bf16"][1], BF16_TOL) if "bf16" in name else (one_process["fp32"][1], FP32_TOL)


def test_the_stale_batch_makes_every_term_act(one_process, groups):
    samples = [s for g in groups for s in g]
    assert len({s.reward for s in samples}) == 2 and any(s.finish == "truncated" for s in samples)
    assert {v for s in samples for v in s.segment_versions()} == {0, 1, 2}
    step = one_process["fp32"][1]
    assert step["moved"].abs().max() > 1e-3 and step["grad_norm"] > 0


@pytest.mark.parametrize("name", list(ONE))
def test_one_process_micro_batches_give_one_update(one_process, name):
    want, tol = reference(one_process, name)
    for split in SPLITS:
        assert gap(one_process[name][split], want) < tol, (name, split)
        # the clip's norm is of every gradient the optimizer steps with
        assert one_process[name][split]["stepped_norm"] == pytest.approx(one_process[name][split]["grad_norm"], rel=1e-6)
        assert one_process[name][split]["gap_tokens"] == want["gap_tokens"] > 0


@pytest.mark.parametrize("name", list(RANKED_PATHS))
def test_two_ranks_give_one_process_update_at_every_split(launch, one_process, name):
    """The same samples over 2 ranks, each rank's share in 1, 2 or 3 micro-batches (a rank with fewer runs empty
    stand-ins), move the weights as one process in one micro-batch does, and the gap check counts each token once
    (not the stand-ins', nor a sequence-parallel group's twice)."""
    want, tol = reference(one_process, name)
    for split in SPLITS:
        step = launch["results"][name][split]
        assert gap(step, want) < tol, (name, split)
        assert step["stepped_norm"] == pytest.approx(step["grad_norm"], rel=1e-6)  # the norm of every gradient
        assert launch["results"][name][split]["gap_tokens"] == want["gap_tokens"], (name, split)  # each counted once


def test_the_ranked_flags_reach_their_functions(launch):
    seen = launch["seen"]
    assert seen["dist_timeout"] == 123.0  # the default: 1800
    assert seen["sp"] == 2  # the default (1): no group
    assert seen["parallel fsdp"] != seen["parallel ddp"] == "DistributedDataParallel"
    assert seen["offload true"] != seen["offload false"] and "CPUOffloadPolicy" in seen["offload true"]


def test_a_reset_under_fsdp_copies_the_policy_into_the_reference(launch):
    assert launch["seen"]["reset"] == (True, True, True)
