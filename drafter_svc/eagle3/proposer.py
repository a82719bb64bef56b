"""The EAGLE-3 proposer behind the drafter service: a head, the target's embedding, drafting
defaults; the head is checked against the target it is paired with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from drafter_svc.checkpoints import check_target, shipped_or_given, target_embedding
from drafter_svc.eagle3.draft import Eagle3Drafter, Eagle3State
from drafter_svc.eagle3.model import load_head, read_head_config
from drafter_svc.proposal import Proposal, TreeShape, joined_rows

# heads this package ships, each found by the target its config.json says it was made for
SHIPPED_DIR = Path(__file__).resolve().parent / "heads"
# where the head's forwards of a few rows run: numpy and specd's compiled kernels on the CPU, or
# MLX on its device; auto: the host where the kernels are built
HEAD_FORWARDS = ("auto", "host", "mlx")


def head_config(directory: Path):
    """(config, target layers it reads), from config.json alone."""
    cfg = read_head_config(directory)
    return cfg, cfg.capture_layers


@dataclass
class Eagle3Options:
    weights: Path | None = None  # head directory; None: the head shipped for the target
    num_draft_tokens: int = 0  # chain length; 0: from the head's config or 6
    max_draft_tokens: int = 16
    tree: TreeShape | None = None  # default shape; None: from the head's config; total 0: chain
    forwards: str = "auto"  # HEAD_FORWARDS: where the head's forwards of a few rows run
    draft_p_min: float = 0.0  # a chain ends before a later draft the head gives less than this
    tree_min_prob: float = 0.0  # a tree sends no later node of a lower path probability
    extra: dict = field(default_factory=dict)


class Eagle3Proposer:
    kind = "eagle3"
    text_driven = False
    sends_draft_probs = False  # argmax drafting: q is one-hot
    accepts_speculative_ids = True  # drafted past with the head's own features

    def __init__(self, drafter: Eagle3Drafter, options: Eagle3Options, source: str):
        self.drafter = drafter
        cfg = drafter.cfg
        self.capture_layers = tuple(cfg.capture_layers)
        tree_cfg = cfg.tree or {}
        self.default_draft_tokens = options.num_draft_tokens or int(tree_cfg.get("chain", 6))
        self.max_draft_tokens = max(options.max_draft_tokens, self.default_draft_tokens)
        if options.tree is not None:
            self.default_tree = options.tree
        else:
            self.default_tree = TreeShape(
                total_tokens=int(tree_cfg.get("total_tokens", 0)),
                depth=int(tree_cfg.get("depth", 5)),
                top_k=int(tree_cfg.get("top_k", 4)),
            )
        self.source = source
        self.p_min = options.draft_p_min
        self.tree_min_prob = options.tree_min_prob

    def open(self, context_ids: list[int], hidden_rows=None) -> Eagle3State:
        return self.drafter.open(list(context_ids), joined_rows(hidden_rows))

    def extend(self, state: Eagle3State, new_ids: list[int], hidden_rows=None) -> None:
        self.drafter.extend(state, list(new_ids), joined_rows(hidden_rows))

    def propose(self, state, k: int, sampling=None, speculative=(), tree=None) -> Proposal:
        """A chain of k drafts, or a tree when `tree` (or the default shape) asks for one, at most
        k deep (k is what adaptive speculation tunes). Past speculative ids, always a chain: the
        block a round drafts ahead while its verify runs."""
        shape = self.default_tree if tree is None else tree
        if speculative:
            return self.drafter.chain(state, k, list(speculative), self.p_min)
        if shape.total_tokens > 0:
            depth = min(shape.depth, k) if shape.depth else k
            if shape.total_tokens == 1 or shape.top_k == 1:  # one child per node: a chain
                return self.drafter.chain(state, min(depth, shape.total_tokens), p_min=self.p_min)
            return self.drafter.tree(
                state,
                TreeShape(shape.total_tokens, min(depth, self.max_draft_tokens),
                          shape.top_k or self.default_tree.top_k or 4),
                self.tree_min_prob,
            )  # fmt: skip
        return self.drafter.chain(state, k, p_min=self.p_min)

    def params(self) -> dict[str, str]:
        return {
            "weights": self.source,
            "capture_layers": ",".join(map(str, self.capture_layers)),
            "draft_vocab": str(self.drafter.cfg.draft_vocab_size),
            "chain_forwards": "numpy" if self.drafter.cpu_head is not None else "mlx",
            "draft_p_min": str(self.p_min),
            "tree_min_prob": str(self.tree_min_prob),
            "tree": self.default_tree.describe(),
        }


def load_eagle3(options: Eagle3Options, target_dir: Path, target_identity) -> Eagle3Proposer:
    """Load the head and the target's embedding; refuse a head made for another target."""
    weights = shipped_or_given(options.weights, SHIPPED_DIR, head_config, target_identity,
                               "EAGLE-3 head", "eagle3")  # fmt: skip
    head, extras = load_head(weights)
    check_target("head", weights, head.config, head.config.capture_layers, target_identity)
    embedding = extras.get("embed_tokens")
    embedding = embedding.astype(mx.float32) if embedding is not None else target_embedding(
        target_dir)  # fmt: skip
    from drafter_svc.eagle3.cpu_head import CpuHead  # mlx-lm: not for drafters of other kinds

    cpu_head = None if options.forwards == "mlx" else CpuHead.attach(head, embedding)
    if cpu_head is None and options.forwards == "host":
        raise ValueError(
            "--head-forwards host: this head cannot run on the host here (specd's compiled "
            "kernels are not built, or the head's size or RoPE is one they do not take); "
            "use auto or mlx"
        )
    return Eagle3Proposer(Eagle3Drafter(head, embedding, cpu_head), options, str(weights))
