"""What every benchmark arm trains: a model preset (an HF config) and synthetic packed SFT batches.

Models (random init; shapes are what matters for throughput):
  qwen3_30b     Qwen3-30B-A3B (recipes/models/qwen3_30b_a3b): hidden 2048, 32 q / 4 kv heads of 128,
                qk-norm, 128 experts top-8 x 768, vocab 151936; `--layers` of its 48 layers
  dsv3_reduced  DeepSeek-V3 (recipes/models/deepseek_v3) reduced to fit one GPU: MLA with the real
                q_lora 1536 / kv_lora 512 / 128 nope + 64 rope / 128 v head dims but 16 heads,
                hidden 2048, 256 routed experts top-8 x 512 (group-limited: 8 groups, top-4 groups,
                sigmoid + expert bias), 1 shared expert, first layer dense (4608), 1 MTP layer,
                vocab 129280; the recipe's router settings (seq aux loss 1e-4, bias update 1e-3)
  gpt_oss_20b   gpt-oss-20b (recipes/models/gpt_oss_20b): hidden 2880, 64 q / 8 kv heads of 64 with
                biases and learned sinks, sliding (128) and full layers alternating, YaRN, 32
                biased experts top-4 x 2880 (clamped SwiGLU), vocab 201088; `--layers` of its 24
  tiny, tiny_dsv3  the test families' tiny configs (CPU smoke)

Data: documents with log-normal lengths (median 600 tokens, sigma 1.0: a long tail up to the
budget), each a random prompt share (10-50%, no loss) then the answer (loss). Every step draws its
own documents from a seed fixed by (seed, budget, step), packs them best-fit decreasing into
`budget`-token bins (moe_sft.data.packing, the trainer's packer), picks bins at random among those
at least 90% full, and fills
each one's last free tokens (<1% on average) with one more document of exactly that length, so
every micro-batch holds `budget` real tokens and no padding; all arms see the same token ids.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_sft.data.chat import TokenizedDoc
from moe_sft.data.packing import PackedMicroBatch, best_fit_decreasing, build_micro_batch

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / "recipes" / "models"


@dataclass(frozen=True)
class Preset:
    family: str  # moe_sft.models.registry name
    base: str | None  # recipes/models/<base>/config.json, else the family's tiny config
    layers: int  # default --layers (one H200 with the distributed optimizer)
    overrides: dict = field(default_factory=dict)  # HF config fields
    model_options: dict = field(default_factory=dict)  # moe_sft ModelConfig fields (the recipe's)
    hf_arm: bool = False  # transformers' implementation is benchmarked too


DSV3_ROUTER = dict(
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-3,
    mtp_loss_weight=0.1,
)

PRESETS = {
    # 8 layers: the planner's 128 of 139.7 GiB at 8192 tokens (9 layers: 141); docs/benchmarks.md
    "qwen3_30b": Preset("qwen3_moe", "qwen3_30b_a3b", layers=8, hf_arm=True),
    # 5 layers (1 dense + 4 MoE) + 1 MTP layer: the planner's 115 of 139.7 GiB at 8192 tokens
    "dsv3_reduced": Preset(
        "deepseek_v3",
        "deepseek_v3",
        layers=5,
        overrides=dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=16,
            moe_intermediate_size=512,
            intermediate_size=4608,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
        ),
        model_options=DSV3_ROUTER,
    ),
    # 2 layers (one sliding, one full): 18 B/param of weights and optimizer state on one GPU, and
    # its 1.16 B embedding + head parameters, leave room for 8192-token activations on an 80 GB H100
    "gpt_oss_20b": Preset("gpt_oss", "gpt_oss_20b", layers=2, hf_arm=True),
    # 5 layers (GDN x 3, gated attention, GDN): the hybrid pattern in 5.1 B parameters on one H200;
    # without the release's MTP layer, which transformers' arm does not run either
    "qwen3_5_35b": Preset(
        "qwen3_5_moe", "qwen3_5_35b_a3b_text", layers=5, overrides=dict(mtp_num_hidden_layers=0), hf_arm=True
    ),
    # 4 layers (GDN x 3, gated attention): Qwen3-Next-80B's pattern at 512 experts of 512, no MTP layer
    "qwen3_next_80b": Preset(
        "qwen3_next", "qwen3_next_80b_a3b", layers=4, overrides=dict(mtp_num_hidden_layers=0), hf_arm=True
    ),
    # 6 layers (5 sliding + 1 full, the release's pattern): 5.4 B parameters (its 0.74 B tied
    # embedding included) on one H200 with the distributed optimizer
    "gemma4_26b": Preset("gemma4", "gemma4_26b_a4b", layers=6, hf_arm=True),
    "tiny": Preset("qwen3_moe", None, layers=2, hf_arm=True),
    "tiny_dsv3": Preset(
        "deepseek_v3", None, layers=2, overrides=dict(num_nextn_predict_layers=1), model_options=DSV3_ROUTER
    ),
}


def _first_layers(cfg, n: int):
    """`cfg` cut to its first `n` layers: their per-layer attention kinds (gpt-oss, Gemma 4) and
    transformers' per-layer overrides (Gemma 4's full layers), which it checks against the layer count."""
    d = cfg.to_dict()
    d["num_hidden_layers"] = n
    if d.get("layer_types"):
        d["layer_types"] = list(d["layer_types"][:n])
    if isinstance(d.get("per_layer_config"), dict):
        d["per_layer_config"] = {k: v for k, v in d["per_layer_config"].items() if int(k) < n}
    return type(cfg).from_dict(d)


def hf_config(model: str, layers: int | None = None):
    """(family, HF config) of preset `model` with `layers` decoder layers (default: the preset's)."""
    from moe_sft.models import registry

    preset = PRESETS[model]
    family = registry.family_by_name(preset.family)
    if preset.base:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(MODELS_DIR / preset.base), local_files_only=True)
        for name in ("quantization_config", "_pre_quantization_dtype"):  # random bf16 weights, not FP8
            if hasattr(cfg, name):
                delattr(cfg, name)
    else:
        cfg = family.tiny_hf_config()
    if family.composite:  # a vision-language release's config: its language model
        cfg = family.composite.text_config(cfg)
    cfg = copy.deepcopy(cfg)
    for key, value in preset.overrides.items():
        setattr(cfg, key, value)
    cfg = _first_layers(cfg, layers or preset.layers)
    if hasattr(cfg, "mlp_only_layers"):
        cfg.mlp_only_layers = []
    family.check_supported(cfg)
    return family, cfg


def model_shape(model: str, layers: int | None = None, run_mtp: bool = True):
    """moe_sft.models.shape.ModelShape of the preset, from the same TransformerConfig the trainer builds."""
    from moe_sft.models.builder import ModelOptions, build_transformer_config
    from moe_sft.models.shape import ModelShape

    family, cfg = hf_config(model, layers)
    config = build_transformer_config(family, cfg, ModelOptions())
    return ModelShape.from_config(config, cfg.vocab_size, run_mtp=run_mtp)


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Workload:
    """The packed global batches of every step at one token budget (pure function of the fields)."""

    budget: int  # tokens per packed micro-batch
    micro_batches: int  # per step, over all data-parallel ranks
    vocab: int
    seed: int = 0
    median: float = 600.0  # document length distribution (log-normal, clipped to the budget)
    sigma: float = 1.0
    min_len: int = 16
    pad_to: int = 1

    def lengths(self, rng: np.random.Generator) -> list[int]:
        need, out = 1.5 * self.micro_batches * self.budget + self.budget, []
        while sum(out) < need:
            n = rng.lognormal(np.log(self.median), self.sigma)
            out.append(int(np.clip(n, min(self.min_len, self.budget), self.budget)))
        return out

    def doc(self, rng: np.random.Generator, n: int) -> TokenizedDoc:
        ids = rng.integers(0, self.vocab, n, dtype=np.int64)
        prompt = int(n * rng.uniform(0.1, 0.5))
        return TokenizedDoc(ids, (np.arange(n) >= prompt).astype(np.float32))

    def global_batch(self, step: int) -> list[PackedMicroBatch]:
        rng = np.random.default_rng([self.seed, self.budget, step])
        lengths = self.lengths(rng)
        bins = best_fit_decreasing(lengths, self.budget)
        # a random choice among the bins that best-fit filled to >= 90% (not the fullest: those are the
        # documents clipped to the whole budget)
        full = [b for b in bins if sum(lengths[i] for i in b) >= 0.9 * self.budget]
        bins = [full[i] for i in rng.permutation(len(full))[: self.micro_batches]]
        out = []
        for members in bins:
            docs = [self.doc(rng, lengths[i]) for i in members]
            room = self.budget - sum(lengths[i] for i in members)
            if room:
                docs.append(self.doc(rng, room))
            out.append(build_micro_batch(docs, pad_to=self.pad_to))
        return out


def real_tokens(micro_batches) -> int:
    """Non-padding tokens (documents' real lengths) of PackedMicroBatches."""
    from moe_sft.trainer.flops import document_lengths

    return sum(sum(document_lengths(mb)) for mb in micro_batches)


def digest(micro_batches, previous: str = "") -> str:
    """A running sha1 over the token ids and segment bounds the arm was fed (same data check)."""
    h = hashlib.sha1(previous.encode())
    for mb in micro_batches:
        h.update(mb.tokens.numpy().tobytes())
        h.update(mb.cu_seqlens.numpy().tobytes())
    return h.hexdigest()


class SyntheticPlan:
    """The part of the data plan (moe_sft.data.loader) that `Trainer.train_one_step` uses, over a
    Workload; it records what it handed out (the global batch's real tokens and digest)."""

    def __init__(self, workload: Workload):
        self.workload = workload
        self.next_step = 0
        self.fed_tokens = 0
        self.fed_digest = ""
        self._cache: dict[int, list[PackedMicroBatch]] = {}

    def global_batch(self, step: int) -> list[PackedMicroBatch]:
        if step not in self._cache:
            self._cache = {step: self.workload.global_batch(step)}
        return self._cache[step]

    def batches_for_step(self, step: int, dp_rank: int = 0, dp_size: int = 1):
        batch = self.global_batch(step)
        if len(batch) % dp_size:
            raise ValueError(
                f"{len(batch)} micro-batches per step do not split over {dp_size} data-parallel "
                f"ranks; use a --tokens-per-step that is a multiple of budget x {dp_size}"
            )
        self.fed_tokens += real_tokens(batch)
        self.fed_digest = digest(batch, self.fed_digest)
        return batch[dp_rank::dp_size], sum(mb.loss_weight_sum for mb in batch)

    def reset_record(self) -> None:
        self.fed_tokens, self.fed_digest = 0, ""

    def prefetch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        pass  # the benchmark builds each step's batch before its timer starts (global_batch)

    def step_info(self, step: int) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}
