"""The derived parallel facts of one run, computed in one place (torchtitan's `ParallelDims`).

`Layout` holds the degrees the recipe names (TP, PP, VPP, CP, EP, expert-TP) at a world size, and
what follows from them and from the model and runtime: data-parallel and expert-data-parallel
sizes, the expert group (EP x expert-TP: the ranks one MoE layer's tokens are spread over), the
token dispatcher `auto` stands for, whether every micro-batch needs one shape, and whether the
allgather dispatcher's local permutation has a static row count (static rows, which need moe-sft's
permutation: `kernels.fused`). Validation, the planner, the model builder, distributed init, the
trainer and the kernels read it; none of them derives these facts again. Pure Python: the planner
uses it for any world size without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Eager static rows: the most tokens a rank gathers (micro-batch x expert group). Past it the host
# wait they save is small against the work, and their padding rows cost more than it.
STATIC_ROWS_MAX_GATHERED = 8192


def static_rows_apply(gathered: int, graphed: bool = False) -> bool:
    """Static rows where a rank's dispatcher gathers `gathered` tokens (tokens per rank of a
    micro-batch x EP x expert-TP); any size where the MoE half is `graphed` (trainer.cuda_graphs),
    since a graph needs the static size."""
    return graphed or gathered <= STATIC_ROWS_MAX_GATHERED


def token_dispatcher(requested: str, device: str, expert_group: int, topk: int) -> str:
    """The token dispatcher `auto` stands for. On CPU allgather (alltoall needs CUDA streams). On
    CUDA, with an expert group of G = EP x expert-TP ranks, allgather where G <= top-k: each rank
    then receives (G - 1) x tokens rows against the alltoall's ~top-k x (G - 1) / G x tokens, and
    its collectives have static sizes (the alltoall waits for its split sizes on the host); the
    loader then pads micro-batches to one length for it (`Layout.fixed_shape`). Alone (G = 1)
    alltoall: its dispatch is then local and makes no host wait (moe_sft/kernels/permute.py)."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "allgather"
    return "allgather" if 1 < expert_group <= topk else "alltoall"


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    first: int | None = None  # num_layers_in_first_pipeline_stage
    last: int | None = None  # num_layers_in_last_pipeline_stage
    # the model and the runtime (defaults: a layout of degrees only)
    requested_dispatcher: str = "auto"  # model.moe_token_dispatcher_type
    device: str = "cuda"
    topk: int = 0  # the model's router top-k; 0: not known yet
    tokens: int = 0  # data.pack_length: a micro-batch's tokens before CP splits them
    graphed: bool = False  # trainer.cuda_graphs
    fused: bool = True  # kernels.fused: moe-sft's permutation and combine are installed

    @classmethod
    def of_parallel(cls, p, world: int) -> Layout:
        """The degrees of a `parallel` section (config/schema.py's ParallelConfig) at `world` ranks."""
        return cls(
            world=world,
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            vpp=p.virtual_pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            ep=p.expert_model_parallel_size,
            etp=p.expert_tp,
            first=p.num_layers_in_first_pipeline_stage,
            last=p.num_layers_in_last_pipeline_stage,
        )

    @classmethod
    def from_config(cls, cfg, world: int, *, topk: int = 0, device: str = "cuda") -> Layout:
        """The layout a recipe gives at `world` ranks; `device` is the resolved trainer.device."""
        return replace(
            cls.of_parallel(cfg.parallel, world),
            requested_dispatcher=cfg.model.moe_token_dispatcher_type,
            device=device,
            topk=topk,
            tokens=cfg.data.pack_length,
            graphed=cfg.trainer.cuda_graphs,
            fused=cfg.kernels.fused,
        )

    def with_topk(self, topk: int) -> Layout:
        """This layout once the model's top-k is known (the trainer reads it after the process groups)."""
        return replace(self, topk=topk)

    # ------------------------------------------------------------------ degrees
    @property
    def model_ranks(self) -> int:
        """Ranks one data-parallel replica spans: TP x PP x CP."""
        return self.tp * self.pp * self.cp

    @property
    def expert_group(self) -> int:
        """Ranks one MoE layer's experts and tokens are spread over: EP x expert-TP."""
        return self.ep * self.etp

    @property
    def expert_ranks(self) -> int:
        """Ranks one expert data-parallel replica spans: EP x expert-TP x PP."""
        return self.expert_group * self.pp

    @property
    def dp(self) -> int:
        return self.world // self.model_ranks

    @property
    def edp(self) -> int:
        return self.world // self.expert_ranks

    def exact_dp(self) -> int | None:
        """world / (TP x PP x CP); None when that is not an integer."""
        m = self.model_ranks
        return self.world // m if m > 0 and self.world % m == 0 else None

    def exact_edp(self) -> int | None:
        """world / (expert-TP x EP x PP); None when that is not an integer."""
        e = self.expert_ranks
        return self.world // e if e > 0 and self.world % e == 0 else None

    @property
    def vp(self) -> int:
        return self.vpp or 1

    def short(self) -> str:
        parts = (
            [f"TP{self.tp}", f"PP{self.pp}"]
            + ([f"VPP{self.vpp}"] if self.vpp else [])
            + ([f"CP{self.cp}"] if self.cp > 1 else [])
            + [f"EP{self.ep}", f"ETP{self.etp}", f"DP{self.dp}"]
        )
        return "·".join(parts) + f" (expert DP {self.edp})"

    # ------------------------------------------------------------------ dispatch
    @property
    def dispatcher(self) -> str:
        """The token dispatcher the MoE layers use (`auto` resolved)."""
        return token_dispatcher(self.requested_dispatcher, self.device, self.expert_group, self.topk)

    @property
    def fixed_shape(self) -> bool:
        """Every micro-batch has one length: pipeline p2p, and the allgather dispatcher (it gathers
        equal-sized slices across the expert group)."""
        return self.pp > 1 or (self.dispatcher == "allgather" and self.expert_group > 1)

    @property
    def gathered_tokens(self) -> int:
        """The tokens a rank's allgather dispatcher gathers per micro-batch."""
        return self.tokens // self.cp * self.expert_group

    @property
    def static_rows(self) -> bool:
        """The allgather dispatcher's local permutation has a static row count (kernels/permute.py
        `enable_static_rows`; experts with biases or adapters are left out there, layer by layer)."""
        return self.fused and self.dispatcher == "allgather" and static_rows_apply(self.gathered_tokens, self.graphed)

    @property
    def reduced_combine(self) -> bool:
        """model.moe_combine_dtype can act: moe-sft's allgather combine is installed and in use, and
        reduce-scatters over more than one rank."""
        return self.fused and self.dispatcher == "allgather" and self.expert_group > 1
