"""A second call for a session whose round is still running in the verifier's batch (a retry)
is checked once that round is answered, within the same batch, not after the batch's other
rounds are all done: under steady load a batch may not end."""

import asyncio
import threading

from specd.service import MlxThread
from specd.v1 import verifier_pb2
from tests.sessions import RpcContext
from verifier_svc.config import VerifierConfig
from verifier_svc.servicer import VerifierServicer


def test_a_retried_round_is_answered_when_its_first_is_not_after_the_whole_batch(
    tiny_model_dir,
):
    async def main():
        mlx = MlxThread(inline_rounds=False)
        verifier = VerifierServicer(
            VerifierConfig(model=str(tiny_model_dir), warmup="minimal"), mlx
        )
        await verifier.load()
        context = RpcContext()
        short, long = [
            await verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), context)
            for p in ([8, 9, 10, 11], [5, 6, 7])
        ]
        done: list[str] = []

        async def burst(session, steps, name):
            ask = verifier_pb2.VerifyRequest(
                session_id=session.session_id, position=session.position, plain_steps=steps
            )
            try:
                await verifier.Verify(ask, context)
                done.append(name)
            except AssertionError as exc:  # the status the call was answered with
                done.append(f"{name}: {str(exc).split(':')[0]}")

        gate = threading.Event()
        mlx.submit(gate.wait)
        submitted = mlx._submitted
        asks = (burst(short, 2, "short"), burst(long, 16, "long"), burst(short, 2, "retry"))
        tasks = [asyncio.ensure_future(ask) for ask in asks]
        while mlx._submitted < submitted + 3:  # all three queued behind the gate
            await asyncio.sleep(0.001)
        gate.set()
        await asyncio.gather(*tasks)
        mlx.shutdown()
        return done

    done = asyncio.run(main())
    # the retry's position is the one the first call moved past: refused, and before the
    # burst of 16 beside them ended
    assert done == ["short", "retry: StatusCode.FAILED_PRECONDITION", "long"]
