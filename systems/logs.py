"""What a run writes beside its checkpoints, on rank 0: `metrics.jsonl` (one record a step; the first also holds
the config and git hash), `samples.jsonl` (the trained responses, decoded), and with --report-to the same
numbers under the same keys to TensorBoard (event files in --out/tb) and/or Weights & Biases (offline unless
WANDB_MODE=online: no network or account needed). On resume both files are cut back to the checkpoint's step:
the steps after it are done again and written again.
"""
import dataclasses
import json
import math
import os
import subprocess

from systems.outdir import Folder


def git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_record(f, rec: dict) -> None:
    """One JSON line; NaN or inf (not JSON) become null."""
    rec = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
    f.write(json.dumps(rec, allow_nan=False) + "\n")
    f.flush()


def open_for_append(folder: Folder, name: str, resumed_step: int | None):
    """The file `name` in the run's folder, open for appending; on resume without the records of steps after
    `resumed_step`."""
    keep = []
    if resumed_step is not None and name in folder.names():
        with folder.open(name, "r") as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
    with folder.open(name, "w") as f:
        f.writelines(keep)
    return folder.open(name, "a")


class RunLog:
    """Rank 0's records of a run in `out`, its --out held since the start (config.py's `Config` `cfg`).
    --report-to's libraries open their folders (tb/, wandb/) by path: theirs, not the run's own files."""

    def __init__(self, cfg, out: Folder, resumed_step: int | None):
        self.metrics = open_for_append(out, "metrics.jsonl", resumed_step)
        self.samples = open_for_append(out, "samples.jsonl", resumed_step)
        self.first = {} if resumed_step is not None else {"git": git_hash(), "config": dataclasses.asdict(cfg)}
        self.tb = self.wandb = None
        targets = set(cfg.report_to.split(","))
        try:
            if "tensorboard" in targets:
                from torch.utils.tensorboard import SummaryWriter  # only runs that ask for it pay the import
                self.tb = SummaryWriter(os.path.join(cfg.out, "tb"))
            if "wandb" in targets:
                import wandb
                os.environ.setdefault("WANDB_MODE", "offline")
                self.wandb = wandb.init(project="ulorl", dir=cfg.out, config=dataclasses.asdict(cfg),
                                        resume="allow", id=os.path.basename(os.path.abspath(cfg.out)))
        except ImportError as e:
            raise ValueError(f"--report-to {cfg.report_to}: {e.name} is not installed (pip install tensorboard "
                             f"wandb)") from None

    def record(self, rec: dict) -> None:
        """One metrics.jsonl line; a new run's first also holds the git hash and the config. `rec`'s finite
        numbers go to the trackers."""
        write_record(self.metrics, {**rec, **self.first})
        self.first = {}
        numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, rec["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=rec["step"])

    def dump_samples(self, groups: list, step: int, tokenizer, limit: int) -> None:
        """The first `limit` trained samples of the step, decoded, with their per-segment policy versions."""
        samples = [s for g in groups for s in g][:limit]
        texts = tokenizer.batch_decode([s.tokens for s in samples], skip_special_tokens=True)
        prompts = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=False)
        for s, text, prompt in zip(samples, texts, prompts):
            self.samples.write(json.dumps({
                "step": step, "group": s.group, "uid": s.uid, "verifier": s.row.get("verifier"), "prompt": prompt,
                "response": text, "n_tokens": len(s.tokens), "versions": s.segment_versions(), "finish": s.finish,
                "reward": s.reward}) + "\n")
        self.samples.flush()

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
