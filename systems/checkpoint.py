"""Checkpoints: everything a run needs to continue bit for bit, written atomically, verified on resume.

A checkpoint `step_NNNNNN/` holds HF-format weights (safetensors, gathered parameter by parameter from the
shards; `AutoModelForCausalLM.from_pretrained` and vLLM load it), the reference model (`reference/`), one
optimizer + scheduler + RNG state per trainer rank (`trainer_state_rankN.pt`), and `ulorl_state.json`: the
unfinished samples, the experience pool and the ready groups, the run state (step, policy version, data
cursor), Python's RNG, the config; `routing.pt`: the samples' Mixture-of-Experts routing (--routing-replay).
`manifest.json` lists the size and sha256 of every file. The weights, the optimizer states and the run state
are hashed as they are written (checkpoint.HashingWriter), so a save reads nothing back; the few small files a
library writes itself (config, tokenizer) are read back. Resume checks every file against its digest: one
flipped bit anywhere is caught, at the cost of reading the checkpoint once (a 30B policy + reference + AdamW
in fp32 is ~0.7 TB over all ranks: minutes at a few GB/s). Everything is written to `step_NNNNNN.tmp`,
fsynced, then renamed (a step saved again, on the engine-failure path, is swapped in with one
renameat2(RENAME_EXCHANGE)): at every instant a complete checkpoint is there, the old or the new. Every file is
written and read through an outdir.Folder (a held folder descriptor; no link followed, regular files of one
link only), so a name swapped under --out while a save runs makes the save fail, never write elsewhere. The
run's folder is the one each rank opened at start (train.claim_out): no writer is given a path under --out.
The safetensors shards and the index are written by write_safetensors into a HashingWriter (a file opened in
the held folder), torch.save (each rank's optimizer shard, routing.pt) writes into one too, and what
transformers' save_pretrained writes by path (config, tokenizer) goes to a private folder in TMPDIR and is
copied in the same way. Which checkpoint a run resumes, and the --out folder's lock, are outdir.py's.
"""
import contextlib
import copy
import errno
import dataclasses
import hashlib
import json
import os
import random
import tempfile

import torch
from torch.distributed.tensor import DTensor

import model as model_lib
from segment_rollout import Pools, Sample
from rollouts import Prefetched
from ulorl import RunState
from systems import distributed
from systems import outdir
from systems.outdir import Folder

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


def write_manifest(folder: Folder, run_id: str, step: int, digests: dict[str, dict]) -> None:
    """manifest.json: which run and step wrote the checkpoint, and each file's size and sha256: from `digests`
    (relative path -> {size, sha256}, taken as the files were written), else read now."""
    listing = {}
    for name in folder.files():
        with folder.open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            listing[name] = digests.get(name) or {"size": size, "sha256": outdir.file_digest(f)}
            if listing[name]["size"] != size:
                raise OSError(errno.EIO, f"{name} has {size} bytes on disk, {listing[name]['size']} were written",
                              os.path.join(folder.path, name))
    with folder.open("manifest.json", "w", new=True) as fh:
        json.dump({"run": run_id, "step": step, "files": listing}, fh, indent=1)
    for name in [*listing, "manifest.json"]:  # data on disk before the rename makes it visible
        with folder.open(name, "rb") as f:
            os.fsync(f.fileno())


def save(out: Folder, name: str, lm, ref_lm, tokenizer, opt, sched, engine, pools: Pools, state: RunState, cfg,
         git: str = "unknown") -> None:
    """Write checkpoint `name` into `out`, the run's folder held since its start (see the module docstring).
    Every trainer rank calls this, each with its own hold on the same folder: the weights are gathered from the
    shards (rank 0 writes them) and each rank writes its own optimizer state. `cfg` is config.py's Config; the
    newest --keep-last checkpoints of this run are kept."""
    lead = distributed.rank() == 0
    if lead:
        if name + ".tmp" in out.names():
            out.remove(name + ".tmp")
        out.sub(name + ".tmp", create=True).close()
    distributed.barrier()
    with out.sub(name + ".tmp") as tmp:
        _save_into(tmp, lm, ref_lm, tokenizer, opt, sched, engine, pools, state, cfg, git)
        if lead:
            publish(out, tmp, name)
            outdir.prune(out, cfg.keep_last, state.run_id)
    distributed.barrier()


def _save_into(tmp: Folder, lm, ref_lm, tokenizer, opt, sched, engine, pools, state, cfg, git) -> None:
    lead = distributed.rank() == 0
    digests = {}  # relative path -> {size, sha256}, hashed as written
    dtype = model_lib.DTYPES[cfg.dtype]  # what a user serves: the run's dtype, whatever the masters' (fp32)
    for model, sub in ((lm, ""), (ref_lm, "reference")):
        if model is not None:
            if lead:
                folder = tmp.sub(sub, create=True) if sub else tmp
                try:
                    written = save_weights(model, distributed.hf_weights(model, dtype=dtype), tokenizer, folder,
                                           dtype=dtype)
                finally:
                    if sub:
                        folder.close()
                digests.update({os.path.join(sub, n): d for n, d in written.items()})
            else:
                distributed.gather_only(model, dtype)
    # a bf16 run's fp32 master weights (what AdamW steps; the export above is rounded), this rank's shards
    masters = [local_shards(p.detach()) for g in opt.param_groups for p in g["params"]] \
        if cfg.dtype != "float32" else None
    name = f"trainer_state_rank{distributed.rank()}.pt"
    written = torch_save({"optimizer": local_shards(opt.state_dict()), "masters": masters,
                          "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                          "engine_rng": engine.rng_state() if engine is not None else None}, tmp, name)
    for ranks_digest in distributed.gather_objects({name: written}):  # every rank's, to rank 0's manifest
        digests.update(ranks_digest)
    distributed.barrier()
    if lead:
        run_state = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "ready"}
        run_state["prefetched"] = dataclasses.asdict(state.prefetched) if state.prefetched else {}
        pool_state = {"unfinished": [sample_record(s) for s in pools.unfinished],
                      "experience": [sample_record(s) for g in pools.experience.values() for s in g],
                      "ready": [[sample_record(s) for s in g] for g in state.ready],
                      "next_uid": pools.next_uid, "next_group": pools.next_group}
        routes = {s.uid: s.routing for s in pooled(pools, state) if s.routing is not None}
        if routes:  # --routing-replay: layers x top_k bytes a token, binary beside the JSON
            digests["routing.pt"] = torch_save(routes, tmp, "routing.pt")
        with HashingWriter(tmp, "ulorl_state.json") as f:
            f.write(json.dumps({"config": dataclasses.asdict(cfg), "git": git, **run_state,
                                "world_size": distributed.world(), "python_rng": random.getstate(),
                                "pools": pool_state}).encode())
        digests["ulorl_state.json"] = f.digest()
        write_manifest(tmp, state.run_id, state.step, digests)


def torch_save(obj, folder: Folder, name: str) -> dict:
    """torch.save into `name` in `folder`, hashed as written; returns its {size, sha256}. A refused write (a full
    disk) is the OSError it was, not the RuntimeError torch's writer wraps it in."""
    with HashingWriter(folder, name) as f:
        try:
            torch.save(obj, f)
        except RuntimeError:
            if f.error is None:
                raise
            raise f.error from None
    return f.digest()


def publish(out: Folder, tmp: Folder, name: str) -> None:
    """The finished checkpoint `tmp` (held open, named `name`.tmp in `out`) becomes `name`. A new step is a
    rename. A step saved again (the engine failure path) is swapped with its old copy in one renameat2
    (RENAME_EXCHANGE), and the old copy, now under the `.tmp` name, deleted: deleting first and renaming after
    would leave, for a SIGKILL in between, only a `.tmp` that resume does not trust. The name must hold `tmp`
    itself before and after: something else put there while the save ran (a link to another folder) fails it."""
    def check(at: str, when: str) -> None:
        if not out.holds(at, tmp):
            raise ValueError(f"{os.path.join(out.path, at)} was replaced {when} (something else writes into --out); "
                             f"the checkpoint was not published")
    check(name + ".tmp", "while the checkpoint was written")
    if name not in out.names():
        out.replace(name + ".tmp", name)
    else:
        out.exchange(name + ".tmp", name)
        out.remove(name + ".tmp")
    check(name, "as the checkpoint was published")


def pooled(pools: Pools, state: RunState) -> list[Sample]:
    """Every sample a checkpoint keeps: unfinished, in the experience pool, in the ready groups."""
    return pools.unfinished + [s for g in [*pools.experience.values(), *state.ready] for s in g]


def sample_record(s: Sample) -> dict:
    """A sample's fields for ulorl_state.json (its routing goes to routing.pt)."""
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "routing"}


def load(path: str, opt, sched, engine, pools: Pools, state: RunState, masters=None) -> None:
    """The state save() wrote (the weights were loaded with the model); every rank reads its own optimizer
    state, so a sharded run resumes on the same number of ranks. A bf16 run's fp32 master weights replace
    the rounded ones the model loaded with: the optimizer's parameters, and `masters` (distributed.MasterWeights)
    copies them into the module."""
    with Folder.at(os.path.dirname(path) or ".") as out, out.sub(os.path.basename(path)) as folder:
        with folder.open("ulorl_state.json", "r") as f:
            try:
                saved = json.load(f)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{os.path.join(path, 'ulorl_state.json')}: not JSON ({e})") from None
        if not isinstance(saved, dict) or type(saved.get("world_size")) is not int:
            raise ValueError(f"{os.path.join(path, 'ulorl_state.json')}: not the state a run saves (no world_size)")
        if saved["world_size"] != distributed.world():
            raise ValueError(f"--resume {path}: saved by {saved['world_size']} trainer process(es), resumed "
                             f"with {distributed.world()}; run with --nproc-per-node {saved['world_size']}")
        trainer = load_tensors(folder, f"trainer_state_rank{distributed.rank()}.pt")
        routes = None
        if distributed.rank() == 0 and "routing.pt" in folder.names():  # only rank 0 samples
            routes = load_tensors(folder, "routing.pt")
    try:
        _restore(saved, trainer, routes, opt, sched, engine, pools, state, masters)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ValueError(f"{os.path.join(path, 'ulorl_state.json')}: not the state a run saves, or not this run's "
                         f"optimizer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _restore(saved: dict, trainer: dict, routes, opt, sched, engine, pools: Pools, state: RunState, masters) -> None:
    load_optimizer(opt, trainer["optimizer"])
    if trainer.get("masters") is not None:
        with torch.no_grad():
            for p, master in zip([p for g in opt.param_groups for p in g["params"]], trainer["masters"]):
                (p.to_local() if isinstance(p, DTensor) else p).copy_(master)
        if masters is not None:
            masters.copy_to_model()
    sched.load_state_dict(trainer["scheduler"])
    if engine is not None:
        engine.set_rng_state(trainer["engine_rng"])
    torch.set_rng_state(trainer["torch_rng"])
    version, internal, gauss = saved["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    p = saved["pools"]
    pools.unfinished = [Sample(**d) for d in p["unfinished"]]
    for d in p["experience"]:
        pools.experience.setdefault(d["group"], []).append(Sample(**d))
    pools.next_uid, pools.next_group = p["next_uid"], p["next_group"]
    for f in dataclasses.fields(RunState):  # step, version, cursor, ...; ready groups are with the pools
        if f.name in saved and f.name != "ready":
            setattr(state, f.name, saved[f.name])
    state.prefetched = Prefetched(**saved["prefetched"]) if saved.get("prefetched") else None
    state.ready = [[Sample(**d) for d in g] for g in p["ready"]]
    if routes is not None:
        for s in pooled(pools, state):
            s.routing = routes.get(s.uid)


def load_tensors(folder: Folder, name: str):
    """torch.load of `name` in `folder` as weights only: a pickle that would build anything else (run code) is
    refused, naming the file, as is a file torch cannot read."""
    with folder.open(name, "rb") as f:
        try:
            return torch.load(f, weights_only=True)
        except Exception as e:  # pickle's UnpicklingError, torch's RuntimeError for a damaged archive, ...
            raise ValueError(f"{os.path.join(folder.path, name)}: not a file of tensors that loads without running "
                             f"code ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


# ------------------------------------------------------------------ HF-format weights with their digests

class HashingWriter:
    """A new file `name` in `folder` whose bytes are hashed (sha256) as they pass: a checkpoint's manifest gets
    every file's digest without reading anything back (at 30B that would be ~120 GB more to read a save)."""

    def __init__(self, folder: Folder, name: str):
        self.file, self.sha, self.size = folder.open(name, "wb", new=True), hashlib.sha256(), 0
        self.path = os.path.join(folder.path, name)
        self.error: OSError | None = None  # the refused write, for a caller that gets it wrapped (torch.save)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += view.nbytes
        try:
            return self.file.write(view)
        except OSError as e:  # name the file (a full disk's error names none)
            self.error = OSError(e.errno, e.strerror, self.path)
            raise self.error from None

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def digest(self) -> dict:
        return {"size": self.size, "sha256": self.sha.hexdigest()}


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(tensors: dict[str, torch.Tensor], f, metadata: dict | None = None) -> None:
    """The safetensors format into the open file `f`, tensor by tensor: an 8-byte little-endian header size,
    a JSON header (each tensor's dtype, shape and byte range; padded with spaces to 8 bytes), then the raw
    bytes in that order. Written here rather than by safetensors.save_file so that its bytes can be hashed
    as they are written (HashingWriter) and a full disk raises an ordinary OSError."""
    header, offset = {"__metadata__": metadata} if metadata else {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for t in tensors.values():
        if t.numel():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def in_tmpdir():
    """A refused write in the block is TMPDIR's (outdir.TmpdirError): a full TMPDIR is said as such, not as --out."""
    try:
        yield
    except OSError as e:
        raise outdir.TmpdirError(e.errno, e.strerror, tempfile.gettempdir()) from None


def save_weights(lm, weights, tokenizer, dest: "Folder | str", max_shard_bytes: int = 5 << 30,
                 dtype: torch.dtype | None = None) -> dict[str, dict]:
    """An HF-format checkpoint written into `dest` (a Folder, or a path made if needed) as the (name, tensor) pairs
    stream in (hf_weights: a decoder layer at a time): safetensors shards of at most `max_shard_bytes` with
    model.safetensors.index.json (a single model.safetensors when all fits one), config, tokenizer; loadable by
    from_pretrained and vLLM. Host memory holds one shard and one layer, never the whole model. In a sharded
    run every rank walks hf_weights() (or gather_only) and only rank 0 calls this with it. Returns the size and
    sha256 of each file written, by its name in `dest`, hashed as written. dtype: the weights' dtype as
    config.json states it (hf_weights(dtype=...) casts them; fp32 master weights are exported in the run's
    dtype)."""
    if isinstance(dest, str):
        os.makedirs(dest, exist_ok=True)
        with Folder.at(dest) as folder:
            return save_weights(lm, weights, tokenizer, folder, max_shard_bytes, dtype)
    shard, size, files, weight_map, digests = {}, 0, [], {}, {}

    def write():
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        with HashingWriter(dest, files[-1]) as f:
            write_safetensors(shard, f, metadata={"format": "pt"})
        digests[files[-1]] = f.digest()
        weight_map.update(dict.fromkeys(shard, files[-1]))

    total = 0
    for name, t in weights:
        t = t.detach().to("cpu", copy=True).contiguous()
        if shard and size + t.nbytes > max_shard_bytes:
            write()
            shard, size = {}, 0
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes
    if shard or not files:
        write()
    # the total is known only now: the usual names carry it
    final = {files[0]: "model.safetensors"} if len(files) == 1 else \
        {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for f, g in final.items():
        dest.replace(f, g)
    digests = {final[f]: d for f, d in digests.items()}
    if len(files) > 1:
        with HashingWriter(dest, "model.safetensors.index.json") as f:
            f.write(json.dumps({"metadata": {"total_size": total},
                                "weight_map": {k: final[v] for k, v in weight_map.items()}}, indent=2).encode())
        digests["model.safetensors.index.json"] = f.digest()
    return {**digests, **save_library_files(lm, tokenizer, dest, dtype)}


def save_library_files(lm, tokenizer, dest: Folder, dtype: torch.dtype | None) -> dict[str, dict]:
    """What the libraries write themselves (config, generation config, tokenizer), into a private folder in TMPDIR
    first, then into `dest` through HashingWriter: a library opens paths, and would follow a link planted in
    --out. Returns each file's size and sha256."""
    config = copy.deepcopy(lm.config)
    if dtype is not None:
        config.dtype = dtype
    digests = {}
    with in_tmpdir():
        folder = tempfile.TemporaryDirectory(prefix="ulorl_save_")
    with folder as private:
        with in_tmpdir():
            config.save_pretrained(private)
            if getattr(lm, "generation_config", None) is not None:
                lm.generation_config.save_pretrained(private)
            tokenizer.save_pretrained(private)
        for name in sorted(os.listdir(private)):
            with open(os.path.join(private, name), "rb") as src, HashingWriter(dest, name) as f:
                for block in iter(lambda: src.read(1 << 20), b""):
                    f.write(block)
            digests[name] = f.digest()
    return digests
