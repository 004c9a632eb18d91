"""Benchmarks that print ratios measured side by side in one run: `python -m bench NAME` (bench/__main__.py
lists them). Each mode is a module of this package; the shared pieces are common.py, the GPU cost model
gpu_cost.py and the rollout simulation simulate.py."""
