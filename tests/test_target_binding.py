"""Drafters bind to a target by what it is (tokenizer fingerprint, vocabulary, hidden size,
layers), never by its name or path: the shipped models are found for a copy of the embedded
model under any name, and refused, with the reason, for a target they were not made for."""

from __future__ import annotations

import json
import shutil

import pytest

from drafter_svc.checkpoints import CheckpointError, shipped_or_given
from drafter_svc.config import DrafterConfig
from drafter_svc.dflash.proposer import SHIPPED_DIR as DFLASH_SHIPPED
from drafter_svc.eagle3.proposer import SHIPPED_DIR as EAGLE3_SHIPPED
from drafter_svc.eagle3.proposer import head_config
from drafter_svc.server import describe_target, make_proposer
from specd.models.resolve import resolve_model

SHIPPED = {
    "eagle3": EAGLE3_SHIPPED / "smollm2-135m-instruct",
    "dflash": DFLASH_SHIPPED / "smollm2-135m-instruct",
}
WHAT = {"eagle3": "EAGLE-3 head", "dflash": "DFlash drafter"}
KINDS = list(SHIPPED)


@pytest.fixture(scope="module")
def renamed(tmp_path_factory):
    """The embedded model under a name no lookup by name could know."""
    return shutil.copytree(resolve_model(None), tmp_path_factory.mktemp("copy") / "any-name")


def _variant(renamed, tmp_path, name, edit):
    """The renamed model's configuration and tokenizer (weights are not read to refuse it),
    with one file edited."""
    path = shutil.copytree(renamed, tmp_path / name, ignore=shutil.ignore_patterns("*.safetensors"))
    edit(path)
    return path


def _swap_two_tokens(path):
    """Another tokenizer of the same size: two vocabulary entries trade ids."""
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (path / "tokenizer.json").write_text(json.dumps(tok))


def _wider(path):
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 720
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("given_as", ["copy under another name", "default"])
def test_shipped_model_is_found_by_what_the_target_is(kind, given_as, renamed):
    target = None if given_as == "default" else str(renamed)
    config = DrafterConfig(kind=kind, target=target)
    target_dir, identity = describe_target(config)
    assert target is None or target_dir == renamed.resolve()
    assert identity[1:] == (49152, 576, 30)
    assert make_proposer(config).params()["weights"] == str(SHIPPED[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_another_tokenizer_is_refused_naming_the_fingerprints(kind, renamed, tmp_path):
    target = _variant(renamed, tmp_path, "swapped", _swap_two_tokens)
    config = DrafterConfig(kind=kind, target=str(target))
    fingerprint, vocab, hidden, layers = describe_target(config)[1]
    shipped_fingerprint = describe_target(DrafterConfig(kind=kind))[1][0]
    assert fingerprint != shipped_fingerprint and (vocab, hidden, layers) == (49152, 576, 30)
    with pytest.raises(CheckpointError) as refused:
        make_proposer(config)
    message = str(refused.value)
    assert f"no {WHAT[kind]} ships for this target (tokenizer fingerprint {fingerprint}" in message
    assert f"smollm2-135m-instruct (SmolLM2-135M-Instruct-Q4_1: tokenizer fingerprint " \
        f"{shipped_fingerprint}" in message  # fmt: skip
    assert "the tokenizer fingerprints differ" in message
    assert f"specd train {kind} --target" in message


@pytest.mark.parametrize("kind", KINDS)
def test_another_hidden_size_is_refused_naming_it(kind, renamed, tmp_path):
    config = DrafterConfig(kind=kind, target=str(_variant(renamed, tmp_path, "wide", _wider)))
    with pytest.raises(CheckpointError, match=r"hidden size 720, 30 layers\); .*hidden size "
                       r"576.*the hidden sizes differ"):  # fmt: skip
        make_proposer(config)


@pytest.mark.parametrize("kind", KINDS)
def test_given_weights_for_another_target_are_refused_with_the_reason(kind, renamed, tmp_path):
    config = DrafterConfig(kind=kind, target=str(_variant(renamed, tmp_path, "wide", _wider)))
    getattr(config, kind).weights = SHIPPED[kind]
    with pytest.raises(CheckpointError, match=r"trained for target SmolLM2-135M-Instruct-Q4_1 "
                       r"\(.*hidden size 576.*\), not this one \(.*hidden size 720.*\): the hidden "
                       r"sizes differ"):  # fmt: skip
        make_proposer(config)


# ------------------------------------------------- the lookup on a folder of fake configs


def _fake_head(folder, fingerprint, hidden=64, vocab=100, capture=(0, 1)):
    folder.mkdir(parents=True)
    config = {
        "hidden_size": hidden, "intermediate_size": 128, "num_attention_heads": 4,
        "vocab_size": vocab,
        "specd": {"target_fingerprint": fingerprint, "target_name": "made-for-" + fingerprint,
                  "capture_layers": list(capture)},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def shipped(tmp_path):
    _fake_head(tmp_path / "a", "aaa")
    _fake_head(tmp_path / "b", "bbb")
    _fake_head(tmp_path / "c", "bbb", hidden=32)
    _fake_head(tmp_path / "d", "", hidden=48)  # shapes alone do not bind
    (tmp_path / "0-no-config").mkdir()  # first in order: would fail if read
    (tmp_path / "0-no-config" / "README").write_text("not a model")
    (tmp_path / "stray.txt").write_text("not a folder")
    return tmp_path


def lookup(shipped, identity, weights=None):
    return shipped_or_given(weights, shipped, head_config, identity, "EAGLE-3 head", "eagle3")


def test_lookup_picks_the_model_made_for_the_target(shipped):
    assert lookup(shipped, ("bbb", 100, 64, 2)) == shipped / "b"
    assert lookup(shipped, ("bbb", 100, 32, 2)) == shipped / "c"
    assert lookup(shipped, ("aaa", 100, 64, 30)) == shipped / "a"
    assert lookup(shipped, ("zzz", 1, 1, 1), weights=shipped / "x") == shipped / "x"


TOKENIZER, VOCAB, HIDDEN = (f"the {x} differ" for x in ("tokenizer fingerprints", "vocab sizes",
                                                       "hidden sizes"))  # fmt: skip


@pytest.mark.parametrize(
    ("identity", "reasons"),
    [
        (("zzz", 100, 64, 2), [TOKENIZER, TOKENIZER, TOKENIZER]),
        (("bbb", 100, 48, 2), [TOKENIZER, HIDDEN, HIDDEN]),
        (("bbb", 99, 64, 2), [TOKENIZER, VOCAB, VOCAB]),
        (("bbb", 100, 64, 1), [TOKENIZER, "it needs target layer 1", HIDDEN]),
    ],
)
def test_lookup_refuses_saying_what_each_model_was_made_for(shipped, identity, reasons):
    fingerprint, vocab, hidden, layers = identity
    with pytest.raises(CheckpointError) as refused:
        lookup(shipped, identity)
    message = str(refused.value)
    assert message.startswith(
        f"no EAGLE-3 head ships for this target (tokenizer fingerprint {fingerprint}, vocab "
        f"{vocab}, hidden size {hidden}, {layers} layers); shipped EAGLE-3 heads are for: "
    )
    made_for = [
        f"a (made-for-aaa: tokenizer fingerprint aaa, vocab 100, hidden size 64, reading layers "
        f"0,1; {reasons[0]})",
        f"b (made-for-bbb: tokenizer fingerprint bbb, vocab 100, hidden size 64, reading layers "
        f"0,1; {reasons[1]})",
        f"c (made-for-bbb: tokenizer fingerprint bbb, vocab 100, hidden size 32, reading layers "
        f"0,1; {reasons[2]})",
        "d (made-for-: tokenizer fingerprint ?, vocab 100, hidden size 48, reading layers 0,1; "
        "it records no tokenizer fingerprint)",
    ]
    assert ", ".join(made_for) in message
    assert "0-no-config" not in message and "stray" not in message
    assert message.endswith("pass --weights DIR (train one with `specd train eagle3 --target ...`)")


def test_lookup_in_an_empty_folder_says_none_ship(tmp_path):
    with pytest.raises(CheckpointError, match="shipped EAGLE-3 heads are for: none; pass"):
        lookup(tmp_path, ("aaa", 100, 64, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_each_shipped_weight_file_fits_16_mib(kind):
    files = list(SHIPPED[kind].glob("*.safetensors"))
    assert files and all(f.stat().st_size <= 16 * 2**20 for f in files)
