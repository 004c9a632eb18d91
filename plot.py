"""Training curves from runs' `metrics.jsonl` to PNG files, several runs on one figure (one line per run,
the legend names its directory). Null values (the step-0 record has no training metrics) are skipped.

    python plot.py runs/tiny                          # PNGs into runs/tiny/
    python plot.py runs/tiny runs/tiny_vllm --out /tmp/plots

Writes reward.png (rollout reward and held-out accuracy), entropy.png (with DMMPTs' target sigma from the
first run's config), masked.png, length.png (mean and max response tokens), unfinished.png, step_time.png
and eval.png (accuracy, mean length, truncation rate of every evaluation); for a run that mixes domains,
reward_by_verifier.png (the mean reward of each verifier). A figure with no data in any run is not written.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

# file -> subplots, each (title, [(metric key, line style), ...]); colour = run, line style = metric
FIGURES = {
    "reward.png": [("reward and held-out accuracy", [("reward/mean", "-"), ("eval/accuracy", "o--")])],
    "entropy.png": [("mean token entropy (line: target sigma)", [("entropy/mean", "-")])],
    "masked.png": [("fraction of response tokens masked (DMMPTs)", [("mpt/masked_frac", "-")])],
    "length.png": [("response tokens (trained samples)", [("response/mean_len", "-"), ("response/max_len", ":")])],
    "unfinished.png": [("unfinished pool (samples)", [("rollout/unfinished", "-")])],
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


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (train.py --out), each with a metrics.jsonl")
    p.add_argument("--out", default="", help="where to write the PNGs (default: the first run directory)")
    args = p.parse_args(argv)
    runs = {}
    for d in args.runs:
        name = os.path.basename(os.path.normpath(d))
        runs[name if name not in runs else d] = read_metrics(d)  # two runs named alike: the full path
    config = next(iter(runs.values()))[0].get("config", {}) if next(iter(runs.values())) else {}
    sigma = config.get("mpt_sigma")  # DMMPTs mask while a sample's entropy is below this (UloRL 3.2)
    out = args.out or args.runs[0]
    os.makedirs(out, exist_ok=True)
    written, figures = [], dict(FIGURES)
    domains = sorted({k for recs in runs.values() for r in recs for k in r if k.startswith("reward/by_verifier/")})
    if len(domains) > 1:  # a mixture of domains: one reward curve per verifier
        styles = ["-", "--", ":", "-."]
        figures["reward_by_verifier.png"] = [("reward by verifier", [(k, styles[i % 4]) for i, k in enumerate(domains)])]
    for fname, panels in figures.items():
        path = os.path.join(out, fname)
        if plot_figure(runs, panels, path, sigma if fname == "entropy.png" else None):
            written.append(path)
        else:
            print(f"{fname}: no data in any run, not written")
    print("wrote " + " ".join(written))
    return written


if __name__ == "__main__":
    main()
