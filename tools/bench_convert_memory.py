"""Convert (and export back) a synthetic checkpoint larger than this machine's RAM; report peak
RSS, MB/s and the machine's load average.

    python tools/bench_convert_memory.py [--dir /tmp/moe_sft_bench] [--size-gb 28] [--workers 1 2]
                                         [--chunk-size 256MiB] [--export [--read-size 256MiB]] [--keep]

1. Writes a Qwen3-30B-A3B-shaped bf16 checkpoint (hidden 2048, 128 experts of width 768, vocab
   151936) with as many layers as reach --size-gb, shard by shard (the writer holds a few MB).
   Refuses when the disk lacks room for source + output (+ export, see 6).
2. Measures the baseline: a process that imports everything and builds the meta model.
3. Runs tools/convert_hf_to_mcore.py in a child process for each --workers value and reports the
   child's peak RSS (wait4's ru_maxrss: exact, per process), the sampled peak of the summed RSS of
   all its processes (psutil, every 0.1 s), wall time, MB/s and the 1-minute load average
   (sampled every 5 s: the machine may be shared).
4. Spot-checks the result against the HF tensors: the embedding and layer 0's expert weights,
   read back with megatron's dist_checkpointing.load.
5. With --export: measures the export baseline (imports + meta models + export plan), then runs
   tools/export_mcore_to_hf.py (bf16, --read-size) on the last conversion's output, measured the
   same way, and spot-checks the exported embedding and layer 0's experts against the megatron
   checkpoint (megatron's loader). When the disk cannot hold source, checkpoint and export at
   once, the HF source is deleted before the export (the check then needs only the checkpoint).
6. Deletes everything (unless --keep).

This process never imports torch: every step runs in a child. A child's ru_maxrss starts at its
parent's peak RSS (Linux counts the memory a vfork/fork child shares before exec), so a large
parent would inflate what is measured.

Exit status 0 when every conversion succeeded and the spot check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
    max_position_embeddings=4096,
)
# bf16 bytes: each layer (128 experts × 3 × 2048 × 768, attention, norms, router) and the rest
LAYER_BYTES = 2 * (128 * 3 * 2048 * 768 + 2048 * (4096 + 2 * 512) + 4096 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128)
FIXED_BYTES = 2 * (2 * 151936 * 2048 + 2048)
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

BASELINE_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from moe_sft.conversion.hf_source import prepare
from moe_sft.conversion.meta_model import meta_model
job = prepare({hf!r})
meta_model(job.family, job.hf_cfg, job.precision)
"""
EXPORT_BASELINE_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from moe_sft.conversion import export_plan
from moe_sft.conversion.hf_source import load_hf_config
from moe_sft.conversion.dcp_reader import DistCheckpointReader
family, hf_cfg = load_hf_config(Path({ckpt!r}) / "hf")
export_plan.build(family, hf_cfg, DistCheckpointReader({ckpt!r}), {read})
"""


def parse_args(argv=None):
    from moe_sft.conversion.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        default=tempfile.gettempdir() + "/moe_sft_bench",
        help="where the synthetic checkpoint and the output go (deleted after)",
    )
    parser.add_argument("--size-gb", type=float, default=28.0, help="synthetic checkpoint size (GB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="one conversion per value (default: 1)")
    parser.add_argument("--chunk-size", default="256MiB", type=parse_size)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per conversion process (OMP_NUM_THREADS; default: torch's)",
    )
    parser.add_argument(
        "--export", action="store_true", help="also export the converted checkpoint back to HF, measured the same way"
    )
    parser.add_argument(
        "--read-size", default="256MiB", type=parse_size, help="the exporter's --read-size (default 256MiB)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--step", nargs="+", help=argparse.SUPPRESS)  # internal: a child's job
    return parser.parse_args(argv)


def _env(threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_measured(cmd: list[str], threads: int | None = None) -> dict:
    """Run `cmd`; its exact peak RSS (wait4) and the sampled peak RSS summed over its process tree."""
    import psutil

    started = time.time()
    proc = subprocess.Popen(cmd, env=_env(threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_tree, loads, done = [0], [], threading.Event()

    def sample():
        parent, ticks = psutil.Process(proc.pid), 0
        while not done.is_set():
            try:
                procs = [parent] + parent.children(recursive=True)
                peak_tree[0] = max(peak_tree[0], sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            if ticks % 50 == 0:  # every 5 s
                loads.append(os.getloadavg()[0])
            ticks += 1
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_chunks, err_chunks = [], []
    readers = [
        threading.Thread(target=lambda s=s, c=c: c.append(s.read()), daemon=True)
        for s, c in ((proc.stdout, out_chunks), (proc.stderr, err_chunks))
    ]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    loads.append(os.getloadavg()[0])
    return dict(
        returncode=proc.returncode,
        seconds=time.time() - started,
        peak_rss_bytes=usage.ru_maxrss * 1024,
        peak_tree_rss_bytes=peak_tree[0],
        load_min=min(loads),
        load_max=max(loads),
        load_mean=sum(loads) / len(loads),
        stdout="".join(out_chunks),
        stderr="".join(err_chunks),
    )


def write_source(hf_dir: Path, layers: int) -> int:
    from moe_sft.conversion.synthetic import write_synthetic_checkpoint
    from moe_sft.models import qwen3_moe

    cfg = qwen3_moe.tiny_hf_config(num_hidden_layers=layers, **QWEN3_30B_A3B)
    return write_synthetic_checkpoint(hf_dir, cfg, shard_bytes=4 * 10**9)


def spot_check(hf_dir: Path, out_dir: Path) -> list[str]:
    """Embedding and layer-0 experts, read back with megatron's loader, equal the HF tensors."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from moe_sft.conversion.single_rank import init_single_rank
    from moe_sft.conversion.streaming_reader import StreamingHFReader

    init_single_rank("bf16")  # megatron's loader needs a process group
    reader = StreamingHFReader(hf_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(out_dir))
    keys = [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.experts.linear_fc2.weight",
    ]
    template = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(stored[k].global_shape, dtype=stored[k].dtype)) for k in keys
    }
    loaded = dist_checkpointing.load(template, str(out_dir), validate_access_integrity=False)
    problems = []
    embed = reader.get("model.embed_tokens.weight")
    if not torch.equal(loaded[keys[0]][: embed.shape[0]], embed):
        problems.append("embedding differs")
    fc1, fc2 = loaded[keys[1]], loaded[keys[2]]  # [E, 2F, H] (gate ‖ up), [E, H, F] (down): HF layouts
    ffn = fc1.shape[1] // 2
    for e in range(fc1.shape[0]):
        prefix = f"model.layers.0.mlp.experts.{e}."
        if not (
            torch.equal(fc1[e, :ffn], reader.get(prefix + "gate_proj.weight"))
            and torch.equal(fc1[e, ffn:], reader.get(prefix + "up_proj.weight"))
            and torch.equal(fc2[e], reader.get(prefix + "down_proj.weight"))
        ):
            problems.append(f"layer 0 expert {e} differs")
    return problems


def export_spot_check(ckpt_dir: Path, export_dir: Path) -> list[str]:
    """The exported embedding and layer-0 experts equal the megatron checkpoint's tensors."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from moe_sft.conversion.single_rank import init_single_rank
    from moe_sft.conversion.streaming_reader import StreamingHFReader

    init_single_rank("bf16")
    exported = StreamingHFReader(export_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    keys = [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.experts.linear_fc2.weight",
    ]
    template = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(stored[k].global_shape, dtype=stored[k].dtype)) for k in keys
    }
    loaded = dist_checkpointing.load(template, str(ckpt_dir), validate_access_integrity=False)
    problems = []
    embed = exported.get("model.embed_tokens.weight")
    if not torch.equal(loaded[keys[0]][: embed.shape[0]], embed):
        problems.append("embedding differs")
    fc1, fc2 = loaded[keys[1]], loaded[keys[2]]
    ffn = fc1.shape[1] // 2
    for e in range(fc1.shape[0]):
        prefix = f"model.layers.0.mlp.experts.{e}."
        if not (
            torch.equal(fc1[e, :ffn], exported.get(prefix + "gate_proj.weight"))
            and torch.equal(fc1[e, ffn:], exported.get(prefix + "up_proj.weight"))
            and torch.equal(fc2[e], exported.get(prefix + "down_proj.weight"))
        ):
            problems.append(f"layer 0 expert {e} differs")
    return problems


def _child_step(step: list[str]) -> int:
    """What the child processes run (this file with --step ...)."""
    if step[0] == "write":
        print(json.dumps(write_source(Path(step[1]), int(step[2]))))
    elif step[0] == "check":
        print(json.dumps(spot_check(Path(step[1]), Path(step[2]))))
    elif step[0] == "check-export":
        print(json.dumps(export_spot_check(Path(step[1]), Path(step[2]))))
    return 0


def _run_step(*step) -> object:
    proc = subprocess.run(
        [sys.executable, __file__, "--step", *map(str, step)], env=_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"step {step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _describe(run: dict) -> str:
    return (
        f"peak RSS {run['peak_rss_bytes'] / 2**30:.2f} GiB per process, "
        f"{run['peak_tree_rss_bytes'] / 2**30:.2f} GiB summed over processes (sampled); load "
        f"average {run['load_min']:.1f}-{run['load_max']:.1f} (mean {run['load_mean']:.1f})"
    )


def _measured_entry(run: dict, written: int, **extra) -> dict:
    keys = ("returncode", "seconds", "peak_rss_bytes", "peak_tree_rss_bytes", "load_min", "load_max", "load_mean")
    return dict(
        extra,
        **{k: run[k] for k in keys},
        written_bytes=written,
        mb_per_s=written / 1e6 / run["seconds"],
        tool_output=run["stdout"].strip().splitlines()[-2:],
    )


def convert_runs(args, hf_dir: Path, out_dir: Path, report: dict) -> int:
    status = 0
    base = run_measured([sys.executable, "-c", BASELINE_SCRIPT.format(repo=str(REPO), hf=str(hf_dir))])
    report["baseline_rss_bytes"] = base["peak_rss_bytes"]
    print(f"baseline (imports + meta model): peak RSS {base['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    for workers in args.workers:
        shutil.rmtree(out_dir, ignore_errors=True)
        cmd = [
            sys.executable,
            str(REPO / "tools" / "convert_hf_to_mcore.py"),
            "--hf-path",
            str(hf_dir),
            "--output",
            str(out_dir),
            "--workers",
            str(workers),
            "--chunk-size",
            str(args.chunk_size),
        ]
        run = run_measured(cmd, args.threads)
        written = sum(f.stat().st_size for f in out_dir.glob("*.distcp")) if out_dir.exists() else 0
        entry = _measured_entry(run, written, workers=workers)
        if run["returncode"] != 0:
            print(run["stderr"][-3000:], file=sys.stderr)
            status = 1
        else:
            entry["spot_check_problems"] = _run_step("check", hf_dir, out_dir)
            status |= bool(entry["spot_check_problems"])
        report["runs"].append(entry)
        print(
            f"workers={workers}: exit {run['returncode']}, {written / 1e9:.2f} GB in "
            f"{run['seconds']:.0f}s (whole process incl. imports) = {entry['mb_per_s']:.0f} MB/s; "
            f"{_describe(run)}; spot check: {entry.get('spot_check_problems') or 'equal'}",
            flush=True,
        )
        for line in entry["tool_output"]:
            print("  tool: " + line)
    return status


def export_run(args, ckpt_dir: Path, export_dir: Path, report: dict) -> int:
    base = run_measured(
        [sys.executable, "-c", EXPORT_BASELINE_SCRIPT.format(repo=str(REPO), ckpt=str(ckpt_dir), read=args.read_size)]
    )
    report["export_baseline_rss_bytes"] = base["peak_rss_bytes"]
    print(
        f"export baseline (imports + meta models + plan): peak RSS {base['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True
    )
    shutil.rmtree(export_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        str(REPO / "tools" / "export_mcore_to_hf.py"),
        "--mcore-path",
        str(ckpt_dir),
        "--output",
        str(export_dir),
        "--dtype",
        "bf16",
        "--read-size",
        str(args.read_size),
    ]
    run = run_measured(cmd, args.threads)
    index = export_dir / "model.safetensors.index.json"
    written = json.loads(index.read_text())["metadata"]["total_size"] if index.is_file() else 0
    entry = _measured_entry(run, written, read_size=args.read_size)
    status = 0
    if run["returncode"] != 0:
        print(run["stderr"][-3000:], file=sys.stderr)
        status = 1
    else:
        entry["spot_check_problems"] = _run_step("check-export", ckpt_dir, export_dir)
        status = int(bool(entry["spot_check_problems"]))
    report["export"] = entry
    print(
        f"export: exit {run['returncode']}, {written / 1e9:.2f} GB in {run['seconds']:.0f}s (whole "
        f"process incl. imports) = {entry['mb_per_s']:.0f} MB/s; {_describe(run)}; spot check: "
        f"{entry.get('spot_check_problems') or 'equal'}",
        flush=True,
    )
    for line in entry["tool_output"]:
        print("  tool: " + line)
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.step:
        return _child_step(args.step)
    root = Path(args.dir)
    layers = max(1, round((args.size_gb * 1e9 - FIXED_BYTES) / LAYER_BYTES))
    expected = FIXED_BYTES + layers * LAYER_BYTES
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = 2 * expected + 2 * 10**9  # source + checkpoint; the export replaces the source if need be
    if free < need:
        print(
            f"error: {root}: {free / 1e9:.1f} GB free, the {expected / 1e9:.1f} GB source plus its "
            f"converted copy need {need / 1e9:.1f} GB; use --dir on a larger disk or a smaller "
            "--size-gb",
            file=sys.stderr,
        )
        return 2
    import psutil

    ram = psutil.virtual_memory().total
    hf_dir, out_dir, export_dir = root / "hf", root / "mcore", root / "export"
    shutil.rmtree(hf_dir, ignore_errors=True)
    report = dict(
        ram_bytes=ram, cpus=os.cpu_count(), threads=args.threads, layers=layers, chunk_size=args.chunk_size, runs=[]
    )
    try:
        started = time.time()
        report["source_bytes"] = _run_step("write", hf_dir, layers)
        report["write_source_seconds"] = time.time() - started
        print(
            f"synthetic Qwen3-30B-A3B-shaped checkpoint, {layers} layers: "
            f"{report['source_bytes'] / 1e9:.2f} GB (RAM {ram / 1e9:.1f} GB), written in "
            f"{report['write_source_seconds']:.0f}s",
            flush=True,
        )
        status = convert_runs(args, hf_dir, out_dir, report)
        if args.export and status == 0:
            if shutil.disk_usage(root).free < expected + 2 * 10**9:
                print("deleting the HF source to make room for the export", flush=True)
                shutil.rmtree(hf_dir)
            status |= export_run(args, out_dir, export_dir, report)
    finally:
        if not args.keep:
            for path in (hf_dir, out_dir, export_dir):
                shutil.rmtree(path, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
