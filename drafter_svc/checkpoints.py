"""What the model drafters share: finding their weights, checking them against the target, and
training checkpoints that resume."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten


class CheckpointError(ValueError):
    """A draft model directory that cannot be used as it is, with the reason."""


def shipped_or_given(weights: Path | None, shipped_dir: Path, read_config, target_identity,
                     what: str, kind: str) -> Path:  # fmt: skip
    """--weights, or the shipped model made for a target like this one: chosen by what the
    target is (tokenizer fingerprint, vocabulary, width, layers), never by its name or path, so
    a copy of the model under any name finds it. read_config(dir) -> (config, layers needed)
    reads config.json alone."""
    if weights is not None:
        return weights
    refused = []
    for config in sorted(shipped_dir.glob("*/config.json")):
        cfg, layers = read_config(config.parent)
        if cfg.target_fingerprint:
            wrong = _mismatch(cfg, layers, target_identity)
        else:  # shapes alone do not say which tokenizer it was made for
            wrong = "it records no tokenizer fingerprint"
        if wrong is None:
            return config.parent
        refused.append(f"{config.parent.name} ({cfg.target_name or '?'}: "
                       f"{_made_for(cfg, layers)}; {wrong})")  # fmt: skip
    raise CheckpointError(
        f"no {what} ships for this target ({_target(target_identity)}); shipped {what}s are "
        f"for: {', '.join(refused) or 'none'}; pass --weights DIR "
        f"(train one with `specd train {kind} --target ...`)"
    )


def _made_for(cfg, layers) -> str:
    return (
        f"tokenizer fingerprint {cfg.target_fingerprint or '?'}, vocab {cfg.vocab_size}, "
        f"hidden size {cfg.feature_size}, reading layers {','.join(map(str, layers))}"
    )


def _target(target_identity) -> str:
    fingerprint, vocab_size, hidden_size, num_layers = target_identity
    return (
        f"tokenizer fingerprint {fingerprint}, vocab {vocab_size}, hidden size {hidden_size}, "
        f"{num_layers} layers"
    )


def _mismatch(cfg, layers, target_identity) -> str | None:
    """How a draft model's config differs from the target, None when it fits. An unrecorded
    fingerprint (a model from elsewhere) is not held against it."""
    fingerprint, vocab_size, hidden_size, num_layers = target_identity
    if cfg.target_fingerprint and cfg.target_fingerprint != fingerprint:
        return "the tokenizer fingerprints differ"
    if cfg.vocab_size != vocab_size:
        return "the vocab sizes differ"
    if cfg.feature_size != hidden_size:
        return "the hidden sizes differ"
    if max(layers) >= num_layers:
        return f"it needs target layer {max(layers)}"
    return None


def check_target(what: str, weights: Path, cfg, layers, target_identity) -> None:
    """Refuse a draft model made for another target, with how they differ."""
    wrong = _mismatch(cfg, layers, target_identity)
    if wrong is not None:
        raise CheckpointError(
            f"the {what} in {weights} was trained for target {cfg.target_name or '?'} "
            f"({_made_for(cfg, layers)}), not this one ({_target(target_identity)}): {wrong}"
        )


# options that may change between sittings of one run; any other change makes another run
RESUMABLE_CHANGES = frozenset(
    "out epochs lr warmup grad_clip save_every resume cache_dir fmt time_limit".split()
)


def run_identity(options) -> dict[str, str]:
    """What makes a training run itself: its options, less those a resume may change."""
    return {
        name: str(getattr(options, name))
        for name in options.__dataclass_fields__
        if name not in RESUMABLE_CHANGES
    }


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """write(staging) then a rename onto path: a run killed mid-write leaves the file it had,
    never a truncated one. The staging name keeps path's suffix (MLX's savers add theirs)."""
    staging = path.with_name(f".{path.name}")
    write(staging)
    staging.replace(path)


def save_training_state(directory: Path, model, optimizer, step: int, run: dict) -> None:
    """Each file written whole, state.json last: a kill part way leaves a checkpoint that
    resumes (at worst the step before with the newer weights), never one that fails to load."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    write_whole(directory / "model.safetensors", lambda f: mx.save_safetensors(str(f), weights))
    state = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    write_whole(directory / "optimizer.safetensors", lambda f: mx.save_safetensors(str(f), state))
    saved = json.dumps({"step": step, "run": run})
    write_whole(directory / "state.json", lambda f: f.write_text(saved))


def load_training_state(directory: Path, model, optimizer, run: dict) -> int | None:
    """The step to go on from, or None when there is no checkpoint. A checkpoint of another
    run (other data, settings or starting model) is refused rather than silently continued."""
    if not (directory / "state.json").is_file():
        return None
    saved = json.loads((directory / "state.json").read_text())
    before = saved.get("run")  # absent in checkpoints written before runs were recorded
    if before is not None:
        # an option added since is absent from an older checkpoint's run: unset ("None") then
        changed = ", ".join(
            f"{k} {before.get(k, 'None')} -> {run.get(k, 'None')}"
            for k in sorted(set(before) | set(run))
            if before.get(k, "None") != run.get(k, "None")
        )
        if changed:
            raise ValueError(
                f"{directory} belongs to another training run ({changed}); pass --no-resume "
                "to start over, or choose another --out"
            )
    model.load_weights(list(mx.load(str(directory / "model.safetensors")).items()))
    optimizer.state = tree_unflatten(
        list(mx.load(str(directory / "optimizer.safetensors")).items())
    )
    return saved["step"]


def make_optimizer(lr: float, warmup: int, total_steps: int) -> optim.Optimizer:
    """AdamW: linear warm-up from 1 % of lr, then cosine decay to 5 % at the last step."""
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(lr * 0.01, lr, warmup),
            optim.cosine_decay(lr, max(1, total_steps - warmup), lr * 0.05),
        ],
        [warmup],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=0.0)


# ---------------------------------------------------------------- weights both drafters read


SHIPPED_FILE_BYTES = 16 * 2**20  # the most one shipped weight file may hold


ROW_BLOCK = re.compile(r"^(?P<name>.+)\.rows(?P<index>\d+)of(?P<count>\d+)$")


def save_weights(directory: Path, weights: dict[str, mx.array],
                 limit: int = SHIPPED_FILE_BYTES) -> list[Path]:  # fmt: skip
    """A drafter's tensors as `model.safetensors`, or, past `limit` bytes, as
    `model-0000i-of-0000n.safetensors` files of at most `limit` each (in name order, as
    Hugging Face shards them); `read_weights` reads either. A tensor past `limit` on its own
    (a wide read-out) is stored as blocks of its rows, `NAME.rowsIofN`, which `read_weights`
    joins. Files of an earlier save go."""
    blocks: dict[str, mx.array] = {}
    for name, array in weights.items():
        blocks.update(_row_blocks(name, array, limit))
    sizes = {name: array.nbytes for name, array in blocks.items()}
    shards: list[dict[str, mx.array]] = [{}]
    held = 0
    for name in sorted(blocks):
        if shards[-1] and held + sizes[name] > limit:
            shards.append({})
            held = 0
        shards[-1][name] = blocks[name]
        held += sizes[name]
    for old in directory.glob("model*.safetensors"):
        old.unlink()
    if len(shards) == 1:
        paths = [directory / "model.safetensors"]
    else:
        paths = [directory / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(1, len(shards) + 1)]  # fmt: skip
    for path, shard in zip(paths, shards, strict=True):
        mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
    return paths


def _row_blocks(name: str, array: mx.array, limit: int) -> dict[str, mx.array]:
    """{name: array} when it fits `limit` bytes, else its rows in blocks that each fit."""
    if array.nbytes <= limit:
        return {name: array}
    row_bytes = array.nbytes // array.shape[0] if array.ndim > 1 else array.nbytes
    if row_bytes > limit:
        raise ValueError(f"tensor {name}: one row ({row_bytes} bytes) is past the {limit}-byte "
                         "limit of one weight file")  # fmt: skip
    per_block = limit // row_bytes
    count = -(-array.shape[0] // per_block)
    return {f"{name}.rows{i}of{count}": array[i * per_block : (i + 1) * per_block]
            for i in range(count)}  # fmt: skip


def _join_row_blocks(weights: dict[str, mx.array], directory: Path) -> dict[str, mx.array]:
    """`save_weights`' row blocks of a tensor back into the one tensor."""
    blocks: dict[str, dict[int, mx.array]] = {}
    counts: dict[str, int] = {}
    joined = {}
    for key, array in weights.items():
        match = ROW_BLOCK.match(key)
        if match is None:
            joined[key] = array
            continue
        name = match["name"]
        blocks.setdefault(name, {})[int(match["index"])] = array
        counts[name] = int(match["count"])
    for name, parts in blocks.items():
        if sorted(parts) != list(range(counts[name])):
            raise CheckpointError(
                f"{directory}: {name} is stored in {counts[name]} row blocks but only "
                f"{len(parts)} are there; copy every weight file"
            )
        joined[name] = mx.concatenate([parts[i] for i in range(counts[name])], axis=0)
    return joined


def read_weights(directory: Path) -> dict[str, mx.array]:
    """Every tensor of a drafter checkpoint directory's safetensors files."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(directory.glob("*.bin"))
        hint = " (PyTorch .bin files are not read: convert them to safetensors)" if bins else ""
        raise CheckpointError(f"no .safetensors weights in {directory}{hint}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return _join_row_blocks(weights, directory)


def strip_prefix(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    # some exports nest everything under "model."
    if weights and all(k.startswith("model.") or k in ("d2t", "t2d") for k in weights):
        return {k.removeprefix("model."): v for k, v in weights.items()}
    return weights


def _read_subset(directory: Path, names: tuple[str, ...]) -> dict[str, mx.array]:
    """Only the tensors asked for, from an mlx-lm/HF directory (lazy mx.load, one file each)."""
    found: dict[str, mx.array] = {}
    for f in sorted(directory.glob("*.safetensors")):
        arrays = mx.load(str(f))
        for name in names:
            for suffix in ("weight", "scales", "biases"):
                key = f"{name}.{suffix}"
                if key in arrays:
                    found[key] = arrays[key]
    return found


def target_matrix(target_dir: Path, names: tuple[str, ...]) -> mx.array:
    """A [V, H] matrix of the target (embedding or lm_head) in float32, dequantized, read
    without loading the rest of the model."""
    config = json.loads((target_dir / "config.json").read_text())
    quant = config.get("quantization") or config.get("quantization_config") or {}
    for name in names:
        found = _read_subset(target_dir, (name,))
        if f"{name}.weight" in found:
            break
    else:
        raise CheckpointError(f"{target_dir} has none of the tensors {', '.join(names)}")
    weight = found[f"{name}.weight"]
    if f"{name}.scales" in found:
        q = quant.get(name) or quant.get(name.removeprefix("model.")) or quant
        weight = mx.dequantize(weight, found[f"{name}.scales"], found.get(f"{name}.biases"),
                               q.get("group_size", 64), q.get("bits", 4))  # fmt: skip
    weight = weight.astype(mx.float32)
    mx.eval(weight)
    return weight


def target_embedding(target_dir: Path) -> mx.array:
    """The target's input embedding [V, H] in float32."""
    return target_matrix(
        target_dir,
        ("model.embed_tokens", "model.language_model.embed_tokens", "embed_tokens"),
    )
