"""Transformer shapes the cost model and planner need (layer 0, stdlib only).

A :class:`ModelSpec` is everything about a model that changes how long a sequence takes or how much
memory it needs: layers, hidden size, heads, KV heads, FFN size, vocabulary, parameter count and the
activation dtype. Presets cover the paper's GPT models; any Megatron GPT config can be described with
:meth:`ModelSpec.from_dict`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    ``num_params`` is the total parameter count; when 0 it is derived from the shape
    (:meth:`param_count`). ``dtype_bytes`` is the activation / communication element size
    (2 for bf16). ``swiglu`` selects a gated MLP (3 FFN matrices instead of 2);
    ``untied_embeddings``: the output layer has its own ``vocab x hidden`` matrix.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int = 0
    ffn_hidden_size: int = 0
    vocab_size: int = 50257
    num_params: float = 0.0
    dtype_bytes: int = 2
    swiglu: bool = False
    learned_positions: bool = False
    untied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                    "vocab_size", "dtype_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {key}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible "
                             f"by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.num_params < 0:
            raise ValueError(f"model {self.name!r}: num_params={self.num_params} must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_hidden_size(self) -> int:
        """Width of K (or V) per token: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Matrix parameters of one transformer layer (attention + MLP, norms and biases ignored)."""
        h, kv, f = self.hidden_size, self.kv_hidden_size, self.ffn_hidden_size
        attn = h * h + 2 * h * kv + h * h  # q, k, v, out
        mlp = (3 if self.swiglu else 2) * h * f
        return attn + mlp

    def param_count(self, max_seq_len: int = 0) -> float:
        """Total parameters: ``num_params`` when given, else layers + embeddings (+ learned positions)."""
        if self.num_params > 0:
            return float(self.num_params)
        positions = max_seq_len if self.learned_positions else 0
        vocab = self.vocab_size * (2 if self.untied_embeddings else 1)
        return float(self.num_layers * self.layer_params() + (vocab + positions) * self.hidden_size)

    def linear_flops_per_token(self) -> float:
        """Forward+backward GEMM FLOPs per token (3 x 2 x matrix parameters, output layer included)."""
        return 6.0 * (self.num_layers * self.layer_params() + self.vocab_size * self.hidden_size)

    def attention_flops_per_token2(self) -> float:
        """Forward+backward causal attention FLOPs per token^2: ``3 * 2 * 2 * L * h / 2``."""
        return 6.0 * self.num_layers * self.hidden_size

    def alltoall_elems_per_token(self, kv_replicated_heads: int = 0) -> int:
        """Elements one token contributes to one layer's Ulysses all-to-alls in one direction.

        q and out carry ``hidden_size`` each; k and v carry ``kv_hidden_size`` each (or
        ``kv_replicated_heads * head_dim`` when KV heads are replicated up to the group size).
        """
        kv = (kv_replicated_heads * self.head_dim) if kv_replicated_heads else self.kv_hidden_size
        return 2 * self.hidden_size + 2 * kv

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("name", "num_layers", "hidden_size", "num_heads") if k not in data]
        if missing:
            raise ValueError(f"model description is missing required key(s) {missing}")
        return cls(**data)


#: Shapes of the paper's models (FlexSP Table; GPT-2 vocabulary, learned absolute positions) and of
#: public Llama-family models (their published configs: RoPE, SwiGLU, untied output layer, GQA).
PRESETS: dict[str, ModelSpec] = {
    "gpt-7b": ModelSpec("gpt-7b", 32, 4096, 64, learned_positions=True),
    "gpt-13b": ModelSpec("gpt-13b", 40, 5120, 64, learned_positions=True),
    "gpt-30b": ModelSpec("gpt-30b", 60, 6656, 64, learned_positions=True),
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, num_kv_heads=8, ffn_hidden_size=14336,
                           vocab_size=128256, swiglu=True, untied_embeddings=True),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, ffn_hidden_size=13824, vocab_size=32000,
                            swiglu=True, untied_embeddings=True),
    "codellama-34b": ModelSpec("codellama-34b", 48, 8192, 64, num_kv_heads=8, ffn_hidden_size=22016,
                               vocab_size=32000, swiglu=True, untied_embeddings=True),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, num_kv_heads=8, ffn_hidden_size=28672,
                            vocab_size=128256, swiglu=True, untied_embeddings=True),
    "tiny": ModelSpec("tiny", 2, 64, 4, ffn_hidden_size=256, vocab_size=1024, dtype_bytes=4),
}


def get_model(name: str) -> ModelSpec:
    """Return the preset called ``name`` or raise ``ValueError`` listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {sorted(PRESETS)}") from None
