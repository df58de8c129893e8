"""python -m moe_sft.plan RECIPE [--gpus N] [--gpu-mem GiB] [--gpu KIND] [--roles] [key=value ...]

RECIPE is a recipe file (recipes/qwen3_235b_a22b.yaml) or a name under recipes/. Exit status 0
when the layout is valid and the largest stage fits, 2 otherwise (errors are printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_sft.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("recipe", help="recipe file or name (recipes/<name>.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for moe_sft.train")
    p.add_argument("--gpus", type=int, help="world size to plan for (default: the recipe's hardware section)")
    p.add_argument("--gpu-mem", type=float, help="GiB per GPU (default: the recipe's hardware.gpu)")
    p.add_argument("--gpu", choices=("h100_80gb", "h200_141gb"), help="GPU kind (sets hardware.gpu)")
    p.add_argument("--roles", action="store_true", help="also print every rank's coordinates, layers and experts")
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="tokens on the busiest expert rank / average (default 1.0: balanced routing)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="missing data / checkpoint paths are errors (pre-flight on the cluster; sbatch uses it)",
    )
    p.add_argument("--json", type=Path, help="also write the numbers as JSON here (used by the calibration script)")
    return p


def _recipe_argv(recipe: str) -> list[str]:
    path = Path(recipe)
    if path.suffix not in (".yaml", ".yml"):
        path = Path("recipes") / f"{recipe}.yaml" if not path.is_file() else path
    return ["--config-path", str(path.parent), "--config-name", path.stem]


def plan_json(plan) -> dict:
    from moe_sft.plan.memory import GIB

    stages = [
        dict(
            stage=st.pp_rank,
            layers=st.layers,
            params=st.params.total,
            allocated_gib=st.allocated / GIB,
            total_gib=st.total / GIB,
            weights_gib=st.weights / GIB,
            grads_gib=st.grads / GIB,
            optimizer_gib=st.optimizer / GIB,
            activations_gib=st.activations / GIB,
            working_gib=st.working / GIB,
            logits_gib=st.logits / GIB,
        )
        for st in plan.stages
    ]
    return dict(
        errors=plan.errors,
        warnings=plan.warnings,
        layout=plan.layout.short(),
        world=plan.layout.world,
        fits=plan.fits if plan.stages else None,
        stages=stages,
        throughput=plan.throughput,
    )


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    args = _parser().parse_intermixed_args(argv)
    from moe_sft.config import ConfigError, load_config
    from moe_sft.plan import make_plan
    from moe_sft.plan.plan_text import format_plan, format_roles

    overrides = list(args.overrides) + ([f"hardware.gpu={args.gpu}"] if args.gpu else [])
    try:
        cfg = load_config(_recipe_argv(args.recipe) + overrides)
        plan = make_plan(
            cfg, gpus=args.gpus, gpu_mem_gib=args.gpu_mem, imbalance=args.moe_imbalance, strict=args.strict
        )
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.roles and not plan.errors:
        print("\n".join(format_roles(plan)))
    if args.json:
        args.json.write_text(json.dumps(plan_json(plan), indent=1))
    return 0 if plan.ok else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
