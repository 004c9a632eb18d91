"""The systems under the algorithm: where each part runs (placement, plan), how the model is sharded and split
(distributed, seqpar, routing), the engines that sample and the weight sync that feeds them (engine, weight_sync,
engine_gap), the reward workers and the code sandbox (workers, sandbox), and what a run leaves on disk (outdir,
checkpoint, logs).

The algorithm above imports these; they import nothing above them but the algorithm's shared types and loaders:
  checkpoint  model (dtypes), segment_rollout (Pools, Sample), rollouts (Prefetched), ulorl (RunState):
              a checkpoint holds them and rebuilds them on resume
  engine      segment_rollout (Sampling): how every engine draws a token
  placement   model (loading, YaRN, the wrap), config (Config, the engines' GPUs and TP sizes)
"""
