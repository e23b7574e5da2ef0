"""How each FlexSP "device" is built from GPUs: tensor parallelism, its sequence parallelism and
activation recomputation (layer 0, stdlib only).

With ``--tensor-model-parallel-size t`` every model replica is split over ``t`` GPUs of one node.
FlexSP then forms its sequence-parallel groups over *devices* -- the ``world / t`` TP groups -- and a
group of ``d`` devices runs Ulysses over ``num_heads / t`` heads per GPU (each TP rank exchanges its
own heads with the same TP rank of the other devices). Ranks follow Megatron's order
(pipeline = context = 1): global rank ``= device * t + tp_rank``.

:class:`Parallelism` carries the three settings the cost model needs and the arithmetic they imply:
device counts, how TP shards compute, activations and states, and what activation recomputation
adds. Its numbers follow Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models": per layer and token ``34 h`` bytes (bf16) of activations with flash attention,
of which ``24 h`` are split by TP and ``10 h`` only by TP's sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Parallelism:
    """Tensor parallelism inside a node (``tp`` a power of two), TP sequence parallelism and
    recomputation (``none``; ``selective``: Megatron recomputes core attention, which flash attention
    never stores, so it equals ``none`` here; ``full``: ``recompute_num_layers`` layers per
    checkpoint, ``uniform`` over all layers, or ``block``: only the first ``recompute_num_layers``)."""

    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1 or self.tp & (self.tp - 1):
            raise ValueError(f"tensor parallel size tp={self.tp!r} must be a power of two >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tensor parallelism (tp > 1)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method={self.recompute_method!r} must be 'uniform' or 'block'")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")

    # ------------------------------------------------------------------ ranks
    def devices(self, num_gpus: int) -> int:
        """FlexSP devices (TP groups) among ``num_gpus`` GPUs."""
        if num_gpus % self.tp:
            raise ValueError(f"num_gpus={num_gpus} is not a multiple of the tensor parallel size "
                             f"{self.tp}")
        return num_gpus // self.tp

    def devices_per_node(self, gpus_per_node: int) -> int:
        """Devices per node; TP must fit inside a node."""
        if gpus_per_node % self.tp:
            raise ValueError(f"tensor parallel size {self.tp} does not divide gpus_per_node="
                             f"{gpus_per_node}: tensor parallelism must stay inside a node")
        return gpus_per_node // self.tp

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Megatron's own rule: TP splits query heads and KV groups evenly."""
        if num_heads % self.tp or num_kv_heads % self.tp:
            raise ValueError(f"tensor parallel size {self.tp} must divide num_heads={num_heads} and "
                             f"num_kv_heads={num_kv_heads}")

    # ------------------------------------------------------------------ compute and memory
    def recomputed_fraction(self, num_layers: int) -> float:
        """Share of the layers whose forward runs twice (0 without full recomputation)."""
        if self.recompute != "full":
            return 0.0
        if self.recompute_method == "uniform":
            return 1.0
        return min(self.recompute_num_layers, num_layers) / num_layers

    def compute_factor(self, num_layers: int) -> float:
        """Per-GPU compute relative to one unsplit GPU without recomputation: ``1/tp``, plus a third
        for every recomputed layer (its forward, a third of forward + backward, runs twice)."""
        return (1.0 + self.recomputed_fraction(num_layers) / 3.0) / self.tp

    def forward_comm_extra(self, num_layers: int) -> float:
        """Multiplier on communication made of equal forward and backward halves (all-to-alls, TP
        collectives): up to 1.5 when recomputation repeats the forward half."""
        return 1.0 + self.recomputed_fraction(num_layers) / 2.0

    def activation_factor(self) -> float:
        """Per-GPU activations of a layer relative to TP=1: ``(10 + 24/t)/34`` (``1/t`` with sequence
        parallelism)."""
        t = self.tp
        return 1.0 / t if self.sequence_parallel else (10.0 + 24.0 / t) / 34.0

    def activation_bytes_per_token(self, full_bytes_per_token: float, *, num_layers: int,
                                   hidden_size: int, dtype_bytes: int) -> float:
        """Bytes per token a GPU holds for its device's tokens, given ``full_bytes_per_token`` (all
        layers' activations at TP=1 without recomputation).

        Full recomputation keeps each checkpoint's input (``hidden * dtype_bytes``, split by TP with
        sequence parallelism) and one checkpoint's full activations while it is recomputed."""
        per_layer = full_bytes_per_token * self.activation_factor() / num_layers
        if self.recompute != "full":
            return per_layer * num_layers
        keep = hidden_size * dtype_bytes / (self.tp if self.sequence_parallel else 1)
        n = min(self.recompute_num_layers, num_layers)
        if self.recompute_method == "uniform":
            checkpoints = -(-num_layers // n)
            return checkpoints * keep + n * per_layer
        # block: the first n layers keep only their inputs, the rest everything (the peak is at the
        # end of the forward: when the first layers are recomputed, the later ones are freed)
        return n * keep + (num_layers - n) * per_layer

    def state_bytes_per_param(self, replicated: float, sharded: float, num_gpus: int) -> float:
        """Model-state bytes per parameter per GPU: TP splits every matrix (``replicated / tp``); the
        distributed optimizer shards the rest over the data-parallel ranks of each TP shard
        (``sharded / num_gpus``)."""
        return replicated / self.tp + sharded / num_gpus

    def to_dict(self) -> dict:
        return {"tp": self.tp, "sequence_parallel": self.sequence_parallel, "recompute": self.recompute,
                "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers}

    @classmethod
    def from_megatron_args(cls, args) -> "Parallelism":
        """The settings of Megatron's parsed arguments (``--tensor-model-parallel-size``,
        ``--sequence-parallel``, ``--recompute-granularity/-method/-num-layers``)."""
        return cls(tp=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                   sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                   recompute=getattr(args, "recompute_granularity", None) or "none",
                   recompute_method=getattr(args, "recompute_method", None) or "uniform",
                   recompute_num_layers=int(getattr(args, "recompute_num_layers", None) or 1))
