"""``DSparkConfig``: the DSpark drafter's shape and options, read from and written to
``config.json`` (ours, or a public DSpark one); the model is ``treespark.models.drafter``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class DSparkConfig:
    vocab_size: int                      # the target's vocabulary
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int                      # draft tokens per backbone pass (tree depth cap)
    target_layer_ids: tuple[int, ...]    # target layers whose outputs form the context
    mask_token_id: int
    markov_rank: int
    target_hidden_size: int = 0          # 0: same as hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None     # transformers' rope parameters beyond theta (rope_type, factor, ...)
    max_position_embeddings: int = 40_960
    hidden_act: str = "silu"
    draft_vocab_size: int = 0            # 0: the full vocabulary
    shared_embeddings: bool = False      # embed_tokens comes from the target (and lm_head, unless
    shared_lm_head: bool | None = None   # ... this says otherwise; None: as shared_embeddings)
    confidence_head: bool = False        # the public checkpoint may carry one (unused here)
    confidence_head_with_markov: bool = False  # its input: hidden state, plus the Markov embedding if set

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "markov_rank"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DSparkConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("DSparkConfig.target_layer_ids must name at least one layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def head_shared(self) -> bool:
        """Whether the LM head comes from the target."""
        return self.shared_embeddings if self.shared_lm_head is None else self.shared_lm_head

    @property
    def context_size(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["architectures"] = ["DSparkDraft"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DSparkConfig:
        """Read our config.json or a public DSpark one (unknown keys are ignored; the
        DSpark-specific keys may also sit in a nested ``dspark_config`` dict)."""
        flat = {**d, **d.get("dspark_config", {})}
        rope = flat.get("rope_parameters")
        if isinstance(rope, dict):  # transformers >= 5: theta and scaling in one dict
            flat.setdefault("rope_theta", rope.get("rope_theta", 1_000_000.0))
            if rope.get("rope_type", "default") != "default" and not flat.get("rope_scaling"):
                flat["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if not flat.get("head_dim"):
            flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in flat.items() if k in known and v is not None}
        kwargs["target_layer_ids"] = tuple(int(i) for i in kwargs["target_layer_ids"])
        if "markov_rank" not in kwargs:
            raise ValueError("config has no markov_rank: not a DSpark drafter config")
        return cls(**kwargs)
