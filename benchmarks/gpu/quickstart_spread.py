"""Does a kernel change move how well the quickstart learns, or is it run-to-run spread?

Trains the quickstart (recipes/quickstart.yaml, bf16 on one GPU, or `--nproc` GPUs with `--extra`'s
parallel overrides) once per (variant, data seed), several runs side by side on the same GPUs,
each from the same tiny model, and reports per run the train loss at steps 100 and 200 and at the
last step, the last eval loss and the exported model's exact match on the demo eval
(tools/eval_demo.py). A variant switches kernels off: `base` runs the code as it
is, `off_all` every switch below, any other name one switch (ab_steps.py's names, plus
`embedding` for the embedding's main-grad fusion), and a name with `=` a Hydra override (e.g.
`model.moe_combine_dtype=bf16`). Spread across data seeds within a variant is
the yardstick a variant's difference has to beat.

    python3 benchmarks/gpu/quickstart_spread.py --out DIR --variants base,off_all --seeds 1234,1,2

Under torchrun (LOCAL_RANK set) this file is the child: it applies QS_OFF's switches, then runs
moe_sft.train with the given Hydra overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SWITCHES = ("router_topk", "topk_rows", "flash_direct", "triton_launch", "one_rank_collectives")


def _switch_off(name: str) -> None:
    if name == "embedding":
        from moe_sft.kernels import dense_wgrad

        dense_wgrad._fusable_embedding = lambda module: False
        return
    import importlib

    sys.path.insert(0, str(Path(__file__).parent))
    from ab_steps import SWITCHES, _off_values

    module_name, attr = SWITCHES[name]
    setattr(importlib.import_module(module_name), attr, _off_values()[name])


def child() -> None:
    sys.path.insert(0, str(ROOT))  # a script's own folder, not the repo, heads sys.path
    for name in filter(None, os.environ.get("QS_OFF", "").split(",")):
        _switch_off(name)
        print(f"quickstart_spread: {name} switched off", flush=True)
    sys.argv = ["moe_sft.train", *sys.argv[1:]]
    runpy.run_module("moe_sft.train", run_name="__main__", alter_sys=True)


def _off_list(variant: str) -> list[str]:
    if variant == "base" or "=" in variant:
        return []
    if variant == "off_all":
        return [*KERNEL_SWITCHES, "embedding"]
    return variant.split("+")


def _parse(log: str) -> dict:
    train = {int(s): float(v) for s, v in re.findall(r"^step (\d+)/\d+ loss=(\S+)", log, re.M)}
    evals = [float(v) for v in re.findall(r"^eval \d+/\d+ loss=(\S+)", log, re.M)]
    last = max(train, default=None)
    return {
        "loss": {s: train.get(s) for s in (50, 100, 150, 200)},
        "last_step": last,
        "last_loss": train.get(last),
        "eval_loss": evals[-1] if evals else None,
    }


def one_run(work: Path, variant: str, seed: int, shared: Path, extra: list[str], nproc: int = 1) -> dict:
    run = work / f"{variant.replace('=', '-')}_s{seed}"
    overrides = [variant] if "=" in variant else []  # a Hydra override, e.g. model.moe_combine_dtype=bf16
    run.mkdir(parents=True, exist_ok=True)
    # runs share the host's cores: two threads each keeps the Python side from thrashing
    env = {"OMP_NUM_THREADS": "2", **os.environ, "QS_OFF": ",".join(_off_list(variant))}
    cmd = [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(__file__)),
        "--config-path",
        str(ROOT / "recipes"),
        "--config-name",
        "quickstart",
        f"trainer.output_dir={run}/out",
        f"model.hf_path={shared}/tiny_hf",
        f"model.mcore_path={shared}/tiny_mcore",
        f"data.cache_dir={run}/cache",
        f"data.seed={seed}",
        *extra,
        *overrides,
    ]
    start, rc = time.time(), 0
    if (run / "out" / "hf").is_dir():  # trained by an earlier call that ran out of time in the evals
        log = (run / "train.log").read_text()
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        log, rc = proc.stdout + proc.stderr, proc.returncode
        (run / "train.log").write_text(log)
    result = {"variant": variant, "seed": seed, "rc": rc, "train_s": round(time.time() - start, 1), **_parse(log)}
    if rc == 0:
        ev = subprocess.run(
            [sys.executable, "tools/eval_demo.py", "--model", f"{run}/out/hf"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        m = re.search(r"exact match: (\d+)/(\d+)", ev.stdout)
        result["exact_match"] = f"{m.group(1)}/{m.group(2)}" if m else ev.stderr[-400:]
    else:
        result["tail"] = log[-1500:]
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="base,off_all")
    p.add_argument("--seeds", default="1234,1,2")
    p.add_argument("--parallel", type=int, default=6)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (with --extra's parallel overrides)")
    p.add_argument("--tiny-args", default="", help='moe_sft.quickstart_model options, e.g. "--experts 16 --top-k 8"')
    args = p.parse_args()
    work, shared = args.out / "runs", args.out / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    if not (shared / "tiny_mcore").exists():  # made once: every run starts from the same weights
        subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_sft.quickstart_model",
                "--hf-path",
                f"{shared}/tiny_hf",
                "--mcore-path",
                f"{shared}/tiny_mcore",
                "--tokenizer",
                "recipes/demo/tokenizer",
                *shlex.split(args.tiny_args),
            ],
            cwd=ROOT,
            check=True,
        )
    jobs = [(v, int(s)) for v in args.variants.split(",") for s in args.seeds.split(",")]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda j: one_run(work, j[0], j[1], shared, args.extra, args.nproc), jobs))
    (args.out / "spread.json").write_text(json.dumps(results, indent=1))
    print(f"{'variant':<32}{'seed':>6}{'loss@100':>10}{'loss@200':>10}{'last':>12}{'eval':>9}  exact")
    for r in results:
        f = lambda x: f"{x:.4f}" if isinstance(x, float) else "-"  # noqa: E731
        print(
            f"{r['variant']:<32}{r['seed']:>6}{f(r['loss'].get(100)):>10}{f(r['loss'].get(200)):>10}"
            f"{f(r['last_loss']):>7}@{r['last_step'] or '-':<4}{f(r['eval_loss']):>9}  "
            f"{r.get('exact_match', 'rc=' + str(r['rc']))}"
        )
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        child()
    else:
        sys.exit(main())
