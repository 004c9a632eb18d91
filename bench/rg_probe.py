"""`python -m bench rg`: how training may reward each Reasoning Gym dataset, from its probe as a run does it
(data.rg_verdict, verifiers.rg_probe): scores as they are, full marks only, or refused, with the reason and the
probe's seconds. Not a timing to compare: the census behind docs/rewards.md's table."""
import json
import time


def bench_rg(args, _unused: list[str]) -> dict:
    import reasoning_gym

    import data
    import verifiers
    names = args.datasets.split(",") if args.datasets else sorted(reasoning_gym.factory.DATASETS)
    verdicts, seconds = {}, 0.0
    for name in names:
        start = time.perf_counter()
        try:
            entries = data.rg_entries(name, data.RG_PROBE_SEED, verifiers.RG_PROBE_ROWS)
        except Exception as e:  # the library cannot make rows the scorer can read (composite, gsm_symbolic)
            verdict, why = "not generated", f"{type(e).__name__}: {e}"
        else:
            try:
                full_marks, why = verifiers.rg_probe(name, entries)
                verdict = "full marks only" if full_marks else "as is"
            except ValueError as e:
                verdict, why = "refused", str(e).split(": this dataset is not supported: ")[-1]
        seconds += time.perf_counter() - start
        verdicts[name] = verdict
        print(json.dumps({"dataset": name, "verdict": verdict, "why": why[:300],
                          "s": round(time.perf_counter() - start, 1)}), flush=True)
    counts = {v: sum(x == v for x in verdicts.values()) for v in ("as is", "full marks only", "refused", "not generated")}
    print(f"{len(names)} datasets: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + f"; {seconds:.0f} s", flush=True)
    return {"bench": "rg", "datasets": len(names), **counts, "seconds": seconds,
            "refused": sorted(n for n, v in verdicts.items() if v == "refused")}


def add_parser(sub) -> None:
    w = sub.add_parser("rg", help="every Reasoning Gym dataset's probe: scores as they are, full marks only, refused")
    w.add_argument("--datasets", default="", help="comma-separated names (default: all the library has)")
    w.set_defaults(run=bench_rg)
