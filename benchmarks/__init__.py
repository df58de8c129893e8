"""Training-throughput benchmark (benchmarks/benchmark.py; method and results: docs/benchmarks.md).
Lab code, not part of the installed `moe_sft` package: run from a checkout (the repo root on sys.path).

workload.py  model presets and the synthetic packed SFT batches every arm trains on
ours.py      the moe-sft arm: the production Trainer, random init, the workload as its data plan
hf.py        the transformers arm;  titan.py  the experimental torchtitan arm
measure.py   the timing loop and its record;  phases.py  per-phase time from torch.profiler
ceilings.py  kernel ceilings at the model's shapes;  results.py  benchmark.json and markdown
gpu/         GPU sweeps and A/B timing scripts (python3 benchmarks/gpu/NAME.py); tests/gpu holds tests only
"""
