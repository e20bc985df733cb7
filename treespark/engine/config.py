"""``EngineConfig``: the engine's sizes, memory and switches, checked when made
(``treespark.engine.core.Engine`` runs on one)."""

from __future__ import annotations

from dataclasses import dataclass

from treespark.kernels.attention import AttentionPath


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8         # running requests verified together
    max_context: int = 1024         # prompt + generated tokens per request
    max_tree_nodes: int = 64        # hard cap on draft nodes per tree, whatever the budget
    prefill_chunk: int = 256        # most prompt tokens of one request per step
    # tokens per step: the running rows' trees (their node caps), then prefill chunks of
    # several requests up to this (always at least a chunk less a token a running row)
    max_num_batched_tokens: int = 512
    # KV memory: a pool of blocks of block_size tokens (target + drafter), as many as the
    # budget holds; requests are admitted, and grow, by free blocks
    block_size: int = 16
    kv_blocks: int = 0              # > 0: this many blocks, whatever the budget
    kv_budget_bytes: int = 0        # 0: no budget in bytes
    kv_memory_fraction: float = 0.0 # 0: none; else this fraction of device memory less what is in use
    # (no kv_blocks: max_batch_size requests at max_context each, or fewer if the budget says so)
    prefix_caching: bool = True     # reuse the cached blocks of a prompt's longest known prefix
    attention: AttentionPath = AttentionPath.GROUPED  # the target's attention path (kernels/attention.py)
    # the target forward's norms, rotation and activation, and a depth of the T > 0 walk,
    # compiled by torch.compile with this backend ("inductor"; kernels/compile.py): fewer
    # launches on a GPU (docs/results/engine/ops.md for CPU); the first steps of each shape
    # compile. None: eager
    compile_backend: str | None = None
    # the verify forward replayed from CUDA graphs, its rows, tokens a row and block-table
    # columns each padded to a power of two or the largest (engine/graphs.py); prefill and
    # shapes above the largest bucket run eagerly. Off CUDA nothing is captured: the same
    # padded forward runs eagerly (what the CPU tests check), slower than False, with one
    # warning
    cuda_graphs: bool = False
    # also the drafter's block pass, its rows and context block-table columns padded the
    # same way (engine/draft_graphs.py), in the same memory pool; needs cuda_graphs. Its own
    # switch until a GPU has captured it (treespark device-check's graphs forwards run it)
    cuda_graphs_draft: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_context", "prefill_chunk", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0")
        if self.kv_blocks < 0 or self.kv_budget_bytes < 0 or not 0.0 <= self.kv_memory_fraction <= 1.0:
            raise ValueError("EngineConfig.kv_blocks and kv_budget_bytes must be >= 0 and kv_memory_fraction in [0, 1]")
        if self.max_tree_nodes < 0:
            raise ValueError("EngineConfig.max_tree_nodes must be >= 0")
        if self.cuda_graphs and self.attention is not AttentionPath.GROUPED:
            raise ValueError("EngineConfig.cuda_graphs replays the grouped attention path: set attention=GROUPED")
        if self.cuda_graphs_draft and not self.cuda_graphs:
            raise ValueError("EngineConfig.cuda_graphs_draft needs cuda_graphs")
