from coordinator.pairing import pairing_error
from specd.v1 import common_pb2, drafter_pb2, verifier_pb2

VERIFIER = verifier_pb2.VerifierInfo(
    model=common_pb2.ModelIdentity(
        name="target", fingerprint="f" * 32, vocab_size=100, num_layers=30
    )
)


def test_any_target_drafter_pairs():
    assert pairing_error(VERIFIER, drafter_pb2.DrafterInfo(kind="ngram")) == ""


def test_drafter_for_another_target_is_refused_with_the_reason():
    other = drafter_pb2.DrafterInfo(kind="eagle3", target_fingerprint="a" * 32)
    assert "made for a target" in pairing_error(VERIFIER, other)
    vocab = drafter_pb2.DrafterInfo(kind="ngram", vocab_size=50)
    assert "50 tokens" in pairing_error(VERIFIER, vocab)
    layers = drafter_pb2.DrafterInfo(kind="eagle3", capture_layers=[2, 15, 40])
    assert "30 layers" in pairing_error(VERIFIER, layers)
