"""Training-throughput benchmark (tools/benchmark.py; method and results: docs/benchmarks.md).

workload.py  model presets and the synthetic packed SFT batches every arm trains on
ours.py      the moe-sft arm: the production Trainer, random init, the workload as its data plan
hf.py        the transformers arm;  titan.py  the experimental torchtitan arm
measure.py   the timing loop and its record;  phases.py  per-phase time from torch.profiler
ceilings.py  kernel ceilings at the model's shapes;  report.py  benchmark.json and markdown
"""
