"""The model side of the trainer: loading the model and tokenizer (YaRN flags; sharded under FSDP), the
micro-batch layout (`MicroBatch`, `micro_batches`, `collate`) and the forward pass to response log-probs
(`response_logprobs`, as the module `Policy` that DDP/FSDP2 wrap). The systems wrap that forward from outside
(systems/placement.py `wrap`: sequence parallelism and packed attention, MoE routing replay, FSDP2/DDP).
"""
import functools
import itertools
import json
import math
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import data
import loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def yarn_overrides(config, factor: float, original_max_positions: int = 0) -> dict:
    """Config fields that turn on YaRN rope scaling (UloRL section 4: factor 1.5 over 95232 original
    positions, so 142848 positions reach 128k responses); {} when factor is 0. The same dict goes to the
    trainer's config (load) and to vLLM (`hf_overrides`), so both compute the same positions.
    transformers 5 keeps rope settings in `config.rope_parameters` (rope_theta included), and both it and
    vLLM take `max_position_embeddings` as the length *after* scaling. original_max_positions 0: the
    config's own (its YaRN original when it has one, so that a checkpoint saved with YaRN is not scaled
    twice on resume). A model saved with YaRN in its config.json needs no flag."""
    if not factor:
        return {}
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in rope:
        raise ValueError(f"--rope-scaling-factor: the model config has no single rope_parameters dict with a "
                         f"rope_theta ({rope!r}); set YaRN in its config.json instead")
    original = (original_max_positions or rope.get("original_max_position_embeddings")
                or config.max_position_embeddings)
    kept = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}
    return {"rope_parameters": {**kept, "rope_type": "yarn", "factor": float(factor),
                                "original_max_position_embeddings": original},
            "max_position_embeddings": int(original * factor)}


def load_config(name_or_path: str, rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0):
    """(tokenizer, config) of a hub name (from the Hugging Face cache, or downloaded) or a local directory,
    with the YaRN flags applied (yarn_overrides) and a Mixture-of-Experts model's router auxiliary loss off
    (output_router_logits False): RL's loss is the policy's alone, and the trainer's forward
    (response_logprobs) runs the decoder without it."""
    if os.path.isdir(os.path.expanduser(name_or_path)):
        check_files(os.path.expanduser(name_or_path))
    tokenizer = hub_files(name_or_path, functools.partial(AutoTokenizer.from_pretrained, trust_remote_code=False))
    if tokenizer.pad_token_id is None:  # base models often lack one; it is only used as padding here
        tokenizer.pad_token = tokenizer.eos_token
    check_template(tokenizer)
    return tokenizer, model_config(name_or_path, rope_scaling_factor, rope_original_max_positions)


def model_config(name_or_path: str, rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0):
    """The config.json alone (what train.py --plan reads), with load_config's YaRN and router settings."""
    config = hub_files(name_or_path, functools.partial(AutoConfig.from_pretrained, trust_remote_code=False))
    for key, value in yarn_overrides(config, rope_scaling_factor, rope_original_max_positions).items():
        setattr(config, key, value)  # what vLLM does with hf_overrides
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    return config


def hub_files(name_or_path: str, load):
    """load(name_or_path), with one clear error when neither a directory nor the hub/cache has it."""
    from config import is_local_path  # (config.py reads --model without loading this file's model code)
    if is_local_path(name_or_path) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"--model {name_or_path}: no such directory")
    try:
        return load(name_or_path)
    except OSError as e:
        offline = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise FileNotFoundError(f"--model {name_or_path}: neither a local directory nor a model the Hugging Face "
                                f"hub or cache has{offline}: {e}") from None


def load(name_or_path: str, dtype: str = "float32", device: str = "cpu", gradient_checkpointing: bool = False,
         rope_scaling_factor: float = 0.0, rope_original_max_positions: int = 0, attn_implementation: str = "sdpa"):
    """(model, tokenizer), the whole model in this process (one process, DDP, the engine's copy): a hub name
    or a local directory (load_config), weights from safetensors only (no pickle)."""
    tokenizer, config = load_config(name_or_path, rope_scaling_factor, rope_original_max_positions)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=DTYPES[dtype], use_safetensors=True,
                                                 attn_implementation=attn_implementation, trust_remote_code=False)
    if gradient_checkpointing:  # recompute each decoder layer in the backward (non-reentrant checkpoint)
        model.gradient_checkpointing_enable()
    return model.to(device), tokenizer


# ------------------------------------------------------------------ a model's folder, before a library reads it
# A checkpoint in --out (or a --model folder) may hold what whoever can write there put in it, with a manifest
# made to match. What the libraries would run or read out of bounds is refused first, naming the file: code
# (auto_map: never trust_remote_code), a safetensors header whose tensors do not tile the file (the library
# fails with a traceback), an index naming files outside the folder, a chat template that reads other templates
# or loops (data.encode_prompt bounds every rendering in time; a probe renders one at load). Pickles are never
# loaded: weights from safetensors only, torch.load with weights_only (checkpoint.load).

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                     "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def check_files(path: str) -> None:
    """A model's folder (a checkpoint, or --model PATH) as the libraries will read it: refused with one line
    naming the file (see above)."""
    for name in ("config.json", "tokenizer_config.json"):
        if os.path.isfile(file := os.path.join(path, name)):
            try:
                with open(file, "rb") as f:
                    found = json.loads(f.read(MAX_HEADER_BYTES))
            except (OSError, ValueError, RecursionError) as e:
                raise ValueError(f"{file}: not a JSON object ({type(e).__name__}: {e})") from None
            if isinstance(found, dict) and "auto_map" in found:
                raise ValueError(f"{file} names code of its own to run (auto_map): ulorl never runs a model "
                                 f"folder's code; a model transformers has needs no auto_map")
    index = os.path.join(path, "model.safetensors.index.json")
    shards = {n for n in os.listdir(path) if n.endswith(".safetensors")}
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:
                named = set(json.loads(f.read(MAX_HEADER_BYTES))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ValueError(f"{index}: no weight_map ({type(e).__name__}: {e})") from None
        if outside := sorted(str(n) for n in named - shards):
            raise ValueError(f"{index} names {outside[0]}, which is not a .safetensors file of {path}")
    for name in sorted(shards):
        if why := safetensors_problem(os.path.join(path, name)):
            raise ValueError(f"{os.path.join(path, name)}: {why}")


def safetensors_problem(path: str) -> str | None:
    """Why a .safetensors file's header does not describe its bytes, or None: an 8-byte header size within the
    file (and safetensors' limit), a JSON header whose tensors each span their shape's bytes, one after another
    from the start of the data to its end."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(MAX_HEADER_BYTES, size - 8):
            return f"its header size ({n} bytes) does not fit the file ({size} bytes)"
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            return f"its header is not JSON ({type(e).__name__})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            (begin, end), shape, itemsize = t["data_offsets"], t["shape"], SAFETENSORS_BYTES[t["dtype"]]
            if not all(type(x) is int and x >= 0 for x in [begin, end, *shape]):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no dtype, shape and data_offsets as safetensors writes them"
        if end - begin != math.prod(shape) * itemsize:
            return (f"tensor {name!r} ({t['dtype']} {shape}) spans {end - begin} bytes, not "
                    f"{math.prod(shape) * itemsize}")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            return f"tensor {name!r} starts at byte {begin} of the data, where {at} was due"
        at = end
    return None if at == size - 8 - n else f"its tensors span {at} bytes of data, the file holds {size - 8 - n}"


def check_template(tokenizer) -> None:
    """A chat template that would read other templates (include, import, extends) is refused, naming its file;
    one probe prompt renders within data.TEMPLATE_SECONDS, so a template that loops stops the run at load."""
    import jinja2
    from jinja2 import nodes
    templates = tokenizer.chat_template
    for source in (templates.values() if isinstance(templates, dict) else [templates] if templates else []):
        try:
            tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        except jinja2.TemplateError:  # a tag of transformers' own environment: the probe renders it there
            continue
        if next(tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)), None):
            raise ValueError(f"{data.template_file(tokenizer)}: its chat template reads other templates (include, "
                             f"import or extends); a model's template is one self-contained text")
    data.encode_prompt(tokenizer, "1+1=" if not templates else [{"role": "user", "content": "1+1="}])


# ------------------------------------------------------------------------------------ micro-batches

@dataclass
class MicroBatch:
    """One forward/backward of the trainer: the model's inputs and the response-aligned tensors ([b] or
    [b, T], right-padded). `collate` fills the first block; the update (ulorl.py) fills the second."""
    input_ids: torch.Tensor  # [rows, L]
    attention_mask: torch.Tensor | None  # [b, L] when padded; None when packed
    position_ids: torch.Tensor | None  # [1, L] when packed (restarting at 0 for each sequence); None when padded
    rows: torch.Tensor  # [N]: row and column of the hidden state that predicts each response token
    cols: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]: the response tokens, samples in order
    resp_mask: torch.Tensor  # [b, T] bool: a real response token
    behaviour: torch.Tensor  # [b, T]: the engine's log-prob of each token when it was sampled
    versions: torch.Tensor  # [b, T]: the policy version that sampled each token (-1 on padding)
    rewards: torch.Tensor  # [b]
    truncated: torch.Tensor  # [b] bool
    samples: list = field(default_factory=list)  # the b samples (segment_rollout.Sample), in order
    starts: list = field(default_factory=list)  # where each sample's first position is in [rows x L] order
    attention: dict = field(default_factory=dict)  # the decoder's further attention arguments (seqpar's kernels)
    offset: int = 0  # the column of input_ids[:, 0] in the whole row (seqpar's slice of it)
    # filled by the update
    adv: torch.Tensor | None = None  # [b]
    old_logprobs: torch.Tensor | None = None  # [b, T]: pi_old, what the importance ratio divides by
    ref_logprobs: torch.Tensor | None = None  # [b, T]: the reference policy's log-probs (KL)
    loss_mask: torch.Tensor | None = None  # [b, T] bool: the tokens the loss averages over (its denominator)
    pg_mask: torch.Tensor | None = None  # [b, T] bool: the loss_mask tokens whose policy-gradient term trains
    empty: bool = False  # a stand-in that trains nothing (ranks with fewer micro-batches run these)
    counted: bool = True  # its tokens count in sums over ranks: not a stand-in, nor an --sp group's other ranks' copy

    def to(self, device) -> "MicroBatch":
        for f in fields(self):
            if torch.is_tensor(v := getattr(self, f.name)):
                setattr(self, f.name, v.to(device))
        return self


def micro_batches(samples: list, max_tokens: int, pack: bool = True) -> list[list[int]]:
    """Sample indices in micro-batches of at most `max_tokens` tokens (a longer sequence: one of its own). pack: one
    row of sequences back to back, first-fit by decreasing length; else padded rows, rows x longest <= max_tokens."""
    lengths = [len(s.prompt_ids) + len(s.tokens) for s in samples]
    if pack:
        bins, room = [], []
        for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
            b = next((b for b, r in enumerate(room) if lengths[i] <= r), len(bins))
            if b == len(bins):
                bins.append([])
                room.append(max_tokens)
            bins[b].append(i)
            room[b] -= lengths[i]
        return [sorted(b) for b in bins]
    out, cur, longest = [], [], 0
    for i in sorted(range(len(samples)), key=lambda i: lengths[i]):
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    return out + ([cur] if cur else [])


def collate(samples: list, pad_id: int, device="cpu", pack: bool = True) -> MicroBatch:
    """The trainer's input for one micro-batch. pack: one row [1, L], position_ids restarting at 0 per sequence and
    no attention_mask, from which transformers derives a block-diagonal causal mask (only with no KV cache); else
    right-padded rows [b, L]. A sample's response token t is predicted at (its row, start + prompt length + t - 1)."""
    seqs = [s.prompt_ids + s.tokens for s in samples]
    T = max(len(s.tokens) for s in samples)
    attn = pos = None
    if pack:
        ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)  # [1, L]
        pos = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]  # [1, L]
        starts = [0] + list(itertools.accumulate(map(len, seqs)))[:-1]
    else:
        L = max(map(len, seqs))
        ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
        attn = torch.zeros((len(samples), L), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = 1
        starts = [0] * len(samples)
    resp_mask = torch.zeros((len(samples), T), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), T))
    versions = torch.full((len(samples), T), -1, dtype=torch.long)
    rows, cols = [], []
    for i, (s, start) in enumerate(zip(samples, starts)):
        n, p = len(s.tokens), len(s.prompt_ids)
        resp_mask[i, :n] = True
        behaviour[i, :n] = torch.tensor(s.logprobs)
        versions[i, :n] = torch.tensor(s.versions)
        rows += [0 if pack else i] * n
        cols += range(start + p - 1, start + p - 1 + n)
    mb = MicroBatch(input_ids=ids, attention_mask=attn, position_ids=pos, rows=torch.tensor(rows),
                      cols=torch.tensor(cols), targets=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
                      resp_mask=resp_mask, behaviour=behaviour, versions=versions,
                      rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                      truncated=torch.tensor([s.finish == "truncated" for s in samples]), samples=list(samples),
                      starts=[start + (0 if pack else i * ids.shape[1]) for i, start in enumerate(starts)]).to(device)
    return mb


# ---------------------------------------------------------------------------------- the forward pass

def response_tokens(lm, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every response token, [N] each; only those N positions go through the lm_head.
    use_cache=False: with a KV cache transformers skips the packed mask, and a row's sequences would see each other."""
    hidden = lm.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                              use_cache=False, **mb.attention).last_hidden_state
    return loss.token_logprobs(hidden[mb.rows, mb.cols], lm.get_output_embeddings().weight, mb.targets, temperature)


def response_logprobs(lm, mb: MicroBatch, temperature: float, tokens=response_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """response_tokens (or `tokens`, it wrapped) laid out as [b, T] each, 0 on padding."""
    lp, ent = tokens(lm, mb, temperature)
    return (torch.zeros(mb.resp_mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mb.resp_mask, lp),
            torch.zeros(mb.resp_mask.shape, dtype=ent.dtype, device=ent.device).masked_scatter(mb.resp_mask, ent))


class Policy(torch.nn.Module):
    """The trainer's forward as one module: micro-batch -> (log-probs, entropy) of its response tokens, [b, T].
    DDP and FSDP2 act through a module's forward (gradient hooks; all-gathers of sharded parameters), so the
    whole computation, chunked lm_head included, runs inside this one. `lm` is the Hugging Face model; `tokens`
    is response_tokens, or it wrapped by what the run uses (wrap)."""

    def __init__(self, lm, tokens=response_tokens):
        super().__init__()
        self.lm, self.tokens = lm, tokens

    def forward(self, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self.lm, mb, temperature, self.tokens)

    def reshard(self) -> None:
        """Nothing to free in one process or under DDP; FSDP2's class puts its own first."""

