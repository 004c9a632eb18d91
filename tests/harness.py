"""The trainer's own entry points run in the test's process with tiny budgets: `train.set_up` (`setup`) and
`train.main` (`train_run`), with what they change of the process (threads, umask, signal handlers) put back, and
what a run wrote read back as plain values (`observe`). A whole 2-step run takes ~0.5 s this way, a process
~3 s. Shared by tests/test_flags.py and tests/test_resume.py."""
import contextlib
import copy
import json
import os
import signal

import torch

import config
import data
import model as model_lib
import reward
import tiny
import train
import verifiers
from segment_rollout import Pools, rollout_step
from systems.engine import HFEngine, Sampling

# timing, memory and the startup record differ from run to run: never an observable
VOLATILE = ("time/", "memory/", "tokens/per_s", "config", "git")


@contextlib.contextmanager
def process_state():
    """What set_up and main change of this process (torch's threads, the umask, SIGTERM/SIGINT), put back."""
    threads, umask = torch.get_num_threads(), os.umask(0o022)
    os.umask(umask)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.umask(umask)
        for s, h in handlers.items():
            signal.signal(s, h)


def parse(args: list[str], out) -> config.Config:
    """`args` as train.py reads them, with one thread unless they say otherwise and --out `out`."""
    return config.parse_config(["--threads", "1", *args, "--out", str(out)])


@contextlib.contextmanager
def setup(args: list[str], out):
    """train.set_up's Run for `args` (one thread, --out `out`), its log and --out lock closed afterwards."""
    with process_state():
        run = train.set_up(parse(args, out))
        try:
            yield run
        finally:
            run.log.close()
            run.out_lock.close()
            run.out.close()


def train_run(args: list[str], out) -> str:
    """train.main for `args` (one thread, --out `out`); returns `out`."""
    with process_state():
        train.main(parse(args, out))
    return str(out)


def records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in f]


def observe(out) -> dict:
    """What a run wrote, as plain values: its records (timing and memory left out), the held-out evaluations and
    the reference resets among them, the samples it dumped, the files in --out and its checkpoints."""
    recs = records(out)
    with open(os.path.join(out, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    return {"records": recs, "samples": samples,
            "evals": {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in recs
                      if "eval/accuracy" in r},
            "resets": [r["step"] for r in recs if r.get("train/ref_reset")],
            "files": sorted(os.listdir(out)), "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("step_"))}


def stale_groups(n_prompts: int = 8, group: int = 4, seed: int = 7) -> list[list]:
    """Complete groups of the shipped warm start's own rollouts of the tiny task, rewarded as training rewards
    them, decoded over three policy versions: segments of 8 tokens by version 0 (the warm start's weights
    perturbed by noise of std 0.02), 1 (std 0.01) and 2 (the warm start itself, so that the trainer's weights
    are the engine's for the tokens version 2 sampled); 24 tokens at most, so that long responses are truncated
    (reward 0, as --overlong zero gives). Every kind of token a step can train: three versions, positive and
    negative samples, mastered tokens, truncated samples."""
    lm, tok = model_lib.load(tiny.CKPT)
    warm = copy.deepcopy(lm.state_dict())
    engine = HFEngine(lm, [tok.eos_token_id], tok.pad_token_id, seed=seed)
    pools, noise = Pools(), torch.Generator().manual_seed(seed)
    new = [pools.new_group(data.encode_prompt(tok, r["prompt"]), r, group) for r in tiny.make_rows(n_prompts, seed)]
    for version, std in enumerate((0.02, 0.01, 0.0)):
        with torch.no_grad():
            for name, p in lm.named_parameters():
                p.copy_(warm[name] + std * torch.randn(p.shape, generator=noise))
        rollout_step(engine, pools, new if version == 0 else [], 8, 24, Sampling(1.0), version)
    assert not pools.unfinished
    groups = pools.ready_groups(group)
    samples = [s for g in groups for s in g]
    texts = tok.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
    for s, text in zip(samples, texts):
        s.reward = reward.overlong_reward(verifiers.tiny_reward(text, s.row["answer"]), len(s.tokens),
                                          s.finish == "truncated", 24)
    return groups

