"""The papers' findings, reproduced at small scale on the built-in any-order task (tiny.py: many right responses,
so that entropy and error come apart): each subcommand trains its variants with fixed seeds (one `train.py` process
per run, variants interleaved within each seed), writes every run's metrics.jsonl under --root, draws one figure
with the variants side by side, and prints a table and one JSON line with the numbers docs/findings.md quotes.
Each comparison's metric, steps and expected direction is fixed in CLAIMS before it runs, over 5 seeds:

    python experiments/findings.py dmmpt-any --seeds 0,1,2,3,4 --jobs 2 --record   # DMMPTs off / static / dynamic
    python experiments/findings.py sigma-any --seeds 0,1,2,3,4 --jobs 2 --record   # dynamic at sigma 0.1 / 0.3
    python experiments/findings.py is-any --seeds 0,1,2,3,4 --jobs 2 --record      # TOIS / SAIS / POIS, stale by segments
    python experiments/findings.py resets-any --seeds 1,2,3,4,5 --jobs 2 --record  # KL 1, resets of each kind (seed 0: the pilot)
    python experiments/findings.py resets-dose-any --seeds 1,2,3,4,5 --jobs 2 --record  # the same at KL 0.1
    python experiments/findings.py dynsamp-any --seeds 0,1,2,3,4 --jobs 2 --record  # dynamic sampling on / off
    python experiments/findings.py noisy-any --seeds 0,1,2,3,4 --jobs 2 --record   # data cleaning, noisy labels
    python experiments/findings.py prorl-any --seeds 0,1,2,3,4 --jobs 2 --record   # ProRL's settings, clip-higher
    python experiments/findings.py length-any --seeds 0,1,2,3,4 --jobs 2 --record  # response cap 32 / 64 tokens
    python experiments/findings.py boundary-any --seeds 0,1,2,3,4 --record  # pass@1..64, warm start / dynsamp-any's "on"
    python experiments/findings.py check      # recompute docs/findings.md's verdict rows and marked tables from the records

One verdict rule for every claim (VERDICT_RULE below): "reproduced" only when the arms differ in the paper's
direction and their bands, lowest to highest seed, over >= 5 seeds do not overlap. `--record` keeps each run's
metrics (the keys KEPT, gzipped) under experiments/records/FINDING/, committed: `check` recomputes the verdict
rows, and every table under a `<!-- findings.py table ... -->` line (TABLE), from them alone and fails on any
difference.

Your own study: named variants, each a string of train.py flags, over seeds, with the same figure and table
(runs in ROOT/NAME/VARIANT_sSEED; `--keys` picks the metrics drawn, one panel each):

    python experiments/findings.py variants --variant "constant=--lr-final 1" --variant "cosine=" \
        --seeds 0,1,2 --jobs 2 --name lr --keys eval/accuracy,reward/mean,entropy/mean

A run that finished is not run again (delete its folder to redo it); one that was stopped continues from its
newest checkpoint; `--only NAME,...` runs and reports some of a finding's variants. `--jobs 2` runs two at a time (one thread each). Flags this script does not know go to
every train.py run, after the finding's own (the smoke test shrinks the runs this way: `--steps 2 ...`).
The figure goes beside the runs (ROOT/FINDING/FINDING.png) unless `--figure` names a path; docs/findings.md
gives the commands that redraw its figures.
"""
import argparse
import dataclasses
import glob
import gzip
import itertools
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py, eval.py, plot.py and tiny.py live one folder up

import eval as eval_lib  # noqa: E402
import plot  # noqa: E402
import tiny  # noqa: E402
from systems import outdir  # noqa: E402

# What every run of a finding shares, then its variants (label -> train.py flags). The rest is train.py's
# tiny default: 16 prompts x 8 samples a step, 64-token cap in 4 segments, T 1, held-out accuracy on 512
# problems every 25 steps; but a constant learning rate of 3e-4, as both papers train (and as the findings
# in docs/findings.md ran), where the tiny default decays it.
STEPS = 150
PAPER_LR = ["--lr-final", "1"]
PRORL_COMMON = [*PAPER_LR, "--mpt", "off", "--eps-high", "0.4"]  # ProRL where it differs from the tiny default
FINDINGS: dict[str, dict] = {}  # the findings below, each added where its claims' reasons are given


VERDICT_RULE = ("reproduced: the arms differ in the paper's direction and their bands (lowest to highest seed) over "
                "at least 5 seeds do not overlap; in part: the means go the paper's way, but the bands overlap or there "
                "are fewer seeds; not reproduced: the means go the other way (3 seeds separate two equal arms about 1 "
                "time in 10, 5 seeds about 1 in 125); not testable here: every seed of both arms at one value (a "
                "ceiling), or a reason in a line")
MIN_SEEDS = 5
RECORDS = os.path.join(ROOT, "experiments", "records")  # FINDING/VARIANT_sSEED.jsonl.gz: the runs behind the table
KEPT = ("step", "eval/accuracy", "reward/mean", "entropy/mean", "mpt/masked_frac", "entropy/cov", "entropy/cov_masked",
        "response/mean_len", "staleness/token_mean", "staleness/last_segment_mean", "clip/low_frac", "clip/high_frac", "loss/kl", "train/ref_reset",
        "tokens/generated", "rollout/rounds", "dynamic/dropped_groups")
DOC = os.path.join(ROOT, "docs", "findings.md")
PREPARED = "prepared.json"  # what a finding's `prepare` counted in its data, beside its runs and in its records


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim as one comparison, fixed before the runs: the arm `higher` has the larger `metric`, averaged
    over steps first..last of each run (a held-out metric: the evaluations in that window)."""
    text: str
    metric: str
    first: int
    last: int
    higher: str
    lower: str


# The any-order task's DMMPT runs. The warm start's mean token entropy is ~SIGMA_ANY x 2 (tiny.choice_entropy), so
# the paper's sigma (0.2) lies inside the task's range, as in UloRL's Fig. 4-5.
SIGMA_ANY = 0.2
FINDINGS["dmmpt-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT, "--mpt-sigma", str(SIGMA_ANY)],
                             variants={"off": ["--mpt", "off"], "static": ["--mpt", "static"],
                                       "dynamic": ["--mpt", "dynamic"]})
# dynamic DMMPTs at sigma below and above the paper's 0.2 (the dmmpt-any runs' own), on either side of where the
# warm start's entropy begins (~0.27)
SIGMA_ANY_DOSES = ("0.1", "0.3")
FINDINGS["sigma-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT, "--mpt", "dynamic"],
                             variants={f"dynamic_sigma{s}": ["--mpt-sigma", s] for s in SIGMA_ANY_DOSES})
# TOIS / SAIS / POIS where the trained tokens are stale only because of segments: 8 segments of 8 tokens, and the
# groups past --train-groups dropped rather than kept for the next step (--surplus drop), so that no finished group
# waits a version; TOIS decodes whole responses in one segment, as UloRL's baseline
FINDINGS["is-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT, "--surplus", "drop"], variants={
    "tois-1seg": ["--is-mode", "tois", "--segments", "1"], "sais-8seg": ["--is-mode", "sais", "--segments", "8"],
    "pois-8seg": ["--is-mode", "pois", "--segments", "8"]})
# ProRL's KL and resets on the any-order task: a KL that binds anchors the policy to its reference until training
# stalls, and resetting the reference releases it (ProRL Sec. 3: resets let training go on improving). The resets
# separated: both (ProRL), the reference alone, AdamW's moments alone, and both on a stall of the held-out accuracy
# (an evaluation without a new best) instead of a schedule; no KL as the baseline. beta 1 from a one-seed pilot
# (seed 0, kept out of the finding's seeds): at beta 1 KL alone stalls at ~0.64 held out from step 50 on, where no
# KL reaches 0.95 by step 150; a stall trigger of 2 evaluations never fired there in 150 steps
RESETS_ANY_STEPS, BETA_ANY, RESET_EVERY_ANY, STALL_ANY = 150, 1.0, 50, 1
KL_ANY = ["--kl-coef", str(BETA_ANY)]
FINDINGS["resets-any"] = dict(steps=RESETS_ANY_STEPS, common=[*PRORL_COMMON, "--model", tiny.ANY_CKPT], variants={
    "no-kl": [], "kl": KL_ANY,
    **{f"kl+{renew}": [*KL_ANY, "--ref-reset-every", str(RESET_EVERY_ANY), "--reset", renew]
       for renew in ("both", "reference", "optimizer")},
    "kl+both-on-stall": [*KL_ANY, "--ref-reset-on-stall", str(STALL_ANY)]})
# The same resets along the KL strength: at beta 0.1 (10x weaker than resets-any's) does KL alone still stall, and
# do the resets still help? Beside resets-any's arms at beta 1 (its no-kl arm is the common baseline)
BETA_DOSE = 0.1
FINDINGS["resets-dose-any"] = dict(steps=RESETS_ANY_STEPS, common=[*PRORL_COMMON, "--model", tiny.ANY_CKPT], variants={
    f"kl{BETA_DOSE}": ["--kl-coef", str(BETA_DOSE)],
    f"kl{BETA_DOSE}+both": ["--kl-coef", str(BETA_DOSE), "--ref-reset-every", str(RESET_EVERY_ANY)]})
# Dynamic sampling (DAPO, both papers) on and off at the tiny default's settings: off, a step's 16 groups include
# those whose rewards are all equal, which carry no advantage and so no gradient
FINDINGS["dynsamp-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT], variants={
    "on": ["--dynamic-sampling", "true"], "off": ["--dynamic-sampling", "false"]})
# UloRL's data cleaning (section 3.4) under noisy labels: NOISY_ROWS training problems of the any-order task, a
# NOISE share of them with the reference off by one (as a slipped sum would write it), which rewards a slip and
# scores a right response 0; clean.py's majority check drops the rows where both warm starts, greedy, agree on an
# answer that is not the reference. Trained on the noisy labels and on the cleaned ones (noisy_data)
NOISY_ROWS, NOISE, NOISY_SEED = 4000, 0.3, 7
FINDINGS["noisy-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT, "--eval-data", "tiny"],
                             prepare=lambda folder: noisy_data(folder), variants={
                                 arm: ["--data", os.path.join("{folder}", f"{arm}.jsonl")]
                                 for arm in ("noisy", "cleaned")})
# ProRL's own sampling and update settings (T 1.2, 16 samples, 4 updates a step so the 0.4 clip acts) against the
# symmetric clip of 0.2 there: clip-higher keeps the entropy up (ProRL Sec. 3, after DAPO)
FINDINGS["prorl-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT, "--mpt", "off",
                                                  "--temperature", "1.2", "--group-size", "16", "--mini-batch", "64"],
                             variants={"clip0.2-0.4": ["--eps-high", "0.4"], "clip0.2-0.2": ["--eps-high", "0.2"]})
# Longer outputs (UloRL trains and evaluates at 32k to 128k): the response cap halved, in segments of 16 tokens as
# UloRL keeps its segments' length and adds segments; each arm's held-out accuracy is measured at its own cap
FINDINGS["length-any"] = dict(steps=STEPS, common=[*PAPER_LR, "--model", tiny.ANY_CKPT], variants={
    f"len{n}": ["--max-response-len", str(n), "--segments", str(n // 16)] for n in (32, 64)})
# ProRL's reasoning boundary: pass@1..BOUNDARY_K of the warm start against the last checkpoints of BOUNDARY_RUNS (the
# tiny default at a constant learning rate, 150 steps), on BOUNDARY_PROBLEMS held-out problems. Seed s's model
# samples the held-out draw of seed s (eval.py --seed), and so does the warm start once for each s, so both bands
# carry the draw. Trains nothing: its records hold one row per k (`step` is k, `passk` the estimate)
BOUNDARY_RUNS, BOUNDARY_K, BOUNDARY_PROBLEMS = "dynsamp-any/on", 64, 256
CLAIMS = {
    "length-any": [
        Claim("a longer response cap trains to a higher held-out accuracy (UloRL: 73.5 at 32k -> 82.8 at 128k)",
              "eval/accuracy", STEPS - 50, STEPS, "len64", "len32"),
    ],
    "boundary-any": [
        Claim("RL raises pass@1 (ProRL; the sharpening view agrees)", "passk", 1, 1, "rl", "warm-start"),
        Claim(f"RL raises pass@{BOUNDARY_K} too: it solves problems the warm start does not (ProRL's boundary)",
              "passk", BOUNDARY_K, BOUNDARY_K, "rl", "warm-start"),
    ],
    "sigma-any": [
        Claim("dynamic DMMPTs hold a higher entropy at a higher sigma (UloRL Fig. 4: it settles near sigma)",
              "entropy/mean", STEPS - 19, STEPS, "dynamic_sigma0.3", "dynamic_sigma0.1"),
    ],
    "is-any": [
        Claim("POIS trains to a higher accuracy than SAIS (UloRL Fig. 2)", "eval/accuracy", STEPS - 50, STEPS,
              "pois-8seg", "sais-8seg"),
        Claim("TOIS trains to a higher accuracy than SAIS (UloRL Fig. 2)", "eval/accuracy", STEPS - 50, STEPS,
              "tois-1seg", "sais-8seg"),
    ],
    "resets-any": [
        Claim("with a KL that binds, resets of the reference and AdamW keep improving past KL alone (ProRL Fig. 1-2)",
              "eval/accuracy", RESETS_ANY_STEPS - 50, RESETS_ANY_STEPS, "kl+both", "kl"),
        Claim("the reference's reset alone does too (what releases the anchor)", "eval/accuracy",
              RESETS_ANY_STEPS - 50, RESETS_ANY_STEPS, "kl+reference", "kl"),
        Claim("resets on a stall of the held-out accuracy do too (ProRL resets when validation stalls)",
              "eval/accuracy", RESETS_ANY_STEPS - 50, RESETS_ANY_STEPS, "kl+both-on-stall", "kl"),
    ],
    "resets-dose-any": [
        Claim(f"with a weaker KL ({BETA_DOSE}), resets of the reference and AdamW still keep improving past KL alone",
              "eval/accuracy", RESETS_ANY_STEPS - 50, RESETS_ANY_STEPS, f"kl{BETA_DOSE}+both", f"kl{BETA_DOSE}"),
    ],
    "dynsamp-any": [
        Claim("dynamic sampling trains to a higher held-out accuracy per step than keeping all-equal groups (DAPO)",
              "eval/accuracy", STEPS - 50, STEPS, "on", "off"),
    ],
    "noisy-any": [
        Claim("cleaning a noisy dataset (majority of models against the reference) trains to a higher accuracy than "
              "the noisy data (UloRL 3.4)", "eval/accuracy", STEPS - 50, STEPS, "cleaned", "noisy"),
    ],
    "prorl-any": [
        Claim("clip-higher (0.4) keeps more entropy than 0.2 at ProRL's settings (ProRL Sec. 3, DAPO)",
              "entropy/mean", STEPS - 19, STEPS, "clip0.2-0.4", "clip0.2-0.2"),
    ],
    "dmmpt-any": [
        Claim("dynamic DMMPTs keep more entropy than none (UloRL Fig. 4)", "entropy/mean", STEPS - 19, STEPS,
              "dynamic", "off"),
        Claim("static DMMPTs raise the entropy above dynamic ones (UloRL Fig. 4)", "entropy/mean", STEPS - 19, STEPS,
              "static", "dynamic"),
        Claim("dynamic DMMPTs train to a higher accuracy than none (UloRL Fig. 5)", "eval/accuracy", STEPS, STEPS,
              "dynamic", "off"),
    ],
}


def claim_values(runs: dict, claim: Claim) -> dict[str, list[float]]:
    """Each arm's value per seed: `claim.metric` averaged over its window."""
    return {arm: [window_mean(rs, claim.metric, claim.first, claim.last) for rs in runs[arm]]
            for arm in (claim.higher, claim.lower)}


def verdict(higher: list[float], lower: list[float]) -> tuple[str, str]:
    """VERDICT_RULE on the seeds' values of the arm the paper says is higher and of the other: (verdict, reason)."""
    mean_h, mean_l = sum(higher) / len(higher), sum(lower) / len(lower)
    seeds = min(len(higher), len(lower))
    if len(set(higher + lower)) == 1:  # every seed of both arms the same value: a ceiling or a floor
        return "not testable here", f"every seed of both arms at {higher[0]:.3f}: nothing can differ"
    if mean_h <= mean_l:
        if max(higher) >= min(lower):
            return "not reproduced", "no difference: the bands overlap (the means the other way)"
        return "not reproduced", f"the reverse direction, bands apart over {seeds} seeds"
    if min(higher) <= max(lower):
        return "in part", "the direction matches; the bands overlap"
    if seeds < MIN_SEEDS:
        return "in part", f"the direction matches, bands apart, but {seeds} seeds (< {MIN_SEEDS})"
    return "reproduced", f"bands apart over {seeds} seeds"


def band(values: list[float]) -> str:
    """mean [lowest, highest]: 3 decimals, 4 where every value is under 0.01 and one is not 0 (a clipped share)"""
    d = 4 if 0 < max(map(abs, values)) < 0.01 else 3
    return f"{sum(values) / len(values):.{d}f} [{min(values):.{d}f}, {max(values):.{d}f}]"


def verdict_rows(name: str, runs: dict) -> list[str]:
    """docs/findings.md's table rows of a finding's claims, from its runs: one a claim."""
    rows = []
    for claim in CLAIMS[name]:
        values = claim_values(runs, claim)
        word, why = verdict(values[claim.higher], values[claim.lower])
        span = str(claim.last) if claim.first == claim.last else f"{claim.first}-{claim.last}"
        window = (f"k = {span}" if claim.metric == "passk"  # pass@k's records: one row a k
                  else f"step {span}" if claim.first == claim.last else f"steps {span}")
        rows.append(f"| {name} | {claim.text} | {claim.metric}, {window}, {len(values[claim.higher])} seeds | "
                    f"{claim.higher} {band(values[claim.higher])} vs {claim.lower} {band(values[claim.lower])} | "
                    f"**{word}**: {why} |")
    return rows


def write_records(name: str, runs_dir: str, variants: list[str], seeds: list[int], records: str = RECORDS) -> None:
    """Each run's metrics.jsonl, only the KEPT keys, gzipped into records/NAME/VARIANT_sSEED.jsonl.gz (a few KB),
    and what a finding's `prepare` counted (PREPARED), where it did."""
    save_records(name, {v: [[{k: r[k] for k in KEPT if k in r} for r in plot.read_metrics(os.path.join(runs_dir, f"{v}_s{seed}"))]
                            for seed in seeds] for v in variants}, seeds, records)
    if os.path.exists(os.path.join(runs_dir, PREPARED)):
        shutil.copyfile(os.path.join(runs_dir, PREPARED), os.path.join(records, name, PREPARED))


def save_records(name: str, runs: dict[str, list[list[dict]]], seeds: list[int], records: str = RECORDS) -> None:
    """{variant: [each seed's rows]} gzipped into records/NAME/VARIANT_sSEED.jsonl.gz, one JSON row a line."""
    os.makedirs(os.path.join(records, name), exist_ok=True)
    for v, per_seed in runs.items():
        for seed, rows in zip(seeds, per_seed, strict=True):
            with gzip.GzipFile(os.path.join(records, name, f"{v}_s{seed}.jsonl.gz"), "wb", mtime=0) as f:
                f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())


def read_records(name: str, records: str = RECORDS) -> dict[str, list[list[dict]]]:
    """{variant: [each seed's records]} of a recorded finding, seeds in order."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(records, name, "*_s*.jsonl.gz")),
                       key=lambda p: (int(p.rpartition("_s")[2].split(".")[0]), p)):
        variant = os.path.basename(path).rpartition("_s")[0]
        with gzip.open(path, "rt") as f:
            runs.setdefault(variant, []).append([json.loads(line) for line in f if line.strip()])
    return runs


# A table of docs/findings.md whose rows are recomputed from the records: this line above its header, each column
# a metric averaged over steps (`@first-last`, or `@step`; `count:METRIC@...`, the steps that log it, as a reset's
# train/ref_reset), one row an arm (mean [lowest, highest seed])
TABLE = re.compile(r"^[ \t]*<!-- findings\.py table ([\w-]+): (.+?) -->$", re.MULTILINE)  # indented: in a list item


def column(spec: str) -> tuple[str, int, int]:
    metric, _, steps = spec.partition("@")
    first, _, last = steps.partition("-")
    return metric, int(first), int(last or first)


def cell(records: list[dict], spec: str) -> float:
    """One run's value of a TABLE column."""
    metric, first, last = column(spec.removeprefix("count:"))
    if spec.startswith("count:"):
        return float(sum(first <= r["step"] <= last and r.get(metric) is not None for r in records))
    return window_mean(records, metric, first, last)


def table_rows(runs: dict, columns: list[str]) -> list[str]:
    """A TABLE's rows from a finding's runs: one an arm, in the runs' order."""
    return [f"| {v} | " + " | ".join(band([cell(rs, c) for rs in seeds]) for c in columns) + " |"
            for v, seeds in runs.items()]


# A benchmark's table: this line above its header; NAME.json under the records is the bench's last JSON line; each
# column a dotted key of it to a list (row i: item i; `rows.mismatch`: that field of each item of a list) and a
# format (`step_s:.2f`; a trailing `x` prints a ratio as 1.22x; `reward+-reward_sem:.3f` two keys as mean +- error)
BENCH_TABLE = re.compile(r"^[ \t]*<!-- findings\.py bench ([\w./-]+): (.+?) -->$", re.MULTILINE)


# Numbers quoted from a benchmark's record in the text or table that follows: the TEMPLATE's fields read NAME.json
# (`{speedup[2]:.2f}x`: str.format on the record) and the rendered text must stand in the lines after the marker,
# up to the first blank line after them, wherever its lines break (several markers may stand above one table)
QUOTE = re.compile(r"^[ \t]*<!-- findings\.py quote ([\w./-]+): (.+?) -->$", re.MULTILINE)


class NumberKeys(dict):
    """A JSON object whose digit keys a str.format field may give as a number (`{by_replicas[8]}`)."""
    def __missing__(self, key):
        if isinstance(key, int):
            return self[str(key)]
        raise KeyError(key)


def check_quotes(text: str, records: str) -> list[str]:
    """Where a QUOTE's rendered text is not in the block it stands above."""
    problems = []
    for marker in QUOTE.finditer(text):
        path = os.path.join(records, marker[1] + ".json")
        if not os.path.exists(path):
            problems.append(f"quote of {marker[1]}: no record {path}")
            continue
        with open(path) as f:
            quoted = marker[2].format_map(json.load(f, object_hook=NumberKeys))
        block = text[marker.end():].lstrip("\n").split("\n\n")[0]
        if " ".join(quoted.split()) not in " ".join(block.split()):  # wherever the lines break
            problems.append(f"quote of {marker[1]}: {quoted!r} is not in the text under its marker")
    return problems


def bench_value(record: dict, key: str, row: int):
    """record[a][b][row] for the key "a.b"; a list on the way is read item by item (rows.mismatch: each row's)."""
    for part in key.split("."):
        record = [item[part] for item in record] if isinstance(record, list) else record[part]
    return record[row]


def bench_cell(record: dict, spec: str, row: int) -> str:
    key, _, fmt = spec.partition(":")
    ratio = fmt.endswith("x")
    fmt = fmt.removesuffix("x")
    if "+-" in key:
        mean, error = key.split("+-")
        return f"{bench_value(record, mean, row):{fmt}} +- {bench_value(record, error, row):{fmt}}"
    return f"{bench_value(record, key, row):{fmt}}" + ("x" if ratio else "")


def bench_rows(record: dict, columns: list[str]) -> list[str]:
    """A bench table's rows from its record: one an item of the first column's list."""
    first = columns[0].partition(":")[0].split("+-")[0]
    return ["| " + " | ".join(bench_cell(record, c, i) for c in columns) + " |"
            for i in range(len(bench_value(record, first, slice(None))))]


def marked_rows(text: str, marker: re.Match) -> list[str]:
    """The rows of the table under a marker line: after its header and |---|, up to the first line not a row."""
    lines = [line.strip() for line in text[marker.end():].lstrip().splitlines()[2:]]
    return list(itertools.takewhile(lambda line: line.startswith("| "), lines))


def check_tables(text: str, records: str) -> list[str]:
    """Where docs/findings.md's TABLEs and bench tables differ from their rows recomputed from the records."""
    problems = []
    for marker in [*TABLE.finditer(text), *BENCH_TABLE.finditer(text)]:
        name, columns = marker[1], shlex.split(marker[2])  # a key with a space in quotes
        if marker.re is TABLE:
            runs = read_records(name, records)
            computed = table_rows(runs, columns) if runs else None
        else:
            path = os.path.join(records, name + ".json")
            computed = None
            if os.path.exists(path):
                with open(path) as f:
                    computed = bench_rows(json.load(f), columns)
        if computed is None:
            problems.append(f"table of {name}: no records in {records}")
            continue
        in_doc = marked_rows(text, marker)
        problems += [f"table of {name}, in the records, not in the doc: {row}" for row in computed if row not in in_doc]
        problems += [f"table of {name}, in the doc, not from the records: {row}" for row in in_doc
                     if row not in computed]
    return problems


def check(records: str = RECORDS, doc: str = DOC) -> list[str]:
    """What differs between docs/findings.md's verdict rows (and its count of reproduced claims, and its TABLEs)
    and those recomputed from the records: every recorded finding's rows must stand in the doc exactly, and every
    verdict row of the doc must come from records. Empty: they agree."""
    text = open(doc).read()
    in_doc = [line for line in text.splitlines() if line.startswith("| ") and line.split(" | ")[0][2:] in CLAIMS]
    problems, computed = [], []
    for name in CLAIMS:
        runs = read_records(name, records)
        if not runs:
            continue
        missing = ({c.higher for c in CLAIMS[name]} | {c.lower for c in CLAIMS[name]}) - set(runs)
        if missing:
            problems.append(f"{name}: no records of {sorted(missing)} in {records}")
            continue
        computed += verdict_rows(name, runs)
    problems += [f"in the records, not in {doc}: {row}" for row in computed if row not in in_doc]
    problems += [f"in {doc}, not from the records: {row}" for row in in_doc if row not in computed]
    count = count_line(computed)
    if computed and count not in text:
        problems.append(f"{doc} does not say: {count}")
    return problems + check_tables(text, records) + check_quotes(text, records)


def count_line(rows: list[str]) -> str:
    reproduced = sum("| **reproduced**" in row for row in rows)
    verb = "is" if reproduced == 1 else "are"
    return f"By the rule, {reproduced} of the {len(rows)} claims tested on the any-order task {verb} reproduced."


# ------------------------------------------------------------------------------------------- runs

def last_step(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max((json.loads(line)["step"] for line in f if line.strip()), default=0)


def train(run_dir: str, flags: list[str], steps: int) -> None:
    """One train.py run into `run_dir` (its stdout in run_dir + '.log'), unless it already reached `steps`."""
    if last_step(run_dir) >= steps:
        return
    has_checkpoint = bool(outdir.list_checkpoints(run_dir))
    cmd = [sys.executable, "train.py", *flags, "--steps", str(steps), "--out", run_dir, "--threads", "1",
           "--save-every", "50", "--keep-last", "1", "--dump-samples", "0",
           *(["--resume", "auto"] if has_checkpoint else ["--overwrite", "true"])]
    t0 = time.time()
    with open(run_dir + ".log", "a") as log:
        p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}); its output: {run_dir}.log")
    print(f"  {os.path.basename(run_dir)}: {time.time() - t0:.0f}s", flush=True)


def noisy_data(folder: str) -> None:
    """noisy-any's datasets in `folder`, unless there: true.jsonl (NOISY_ROWS training problems), noisy.jsonl (the
    same, a NOISE share of the answers one off, up or down at random) and cleaned.jsonl (noisy.jsonl after clean.py's
    majority check, its report beside it); then how many noisy and true rows the cleaning dropped, printed and
    written to prepared.json (--record keeps it)."""
    if not os.path.exists(os.path.join(folder, "cleaned.jsonl")):
        rng = random.Random(NOISY_SEED)
        rows = tiny.make_rows(NOISY_ROWS, NOISY_SEED)
        noisy = [dict(r, answer=str(int(r["answer"]) + rng.choice((-1, 1)))) if rng.random() < NOISE else r
                 for r in rows]
        for arm, arm_rows in (("true", rows), ("noisy", noisy)):
            with open(os.path.join(folder, f"{arm}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in arm_rows)
        cmd = [sys.executable, "clean.py", os.path.join(folder, "noisy.jsonl"), os.path.join(folder, "cleaned.jsonl"),
               "--default-verifier", "tiny", "--majority-models", f"{tiny.CKPT},{tiny.ANY_CKPT}", "--temperature", "0",
               "--max-tokens", "64", "--engine", "hf"]
        subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if os.path.exists(os.path.join(folder, PREPARED)):
        return
    rows, noisy = ([json.loads(line) for line in open(os.path.join(folder, f"{arm}.jsonl"))] for arm in ("true", "noisy"))
    with open(os.path.join(folder, "cleaned.report.json")) as f:  # each dropped row "where": path:LINE, from 1
        dropped = {int(d["where"].rpartition(":")[2]) - 1 for d in json.load(f)["dropped_rows"]}
    wrong = [r["answer"] != t["answer"] for r, t in zip(noisy, rows)]
    counts = {"rows": len(rows), "wrong": sum(wrong), "dropped": len(dropped),
              "dropped_wrong": sum(wrong[i] for i in dropped), "dropped_right": sum(not wrong[i] for i in dropped)}
    with open(os.path.join(folder, PREPARED), "w") as f:
        json.dump(counts, f, indent=1)
    print(f"noisy-any data: {counts['wrong']} of {counts['rows']} labels wrong; the cleaning dropped "
          f"{counts['dropped_wrong']} of them and {counts['dropped_right']} right ones", flush=True)


def run_all(name: str, spec: dict, seeds: list[int], root: str, extra: list[str], jobs: int) -> dict:
    """Every (seed, variant) run of a finding; returns {variant: [metrics records of each seed]}. A finding's
    `prepare` (a function of the folder) first makes what its runs read there ("{folder}" in its flags)."""
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    if "prepare" in spec:
        spec["prepare"](folder)
    steps = int(next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--steps"), spec["steps"]))
    extra = [a for i, a in enumerate(extra) if a != "--steps" and (i == 0 or extra[i - 1] != "--steps")]
    todo = [(os.path.join(folder, f"{v}_s{s}"),
             spec["common"] + [f.replace("{folder}", folder) for f in flags] + extra + ["--seed", str(s)])
            for s in seeds for v, flags in spec["variants"].items()]  # seed-major: each seed's variants together
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda job: train(job[0], job[1], steps), todo))
    return {v: [plot.read_metrics(os.path.join(root, name, f"{v}_s{s}")) for s in seeds] for v in spec["variants"]}


# ------------------------------------------------------------------------------------------ numbers

def finals(seeds: list[list[dict]], key: str) -> list[float]:
    """The last logged value of `key` in each seed's run (NaN for a run that never logged it)."""
    return [(plot.series(records, key)[1] or [float("nan")])[-1] for records in seeds]


def window_mean(records: list[dict], key: str, first: int, last: int) -> float:
    values = [r[key] for r in records if first <= r["step"] <= last and r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def spread(values: list[float]) -> dict:
    """Mean and half the range over seeds (with two seeds: mean +- this gives both)."""
    return {"mean": sum(values) / len(values), "pm": (max(values) - min(values)) / 2, "seeds": values}


def clean(x):
    """JSON has no NaN: None instead."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def fmt(s: dict, digits: int = 3) -> str:
    form = f".{digits}g" if 0 < abs(s["mean"] or 0) < 0.01 else f".{digits}f"  # a learning rate, say
    return f"{s['mean']:{form}} +- {s['pm']:{form}}" if s["mean"] is not None else "-"


def run_seconds(seeds: list[list[dict]]) -> list[float]:
    """Each run's own time: the sum of its steps' times (evaluations included), model loading left out."""
    return [sum(r.get("time/step_s") or 0 for r in records) for records in seeds]


def eval_at(seeds: list[list[dict]], step: int) -> dict:
    """Held-out accuracy at `step` over seeds (NaN where a run did not evaluate there)."""
    return spread(finals([[r for r in rs if r["step"] == step] for rs in seeds], "eval/accuracy"))


def common_numbers(runs: dict, steps: int) -> dict:
    """Per variant: held-out accuracy first and last, entropy early / late, mean clip and masked fractions."""
    out = {}
    for v, seeds in runs.items():
        late = max(1, steps - 19)
        out[v] = {"eval_first": eval_at(seeds, 0),
                  "eval_last": spread(finals(seeds, "eval/accuracy")),
                  "entropy_first10": spread([window_mean(rs, "entropy/mean", 1, 10) for rs in seeds]),
                  "entropy_last20": spread([window_mean(rs, "entropy/mean", late, steps) for rs in seeds]),
                  "clip_frac": spread([window_mean(rs, "clip/low_frac", 1, steps) + window_mean(rs, "clip/high_frac", 1, steps)
                                       + window_mean(rs, "clip/dual_frac", 1, steps) for rs in seeds]),
                  "masked_frac": spread([window_mean(rs, "mpt/masked_frac", 1, steps) for rs in seeds]),
                  # the covariance of log-prob and advantage (what a step takes from the entropy), and the part of
                  # it on the tokens DMMPTs mask, over all steps
                  "cov": spread([window_mean(rs, "entropy/cov", 1, steps) for rs in seeds]),
                  "cov_masked": spread([window_mean(rs, "entropy/cov_masked", 1, steps) for rs in seeds]),
                  "run_s": spread(run_seconds(seeds))}
    return out


def curves(runs: dict, key: str, smooth: int = 1) -> dict:
    lines = {}
    for v, seeds in runs.items():
        steps, mean, low, high = plot.variant_curves(seeds, key, smooth)
        if steps:
            lines[v] = (steps, mean, low, high)
    return lines


def eval_title(runs: dict) -> str:
    """The held-out accuracy panel's title, with the number of problems the runs evaluated (--eval-n)."""
    first = next(iter(runs.values()))[0][0]
    return f"held-out accuracy ({first.get('config', {}).get('eval_n', '?')} problems)"


def print_table(numbers: dict, keys: list[str]) -> None:
    print(f"\n{'variant':>10} | " + " | ".join(f"{k:>16}" for k in keys))
    for v, n in numbers.items():
        print(f"{v:>10} | " + " | ".join(f"{fmt(n[k]):>16}" for k in keys))


# ------------------------------------------------------------------------------------------ findings

def finding_dmmpt(runs: dict, steps: int, figure: str) -> dict:
    numbers = common_numbers(runs, steps)
    sigma = next(iter(runs.values()))[0][0].get("config", {}).get("mpt_sigma", SIGMA_ANY)  # the runs' own
    print_table(numbers, ["eval_first", "eval_last", "entropy_first10", "entropy_last20", "masked_frac", "cov",
                          "cov_masked"])
    plot.panel_figure([
        {"title": "mean token entropy (trailing mean of 5 steps)", "xlabel": "step", "lines": curves(runs, "entropy/mean", 5),
         "hlines": {f"sigma {sigma}": sigma}},
        {"title": eval_title(runs), "xlabel": "step", "lines": curves(runs, "eval/accuracy"),
         "style": "o-"},
        {"title": "tokens masked by DMMPTs (trailing mean of 5)", "xlabel": "step", "lines": curves(runs, "mpt/masked_frac", 5)},
        {"title": "Cov(log-prob, advantage): all (solid), masked tokens' part (dashed)", "xlabel": "step",
         "lines": curves(runs, "entropy/cov", 5) | {f"{v}: masked": line for v, line in
                                                    curves(runs, "entropy/cov_masked", 5).items()},
         "styles": {f"{v}: masked": "--" for v in runs}, "colors": {**{v: v for v in runs},
                                                                     **{f"{v}: masked": v for v in runs}}},
    ], figure, "DMMPTs off / static / dynamic: mean over seeds, band = lowest to highest seed")
    return numbers



def finding_sigma(runs: dict, steps: int, figure: str) -> dict:
    """Dynamic DMMPTs against sigma: where each run's entropy settles (the mean of its last 20 steps) against
    its sigma, beside no masking and static masking, with the tokens masked and the covariance they carry."""
    numbers = common_numbers(runs, steps)
    cfg = next(iter(runs.values()))[0][0].get("config", {})  # the runs' own
    late = max(1, steps - 19)
    sigmas = {v: float(v.rpartition("sigma")[2]) for v in runs if v.startswith("dynamic_sigma")}
    for v, seeds in runs.items():
        n = numbers[v]
        n["masked_frac_late"] = spread([window_mean(rs, "mpt/masked_frac", late, steps) for rs in seeds])
        n["push_removed"] = spread([m / c for m, c in zip(n["cov_masked"]["seeds"], n["cov"]["seeds"])])
        if v in sigmas:  # where the entropy settled, from sigma: 0 is "holds at sigma"
            n["late_minus_sigma"] = spread([e - sigmas[v] for e in n["entropy_last20"]["seeds"]])
    print_table(numbers, ["eval_first", "eval_last", "entropy_first10", "entropy_last20", "masked_frac_late",
                          "push_removed"])
    by_sigma = sorted(sigmas, key=sigmas.get)
    xs, late_h = [sigmas[v] for v in by_sigma], [numbers[v]["entropy_last20"] for v in by_sigma]
    settle = {}
    if xs:  # no masking and static masking, which have no sigma, as flat lines across the doses
        settle["dynamic"] = (xs, [h["mean"] for h in late_h], [min(h["seeds"]) for h in late_h],
                             [max(h["seeds"]) for h in late_h])
        settle |= {v: (xs, [numbers[v]["entropy_last20"]["mean"]] * len(xs), None, None) for v in ("off", "static")
                   if v in runs}
        settle["entropy = sigma"] = (xs, xs, None, None)
    flat = {f"{v}: sigma": ([1, steps], [s, s], None, None) for v, s in sigmas.items()}
    plot.panel_figure([
        {"title": "mean token entropy (trailing mean of 5); dashed: each run's sigma", "xlabel": "step",
         "lines": curves(runs, "entropy/mean", 5) | flat, "styles": {label: "--" for label in flat},
         "colors": {**{v: v for v in runs}, **{f"{v}: sigma": v for v in sigmas}}},
        {"title": f"entropy, steps {late}-{steps}, against sigma", "xlabel": "sigma", "style": "o-", "lines": settle,
         "styles": {"off": "--", "static": "--", "entropy = sigma": ":"}},
        {"title": "tokens masked (trailing mean of 5)", "xlabel": "step", "lines": curves(runs, "mpt/masked_frac", 5)},
        {"title": eval_title(runs), "xlabel": "step", "lines": curves(runs, "eval/accuracy"), "style": "o-"},
    ], figure, f"dynamic DMMPTs against sigma ({cfg.get('model')}, --data {cfg.get('data')}, tau {cfg.get('mpt_tau')}): "
               f"mean over seeds, band = lowest to highest seed")
    return numbers


def finding_is(runs: dict, steps: int, figure: str, title: str = "pi_old under segment rollout") -> dict:
    """The IS modes' numbers and figure (and prorl-any's: its arms differ in the clip, whose share is a panel)."""
    numbers = common_numbers(runs, steps)
    for v, seeds in runs.items():  # versions behind: every trained token, and each sample's last segment (a wait)
        numbers[v]["staleness"] = spread([window_mean(rs, "staleness/token_mean", 1, steps) for rs in seeds])
        numbers[v]["staleness_last"] = spread([window_mean(rs, "staleness/last_segment_mean", 1, steps) for rs in seeds])
    print_table(numbers, ["eval_first", "eval_last", "entropy_first10", "entropy_last20", "clip_frac", "staleness",
                          "staleness_last"])
    clip = {}
    for v, seeds in runs.items():  # low + high + dual clip fractions of each step
        summed = [[{"step": r["step"], "clip": sum(r.get(k) or 0 for k in ("clip/low_frac", "clip/high_frac", "clip/dual_frac"))}
                   for r in rs if r.get("clip/low_frac") is not None] for rs in seeds]
        steps_, mean, low, high = plot.variant_curves(summed, "clip", 5)
        clip[v] = (steps_, mean, low, high)
    plot.panel_figure([
        {"title": "mean token entropy (trailing mean of 5 steps)", "xlabel": "step", "lines": curves(runs, "entropy/mean", 5)},
        {"title": eval_title(runs), "xlabel": "step", "lines": curves(runs, "eval/accuracy"),
         "style": "o-"},
        {"title": "clipped token fraction (trailing mean of 5)", "xlabel": "step", "lines": clip},
    ], figure, f"{title}: mean over seeds, band = lowest to highest seed")
    return numbers




def evaluate_at(model_dir: str, report: str, max_len: int, k: int, n: int, seed: int = 0) -> dict:
    """eval.py in its own process (one thread): the report, cached in `report`."""
    if not os.path.exists(report):
        cmd = [sys.executable, "eval.py", "--model", model_dir, "--k", str(k), "--n-problems", str(n),
               "--max-response-len", str(max_len), "--batch", "512", "--seed", str(seed), "--report", report]
        with open(report + ".log", "w") as log:
            p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed; its output: {report}.log")
    with open(report) as f:
        return json.load(f)


def final_checkpoint(run_dir: str) -> str:
    return os.path.join(run_dir, outdir.list_checkpoints(run_dir)[-1])



def pass_curve(report: dict) -> list[float]:
    """pass@k for every k = 1..n from the report's per-problem results (the unbiased estimator)."""
    n = report["k"]
    return [sum(eval_lib.pass_at_k(n, sum(p["correct"]), k) for p in report["per_problem"]) / len(report["per_problem"])
            for k in range(1, n + 1)]



def passk_numbers(reports: dict[str, list[dict]], k: int, n: int) -> tuple[dict, dict]:
    """(figure lines, {model: {k: spread over seeds}}) of pass@1..k, printed as a table."""
    ks = list(range(1, k + 1))
    lines, passk = {}, {}
    for name, reps in reports.items():
        per_seed = [pass_curve(r) for r in reps]
        mean = [sum(c[i] for c in per_seed) / len(per_seed) for i in range(k)]
        lines[name] = (ks, mean, [min(c[i] for c in per_seed) for i in range(k)], [max(c[i] for c in per_seed) for i in range(k)])
        passk[name] = {str(kk): spread([c[kk - 1] for c in per_seed]) for kk in eval_lib.ks_up_to(k)}
    print(f"\npass@k on {n} held-out problems, {k} samples each (T 1, 64-token cap):")
    print(f"{'model':>12} | " + " | ".join(f"{'pass@' + kk:>15}" for kk in next(iter(passk.values()))))
    for name, row in passk.items():
        print(f"{name:>12} | " + " | ".join(f"{fmt(s):>15}" for s in row.values()))
    return lines, passk



def finding_boundary_any(root: str, seeds: list[int], k: int, n: int, figure: str) -> dict[str, list[list[dict]]]:
    """pass@1..k of the warm start and of BOUNDARY_RUNS' last checkpoints, seed by seed, two evaluations at a time:
    {"rl" | "warm-start": [each seed's rows {"step": k, "passk": pass@k}]}."""
    dirs = [os.path.join(root, f"{BOUNDARY_RUNS}_s{s}") for s in seeds]
    missing = [d for d in dirs if not outdir.list_checkpoints(d)]
    if missing:
        raise SystemExit(f"no checkpoint in {', '.join(missing)}: run `python experiments/findings.py "
                         f"{BOUNDARY_RUNS.split('/')[0]} --only {BOUNDARY_RUNS.split('/')[1]} --seeds "
                         f"{','.join(map(str, seeds))} --root {root}` first")
    folder = os.path.join(root, "boundary-any")
    os.makedirs(folder, exist_ok=True)
    jobs = [(arm, s, model) for s, d in zip(seeds, dirs) for arm, model in
            (("rl", final_checkpoint(d)), ("warm-start", tiny.ANY_CKPT))]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda j: evaluate_at(j[2], os.path.join(folder, f"{j[0]}_s{j[1]}.pass{k}x{n}.json"),
                                                   64, k, n, seed=j[1]), jobs))
    reports = {"rl": [], "warm-start": []}
    for (arm, _, _), report in zip(jobs, done):
        reports[arm].append(report)
    lines, _ = passk_numbers(reports, k, n)
    plot.panel_figure([{"title": f"pass@k, {n} held-out problems, {k} samples each", "xlabel": "k", "logx": True,
                        "ylabel": "pass@k", "lines": lines}], figure, "Warm start against RL: mean, band = seeds' range")
    return {arm: [[{"step": kk, "passk": p} for kk, p in enumerate(pass_curve(r), 1)] for r in reps]
            for arm, reps in reports.items()}




def prolonged_numbers(runs: dict, steps: int) -> dict:
    """common_numbers, and for a prolonged run: held-out accuracy at the half, its gain over the second half (a
    stalled run gains nothing) and the mean KL to the reference."""
    numbers = common_numbers(runs, steps)
    for v, seeds in runs.items():
        numbers[v]["eval_half"] = eval_at(seeds, steps // 2)
        numbers[v]["gain_second_half"] = spread([b - a for a, b in zip(numbers[v]["eval_half"]["seeds"],
                                                                       numbers[v]["eval_last"]["seeds"])])
        numbers[v]["kl_mean"] = spread([window_mean(rs, "loss/kl", 1, steps) for rs in seeds])
    return numbers



def finding_resets(runs: dict, steps: int, figure: str, beta: float = BETA_ANY) -> dict:
    """KL and resets of each kind in a prolonged run: held-out accuracy at the half and the end and its gain over
    the second half, the KL to the reference, the entropy, and how many resets each arm made."""
    numbers = prolonged_numbers(runs, steps)
    for v, seeds in runs.items():
        numbers[v]["resets"] = spread([sum(1 for r in rs if r.get("train/ref_reset")) for rs in seeds])
    print_table(numbers, ["eval_first", "eval_half", "eval_last", "gain_second_half", "entropy_last20", "kl_mean",
                          "resets"])
    stall = " or on a stall" if any("on-stall" in v for v in runs) else ""
    plot.panel_figure([
        {"title": eval_title(runs), "xlabel": "step", "style": "o-", "lines": curves(runs, "eval/accuracy")},
        {"title": "k3 KL to the reference per token (trailing mean of 5)", "xlabel": "step",
         "lines": curves({v: rs for v, rs in runs.items() if v != "no-kl"}, "loss/kl", 5)},
        {"title": "mean token entropy (trailing mean of 5)", "xlabel": "step", "lines": curves(runs, "entropy/mean", 5)},
    ], figure, f"KL and resets (KL {beta}, resets every {RESET_EVERY_ANY} steps{stall}): "
               f"mean over seeds, band = lowest to highest seed")
    return numbers


def parse_variants(texts: list[str]) -> dict[str, list[str]]:
    """--variant NAME=FLAGS (FLAGS split as a shell would; may be empty) -> {NAME: [flag, ...]}, in order."""
    variants = {}
    for text in texts:
        name, sep, flags = text.partition("=")
        if not sep or not name.strip() or not name.replace("-", "").replace("+", "").replace(".", "").isalnum():
            raise SystemExit(f"--variant {text!r}: expected NAME=FLAGS, e.g. 'loo=--kl-coef 0.1' (NAME: letters, "
                             f"digits, '-', '+', '.'; FLAGS may be empty: the tiny default)")
        if name in variants:
            raise SystemExit(f"--variant {text!r}: the name {name!r} is given twice")
        variants[name] = shlex.split(flags)
    if len(variants) < 1:
        raise SystemExit("variants: give at least one --variant NAME=FLAGS")
    return variants


def finding_variants(runs: dict, steps: int, figure: str, keys: list[str], name: str) -> dict:
    """A study of the user's own: every variant's held-out accuracy and entropy, the last value of each of
    `keys` (per-step metrics: the mean of the last 10 steps), and one panel per key."""
    numbers = common_numbers(runs, steps)
    for v, seeds in runs.items():
        for key in keys:
            numbers[v][key] = spread(finals(seeds, key) if key.startswith("eval/") else
                                     [window_mean(rs, key, max(1, steps - 9), steps) for rs in seeds])
    print_table(numbers, ["eval_first", "eval_last", "entropy_last20", "run_s"])
    print_table(numbers, keys)
    panels = []
    for key in keys:
        smooth = 1 if key.startswith("eval/") else 5
        lines = curves(runs, key, smooth)
        if lines:
            panels.append({"title": eval_title(runs) if key == "eval/accuracy" else
                           key + ("" if smooth == 1 else " (trailing mean of 5 steps)"), "xlabel": "step",
                           "lines": lines, "style": "o-" if smooth == 1 else "-"})
    if not panels:
        raise SystemExit(f"--keys {','.join(keys)}: no run logged any of them (see a run's metrics.jsonl for keys)")
    plot.panel_figure(panels, figure, f"{name}: mean over seeds, band = lowest to highest seed")
    return numbers


# ---------------------------------------------------------------------------------------------- main

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("finding", choices=[*FINDINGS, "boundary-any", "variants", "check"],
                   help="which finding to reproduce; variants: your own --variant runs; check: docs/findings.md's "
                        "verdict rows against the committed records")
    p.add_argument("--record", action="store_true",
                   help="keep the runs' metrics under experiments/records/FINDING/ (committed: what check reads)")
    p.add_argument("--records", default=RECORDS, help="the records' folder: check reads it, --record writes to it")
    p.add_argument("--doc", default=DOC, help="check: the document whose verdict rows it checks")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="variants: one variant, its train.py flags as one string (repeat the option)")
    p.add_argument("--name", default="variants", help="variants: the study's folder under --root and its title")
    p.add_argument("--keys", default="eval/accuracy,reward/mean,entropy/mean",
                   help="variants: metrics.jsonl keys to draw and tabulate, comma-separated")
    p.add_argument("--only", default="", metavar="VARIANTS",
                   help="a finding: only these of its variants, comma-separated (e.g. tois-1seg,pois-8seg)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds; each variant runs once per seed")
    p.add_argument("--root", default="runs/findings", help="runs go to ROOT/FINDING/VARIANT_sSEED")
    p.add_argument("--figure", default="", help="the figure's path (default: ROOT/FINDING/FINDING.png, beside "
                                                "the runs)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, one thread each")
    p.add_argument("--passk-samples", type=int, default=64, help="boundary-any: samples per problem for pass@k")
    p.add_argument("--passk-problems", type=int, default=256, help="boundary-any: held-out problems for pass@k")
    args, extra = p.parse_known_args(argv)
    if args.finding == "check":
        if extra:
            p.error(f"check trains nothing: unknown arguments {' '.join(extra)}")
        problems = check(args.records, args.doc)
        print("\n".join(problems) if problems else f"{args.doc}: its verdict rows and marked tables agree with {args.records}")
        if problems:
            raise SystemExit(1)
        return {"finding": "check", "problems": []}
    seeds = [int(s) for s in args.seeds.split(",")]
    root = os.path.abspath(args.root)
    name = args.name if args.finding == "variants" else args.finding
    figure = os.path.abspath(args.figure or os.path.join(root, name, f"{name}.png"))
    os.makedirs(os.path.dirname(figure), exist_ok=True)
    t0 = time.time()
    if args.finding == "boundary-any":
        if extra:
            p.error(f"boundary-any trains nothing: unknown arguments {' '.join(extra)}")
        runs = finding_boundary_any(root, seeds, args.passk_samples, args.passk_problems, figure)
        print("\n" + "\n".join(verdict_rows(name, runs)))
        if args.record:
            save_records(name, runs, seeds, args.records)
            print(f"records: {os.path.join(args.records, name)}")
        result = clean({"finding": name, "seeds": seeds, "runs": runs, "figure": figure, "wall_s": time.time() - t0})
        with open(os.path.join(root, name, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
        return result
    if args.finding == "variants":
        spec = dict(steps=STEPS, common=[], variants=parse_variants(args.variant))
    elif args.variant:
        p.error(f"--variant is for 'variants'; {args.finding} has its own: {', '.join(FINDINGS[args.finding]['variants'])}")
    else:
        spec = FINDINGS[args.finding]
    if args.only:
        only = args.only.split(",")
        if args.finding == "variants":
            p.error("--only is for a finding; variants runs the --variant runs it is given")
        if [v for v in only if v not in spec["variants"]]:
            p.error(f"--only {args.only}: {args.finding} has the variants {', '.join(spec['variants'])}")
        spec = dict(spec, variants={v: flags for v, flags in spec["variants"].items() if v in only})
    print(f"{name}: variants {list(spec['variants'])} x seeds {seeds} into {root}/{name}", flush=True)
    runs = run_all(name, spec, seeds, root, extra, args.jobs)
    steps = max(r["step"] for r in runs[next(iter(runs))][0])
    drawn_from_runs = {"dmmpt-any": finding_dmmpt, "sigma-any": finding_sigma, "is-any": finding_is,
                       "resets-any": finding_resets,
                       "resets-dose-any": lambda *a: finding_resets(*a, beta=BETA_DOSE),
                       "dynsamp-any": lambda *a: finding_is(*a, title="dynamic sampling on and off"),
                       "noisy-any": lambda *a: finding_is(*a, title="data cleaning under noisy labels"),
                       "prorl-any": lambda *a: finding_is(*a, title="ProRL's settings (T 1.2, 16 samples, 4 updates a step)"),
                       "length-any": lambda *a: finding_is(*a, title="a 32- against a 64-token response cap")}
    if args.finding in drawn_from_runs:
        numbers = drawn_from_runs[args.finding](runs, steps, figure)
    else:
        numbers = finding_variants(runs, steps, figure, [k for k in args.keys.split(",") if k], name)
    if name in CLAIMS:
        print("\n" + "\n".join(verdict_rows(name, runs)))
        if args.record:
            write_records(name, os.path.join(root, name), list(spec["variants"]), seeds, args.records)
            print(f"records: {os.path.join(args.records, name)}")
    elif args.record:
        p.error(f"--record: {name} has no CLAIMS to check its records against")
    wall = time.time() - t0
    print(f"\nfigure: {figure}\nwall time of this command: {wall:.0f}s (runs already done are not redone)")
    result = {"finding": args.finding, "name": name, "steps": steps, "seeds": seeds, "variants": spec["variants"],
              "numbers": numbers, "figure": figure, "wall_s": wall}
    result = clean(result)
    with open(os.path.join(root, name, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
