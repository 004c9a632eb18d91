"""`python -m bench routing`: MoE routing, engine against trainer: the experts they choose differently and the
log-prob gap, routing replay off and on, fp32 and bf16. Counts, not timings."""
import time

import torch

from bench.common import div

# EXPERTSxTOP_K:LAYERSxHIDDEN: depth and width at 16 experts, then 64 and 128 (Qwen3-30B-A3B: 128, top-8, 48 layers)
ROUTING_CONFIGS = "16x4:2x128,16x4:8x128,16x4:8x256,64x8:2x128,64x8:8x128,128x8:8x128,128x8:16x128"
ROUTING_VOCAB = 1024


def routing_model(experts: int, top_k: int, layers: int, hidden: int, seed: int):
    """A random qwen3_moe, the headline model's architecture in small: every layer sparse, top-k weights
    renormalised (norm_topk_prob, as Qwen3-30B-A3B), head_dim 32 (one query head per 32 of width, half as many
    KV heads), experts hidden / 2 wide."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    heads = hidden // 32
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=ROUTING_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False, output_router_logits=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, dtype="float32"))


def k3_gaps(d: torch.Tensor) -> dict:
    """Engine/trainer gaps d = trainer - engine log-prob: mean and largest |d|, and the k3 estimate of
    KL(engine || trainer) as ulorl.old_ref_and_masks computes it (rollout/engine_kl)."""
    return {"mean": d.abs().mean().item(), "max": d.abs().max().item(), "k3": (d.exp() - 1 - d).mean().item()}


def routing_point(spec: str, dtype: str, args) -> dict:
    """One model in one dtype. The transformers engine samples --tokens tokens (temperature 1) for each of
    --prompts random prompts of 8-32 tokens, recording the experts of every position it computes (prefill, then
    one decode step a token through the KV cache). The trainer's forward (model.response_logprobs over
    micro-batches, under no_grad as ulorl.old_ref_and_masks) then runs twice: with its own routing, and with the
    engine's replayed (and tallied as rollout/routing_mismatch counts it); each time every layer's experts are
    recorded. A decision is one (position, layer): every position the engine routed, i.e. all but each
    sequence's last; prefill positions are the prompt's, decode positions those that took a sampled token in."""
    import model as model_lib
    from segment_rollout import Sample
    from systems.routing import Routing
    from systems.engine import HFEngine, Sampling
    (experts, top_k), (layers, hidden) = (map(int, part.split("x")) for part in spec.split(":"))
    lm = routing_model(experts, top_k, layers, hidden, args.seed).to(getattr(torch, dtype)).eval()
    routing = Routing.of(lm)
    engine = HFEngine(lm, [], 0, args.seed, routing=True)  # no stop token: every response is --tokens long
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, ROUTING_VOCAB, (int(torch.randint(8, 33, (), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    t0 = time.time()
    gens = engine.generate(prompts, [args.tokens] * len(prompts), Sampling(temperature=1.0), list(range(len(prompts))))
    samples = [Sample(uid=i, group=i, prompt_ids=p, row={}, tokens=x.tokens, logprobs=x.logprobs,
                      versions=[0] * len(x.tokens), seg_starts=[0], reward=0.0, routing=x.routing)
               for i, (p, x) in enumerate(zip(prompts, gens))]
    n = dict.fromkeys(["positions", "decode", "differ", "prefill_differ", "decode_differ", "positions_differ",
                       "replay_differ", "tally_differ", "tally_compared"], 0)
    per_layer, gaps = torch.zeros(layers), {"own": [], "replay": []}
    with torch.no_grad():
        for idx in model_lib.micro_batches(samples, args.micro_batch_tokens, pack=bool(args.pack)):
            mb = model_lib.collate([samples[i] for i in idx], 0, pack=bool(args.pack))
            count_micro_batch(lm, routing, mb, n, per_layer, gaps)
    routing.recorded = routing.replay = routing.tally = routing.counting = None
    own, rep = k3_gaps(torch.cat(gaps["own"])), k3_gaps(torch.cat(gaps["replay"]))
    return {"experts": experts, "top_k": top_k, "layers": layers, "hidden": hidden, "dtype": dtype,
            "positions": n["positions"], "decisions": n["positions"] * layers,
            "mismatch": n["differ"] / (n["positions"] * layers),
            "mismatch_prefill": div(n["prefill_differ"], (n["positions"] - n["decode"]) * layers),
            "mismatch_decode": div(n["decode_differ"], n["decode"] * layers),
            "positions_mismatch": n["positions_differ"] / n["positions"],
            "mismatch_by_layer": (per_layer / n["positions"]).tolist(),
            "replay_differ": n["replay_differ"], "metric_mismatch": div(n["tally_differ"], n["tally_compared"]),
            "gap_mean": own["mean"], "gap_max": own["max"], "engine_kl": own["k3"],
            "replay_gap_mean": rep["mean"], "replay_gap_max": rep["max"], "replay_engine_kl": rep["k3"],
            "response_tokens": sum(map(len, (s.tokens for s in samples))), "seconds": time.time() - t0}


def count_micro_batch(lm, routing, mb, n: dict, per_layer: torch.Tensor, gaps: dict) -> None:
    """One micro-batch of routing_point: the trainer's forward with its own routing, then with the engine's
    replayed, each against the engine's experts; adds to the counts `n`, `per_layer` and the gaps."""
    import model as model_lib
    from systems.routing import replay_layout
    layout, versions = replay_layout(mb.samples, mb.starts)  # [layers, positions, top_k]; -1: not routed by the engine
    engine_ids = layout.new_full((layout.shape[0], mb.input_ids.numel(), layout.shape[2]), -1)  # [layers, rows x L, top_k]
    engine_ids[:, :layout.shape[1]] = layout
    engine_ids = engine_ids.long()
    routed = engine_ids[0, :, 0] >= 0
    predicts = torch.zeros_like(routed)  # the positions that predict a response token
    predicts[mb.rows * mb.input_ids.shape[1] + mb.cols] = True
    decode = (predicts & predicts.roll(1))[routed]  # all but the first of each sample's: the prefill's last
    for mode in ("own", "replay"):
        routing.counting = {"version": 0, "differ": 0, "compared": 0} if mode == "replay" else None
        routing.use(layout if mode == "replay" else None, 0, mb.input_ids.numel(), versions)
        routing.recorded = []
        lp = model_lib.response_logprobs(lm, mb, 1.0)[0]
        used = torch.stack(routing.recorded)[:, routed]  # [layers, positions, top_k]
        differ = (used.sort(-1).values != engine_ids[:, routed].sort(-1).values).any(-1)  # [layers, positions]
        gaps[mode].append((lp.double() - mb.behaviour.double())[mb.resp_mask])
        if mode == "replay":
            n["replay_differ"] += int(differ.sum())
            n["tally_differ"] += routing.counting["differ"]
            n["tally_compared"] += routing.counting["compared"]
            continue
        n["positions"] += differ.shape[1]
        n["decode"] += int(decode.sum())
        n["differ"] += int(differ.sum())
        n["decode_differ"] += int(differ[:, decode].sum())
        n["prefill_differ"] += int(differ[:, ~decode].sum())
        n["positions_differ"] += int(differ.any(0).sum())
        per_layer += differ.sum(1)


def bench_routing(args, _unused: list[str]) -> dict:
    specs, dtypes = args.configs.split(","), args.dtypes.split(",")
    print(f"MoE routing, engine vs trainer: random qwen3_moe models, {args.prompts} prompts x {args.tokens} sampled "
          f"tokens, the transformers engine; the trainer's {'packed' if args.pack else 'padded'} forward with its own "
          f"routing and with the engine's replayed; torch threads {torch.get_num_threads()}", flush=True)
    print(f"{'experts:layers':>15} | {'dtype':>8} | {'decisions':>9} | {'differ':>7} | {'prefill':>7} | "
          f"{'decode':>7} | {'any layer':>9} | {'replayed':>8} | {'|gap| mean own / replay':>23} | "
          f"{'max own / replay':>17} | {'k3 own / replay':>17}")
    rows = []
    for spec in specs:
        for dtype in dtypes:
            r = routing_point(spec, dtype, args)
            rows.append(r)
            print(f"{spec:>15} | {dtype:>8} | {r['decisions']:9d} | {r['mismatch']:7.2%} | "
                  f"{r['mismatch_prefill']:7.2%} | {r['mismatch_decode']:7.2%} | {r['positions_mismatch']:9.2%} | "
                  f"{r['replay_differ']:8d} | {r['gap_mean']:11.1e} / {r['replay_gap_mean']:.1e} | "
                  f"{r['gap_max']:8.1e} / {r['replay_gap_max']:.1e} | {r['engine_kl']:8.1e} / {r['replay_engine_kl']:.1e}",
                  flush=True)
    print("(decisions: (position, layer) pairs the engine routed; differ: the trainer's own forward chose another "
          "expert set, overall, at prompt positions (the engine's prefill) and at sampled ones (its KV-cache decode); "
          "any layer: positions that differ in at least one layer; replayed: decisions the replaying forward did not "
          "take from the engine (must be 0); gap: trainer - engine log-prob of the sampled tokens, nats; k3: "
          "rollout/engine_kl's estimate of KL(engine || trainer) per token)")
    return {"bench": "routing", "prompts": args.prompts, "tokens": args.tokens, "pack": bool(args.pack),
            "threads": torch.get_num_threads(), "rows": rows}


def add_parser(sub) -> None:
    r = sub.add_parser("routing", help="MoE routing, engine vs trainer: differing experts and the log-prob gap, "
                                       "replay off and on, fp32 and bf16")
    r.add_argument("--configs", default=ROUTING_CONFIGS,
                   help="comma-separated random qwen3_moe models, EXPERTSxTOP_K:LAYERSxHIDDEN")
    r.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; float32 is the control")
    r.add_argument("--prompts", type=int, default=32, help="prompts, one response each")
    r.add_argument("--tokens", type=int, default=128, help="sampled tokens a response (no stop token: all of them)")
    r.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="tokens per trainer forward (train.py's --max-tokens-per-micro-batch)")
    r.add_argument("--pack", type=int, default=1, choices=[0, 1], help="1: packed rows (the ulorl preset); 0: padded")
    r.add_argument("--seed", type=int, default=0, help="seed of the models, the prompts and the engine's draws")
    r.set_defaults(run=bench_routing)
