"""Can this drafter serve this verifier's target?"""

from __future__ import annotations


def pairing_error(verifier_info, drafter_info) -> str:
    """Empty when compatible; otherwise a message saying what differs and what to do."""
    model, d = verifier_info.model, drafter_info
    if d.target_fingerprint and d.target_fingerprint != model.fingerprint:
        return (
            f"the {d.kind} drafter was made for a target with tokenizer fingerprint "
            f"{d.target_fingerprint[:16]}, but the verifier serves {model.name} "
            f"({model.fingerprint[:16]}); start a drafter made for this target"
        )
    if d.vocab_size and d.vocab_size != model.vocab_size:
        return (
            f"the {d.kind} drafter has a vocabulary of {d.vocab_size} tokens, the verifier's "
            f"target {model.name} has {model.vocab_size}"
        )
    bad = [i for i in d.capture_layers if not 0 <= i < model.num_layers]
    if bad:
        return (
            f"the {d.kind} drafter needs target layers {list(d.capture_layers)}, but "
            f"{model.name} has {model.num_layers} layers"
        )
    return ""
