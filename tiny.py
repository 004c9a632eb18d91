"""The embedded default: a tiny Qwen3 model, its character tokenizer, a synthetic reasoning task, and the
script that makes the warm-start checkpoint shipped in `tiny_ckpt/`.

The task: add 2-12 one-digit numbers step by step (each next term and the running sum), then give the
answer after ':'

    prompt  "3+4+5="        response  "4=7,5=12:12<eos>"        answer "12"

The number of terms k is drawn with P(k) ~ k^-1.5, so most responses are short (k=2: 6 tokens) and a few
run to ~60 tokens: the long tail that makes segment rollout worth it (UloRL section 3.1). One problem in 8 (by
a hash of its text: `held_out`) belongs to the held-out set and is never drawn for training.

The warm start imitates a *sloppy teacher*: each running sum is off by one with probability `SLIP` (0.2),
and the teacher carries on from the wrong value. Trained on that, the model has learned to add but also to
slip, so sampling at temperature 1 gets about half the problems right; RL with the {0,1} answer reward
must teach it to stop slipping. This is the smallest honest stand-in for what RL does to a real model
(sharpening what it can already do), and it makes a visible gain in minutes on a CPU.

The second task, same problems and verifier (only the answer after ':' is checked), with many right responses:
the terms may be added in any order, each step a term not yet added and the running sum from 0

    prompt  "3+4+5="        responses "5=5,3=8,4=12:12<eos>", "3=3,4=7,5=12:12<eos>", ... (3! orders)

so a k-term problem of distinct digits has k! right responses, and the entropy of the choice of the next term
is not error: with one right response per problem (the first task) entropy is all error, and a mechanism
meant to keep exploring while accuracy rises (DMMPTs) cannot be judged there. Its warm start, `tiny_any_ckpt/`,
imitates a teacher that picks each next term at random and slips like the first one (`SLIP_ANY`); train on it
with `python train.py --model tiny_any_ckpt`. `choice_entropy` measures how much of a model's entropy sits on
the choice of the next term.

    python tiny.py                            # rebuild tiny_ckpt/ (deterministic on a given machine; ~15 min on 2 cores)
    python tiny.py --order any                # rebuild tiny_any_ckpt/ (~10 min on 2 cores; held-out 49.6%)
    python tiny.py --steps 300 --out /tmp/t   # a quick, weaker one
"""
import argparse
import functools
import itertools
import math
import random
import time
import zlib

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

CHARS = "0123456789+=,:"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
MIN_TERMS, MAX_TERMS, TAIL = 2, 12, 1.5  # P(k) ~ k^-TAIL for k in [MIN_TERMS, MAX_TERMS]
SLIP = 0.2  # the warm-start teacher's chance of an off-by-one running sum
HELD_OUT_SHARE = 8  # one problem in 8 is held out (held_out): training never draws it
CKPT = "tiny_ckpt"  # the shipped warm start, relative to the repo root
ANY_CKPT = "tiny_any_ckpt"  # the second task's (--order any)
SLIP_ANY = 0.2  # its teacher's chance of an off-by-one running sum


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; the chat template is the bare prompt (the task needs no roles)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def make_moe_model(tokenizer, seed: int = 0, experts: int = 4, top_k: int = 2) -> Qwen3MoeForCausalLM:
    """A random tiny Mixture-of-Experts model of the headline model's architecture (qwen3_moe, as
    Qwen3-30B-A3B): `experts` experts (4), top-`top_k` (2) routing in every layer, untied embeddings; ~0.6M
    parameters with 4 experts."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=experts,
        num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False, output_router_logits=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    return Qwen3MoeForCausalLM(config)


def make_long_context_model(max_len: int, tokenizer=None, seed: int = 0) -> Qwen3ForCausalLM:
    """A random dense Qwen3 of ~3M parameters (8 heads, 4 KV heads) whose memory and time at a few thousand
    tokens go to activations and attention, not weights: what sequence parallelism splits (bench/sp.py,
    bench/memory_plan.py). `tokenizer`: its vocabulary and special tokens (default: 64 ids, no specials)."""
    torch.manual_seed(seed)
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) if tokenizer else {}
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer) if tokenizer else 64, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=max_len, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=None, dtype="float32", **special))


def make_model(tokenizer, seed: int = 0) -> Qwen3ForCausalLM:
    """~0.8M parameters. head_dim 32 because vLLM's CPU attention needs >= 32; tied embeddings like the
    small Qwen3 models (which exercises the tied-lm_head path of the weight sync)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    return Qwen3ForCausalLM(config)


def draw_terms(rng: random.Random, terms: int | None = None) -> list[int]:
    """A problem's terms: `terms` of them, or a number drawn from the long tail."""
    ks = list(range(MIN_TERMS, MAX_TERMS + 1))
    k = terms or rng.choices(ks, weights=[kk ** -TAIL for kk in ks])[0]
    return [rng.randint(1, 9) for _ in range(k)]


TERMS = range(MIN_TERMS, MAX_TERMS + 1)
TERMS_CUM = list(itertools.accumulate(k ** -TAIL for k in TERMS))


def held_out(prompt: str) -> bool:
    """Whether a problem is in the held-out part of the task: one in HELD_OUT_SHARE of them, chosen by a hash of
    its text, so that no held-out prompt is ever drawn for training, whatever the draws' sizes and seeds (11 of the
    81 two-term problems, 88 of the 729 three-term ones). The space is small: held-out and training draws of the
    whole task shared ~62% of their prompts."""
    return zlib.crc32(prompt.encode()) % HELD_OUT_SHARE == 0


def draw_prompt(rng: random.Random, terms: int | None, part: bool) -> str:
    """A problem of `terms` terms (None: as many as the long tail draws) in the held-out part (`part` True) or the
    training part, its terms redrawn until it is: the number of terms keeps the long tail's law in both."""
    k = terms or rng.choices(TERMS, cum_weights=TERMS_CUM)[0]
    while True:
        prompt = "+".join(rng.choices("123456789", k=k)) + "="
        if held_out(prompt) == part:
            return prompt


def teacher_response(terms: list[int], rng: random.Random, slip: float = 0.0, order: str = "given") -> str:
    """Each next term and the running sum ("4=7"), then ':' and the final sum. Copying the term keeps every
    step local (add the number just written to the sum before it). With `slip` > 0 each sum may be off by
    one, and the teacher carries on from what it wrote (so one slip makes the answer wrong). order "any": the
    terms in a random order, every one written, the sum from 0 ("5=5,3=8,4=12:12")."""
    if order == "any":
        terms, s = [0] + rng.sample(terms, len(terms)), 0
    steps, s = [], terms[0]
    for t in terms[1:]:
        s += t
        if rng.random() < slip:
            s += rng.choice([-1, 1])
        steps.append(f"{t}={s}")
    return ",".join(steps) + ":" + str(s)


def choice_entropy(model, tokenizer, prompts: list[str], samples: int = 8, seed: int = 0) -> dict:
    """Where a model's entropy sits on the any-order task, over `samples` responses a prompt sampled at
    temperature 1: the share of the summed token entropy at the positions that choose the next term (the
    first token of each step), and the mean probability those positions give to terms not yet added (their
    mass on right choices; the rest of it is error). Every other position has one right token."""
    torch.manual_seed(seed)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in CHARS}
    digit_ids = torch.tensor([ids[d] for d in "123456789"])
    choice_ent = all_ent = right_mass = choices = tokens = 0.0
    model.eval()
    for prompt in prompts:
        x = torch.tensor([tokenizer(prompt).input_ids] * samples)
        with torch.no_grad():
            out = model.generate(x, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            logp = torch.log_softmax(model(out).logits[:, x.shape[1] - 1:-1].float(), -1)
        ent = -(logp.exp() * logp).sum(-1)  # [samples, new tokens]: the entropy of each sampled position
        for row, e, lp in zip(out[:, x.shape[1]:].tolist(), ent, logp):
            left, text = [int(t) for t in prompt[:-1].split("+")], ""
            for i, tok in enumerate(row):
                if tok == tokenizer.pad_token_id:
                    break
                all_ent, tokens = all_ent + e[i].item(), tokens + 1
                if tok == tokenizer.eos_token_id:
                    break
                if (text == "" or text.endswith(",")) and left:  # a step begins: the choice of a term
                    choice_ent += e[i].item()
                    right_mass += lp[i, digit_ids[[d - 1 for d in sorted(set(left))]]].exp().sum().item()
                    choices += 1
                    chosen = tokenizer.convert_ids_to_tokens(tok)
                    if chosen.isdigit() and int(chosen) in left:
                        left.remove(int(chosen))
                text += tokenizer.convert_ids_to_tokens(tok)
    return {"choice_share": choice_ent / max(all_ent, 1e-12), "right_choice_mass": right_mass / max(choices, 1),
            "entropy_mean": all_ent / max(tokens, 1), "choices": int(choices), "tokens": int(tokens)}


def check_terms(terms: int) -> None:
    """tiny:K takes K in the range the warm start was trained on."""
    if not MIN_TERMS <= terms <= MAX_TERMS:
        raise ValueError(f"tiny:{terms}: the number of terms must be {MIN_TERMS}-{MAX_TERMS}, the range the warm "
                         f"start ({CKPT}/) was trained on")


@functools.lru_cache(maxsize=4)  # train.py draws the same 100k rows at every start (~1.5 s; bench/ starts it often)
def make_rows(n: int, seed: int, terms: int | None = None, part: bool = False) -> list[dict]:
    """n problems of the training part (`part` True: the held-out part) as dataset rows (the same shape data.py
    loads from files), each of `terms` terms if given (the `tiny:K` variant: every response as long as the tail's
    longest). Cached: never change the rows."""
    if terms is not None:
        check_terms(terms)
    rng = random.Random(seed)
    prompts = [draw_prompt(rng, terms, part) for _ in range(n)]
    return [{"prompt": p, "answer": str(sum(map(int, p[:-1].split("+")))), "verifier": "tiny"} for p in prompts]


def held_out_rows(n: int, seed: int = 0, terms: int | None = None) -> list[dict]:
    """The held-out draw that train.py (--eval-data tiny) and eval.py evaluate on: the held-out part's problems."""
    return make_rows(n, seed=10_000 + seed, terms=terms, part=True)


def pretrain(out: str, steps: int, batch: int, lr: float, seed: int, order: str = "given") -> None:
    """Supervised warm start on the sloppy teacher (terms in the given order, or `order` "any"): next-token loss
    on response tokens only."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    t0, queue = time.time(), []
    for step in range(steps):
        if not queue:  # draw 8 batches at once and group them by length: the long tail makes padding costly
            pool = []
            for _ in range(8 * batch):
                terms = draw_terms(rng)
                prompt = tokenizer("+".join(map(str, terms)) + "=").input_ids
                response = tokenizer(teacher_response(terms, rng, SLIP_ANY if order == "any" else SLIP,
                                                      order)).input_ids + [eos]
                pool.append((prompt + response, len(prompt)))
            pool.sort(key=lambda x: len(x[0]))
            queue = [pool[i:i + batch] for i in range(0, len(pool), batch)]
            random.Random(seed + step).shuffle(queue)
        seqs, n_prompt = zip(*queue.pop())
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad)
        labels = torch.full((len(seqs), width), -100)
        for i, (s, p) in enumerate(zip(seqs, n_prompt)):
            ids[i, :len(s)] = torch.tensor(s)
            labels[i, p:len(s)] = torch.tensor(s[p:])
        # linear warm-up for 5% of the steps, then cosine decay to 10%
        frac = step / steps
        scale = min(1.0, frac / 0.05) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        loss = model(input_ids=ids, labels=labels).loss  # right padding: pads sit after every label
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d} | loss {loss.item():.4f} | lr {lr * scale:.2e} | {time.time() - t0:.0f}s",
                  flush=True)
        if step % 500 == 499:  # a usable checkpoint even if the run is cut short
            model.save_pretrained(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--order", default="given", choices=["given", "any"],
                   help="the task: terms added in the prompt's order (tiny_ckpt/), or in any order (tiny_any_ckpt/)")
    p.add_argument("--out", default=None, help=f"where to write the checkpoint (default {CKPT}/, {ANY_CKPT}/ for "
                                               f"--order any)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps of supervised training")
    p.add_argument("--batch", type=int, default=128, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model init and the data")
    args = p.parse_args()
    pretrain(args.out or (ANY_CKPT if args.order == "any" else CKPT), args.steps, args.batch, args.lr, args.seed,
             args.order)
