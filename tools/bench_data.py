"""Benchmark the SFT data pipeline on this machine's CPU cores (results: docs/data.md).

    python tools/bench_data.py throughput   # tokenize (cache build) and pack+build rows/s and tokens/s
    python tools/bench_data.py efficiency   # packing efficiency at pack_length 4096 vs pack_window
    python tools/bench_data.py memory       # RSS of the cache builder and of the loader vs dataset size
    python tools/bench_data.py all

Data: the demo conversations (recipes/demo/data/train.jsonl, ~43 tokens each) and synthetic
"long-tail" conversations (lognormal lengths, median ~300 tokens, tail to 4096) written with
the demo tokenizer's words. Memory: every size runs in a fresh process; RSS is read from
/proc/self/status (RssAnon = the process's own memory; RssFile = memory-mapped cache pages,
page cache the kernel can drop) and the builder's workers' peak from getrusage(RUSAGE_CHILDREN).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEMO = REPO / "recipes" / "demo"
TOKENIZER = str(DEMO / "tokenizer")


def synthetic_rows(path: Path, n: int, seed: int = 0, long_tail: bool = True) -> Path:
    """n conversations of demo-vocabulary words; lognormal lengths (median ~300 tokens) if long_tail."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_demo_assets import WORDS

    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    demo = (DEMO / "data" / "train.jsonl").read_text().splitlines()
    with path.open("w") as f:
        for i in range(n):
            if not long_tail:
                f.write(demo[i % len(demo)] + "\n")
                continue
            total = int(np.clip(rng.lognormal(np.log(300), 1.1), 20, 3800))
            turns = int(rng.integers(1, 4))
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(turns):
                k = max(total // (2 * turns), 2)
                messages.append({"role": "user", "content": " ".join(rng.choice(words, k))})
                messages.append({"role": "assistant", "content": " ".join(rng.choice(words, k))})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _spec(max_seq_len: int):
    from moe_sft.data.cache import CacheSpec
    from moe_sft.data.chat import ChatOptions

    return CacheSpec(TOKENIZER, ChatOptions(max_seq_len, "truncate"))


def bench_tokenize(rows: Path, workers: int, max_seq_len: int = 4096) -> dict:
    """Building the cache of `rows`; transformers is imported first, as it is in the trainer."""
    from transformers import AutoTokenizer

    from moe_sft.data import cache as cache_mod

    AutoTokenizer.from_pretrained(TOKENIZER)
    cache_mod.SMALL_FILE_BYTES = 0  # use the pool even for small files
    with tempfile.TemporaryDirectory() as root:
        cpu, start = _cpu_seconds(), time.perf_counter()
        cache = cache_mod.open_or_build(rows, _spec(max_seq_len), root, num_workers=workers, log=lambda m: None)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        stats = cache.stats
    # CPU seconds (this process + the workers) do not depend on what else runs on the machine.
    return {
        "rows": stats.rows,
        "tokens": stats.tokens,
        "workers": workers,
        "seconds": round(seconds, 2),
        "rows_per_s": round(stats.rows / seconds),
        "tokens_per_s": round(stats.tokens / seconds),
        "cpu_s": round(cpu, 2),
        "rows_per_cpu_s": round(stats.rows / cpu),
        "tokens_per_cpu_s": round(stats.tokens / cpu),
    }


def _cpu_seconds() -> float:
    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def bench_loader(rows: Path, steps: int, pack_length: int = 4096, global_batch_size: int = 8) -> dict:
    """Pack + build this rank's micro-batches (dp=1: all of them) from the memory-mapped cache."""
    from moe_sft.data.cache import open_or_build
    from moe_sft.data.loader import PackedLoader
    from moe_sft.data.store import CachedDocs

    with tempfile.TemporaryDirectory() as root:
        cache = open_or_build(rows, _spec(pack_length), root, num_workers=2, log=lambda m: None)
        cpu, start = _cpu_seconds(), time.perf_counter()
        loader = PackedLoader(CachedDocs([cache]), pack_length, global_batch_size, seed=0, prefetch=False)
        samples = tokens = 0
        for step in range(steps):
            batches, _ = loader.batches_for_step(step)
            samples += sum(len(p.positions) for p in loader.step_packs(step))
            tokens += sum(mb.tokens.numel() - mb.num_padding for mb in batches)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return {
        "steps": steps,
        "samples_per_s": round(samples / seconds),
        "tokens_per_s": round(tokens / seconds),
        "ms_per_step": round(1000 * seconds / steps, 1),
        "cpu_ms_per_step": round(1000 * cpu / steps, 1),
        "global_batch": f"{global_batch_size} x {pack_length}",
    }


def throughput(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, long_tail in (("demo", False), ("long-tail", True)):
            rows = synthetic_rows(
                Path(tmp) / f"{name}.jsonl", args.rows if not long_tail else args.rows // 4, long_tail=long_tail
            )
            for workers in args.workers:
                print(json.dumps({"bench": "tokenize", "data": name, **bench_tokenize(rows, workers)}), flush=True)
            print(json.dumps({"bench": "pack+build", "data": name, **bench_loader(rows, args.steps)}), flush=True)


def efficiency(args) -> None:
    from transformers import AutoTokenizer

    from moe_sft.data.chat import TokenizedDoc, tokenize_files
    from moe_sft.data.loader import PackedLoader

    def docs(lengths):
        return [TokenizedDoc(np.ones(n, dtype=np.int64), np.ones(n, dtype=np.float32)) for n in lengths]

    demo, _ = tokenize_files(AutoTokenizer.from_pretrained(TOKENIZER), [DEMO / "data" / "train.jsonl"], 4096)
    rng = np.random.default_rng(0)
    tail = np.clip(rng.lognormal(np.log(300), 1.1, 50000), 16, args.pack_length).astype(int).tolist()
    for name, lengths in (("demo", [len(d) for d in demo]), ("long-tail", tail)):
        for window in args.windows:
            loader = PackedLoader(docs(lengths), args.pack_length, 8, seed=0, window=window, prefetch=False)
            packs = loader.epoch_packs(0)
            eff = sum(p.tokens for p in packs) / (len(packs) * args.pack_length)
            print(
                json.dumps(
                    {
                        "bench": "efficiency",
                        "data": name,
                        "samples": len(lengths),
                        "mean_len": round(float(np.mean(lengths)), 1),
                        "pack_length": args.pack_length,
                        "pack_window": window,
                        "micro_batches": len(packs),
                        "efficiency": round(eff, 4),
                    }
                ),
                flush=True,
            )


def _status() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) // 1024  # MiB
    return fields


def memory_one(args) -> None:
    """One dataset size in this (fresh) process: build the cache, then run the loader."""
    from transformers import AutoTokenizer

    from moe_sft.data.cache import open_or_build
    from moe_sft.data.loader import PackedLoader
    from moe_sft.data.store import CachedDocs

    root = Path(args.workdir)
    rows = root / f"rows_{args.n}.jsonl"
    if not rows.exists():
        synthetic_rows(rows, args.n, long_tail=False)
    AutoTokenizer.from_pretrained(TOKENIZER)  # the trainer has it loaded before the data phase, too
    baseline = _status()
    start = time.perf_counter()
    cache = open_or_build(rows, _spec(1024), root / "cache", num_workers=2, log=lambda m: None)
    build_s = time.perf_counter() - start
    after_build = _status()
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    loader = PackedLoader(CachedDocs([cache]), 1024, 8, seed=0, prefetch=False)
    start = time.perf_counter()
    for step in range(args.steps):
        loader.batches_for_step(step)
    loop_s = time.perf_counter() - start
    end = _status()
    print(
        json.dumps(
            {
                "rows": args.n,
                "file_MiB": rows.stat().st_size >> 20,
                "build_s": round(build_s, 1),
                "baseline": baseline,
                "after_build": after_build,
                "build_workers_peak_MiB": children_peak,
                "after_loader": end,
                "loader_ms_per_step": round(1000 * loop_s / args.steps, 2),
            }
        ),
        flush=True,
    )


def memory(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            subprocess.run(
                [sys.executable, __file__, "_memory_one", "--n", str(n), "--workdir", tmp, "--steps", str(args.steps)],
                check=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("throughput")
    p.add_argument("--rows", type=int, default=12000)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--steps", type=int, default=100)
    p = sub.add_parser("efficiency")
    p.add_argument("--pack-length", type=int, default=4096)
    p.add_argument("--windows", type=int, nargs="+", default=[16, 64, 512, 8192])
    p = sub.add_parser("memory")
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--steps", type=int, default=300)
    p = sub.add_parser("_memory_one")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=300)
    sub.add_parser("all")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cmd == "all":
        for name, cmd in (("efficiency", efficiency), ("throughput", throughput), ("memory", memory)):
            cmd(parser.parse_args([name]))
        return
    {"throughput": throughput, "efficiency": efficiency, "memory": memory, "_memory_one": memory_one}[args.cmd](args)


if __name__ == "__main__":
    main()
