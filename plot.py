"""Training curves from runs' `metrics.jsonl` to PNG files, several runs on one figure (one line per run,
the legend names its directory). Null values (the step-0 record has no training metrics) are skipped.

    python plot.py runs/tiny                          # PNGs into runs/tiny/
    python plot.py runs/tiny runs/tiny_vllm --out /tmp/plots
    python plot.py runs/findings/dmmpt/* --seeds      # runs named NAME_s0, NAME_s1: one line per NAME (the mean
                                                      # over seeds), a band from the lowest to the highest seed
    python plot.py runs/tiny --keys loss/kl,clip/high_frac   # any metrics.jsonl keys, one panel each: KEYS.png

Writes reward.png (rollout reward and held-out accuracy), entropy.png (with DMMPTs' target sigma from the
first run's config), entropy_cov.png (the covariance of log-prob and advantage, and the parts of it the tokens
DMMPTs mask and those that train carry), masked.png (tokens DMMPTs drop from the policy-gradient term; tokens --overlong filter
drops from the loss), length.png (mean and max response tokens), unfinished.png (the unfinished pool, and the
trained samples that took more than one segment), step_time.png and eval.png (accuracy, mean length,
truncation rate of every evaluation); for a run that mixes domains, reward_by_verifier.png (the mean reward
of each verifier). A figure with no data in any run is not written. A new figure is one more FIGURES entry.
Colour is the run (or, with --seeds, the variant); line style is the metric.

`variant_curves` and `panel_figure` draw the side-by-side figures of experiments/findings.py.
"""
import argparse
import json
import os
import re

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

# file -> subplots, each (title, [(metric key, line style), ...]); colour = run, line style = metric
FIGURES = {
    "reward.png": [("reward and held-out accuracy", [("reward/mean", "-"), ("eval/accuracy", "o--")])],
    "entropy.png": [("mean token entropy (line: target sigma)", [("entropy/mean", "-")])],
    "entropy_cov.png": [("Cov(log-prob, advantage): what a step takes from the entropy",
                         [("entropy/cov", "-"), ("entropy/cov_masked", "--"), ("entropy/cov_trained", ":")])],
    "masked.png": [("response tokens out of the policy-gradient term (DMMPTs)", [("mpt/masked_frac", "-")]),
                   ("response tokens out of the loss (--overlong filter)", [("overlong/filtered_frac", "-")])],
    "length.png": [("response tokens (trained samples)", [("response/mean_len", "-"), ("response/max_len", ":")])],
    "unfinished.png": [("unfinished pool (samples)", [("rollout/unfinished", "-")]),
                       ("trained samples decoded in more than one segment", [("response/multi_segment_frac", "-")])],
    "step_time.png": [("step time (s)", [("time/step_s", "-")])],
    "eval.png": [("held-out accuracy", [("eval/accuracy", "o-")]),
                 ("held-out mean length", [("eval/mean_length", "o-")]),
                 ("held-out truncation rate", [("eval/truncation_rate", "o-")])],
}


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file; pass a directory that train.py --out wrote")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); a run killed mid-write leaves a "
                                     f"partial last line: delete it") from None
    return records


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of one metric, skipping records where it is missing or null. Step 0's time/step_s
    is the pre-training evaluation, not a step: skipped."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None
              and not (key == "time/step_s" and r["step"] == 0)]
    return [p[0] for p in points], [p[1] for p in points]


def plot_figure(runs: dict[str, list[dict]], panels: list, path: str, sigma: float | None = None) -> bool:
    """One PNG: a row of subplots, one line per (run, metric). Returns False (and writes nothing) if empty."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = False
    for ax, (title, keys) in zip(axes[0], panels):
        for i, (name, records) in enumerate(runs.items()):
            for key, style in keys:
                steps, values = series(records, key)
                if steps:
                    label = name if len(keys) == 1 else f"{name}: {key}"
                    ax.plot(steps, values, style, color=colors[i % len(colors)], label=label, markersize=3)
                    drawn = True
        if sigma is not None:
            ax.axhline(sigma, color="black", linestyle="--", linewidth=1, label=f"target sigma {sigma}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if drawn:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


# ------------------------------------------------------------------ variants x seeds, side by side

def seed_groups(runs: dict[str, list[dict]]) -> dict[str, list[list[dict]]]:
    """Runs named NAME_sSEED grouped by NAME, in first-seen order; any other name is a group of its own."""
    groups: dict[str, list[list[dict]]] = {}
    for name, records in runs.items():
        groups.setdefault(re.sub(r"_s\d+$", "", name), []).append(records)
    return groups


def variant_curves(seeds: list[list[dict]], key: str, smooth: int = 1) -> tuple[list, list, list, list]:
    """(steps, mean, low, high) of one metric over the runs of one variant (one run per seed): at the steps
    every run logged, each run first averaged over a trailing window of `smooth` logged values (per-step
    metrics are noisy; evaluations use 1). low/high: the lowest and highest seed."""
    per_run = []
    for records in seeds:
        steps, values = series(records, key)
        windows = [values[max(0, i - smooth + 1):i + 1] for i in range(len(values))]
        per_run.append({step: sum(w) / len(w) for step, w in zip(steps, windows)})
    common = sorted(set.intersection(*(set(r) for r in per_run))) if per_run else []
    rows = [[r[s] for r in per_run] for s in common]
    return common, [sum(v) / len(v) for v in rows], [min(v) for v in rows], [max(v) for v in rows]


def panel_figure(panels: list[dict], path: str, title: str = "") -> str:
    """One PNG, one subplot per panel, side by side. A panel: {"title", "xlabel", "ylabel" (optional),
    "lines": {label: (xs, ys, low, high)} (low/high None: no band), "hlines": {label: y} (optional),
    "logx": bool (optional), "style": a matplotlib format such as "o-" (optional), "styles": {label: format}
    and "colors": {label: colour group} (optional: lines of one group share a colour)}. Colours follow the
    order of the labels (or groups), the same in every panel."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.9), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = list(dict.fromkeys(p.get("colors", {}).get(label, label) for p in panels for label in p["lines"]))
    for ax, p in zip(axes[0], panels):
        for label, (xs, ys, low, high) in p["lines"].items():
            color = colors[groups.index(p.get("colors", {}).get(label, label)) % len(colors)]
            style = p.get("styles", {}).get(label, p.get("style", "-"))
            ax.plot(xs, ys, style, color=color, label=label, markersize=3, linewidth=1.5)
            if low is not None:
                ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
        for label, y in p.get("hlines", {}).items():
            ax.axhline(y, color="black", linestyle="--", linewidth=1, label=label)
        if p.get("logx"):
            ax.set_xscale("log", base=2)
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel(p["xlabel"])
        if p.get("ylabel"):
            ax.set_ylabel(p["ylabel"])
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def seed_figures(groups: dict[str, list[list[dict]]], figures: dict, out: str, sigma: float | None) -> list[str]:
    """plot.py --seeds: every figure of `figures` with one line per variant and metric (the mean over seeds) and
    its band; a variant keeps one colour, a metric one line style."""
    written = []
    for fname, panels in figures.items():
        if spec := seed_panels(groups, panels, sigma if fname == "entropy.png" else None):
            written.append(panel_figure(spec, os.path.join(out, fname)))
    return written


def seed_panels(groups: dict[str, list[list[dict]]], panels: list, sigma: float | None = None) -> list[dict]:
    """panel_figure's panels for one figure of FIGURES' form: per (variant, metric) the mean over seeds and its
    band, coloured by variant, styled by metric. Panels without data are left out."""
    spec = []
    for title, keys in panels:
        lines, colours, styles = {}, {}, {}
        for name, seeds in groups.items():
            for key, style in keys:
                steps, mean, low, high = variant_curves(seeds, key, 1 if "eval/" in key else 5)
                if steps:
                    label = name if len(keys) == 1 else f"{name}: {key}"
                    lines[label], colours[label], styles[label] = (steps, mean, low, high), name, style
        if lines:
            spec.append({"title": title, "xlabel": "step", "lines": lines, "colors": colours, "styles": styles,
                         "hlines": {f"sigma {sigma}": sigma} if sigma is not None else {}})
    return spec


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (train.py --out), each with a metrics.jsonl")
    p.add_argument("--out", default="", help="where to write the PNGs (default: the first run directory)")
    p.add_argument("--seeds", action="store_true", help="runs named NAME_sSEED: one line per NAME, the mean over "
                                                        "its seeds, with a band from the lowest to the highest "
                                                        "(per-step metrics: a trailing mean over 5 steps)")
    p.add_argument("--keys", default="", help="comma-separated metrics.jsonl keys: one figure, a panel per key, "
                                              "instead of the standard figures")
    args = p.parse_args(argv)
    runs = {}
    for d in args.runs:
        name = os.path.basename(os.path.normpath(d))
        runs[name if name not in runs else d] = read_metrics(d)  # two runs named alike: the full path
    config = next(iter(runs.values()))[0].get("config", {}) if next(iter(runs.values())) else {}
    sigma = config.get("mpt_sigma")  # DMMPTs mask while a sample's entropy is below this (UloRL 3.2)
    out = args.out or args.runs[0]
    os.makedirs(out, exist_ok=True)
    figures = dict(FIGURES)
    domains = sorted({k for recs in runs.values() for r in recs for k in r if k.startswith("reward/by_verifier/")})
    if args.keys:
        keys = [k for k in args.keys.split(",") if k]
        figures = {"+".join(k.replace("/", "-") for k in keys) + ".png":
                   [(k, [(k, "o-" if k.startswith("eval/") else "-")]) for k in keys]}
    elif len(domains) > 1:  # a mixture of domains: one reward curve per verifier
        styles = ["-", "--", ":", "-."]
        figures["reward_by_verifier.png"] = [("reward by verifier", [(k, styles[i % 4]) for i, k in enumerate(domains)])]
    if args.seeds:
        written = seed_figures(seed_groups(runs), figures, out, sigma)
    else:
        written = []
        for fname, panels in figures.items():
            path = os.path.join(out, fname)
            if plot_figure(runs, panels, path, sigma if fname == "entropy.png" else None):
                written.append(path)
            else:
                print(f"{fname}: no data in any run, not written")
    if args.keys and not written:
        known = sorted({k for records in runs.values() for r in records for k in r} - {"config", "git"})
        raise SystemExit(f"--keys {args.keys}: no run logged any of them; the keys logged: {', '.join(known)}")
    print("wrote " + " ".join(written))
    return written


if __name__ == "__main__":
    main()
