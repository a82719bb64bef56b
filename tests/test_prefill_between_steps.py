"""--prefill-between-steps: a prompt that opens while other sessions' rounds run as one batch
is prefilled between two of their steps, and the batch goes on, instead of waiting for the
running rounds to finish while new ones wait behind it; every token the same."""

import asyncio
import threading

import pytest

from specd.service import MlxThread
from specd.v1 import verifier_pb2
from tests.sessions import RpcContext
from verifier_svc.config import PREFILL_IN_STEPS_AUTO, VerifierConfig
from verifier_svc.servicer import VerifierServicer

FORWARDS = {
    "cpu-kernels": {},
    "mlx-pooled-compiled": dict(gemv_rows=0, row_forwards="on", kv_pool="on", compiled_pooled="on"),
}


def _run(model: str, between: int, forwards: dict) -> tuple[list[str], list]:
    """The order in which two 16-step bursts and a new prompt's prefill finished, and what
    each gave, the three queued together behind a held MLX thread."""

    async def main():
        mlx = MlxThread(inline_rounds=False)
        config = VerifierConfig(model=model, warmup="minimal", prefill_between_steps=between,
                                **forwards)  # fmt: skip
        verifier = VerifierServicer(config, mlx)
        await verifier.load()
        context = RpcContext()
        opened = [
            await verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), context)
            for p in ([5, 6, 7], [8, 9, 10, 11])
        ]
        done: list[str] = []

        async def burst(session, name):
            answer = await verifier.Verify(
                verifier_pb2.VerifyRequest(session_id=session.session_id,
                                           position=session.position, plain_steps=16),
                context,
            )  # fmt: skip
            done.append(name)
            return list(answer.committed_ids)

        async def open_one():
            new = verifier_pb2.OpenSessionRequest(prompt_ids=[12, 13, 14, 15, 16])
            answer = await verifier.OpenSession(new, context)
            done.append("prefill")
            return answer.first_token

        gate = threading.Event()
        mlx.submit(gate.wait)
        submitted = mlx._submitted
        asks = (burst(opened[0], "a"), burst(opened[1], "b"), open_one())
        tasks = [asyncio.ensure_future(ask) for ask in asks]
        while mlx._submitted < submitted + 3:  # all three queued behind the gate
            await asyncio.sleep(0.001)
        gate.set()
        results = await asyncio.gather(*tasks)
        mlx.shutdown()
        return done, results

    return asyncio.run(main())


@pytest.mark.parametrize("forwards", list(FORWARDS))
def test_a_prompt_opened_beside_a_batch_is_prefilled_between_its_steps(tiny_model_dir, forwards):
    drained, drained_results = _run(str(tiny_model_dir), 0, FORWARDS[forwards])
    between, between_results = _run(str(tiny_model_dir), 2, FORWARDS[forwards])
    assert drained[-1] == "prefill"  # the default: after the running bursts
    # between their steps: before the burst of 16 finished, which went on after it
    assert between.index("prefill") < between.index("a")
    assert between_results == drained_results
    assert len(between_results[0]) == 16


@pytest.mark.parametrize(
    ("option", "flag"),
    [
        ("prefill_between_steps", "--prefill-between-steps"),
        ("prefill_in_steps", "--prefill-in-steps"),
    ],
)
def test_it_is_refused_beside_a_kv_memory_limit(tiny_model_dir, option, flag):
    config = VerifierConfig(model=str(tiny_model_dir), max_kv_bytes=2**30, **{option: 4})
    with pytest.raises(ValueError, match=f"{flag} with --max-kv-memory"):
        VerifierServicer(config, MlxThread())


def test_prompts_open_in_the_steps_by_default_only_where_the_pool_kernel_attends_them(
    tiny_model_dir,
):
    default = VerifierConfig(model=str(tiny_model_dir))
    assert default.prompts_in_steps(pool_attends_in_place=True) == PREFILL_IN_STEPS_AUTO
    assert default.prompts_in_steps(pool_attends_in_place=False) == 0
    limited = VerifierConfig(model=str(tiny_model_dir), max_kv_bytes=2**30)
    assert limited.prompts_in_steps(pool_attends_in_place=True) == 0
    VerifierServicer(limited, MlxThread())  # the default is no conflict with the limit
    for asked in (0, 64):
        config = VerifierConfig(model=str(tiny_model_dir), prefill_in_steps=asked)
        assert config.prompts_in_steps(pool_attends_in_place=True) == asked
        assert config.prompts_in_steps(pool_attends_in_place=False) == asked
