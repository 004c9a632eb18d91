"""Checkpoints: everything a run needs to continue bit for bit, written atomically, verified on resume.

A checkpoint `step_NNNNNN/` holds HF-format weights (safetensors, gathered parameter by parameter from the
shards; `AutoModelForCausalLM.from_pretrained` and vLLM load it), the reference model (`reference/`), one
optimizer + scheduler + RNG state per trainer rank (`trainer_state_rankN.pt`), and `ulorl_state.json`: the
unfinished samples, the experience pool and the ready groups, the run state (step, policy version, data
cursor), Python's RNG, the config. `manifest.json` lists the size of every file and the sha256 of every
file up to HASH_MAX_BYTES: hashing the weights of a 30B model (policy + reference, ~120 GB) at every save
would take minutes, and a torn or truncated write already shows in the sizes. Everything is written to
`step_NNNNNN.tmp`, fsynced, then renamed: a crash leaves either the old state or the new one.
"""
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys

import torch
from torch.distributed.tensor import DTensor

import model as model_lib
from segment_rollout import Pools, Sample
from ulorl import RunState

HASH_MAX_BYTES = 64 << 20  # files up to 64 MiB get a sha256 in the manifest (all of the tiny model's); bigger ones a size


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def local_shards(obj):
    """An optimizer state dict with each sharded (DTensor) value replaced by this rank's shard."""
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: local_shards(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_shards(v) for v in obj]
    return obj


def load_optimizer(opt, saved: dict) -> None:
    """Inverse of local_shards(): this rank's shards become DTensors shaped like their parameters again."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, st in saved["state"].items():
        p = params[int(i)]
        if isinstance(p, DTensor):
            for k, v in st.items():
                if k != "step" and torch.is_tensor(v) and v.shape == p.to_local().shape:
                    st[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    opt.load_state_dict(saved)


def write_manifest(tmp: str, run_id: str, step: int) -> None:
    """manifest.json: which run and step wrote the checkpoint, and each file's size (and sha256 up to
    HASH_MAX_BYTES)."""
    files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, names in os.walk(tmp) for n in names)
    listing = {}
    for f in files:
        size = os.path.getsize(os.path.join(tmp, f))
        listing[f] = {"size": size, **({"sha256": file_digest(os.path.join(tmp, f))} if size <= HASH_MAX_BYTES else {})}
    with open(os.path.join(tmp, "manifest.json"), "w") as fh:
        json.dump({"run": run_id, "step": step, "files": listing}, fh, indent=1)
    for f in files + ["manifest.json"]:  # data on disk before the rename makes it visible
        fd = os.open(os.path.join(tmp, f), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def save(path: str, lm, ref_lm, tokenizer, opt, sched, engine, pools: Pools, state: RunState, cfg,
         git: str = "unknown") -> None:
    """Write checkpoint `path` (see the module docstring). Every trainer rank calls this: the weights are
    gathered from the shards (rank 0 writes them) and each rank writes its own optimizer state. `cfg` is
    config.py's Config; the newest --keep-last checkpoints in cfg.out are kept."""
    lead = model_lib.rank() == 0
    tmp = path + ".tmp"
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    model_lib.barrier()
    for model, sub in ((lm, ""), (ref_lm, "reference")):
        if model is not None:
            if lead:
                model_lib.save_weights(model, model_lib.hf_weights(model), tokenizer, os.path.join(tmp, sub))
            else:
                model_lib.gather_only(model)
    torch.save({"optimizer": local_shards(opt.state_dict()), "scheduler": sched.state_dict(),
                "engine_rng": engine.rng_state() if engine is not None else None,
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, f"trainer_state_rank{model_lib.rank()}.pt"))
    model_lib.barrier()
    if lead:
        run_state = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "ready"}
        pool_state = {"unfinished": [dataclasses.asdict(s) for s in pools.unfinished],
                      "experience": [dataclasses.asdict(s) for g in pools.experience.values() for s in g],
                      "ready": [[dataclasses.asdict(s) for s in g] for g in state.ready],
                      "next_uid": pools.next_uid, "next_group": pools.next_group}
        with open(os.path.join(tmp, "ulorl_state.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "git": git, **run_state, "world_size": model_lib.world(),
                       "python_rng": random.getstate(), "pools": pool_state}, f)
        write_manifest(tmp, state.run_id, state.step)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        prune(cfg.out, cfg.keep_last, state.run_id)
    model_lib.barrier()


def prune(out: str, keep_last: int, run_id: str) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (0: keep all) of run `run_id` in `out`, never one
    another run wrote. Returns the names deleted."""
    mine = [name for name in list_checkpoints(out) if read_manifest(os.path.join(out, name)).get("run") == run_id]
    gone = mine[:-keep_last] if keep_last > 0 else []
    for name in gone:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    return gone


def list_checkpoints(out: str) -> list[str]:
    """step_NNNNNN directories in `out`, oldest first (unfinished `.tmp` writes excluded)."""
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out) if d.startswith("step_") and not d.endswith(".tmp"))


def read_manifest(path: str) -> dict:
    """A checkpoint's manifest, {} when it has none that parses."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def problem(path: str) -> str | None:
    """Why a checkpoint cannot be trusted (missing manifest, missing, resized or altered file), or None."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable manifest.json ({e})"
    listing = manifest["files"] if "files" in manifest else manifest  # checkpoints from before the run id
    for name, want in listing.items():
        p = os.path.join(path, name)
        if not os.path.exists(p):
            return f"{name} is missing"
        if os.path.getsize(p) != want["size"]:
            return f"{name} has {os.path.getsize(p)} bytes, the manifest says {want['size']}"
        if "sha256" in want and file_digest(p) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def run_files(out: str) -> list[str]:
    """What of a run the folder `out` holds: metrics.jsonl / samples.jsonl with records, step_* checkpoints
    (finished or interrupted), --report-to's tb/ and wandb/ folders."""
    if not os.path.isdir(out):
        return []
    found = [n for n in ("metrics.jsonl", "samples.jsonl")
             if os.path.exists(os.path.join(out, n)) and os.path.getsize(os.path.join(out, n)) > 0]
    return found + sorted(d for d in os.listdir(out) if d.startswith("step_") or d in ("tb", "wandb"))


def find_resume(resume: str, out: str, overwrite: bool = False) -> str | None:
    """The checkpoint a run starts from (None: from the model), given --resume, --out and --overwrite. An --out
    that holds a run is never written over unless --resume continues it or --overwrite says so; --resume auto
    takes the newest checkpoint that passes its manifest check (those skipped are named), starts fresh in a
    folder holding no run, and stops, listing what it found and why each was rejected, when nothing of a run
    there can be resumed. Read-only: --overwrite's deletion is clear_run()'s."""
    held = run_files(out)
    if overwrite:
        return None
    if not resume:
        if held:
            raise ValueError(f"--out {out} holds a run ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): "
                             f"continue it with --resume auto, start it again with --overwrite (deletes those), or "
                             f"choose another --out")
        return None
    if resume != "auto":
        if why := problem(resume):
            raise ValueError(f"--resume {resume}: {why}")
        same = os.path.realpath(os.path.dirname(os.path.abspath(resume))) == os.path.realpath(out)
        if held and not same:
            raise ValueError(f"--resume {resume} writes into --out {out}, which holds another run ({', '.join(held[:5])}"
                             f"): choose an empty --out, or --out {os.path.dirname(os.path.abspath(resume))}")
        return resume
    rejected = []
    for name in reversed(list_checkpoints(out)):
        why = problem(os.path.join(out, name))
        if why is None:
            for skipped, reason in rejected:
                print(f"warning: skipping checkpoint {os.path.join(out, skipped)}: {reason}", file=sys.stderr, flush=True)
            return os.path.join(out, name)
        rejected.append((name, why))
    if not held:
        return None  # nothing to lose: a fresh start
    rejected += [(name, "an interrupted save") for name in held if name.endswith(".tmp")]
    lines = [f"  {name}: {why}" for name, why in rejected] or [f"  no checkpoint; {', '.join(held)} only"]
    raise ValueError(f"--resume auto: nothing in {out} can be resumed:\n" + "\n".join(lines) +
                     "\nstart the run again with --overwrite (deletes them), or choose another --out")


def clear_run(out: str) -> list[str]:
    """--overwrite: delete the run held in `out` (run_files); returns what was deleted."""
    held = run_files(out)
    for name in held:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return held


def load(path: str, opt, sched, engine, pools: Pools, state: RunState) -> None:
    """The state save() wrote (the weights were loaded with the model); every rank reads its own optimizer
    state, so a sharded run resumes on the same number of ranks."""
    with open(os.path.join(path, "ulorl_state.json")) as f:
        saved = json.load(f)
    if saved.get("world_size", 1) != model_lib.world():
        raise ValueError(f"--resume {path}: saved by {saved.get('world_size', 1)} trainer process(es), resumed "
                         f"with {model_lib.world()}; run with --nproc-per-node {saved.get('world_size', 1)}")
    trainer = torch.load(os.path.join(path, f"trainer_state_rank{model_lib.rank()}.pt"), weights_only=True)
    load_optimizer(opt, trainer["optimizer"])
    sched.load_state_dict(trainer["scheduler"])
    if engine is not None:
        engine.set_rng_state(trainer["engine_rng"])
    torch.set_rng_state(trainer["torch_rng"])
    version, internal, gauss = saved["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    p = saved["pools"]
    pools.unfinished = [Sample(**d) for d in p["unfinished"]]
    for d in p.get("experience", p.get("finished", [])):  # "finished": the pool's name before it was renamed
        pools.experience.setdefault(d["group"], []).append(Sample(**d))
    pools.next_uid, pools.next_group = p["next_uid"], p["next_group"]
    for f in dataclasses.fields(RunState):  # step, version, cursor, ...; ready groups are with the pools
        if f.name in saved and f.name != "ready":
            setattr(state, f.name, saved[f.name])
    state.ready = [[Sample(**d) for d in g] for g in p["ready"]]
