"""UloRL's data cleaning (section 3.4): drop the rows a math RL run cannot learn from, and say why for each.
A row goes when its prompt holds several sub-questions, its reference answer is long or a matrix, a model
solves it in all k samples (--model), or several models agree on one answer that is not the reference
(--majority-models). UloRL also rewrote multiple-choice and proof questions into short-answer ones; that is
not automated.

    python clean.py IN.jsonl OUT.jsonl [--model M --k 8 ...]      # writes OUT.jsonl and OUT.report.json
"""
import json
import os
import re

import registry
import reward
import verifiers
from data import encode_prompt, make_row, read_objects
from systems import workers

# Sub-question markers, in order: "(a) ... (b)", "(1) ... (2)", "(i) ... (ii)", "(I) ... (II)", "Part 1 ... Part 2".
# A marker must not follow a word or ')', so that f(a) + f(b) is not a pair of sub-questions.
_SUBPARTS = [re.compile(rf"(?<![\w)])(\({a}\)).*?(?<![\w)])(\({b}\))")
             for a, b in (("a", "b"), ("1", "2"), ("i", "ii"), ("I", "II"))]
_SUBPARTS.append(re.compile(r"(?i)\b(part\s*\(?(?:1|a|i)\)?)\W.*?\b(part\s*\(?(?:2|b|ii)\)?)\W"))
_MATRIX = re.compile(r"\\begin\{[pbvBV]?matrix\}|\\begin\{array\}")


def prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def multi_question(prompt) -> str | None:
    """Why a problem looks like several sub-questions (the marker pair found), or None. A heuristic: it
    misses sub-questions without markers ("Find x. Then find y.")."""
    text = prompt_text(prompt).replace("\n", " ")
    for pattern in _SUBPARTS:
        m = pattern.search(text)
        if m:
            return f"sub-question markers {m.group(1)!r} ... {m.group(2)!r}"
    return None


def long_answer(answer: str, max_chars: int) -> str | None:
    """Why a reference answer is too long to check reliably (UloRL drops matrices), or None."""
    if _MATRIX.search(answer):
        return "matrix or array answer"
    if len(answer) > max_chars:
        return f"answer of {len(answer)} characters > {max_chars}"
    return None


def generate(model_name: str, rows: list[dict], n: int, args) -> list[list[str]]:
    """n responses per row from `model_name` through the rollout engine (greedy when args.temperature == 0)."""
    import model as model_lib
    from systems.engine import Sampling, make_engine
    policy, tokenizer = model_lib.load(model_name, args.dtype, args.device)
    engine = make_engine(args.engine, policy.eval(), tokenizer, args.seed, path=model_name,
                         max_model_len=args.max_prompt_len + args.max_tokens, device=args.device, dtype=args.dtype)
    sampling = Sampling(temperature=1.0, top_k=1) if args.temperature == 0 else Sampling(temperature=args.temperature)
    prompts = [encode_prompt(tokenizer, r["prompt"])[-args.max_prompt_len:] for r in rows]
    texts = []
    for lo in range(0, len(rows), args.batch):
        chunk = [p for p in prompts[lo:lo + args.batch] for _ in range(n)]
        gens = engine.generate(chunk, [args.max_tokens] * len(chunk), sampling)
        texts += tokenizer.batch_decode([g.tokens for g in gens], skip_special_tokens=True)
    return [texts[i * n:(i + 1) * n] for i in range(len(rows))]


def clean(args) -> dict:
    """UloRL's data cleaning (section 3.4): write the kept rows (as they were read) to args.out and a report
    of every dropped row and why to args.report. Filters, cheap ones first:
    multi_question (several sub-questions), long_answer (over --max-answer-chars, or a matrix),
    solved_k_of_k (--model solves it in all --k samples: no learning signal), majority_disagrees
    (--majority-models: at least --majority-min of them give the same final answer, and it is wrong)."""
    objs = read_objects(args.input)
    rows = [make_row(obj, where, args.prompt_key, args.answer_key, args.verifier_key, args.default_verifier)
            for where, obj in objs]
    dropped: dict[int, dict] = {}

    def drop(i: int, reason: str, detail: str) -> None:
        dropped[i] = {"where": rows[i]["where"], "reason": reason, "detail": detail}

    for i, row in enumerate(rows):
        why = multi_question(row["prompt"])
        if why:
            drop(i, "multi_question", why)
        elif why := long_answer(row["answer"], args.max_answer_chars):
            drop(i, "long_answer", why)
    if args.model:
        todo = [i for i in range(len(rows)) if i not in dropped]
        samples = generate(args.model, [rows[i] for i in todo], args.k, args)
        items = [(rows[i]["verifier"], text, rows[i]["answer"]) for i, texts in zip(todo, samples) for text in texts]
        scores, _ = reward.score_batch(workers.run, items, timeout=args.reward_timeout)
        for j, i in enumerate(todo):
            if all(s == 1.0 for s in scores[j * args.k:(j + 1) * args.k]):
                drop(i, "solved_k_of_k", f"{args.model} solved it in {args.k} of {args.k} samples")
    if args.majority_models:
        models = [m for m in args.majority_models.split(",") if m]
        todo = [i for i in range(len(rows))
                if i not in dropped and registry.VERIFIERS[rows[i]["verifier"]].as_response]
        answers = []  # [model][row]: each model's final answer, one sample each
        for m in models:
            texts = generate(m, [rows[i] for i in todo], 1, args)
            answers.append([verifiers.final_answer(rows[i]["verifier"], t[0]) for i, t in zip(todo, texts)])
        for j, i in enumerate(todo):
            votes = [a[j] for a in answers if a[j]]
            top = max(set(votes), key=votes.count) if votes else None
            if top is None or votes.count(top) < args.majority_min:
                continue
            written = registry.VERIFIERS[rows[i]["verifier"]].as_response.format(top)  # as a response would write it
            items = [(rows[i]["verifier"], written, rows[i]["answer"])]
            if reward.score_batch(workers.run, items, timeout=args.reward_timeout)[0][0] == 0.0:
                drop(i, "majority_disagrees", f"{votes.count(top)} of {len(models)} models answer {top!r}, "
                                              f"the reference is {rows[i]['answer']!r}")
    with open(args.out, "w") as f:
        for i, (where, obj) in enumerate(objs):
            if i not in dropped:
                f.write(json.dumps(obj, default=str) + "\n")
    counts = {}
    for d in dropped.values():
        counts[d["reason"]] = counts.get(d["reason"], 0) + 1
    report = {"input": args.input, "output": args.out, "rows": len(rows), "kept": len(rows) - len(dropped),
              "dropped": counts, "dropped_rows": [dropped[i] for i in sorted(dropped)], "args": vars(args)}
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"{args.input}: {len(rows)} rows, kept {report['kept']}, dropped {len(dropped)}: "
          + (", ".join(f"{k} {v}" for k, v in counts.items()) or "none") + f"; report: {args.report}")
    return report


def main(argv=None) -> None:
    import argparse
    c = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("input", help="dataset to clean (any source load_rows takes)")
    c.add_argument("out", help="where the kept rows go (.jsonl, the rows as they were read)")
    c.add_argument("--report", default="", help="JSON report of dropped rows (default: OUT with .report.json)")
    c.add_argument("--prompt-key", default="prompt", help="column holding the prompt")
    c.add_argument("--answer-key", default="answer", help="column holding the reference answer")
    c.add_argument("--verifier-key", default="verifier", help="column holding the verifier name")
    c.add_argument("--default-verifier", default="math", help="verifier of rows without one")
    c.add_argument("--max-answer-chars", type=int, default=64, help="drop longer reference answers (UloRL: short "
                                                                      "answers only; matrices are always dropped)")
    c.add_argument("--model", default="", help="drop problems this model solves in all --k samples ('' = skip)")
    c.add_argument("--k", type=int, default=8, help="samples per problem for --model (UloRL 8)")
    c.add_argument("--majority-models", default="", help="comma-separated models; drop rows whose reference "
                                                         "disagrees with their majority answer ('' = skip)")
    c.add_argument("--majority-min", type=int, default=2, help="models that must agree on one wrong answer")
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    c.add_argument("--max-tokens", type=int, default=4096, help="response tokens per sample")
    c.add_argument("--max-prompt-len", type=int, default=2048, help="prompt tokens kept (the end of longer ones)")
    c.add_argument("--batch", type=int, default=64, help="prompts per engine call")
    c.add_argument("--engine", default="auto", help="rollout engine: hf, vllm or auto")
    c.add_argument("--device", default="cpu", help="torch device for the models")
    c.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    c.add_argument("--reward-timeout", type=float, default=5.0, help="seconds per reward check")
    c.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = c.parse_args(argv)
    args.report = args.report or os.path.splitext(args.out)[0] + ".report.json"
    clean(args)


if __name__ == "__main__":
    main()
