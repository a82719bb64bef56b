"""The DFlash proposer behind the drafter service: the drafter plus only the embedding and
lm_head tensors of its target (tied heads included)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from drafter_svc.checkpoints import (
    CheckpointError,
    check_target,
    shipped_or_given,
    target_embedding,
    target_matrix,
)
from drafter_svc.dflash.draft import BlockDrafter, DFlashState
from drafter_svc.dflash.model import (
    DRAFT_VOCAB,
    load_draft_vocab,
    load_drafter,
    read_drafter_config,
)
from drafter_svc.proposal import Proposal, TreeShape, joined_rows

# drafters this package ships, each found by the target its config.json says it was made for
SHIPPED_DIR = Path(__file__).resolve().parent / "drafters"
# candidates a tree takes at each position: a block scores them all in its one forward, and 8
# kept more of the target's tokens than 3, 4 or 6 in trees of 15 (docs/results.md)
DEFAULT_TREE_TOP_K = 8


def drafter_config(directory: Path):
    """(config, target layers it reads), from config.json alone."""
    cfg = read_drafter_config(directory)
    return cfg, cfg.target_layer_ids


@dataclass
class DFlashOptions:
    weights: Path | None = None  # drafter directory; None: the one shipped for the target
    block_size: int = 0  # 0: the config's
    max_block_size: int = 64
    # read out the N most frequent tokens of the checkpoint's draft vocabulary; None: all of
    # them if it has one, else the whole vocabulary; 0: the whole vocabulary
    draft_vocab: int | None = None
    tree: TreeShape | None = None  # default shape (depth 0: the block's); None or total 0: chains
    tree_min_prob: float = 0.0  # a tree sends no later node of a lower path probability


def target_lm_head(target_dir: Path) -> mx.array:
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        return target_embedding(target_dir)
    return target_matrix(target_dir, ("lm_head", "language_model.lm_head"))


class DFlashProposer:
    kind = "dflash"
    text_driven = False
    capture_layers: tuple[int, ...] = ()
    accepts_speculative_ids = False
    sends_draft_probs = True  # when sampling: drafts drawn from q, q sent

    def __init__(self, drafter: BlockDrafter, options: DFlashOptions, source: str):
        self.drafter = drafter
        cfg = drafter.cfg
        self.capture_layers = tuple(cfg.target_layer_ids)
        self.block_size = options.block_size or cfg.block_size
        self.default_draft_tokens = self.block_size - 1
        self.max_draft_tokens = max(options.max_block_size, self.block_size) - 1
        # chains unless asked; a tree fills a block's rows with each position's likelier tokens
        shape = options.tree or TreeShape(total_tokens=0, depth=0, top_k=DEFAULT_TREE_TOP_K)
        self.default_tree = TreeShape(
            shape.total_tokens, shape.depth or self.default_draft_tokens, shape.top_k
        )
        self.source = source
        self.tree_min_prob = options.tree_min_prob
        self.rng = np.random.default_rng()

    def open(self, context_ids, hidden_rows=None) -> DFlashState:
        return self.drafter.open(list(context_ids), joined_rows(hidden_rows))

    def extend(self, state, new_ids, hidden_rows=None) -> None:
        self.drafter.extend(state, list(new_ids), joined_rows(hidden_rows))

    def propose(self, state, k: int, sampling=None, speculative=(), tree=None) -> Proposal:
        """A block of k drafts, or a tree when `tree` (or the default shape) asks for one, at
        most k deep. A tree's drafts are each position's best tokens whatever the sampling (the
        verifier's tree rule keeps sampling exact for drafts chosen so)."""
        shape = self.default_tree if tree is None else tree
        if shape.total_tokens > 0:
            depth = min(shape.depth or self.default_draft_tokens, k, self.max_draft_tokens)
            top_k = shape.top_k or self.default_tree.top_k
            if top_k > 1:
                shape = TreeShape(shape.total_tokens, depth, top_k)
                return self.drafter.tree(
                    state, shape, self.default_draft_tokens, self.tree_min_prob
                )
            k = min(depth, shape.total_tokens)  # one token a position: the block's chain
        temperature = float(getattr(sampling, "temperature", 0.0) or 0.0)
        return self.drafter.propose(state, k, temperature, self.rng)

    def params(self) -> dict[str, str]:
        cfg = self.drafter.cfg
        readout = self.drafter.readout_ids
        return {
            "weights": self.source,
            "block_size": str(self.block_size),
            "trained_block_size": str(cfg.block_size),
            "layers": str(cfg.num_hidden_layers),
            "target_layer_ids": ",".join(map(str, cfg.target_layer_ids)),
            "mask_token_id": str(cfg.mask_token_id),
            "draft_vocab": "all" if readout is None else str(len(readout)),
            "tree": self.default_tree.describe(),
            "tree_min_prob": str(self.tree_min_prob),
        }


def load_dflash(options: DFlashOptions, target_dir: Path, target_identity) -> DFlashProposer:
    weights = shipped_or_given(options.weights, SHIPPED_DIR, drafter_config, target_identity,
                               "DFlash drafter", "dflash")  # fmt: skip
    model = load_drafter(weights)
    cfg = model.config
    check_target("drafter", weights, cfg, cfg.target_layer_ids, target_identity)
    _, vocab_size, hidden_size, _ = target_identity
    if cfg.hidden_size != hidden_size:
        raise CheckpointError(
            f"the drafter is {cfg.hidden_size} wide; it must be as wide as the target "
            f"({hidden_size}) to use its embedding and lm_head"
        )
    if not 0 <= cfg.mask_token_id < vocab_size:
        raise CheckpointError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary")
    block = options.block_size or cfg.block_size
    if block < 2:
        raise CheckpointError("block size must be at least 2 (the last token and one draft)")
    readout = _readout_ids(weights, options.draft_vocab, vocab_size)
    drafter = BlockDrafter(model, target_embedding(target_dir), target_lm_head(target_dir), readout)
    return DFlashProposer(drafter, options, str(weights))


def _readout_ids(weights: Path, draft_vocab: int | None, vocab_size: int):
    if draft_vocab == 0:
        return None
    ids = load_draft_vocab(weights, vocab_size)
    if draft_vocab is None:
        return ids
    if ids is None:
        raise CheckpointError(
            f"--draft-vocab {draft_vocab}: {weights} has no {DRAFT_VOCAB} to take the most "
            "frequent tokens from (specd train dflash writes one); 0 reads out every token"
        )
    if draft_vocab > len(ids):
        raise CheckpointError(
            f"--draft-vocab {draft_vocab}: {weights}/{DRAFT_VOCAB} lists {len(ids)} tokens"
        )
    return ids[:draft_vocab]
