"""Config layer: Hydra composition onto the dataclass schema, clear errors, pre-flight validation."""

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # plain `pytest` (not `python -m pytest`) from anywhere
    sys.path.insert(0, str(REPO))

from moe_sft.config import (  # noqa: E402
    CONFIGS_DIR,
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    data_parallel_size,
    expert_data_parallel_size,
    load_config,
    load_recipe,
    save_resolved_config,
    validate_against_model,
    validate_config,
)

RECIPE = """\
defaults:
  - parallel: single
  - optimizer: adamw_cosine
  - _self_
model:
  hf_path: {tmp}/hf
  mcore_path: {tmp}/mcore
data:
  train_files: [{tmp}/train.jsonl]
  max_seq_len: 1024
trainer:
  output_dir: {tmp}/out
  max_steps: 10
optimizer:
  lr: 2.0e-5
"""


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "mcore").mkdir()
    _write(tmp_path / "demo.yaml", RECIPE.format(tmp=tmp_path))
    return tmp_path


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _load(recipe_dir: Path, *overrides: str, name: str = "demo") -> TrainConfig:
    return load_config(["--config-path", str(recipe_dir), "--config-name", name, *overrides])


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------- composition


def test_repo_groups_exist():
    for group, option in [
        ("parallel", "single"),
        ("parallel", "tp2_ep2_sp"),
        ("parallel", "pp2"),
        ("parallel", "ep2"),
        ("optimizer", "adamw_cosine"),
    ]:
        assert (CONFIGS_DIR / group / f"{option}.yaml").is_file()


def test_defaults_list_groups_and_overrides_compose(recipe_dir):
    cfg = _load(
        recipe_dir,
        "parallel=tp2_ep2_sp",
        "trainer.max_steps=20",
        "data.pack_length=8192",
        "model.moe_router_dtype=null",
        "checkpoint.keep_last=5",
    )
    assert isinstance(cfg, TrainConfig)
    p = cfg.parallel  # from configs/parallel/tp2_ep2_sp.yaml, chosen on the command line
    assert (
        p.tensor_model_parallel_size,
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size,
        p.sequence_parallel,
        p.pipeline_model_parallel_size,
    ) == (2, 2, 1, True, 1)
    assert cfg.optimizer.lr == 2e-5  # the recipe's own value wins over the group (_self_ last)
    assert (cfg.optimizer.min_lr, cfg.optimizer.weight_decay) == (1e-6, 0.1)  # from adamw_cosine
    assert cfg.trainer.max_steps == 20 and cfg.trainer.global_batch_size == 8  # override / default
    assert cfg.data.pack_length == 8192 and cfg.data.max_seq_len == 1024
    assert cfg.data.train_files == [str(recipe_dir / "train.jsonl")]
    assert cfg.model.moe_router_dtype is None and cfg.checkpoint.keep_last == 5
    assert cfg.model.moe_token_dispatcher_type == "auto"  # schema default, not in the recipe


def test_recipe_default_group_choice(recipe_dir):
    cfg = _load(recipe_dir)
    assert cfg.parallel.tensor_model_parallel_size == 1 and not cfg.parallel.sequence_parallel
    assert cfg.optimizer.lr_decay_style == "cosine"


def test_recipe_dir_group_shadows_repo_group(recipe_dir):
    _write(recipe_dir / "parallel" / "single.yaml", "context_parallel_size: 4\n")
    assert _load(recipe_dir).parallel.context_parallel_size == 4


def test_config_name_forms(recipe_dir, monkeypatch):
    monkeypatch.chdir(recipe_dir.parent)
    rel = recipe_dir.name
    assert load_config(["--config-path", rel, "--config-name", "demo.yaml"]).trainer.max_steps == 10
    assert load_config([f"--config-path={rel}", "--config-name=demo"]).trainer.max_steps == 10
    assert load_config(["-cp", rel, "-cn", "demo", "trainer.max_steps=3"]).trainer.max_steps == 3
    # A name with a directory part still finds configs/ groups (the dir is folded into the path).
    assert load_config(["--config-name", f"{rel}/demo.yaml"]).trainer.max_steps == 10
    assert load_recipe(recipe_dir / "demo.yaml", ["trainer.seed=7"]).trainer.seed == 7


def test_list_override_and_hydra_delete(recipe_dir):
    other = recipe_dir / "b.jsonl"
    cfg = _load(recipe_dir, f"data.train_files=[{other},{other}]", "~optimizer.lr")
    assert cfg.data.train_files == [str(other), str(other)]
    assert cfg.optimizer.lr == 1e-5  # deleted from the composed tree, so the group's value applies


# ----------------------------------------------------------------------------- loader errors


def test_unknown_key_on_command_line_suggests_closest(recipe_dir):
    msg = _error(_load, recipe_dir, "trainer.max_step=3")
    assert "unknown key 'trainer.max_step' (set on the command line) in section 'trainer'" in msg
    assert "Did you mean 'trainer.max_steps'?" in msg
    assert "Valid keys of 'trainer': output_dir, max_steps, global_batch_size" in msg


def test_unknown_key_in_recipe_file(recipe_dir):
    _write(recipe_dir / "typo.yaml", RECIPE.format(tmp=recipe_dir) + "parallel:\n  tensor_parallel_size: 2\n")
    msg = _error(_load, recipe_dir, name="typo")
    assert "unknown key 'parallel.tensor_parallel_size'" in msg
    assert "Did you mean 'parallel.tensor_model_parallel_size'?" in msg


def test_key_in_wrong_section_names_the_right_one(recipe_dir):
    msg = _error(_load, recipe_dir, "trainer.lr=1e-4")
    assert "'lr' is a key of section 'optimizer': use optimizer.lr" in msg


def test_unknown_section_and_unknown_bare_key(recipe_dir):
    msg = _error(_load, recipe_dir, "trainr.max_steps=3")
    assert "unknown section 'trainr'. Did you mean 'trainer'?" in msg
    msg = _error(_load, recipe_dir, "paralel=single")
    assert "unknown override key 'paralel'" in msg and "Did you mean 'parallel'?" in msg


def test_wrong_types_name_field_value_and_type(recipe_dir):
    msg = _error(
        _load, recipe_dir, "trainer.max_steps=abc", "parallel.sequence_parallel=maybe", "data.train_files=x.jsonl"
    )
    assert "invalid configuration (3 problems)" in msg
    assert "wrong type for trainer.max_steps (set on the command line): got 'abc' (str), expected int" in msg
    assert "wrong type for parallel.sequence_parallel" in msg and "expected bool" in msg
    assert "expected list of str" in msg and "write a list" in msg
    assert "missing required field 'data.train_files'" not in msg  # reported once, as a type error


def test_null_for_non_optional_field_is_a_type_error(recipe_dir):
    msg = _error(_load, recipe_dir, "optimizer.lr=null")
    assert "wrong type for optimizer.lr" in msg and "expected float" in msg


def test_missing_required_fields(recipe_dir):
    _write(recipe_dir / "partial.yaml", "trainer:\n  max_steps: 3\n")
    msg = _error(_load, recipe_dir, name="partial")
    assert "missing required field 'data.train_files'" in msg
    assert "missing required field 'trainer.output_dir'" in msg
    assert "pass trainer.output_dir=<value>" in msg
    assert "trainer.max_steps'" not in msg


def test_missing_config_file_lists_available(recipe_dir):
    _write(recipe_dir / "other.yaml", "trainer: {}\n")
    msg = _error(_load, recipe_dir, name="nope")
    assert f"config file not found: {recipe_dir / 'nope.yaml'}" in msg
    assert "demo.yaml, other.yaml" in msg
    msg = _error(load_config, ["--config-path", str(recipe_dir)])
    assert "missing --config-name" in msg and "demo.yaml" in msg
    assert "does not exist" in _error(load_config, ["--config-path", str(recipe_dir / "x"), "-cn", "demo"])


def test_missing_group_option_lists_available(recipe_dir):
    msg = _error(_load, recipe_dir, "parallel=tp9")
    assert "Could not find 'parallel/tp9'" in msg and "tp2_ep2_sp" in msg and "single" in msg


def test_bad_argv(recipe_dir):
    assert "unknown option '--foo'" in _error(_load, recipe_dir, "--foo")
    assert "is not key=value" in _error(_load, recipe_dir, "trainer.max_steps")


def test_unresolvable_interpolation(recipe_dir):
    msg = _error(_load, recipe_dir, "trainer.max_steps=${data.sed}")
    assert "could not resolve 'trainer.max_steps'" in msg and "data.sed" in msg
    assert _load(recipe_dir, "trainer.max_steps=${data.max_seq_len}").trainer.max_steps == 1024


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- round trip


def test_save_then_load_round_trip(recipe_dir, tmp_path):
    cfg = _load(
        recipe_dir,
        "parallel=pp2",
        "model.moe_aux_loss_coeff=0.001",
        "model.moe_router_load_balancing_type=seq_aux_loss",
        "optimizer.adam_eps=1e-12",
    )
    out = tmp_path / "run" / "resolved.yaml"
    save_resolved_config(cfg, out)
    again = load_config(["--config-path", str(out.parent), "--config-name", "resolved"])
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert config_to_dict(cfg)["parallel"]["pipeline_model_parallel_size"] == 2
    assert config_from_dict(config_to_dict(cfg)) == cfg


# ----------------------------------------------------------------------------- validate_config


@pytest.fixture
def good(tmp_path) -> TrainConfig:
    """A valid single-rank config, built without Hydra (fast) through the same typing path."""
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "mcore").mkdir()
    return config_from_dict(
        {
            "model": {"hf_path": str(tmp_path / "hf"), "mcore_path": str(tmp_path / "mcore")},
            "data": {"train_files": [str(tmp_path / "train.jsonl")]},
            "trainer": {"output_dir": str(tmp_path / "out"), "max_steps": 10},
        }
    )


def _with(cfg: TrainConfig, **changes) -> TrainConfig:
    """`_with(cfg, parallel__tensor_model_parallel_size=2)` -> a modified copy."""
    cfg = dataclasses.replace(
        cfg,
        **{
            s: dataclasses.replace(getattr(cfg, s))
            for s in ("model", "data", "parallel", "optimizer", "trainer", "checkpoint")
        },
    )
    for key, value in changes.items():
        section, field = key.split("__")
        assert hasattr(getattr(cfg, section), field), key
        setattr(getattr(cfg, section), field, value)
    return cfg


TP2_SP = dict(parallel__tensor_model_parallel_size=2, parallel__sequence_parallel=True)


@pytest.mark.parametrize(
    "changes, world_size",
    [
        ({}, 1),
        ({}, 8),
        ({**TP2_SP, "parallel__expert_model_parallel_size": 2, "parallel__expert_tensor_parallel_size": 1}, 4),
        ({**TP2_SP, "parallel__expert_model_parallel_size": 4, "parallel__expert_tensor_parallel_size": 1}, 8),
        (
            {
                "parallel__pipeline_model_parallel_size": 2,
                "parallel__virtual_pipeline_model_parallel_size": 2,
                "trainer__global_batch_size": 4,
            },
            4,
        ),
        ({"parallel__context_parallel_size": 2, "data__pack_length": 4096}, 2),
        (
            {
                "parallel__overlap_grad_reduce": True,
                "parallel__overlap_param_gather": True,
                "model__recompute_granularity": "selective",
                "model__recompute_modules": ["core_attn", "moe"],
                "optimizer__optimizer_cpu_offload": True,
                "optimizer__optimizer_offload_fraction": 0.5,
            },
            2,
        ),
        # the loader pads each document to 2*cp: any pack_length works
        ({"parallel__context_parallel_size": 2, "data__pack_length": 4098}, 2),
        ({**TP2_SP, "parallel__context_parallel_size": 2, "data__pad_documents_to": 16}, 4),
        (
            {
                **TP2_SP,
                "parallel__context_parallel_size": 2,
                "parallel__expert_model_parallel_size": 4,
                "parallel__expert_tensor_parallel_size": 1,
            },
            4,
        ),
        ({"trainer__cuda_graphs": True}, 8),  # data parallel is fine: each rank replays its own graphs
        # the allgather dispatcher's collectives are captured (static rows: kernels/permute.py)
        ({"trainer__cuda_graphs": True, "parallel__expert_model_parallel_size": 2}, 2),
    ],
)
def test_good_configs_pass(good, changes, world_size):
    validate_config(_with(good, **changes), world_size)


@pytest.mark.parametrize(
    "changes, world_size, expected",
    [
        (
            {"parallel__tensor_model_parallel_size": 0},
            1,
            "[parallel_sizes_positive] parallel.tensor_model_parallel_size=0 must be >= 1",
        ),
        (
            {**TP2_SP, "parallel__pipeline_model_parallel_size": 2},
            6,
            "[model_parallel_divides_world] parallel.tensor_model_parallel_size=2 x pipeline_model_parallel_size=2"
            " x context_parallel_size=1 = 4 does not divide world_size=6",
        ),
        (
            {**TP2_SP, "parallel__expert_model_parallel_size": 4},
            4,
            "[expert_layout] parallel.expert_tensor_parallel_size=2 (null = TP) x expert_model_parallel_size=4 x "
            "pipeline_model_parallel_size=1 = 8 does not divide world_size=4",
        ),
        ({"parallel__expert_model_parallel_size": 4}, 6, "expert data-parallel size 6/4 is not an integer"),
        (
            {"trainer__global_batch_size": 6},
            4,
            "[global_batch_size] trainer.global_batch_size=6 is not divisible by the data-parallel size 4",
        ),
        (
            {"parallel__tensor_model_parallel_size": 2},
            2,
            "[sequence_parallel] parallel.sequence_parallel=False with tensor_model_parallel_size=2",
        ),
        (
            {"parallel__virtual_pipeline_model_parallel_size": 2},
            1,
            "[pipeline_options] parallel.virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size>1",
        ),
        (
            {
                "parallel__pipeline_model_parallel_size": 2,
                "parallel__virtual_pipeline_model_parallel_size": 2,
                "trainer__global_batch_size": 3,
            },
            2,
            "interleaved (VPP) schedule needs a multiple of",
        ),
        (
            {"parallel__num_layers_in_last_pipeline_stage": 3},
            1,
            "parallel.num_layers_in_last_pipeline_stage=3 needs pipeline_model_parallel_size>1",
        ),
        ({"data__max_seq_len": 8192}, 1, "[sequence_lengths] data.max_seq_len=8192 > data.pack_length=4096"),
        (
            {**TP2_SP, "data__pack_length": 4097},
            2,
            "data.pack_length=4097 must be a multiple of 2 (tensor_model_parallel_size (sequence_parallel)); use 4098",
        ),
        (
            {"parallel__context_parallel_size": 2, "parallel__expert_model_parallel_size": 4},
            2,
            "etp*ep must divide world_size/pp=2 (= tensor x context_parallel_size=2 x data parallel)",
        ),
        (
            {**TP2_SP, "parallel__context_parallel_size": 2, "data__pad_documents_to": 4},
            4,
            "data.pad_documents_to=4 must be a positive multiple of 8, what context_parallel_size=2 (x TP under "
            "sequence parallel) needs; use 8 or null",
        ),
        ({"parallel__context_parallel_size": 3}, 4, "x context_parallel_size=3 = 3 does not divide world_size=4"),
        ({"trainer__device": "tpu"}, 1, "[choices] trainer.device='tpu' is not one of auto | cuda | cpu"),
        ({"trainer__precision": "fp16"}, 1, "trainer.precision='fp16' is not one of auto | bf16 | fp32"),
        ({"model__backend": "apex"}, 1, "model.backend='apex' is not one of auto | te | torch"),
        ({"data__overlong": "wrap"}, 1, "data.overlong='wrap' is not one of truncate | drop"),
        ({"optimizer__lr_decay_style": "WSD"}, 1, "optimizer.lr_decay_style='WSD' is not one of"),
        ({"checkpoint__resume": "always"}, 1, "checkpoint.resume='always' is not one of auto | never"),
        ({"model__moe_token_dispatcher_type": "flex"}, 1, "model.moe_token_dispatcher_type='flex' is not one of"),
        ({"model__moe_router_dtype": "bf16"}, 1, "model.moe_router_dtype='bf16' is not one of null | fp32 | fp64"),
        ({"data__train_files": []}, 1, "[data_files] data.train_files=[] is empty"),
        (
            {"data__train_files": ["/nonexistent/x.jsonl"]},
            1,
            "data.train_files entry '/nonexistent/x.jsonl' does not exist",
        ),
        ({"trainer__eval_interval": 5}, 1, "trainer.eval_interval=5 but data.eval_files is empty"),
        (
            {"data__train_files": ["/tmp/rows.csv"]},
            1,
            "[data_options] data.train_files entry '/tmp/rows.csv' is not a .jsonl / .json / .parquet file",
        ),
        ({"data__train_weights": [1.0, 2.0]}, 1, "data.train_weights has 2 entries for 1 data.train_files"),
        ({"data__train_weights": [0.0]}, 1, "data.train_weights=[0.0] must be >= 0 with at least one > 0"),
        ({"data__eval_fraction": 1.0}, 1, "data.eval_fraction=1.0 must be in [0, 1)"),
        ({"data__fields": {"speaker": "x"}}, 1, "data.fields has unknown keys ['speaker']; rename only messages"),
        ({"data__chat_template": "/nonexistent/t.jinja"}, 1, "data.chat_template='/nonexistent/t.jinja' is not a file"),
        ({"data__pack_window": 0}, 1, "data.pack_window=0 must be >= 1"),
        ({"data__num_workers": -1}, 1, "data.num_workers=-1 must be >= 0"),
        ({"data__on_error": "ignore"}, 1, "data.on_error='ignore' is not one of fail | skip"),
        ({"data__loss_on": "all"}, 1, "data.loss_on='all' is not one of all_assistant | last_assistant"),
        ({"data__format": "csv"}, 1, "data.format='csv' is not one of auto | messages | sharegpt"),
        ({"optimizer__lr": 0.0}, 1, "[optimizer] optimizer.lr=0.0 must be > 0"),
        ({"optimizer__min_lr": 1.0}, 1, "optimizer.min_lr=1.0 must be in [0, optimizer.lr="),
        ({"optimizer__lr_warmup_steps": -1}, 1, "optimizer.lr_warmup_steps=-1 must be >= 0"),
        (
            {"optimizer__optimizer_cpu_offload": True, "trainer__precision": "fp32"},
            1,
            "optimizer.optimizer_cpu_offload needs trainer.precision=bf16",
        ),
        (
            {"optimizer__optimizer_cpu_offload": True, "trainer__device": "cpu"},
            1,
            "with trainer.device=cpu turn it off",
        ),
        (
            {"optimizer__optimizer_cpu_offload": True, "parallel__use_distributed_optimizer": False},
            1,
            "needs parallel.use_distributed_optimizer=true",
        ),
        ({"trainer__max_steps": 0}, 1, "[trainer] trainer.max_steps=0 must be > 0"),
        ({"checkpoint__keep_last": 0}, 1, "checkpoint.keep_last=0 must be >= 1"),
        ({"model__backend": "te", "trainer__device": "cpu"}, 1, "[model] model.backend='te' needs CUDA"),
        (
            {"model__attention_dropout": 0.1},
            1,
            "[model] model.attention_dropout=0.1: the torch-native attention has "
            "no dropout; set model.attention_dropout=0.0 (the SFT default) or model.backend=te",
        ),
        (
            {"model__recompute_granularity": "full"},
            1,
            "model.recompute_granularity='full' needs recompute_method (uniform|block) and recompute_num_layers",
        ),
        (
            {"model__recompute_modules": ["moe"]},
            1,
            "model.recompute_modules=['moe'] needs model.recompute_granularity=selective (got None)",
        ),
        (
            {"model__recompute_granularity": "selective", "model__recompute_modules": ["attention"]},
            1,
            "model.recompute_modules has ['attention']; choose from ['core_attn'",
        ),
        (
            {"model__activation_offload_modules": ["attn_proj"], "trainer__device": "cuda"},
            1,
            "attn_proj needs core_attn too",
        ),
        (
            {"model__activation_offload_modules": ["core_attn"], "model__backend": "torch"},
            1,
            "needs Transformer Engine (megatron-core 0.16.1 offloads through TE's CPU offload",
        ),
        (
            {"model__activation_offload_modules": ["core_attn"], "trainer__device": "cpu"},
            1,
            "with trainer.device=cpu set it to []",
        ),
        (
            {"model__activation_offload_modules": ["experts"]},
            1,
            "model.activation_offload_modules has ['experts']; choose from",
        ),
        (
            {"parallel__overlap_param_gather": True},
            1,
            "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true and "
            "parallel.overlap_grad_reduce=true (got True, False)",
        ),
        (
            {"optimizer__optimizer_cpu_offload": True, "optimizer__optimizer_offload_fraction": 1.5},
            1,
            "optimizer.optimizer_offload_fraction=1.5 must be in (0, 1]",
        ),
        (
            {"trainer__offload_between_steps": True, "parallel__use_distributed_optimizer": False},
            1,
            "trainer.offload_between_steps=true needs parallel.use_distributed_optimizer=true",
        ),
        (
            {"trainer__cuda_graphs": True, "trainer__device": "cpu"},
            1,
            "[trainer] trainer.cuda_graphs=true: trainer.device=cpu: CUDA graphs need CUDA; or set trainer.cuda_graphs=false",
        ),
        (
            {
                "trainer__cuda_graphs": True,
                "parallel__expert_model_parallel_size": 2,
                "model__moe_token_dispatcher_type": "alltoall",
            },
            2,
            "trainer.cuda_graphs=true: parallel.expert_model_parallel_size=2 with "
            "model.moe_token_dispatcher_type=alltoall: its split sizes need the host",
        ),
        (
            {"trainer__cuda_graphs": True, "parallel__tensor_model_parallel_size": 2},
            2,
            "trainer.cuda_graphs=true: parallel.tensor_model_parallel_size=2: the graphed MoE half needs 1",
        ),
        (
            {"trainer__cuda_graphs": True, "parallel__pipeline_model_parallel_size": 2},
            2,
            "trainer.cuda_graphs=true: parallel.pipeline_model_parallel_size=2: the graphed MoE half needs 1",
        ),
        (
            {
                "trainer__cuda_graphs": True,
                "model__recompute_granularity": "selective",
                "model__recompute_modules": ["moe"],
            },
            1,
            "trainer.cuda_graphs=true: model.recompute_granularity=selective",
        ),
        (
            {"trainer__cuda_graphs": True, "trainer__offload_between_steps": True},
            1,
            "trainer.cuda_graphs=true: trainer.offload_between_steps=true",
        ),
        (
            {"trainer__cuda_graphs": True, "parallel__overlap_grad_reduce": True},
            2,
            "trainer.cuda_graphs=true: parallel.overlap_grad_reduce / overlap_param_gather=true",
        ),
        ({"model__moe_dispatch_chunks": 0}, 1, "model.moe_dispatch_chunks=0 must be between 1 (off) and"),
        ({"model__mcore_path": None}, 1, "[model_paths] model.mcore_path is null"),
        ({"model__mcore_path": "/nonexistent/mcore"}, 1, "model.mcore_path='/nonexistent/mcore' does not exist"),
    ],
)
def test_each_check_fires_with_field_value_and_fix(good, changes, world_size, expected):
    msg = _error(validate_config, _with(good, **changes), world_size)
    assert expected in msg, msg


def test_eval_from_a_held_out_fraction_needs_no_eval_files(good):
    validate_config(_with(good, trainer__eval_interval=5, data__eval_fraction=0.01), 1)


def test_suggested_batch_size_fix_passes(good):
    msg = _error(validate_config, _with(good, trainer__global_batch_size=6), 4)
    assert "use a multiple of 4, e.g. 4 or 8" in msg
    validate_config(_with(good, trainer__global_batch_size=8), 4)


def test_create_tiny_needs_paths_but_not_existing_checkpoint(good):
    validate_config(_with(good, model__create_tiny_if_missing=True, model__mcore_path="/not/yet"), 1)
    msg = _error(validate_config, _with(good, model__create_tiny_if_missing=True, model__hf_path=None), 1)
    assert "model.create_tiny_if_missing=True needs model.hf_path" in msg


def test_all_failures_collected_in_one_error(good):
    bad = _with(good, trainer__device="tpu", optimizer__lr=-1.0, parallel__tensor_model_parallel_size=2)
    msg = _error(validate_config, bad, 2)
    assert msg.startswith("invalid configuration (")
    for piece in ("trainer.device='tpu'", "optimizer.lr=-1.0", "parallel.sequence_parallel=False"):
        assert piece in msg


def test_derived_sizes(good):
    cfg = _with(good, **TP2_SP, parallel__expert_model_parallel_size=4, parallel__expert_tensor_parallel_size=1)
    assert data_parallel_size(cfg.parallel, 8) == 4 and expert_data_parallel_size(cfg.parallel, 8) == 2
    assert data_parallel_size(cfg.parallel, 3) is None


# ----------------------------------------------------------------------------- validate_against_model

QWEN3_30B = dict(num_layers=48, num_experts=128, num_attention_heads=32, num_query_groups=4, vocab_size=151936)


def test_model_checks_pass_for_a_real_layout(good):
    cfg = _with(
        good,
        **TP2_SP,
        parallel__expert_model_parallel_size=8,
        parallel__pipeline_model_parallel_size=2,
        parallel__virtual_pipeline_model_parallel_size=4,
    )
    validate_against_model(cfg, **QWEN3_30B)


def test_pipeline_must_divide_layers_and_suggestion_is_valid(good):
    msg = _error(
        validate_against_model,
        _with(good, parallel__pipeline_model_parallel_size=4),
        num_layers=61,
        num_experts=256,
        num_attention_heads=128,
        num_query_groups=128,
        vocab_size=129280,
    )
    assert (
        "[pipeline_layers] parallel.pipeline_model_parallel_size=4 does not divide num_layers=61; use one of 1, 61"
    ) in msg
    assert "parallel.num_layers_in_last_pipeline_stage=16 (15 per other stage)" in msg
    fixed = _with(good, parallel__pipeline_model_parallel_size=4, parallel__num_layers_in_last_pipeline_stage=16)
    validate_against_model(
        fixed, num_layers=61, num_experts=256, num_attention_heads=128, num_query_groups=128, vocab_size=129280
    )


def test_uneven_stages_must_leave_an_even_middle(good):
    cfg = _with(
        good,
        parallel__pipeline_model_parallel_size=4,
        parallel__num_layers_in_first_pipeline_stage=10,
        parallel__num_layers_in_last_pipeline_stage=10,
    )
    msg = _error(validate_against_model, cfg, **{**QWEN3_30B, "num_layers": 61})
    assert "leave 41 of num_layers=61 for 2 middle stage(s)" in msg


def test_vpp_must_divide_layers_per_stage(good):
    cfg = _with(good, parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=4)
    msg = _error(validate_against_model, cfg, **{**QWEN3_30B, "num_layers": 12})
    assert "virtual_pipeline_model_parallel_size=4 does not divide the 6 layers per pipeline stage" in msg


def test_expert_heads_and_vocab_checks_collected(good):
    cfg = _with(
        good,
        parallel__tensor_model_parallel_size=8,
        parallel__sequence_parallel=True,
        parallel__expert_model_parallel_size=16,
    )
    msg = _error(
        validate_against_model,
        cfg,
        num_layers=48,
        num_experts=60,
        num_attention_heads=32,
        num_query_groups=4,
        vocab_size=32001,
    )
    assert "[experts] parallel.expert_model_parallel_size=16 does not divide num_experts=60" in msg
    assert "[attention_heads] parallel.tensor_model_parallel_size=8 does not divide num_query_groups=4" in msg
    assert "[vocab] parallel.tensor_model_parallel_size=8 does not divide vocab_size=32001" in msg
    assert "num_attention_heads=32;" not in msg  # 32 % 8 == 0: not reported


def test_graphed_expert_parallel_is_checked_against_the_model(good):
    """trainer.cuda_graphs at EP > 1 captures the static-row permutation: refused before any GPU work
    where the auto dispatcher picks the alltoall (an expert group above top-k) or the experts have
    biases. EP4 with top-8 is fine: its rows are capped at 2x (kernels/permute.py)."""
    graphs = dict(trainer__cuda_graphs=True)
    for ep in (2, 4, 8):
        validate_against_model(_with(good, **graphs, parallel__expert_model_parallel_size=ep), **QWEN3_30B, topk=8)
    validate_against_model(_with(good, parallel__expert_model_parallel_size=16), **QWEN3_30B, topk=8)  # eager
    msg = _error(
        validate_against_model, _with(good, **graphs, parallel__expert_model_parallel_size=16), **QWEN3_30B, topk=8
    )
    assert (
        "[cuda_graphs] trainer.cuda_graphs=true with an expert group of EP x expert-TP = 16 > top-k 8: "
        "model.moe_token_dispatcher_type=auto picks the alltoall there"
    ) in msg and "set model.moe_token_dispatcher_type=allgather" in msg
    validate_against_model(
        _with(good, **graphs, parallel__expert_model_parallel_size=16, model__moe_token_dispatcher_type="allgather"),
        **QWEN3_30B,
        topk=8,
    )
    msg = _error(
        validate_against_model,
        _with(good, **graphs, parallel__expert_model_parallel_size=2),
        **QWEN3_30B,
        topk=8,
        expert_biases=True,
    )
    assert "this model's experts have biases" in msg and "set trainer.cuda_graphs=false" in msg
    # adapters: graphed at EP1 (the adapters' grouped GEMMs are captured with the MoE half); at EP2 not
    # on the routed experts (they read every static row), but on attention alone they are
    lora = dict(peft__method="lora", peft__target_modules=["all_linear"])
    validate_config(_with(good, **graphs, **lora), 8)
    validate_against_model(_with(good, **graphs, **lora), **QWEN3_30B, topk=8)
    msg = _error(
        validate_against_model,
        _with(good, **graphs, **lora, parallel__expert_model_parallel_size=2),
        **QWEN3_30B,
        topk=8,
    )
    assert "adapters on the routed experts read every row of the static-row permutation" in msg
    attention = dict(peft__method="lora", peft__target_modules=["attention"])
    validate_against_model(
        _with(good, **graphs, **attention, parallel__expert_model_parallel_size=2), **QWEN3_30B, topk=8
    )


def test_dense_model_and_mha_defaults(good):
    validate_against_model(
        good, num_layers=4, num_experts=None, num_attention_heads=4, num_query_groups=None, vocab_size=100
    )


@pytest.mark.parametrize(
    "changes, world_size, expected",
    [
        ({"trainer__global_batch_tokens": 40_000}, 1, 10),  # ceil(40000 / 4096)
        ({"trainer__global_batch_tokens": 40_000}, 4, 12),  # DP 4
        ({"trainer__global_batch_tokens": 4096, **TP2_SP}, 4, 2),  # DP 2: at least one per rank
        (
            {
                "trainer__global_batch_tokens": 40_000,
                "parallel__pipeline_model_parallel_size": 2,
                "parallel__virtual_pipeline_model_parallel_size": 2,
            },
            4,
            12,
        ),  # DP 2 x PP 2 for the interleaved schedule
    ],
)
def test_global_batch_in_tokens_derives_the_micro_batch_count(good, changes, world_size, expected):
    from moe_sft.config.validate import resolve_global_batch

    cfg = _with(good, **changes)
    line = resolve_global_batch(cfg, world_size)
    assert cfg.trainer.global_batch_size == expected and f"global_batch_size={expected}" in line
    validate_config(cfg, world_size)  # the derived size passes every check
