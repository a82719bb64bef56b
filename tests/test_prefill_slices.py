"""A long prompt's prefill does not stall the sessions already open: the verifier runs it a
decoder layer per MLX job, and open sessions' rounds run between those jobs."""

import asyncio

from specd.service import MlxThread
from specd.v1 import verifier_pb2
from tests.sessions import RpcContext
from verifier_svc import servicer as servicer_module
from verifier_svc.config import VerifierConfig
from verifier_svc.servicer import VerifierServicer


def test_open_sessions_round_between_the_layers_of_a_long_prefill(tiny_model_dir, monkeypatch):
    jobs = []  # the MLX jobs in the order they ran

    def logging(fn, name):
        def logged(*args, **kwargs):
            jobs.append(name)
            return fn(*args, **kwargs)

        return logged

    for name in ("rounds_stream", "decode", "verify"):  # however a round runs
        monkeypatch.setattr(servicer_module, name, logging(getattr(servicer_module, name), "round"))
    monkeypatch.setattr(servicer_module, "advance", logging(servicer_module.advance, "layer"))

    async def main():
        mlx = MlxThread()
        verifier = VerifierServicer(
            VerifierConfig(model=str(tiny_model_dir), warmup="minimal"), mlx
        )
        await verifier.load()
        context = RpcContext()
        opened = await verifier.OpenSession(
            verifier_pb2.OpenSessionRequest(prompt_ids=[5, 6, 7]), context
        )
        jobs.clear()
        long_prompt = [
            (7 * i + 3) % 90 + 3 for i in range(VerifierConfig().prefill_slice_tokens + 40)
        ]
        done = []

        async def open_long():
            await verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=long_prompt),
                                       context)  # fmt: skip
            done.append("prefill")

        async def decode_open_one():
            await verifier.Verify(
                verifier_pb2.VerifyRequest(session_id=opened.session_id,
                                           position=opened.position, plain_steps=3),
                context,
            )  # fmt: skip
            done.append("decode")

        await asyncio.gather(open_long(), decode_open_one())
        mlx.shutdown()
        return done

    done = asyncio.run(main())
    assert jobs.count("layer") >= 3  # a job per decoder layer, and the last token's
    assert done == ["decode", "prefill"]  # the open session did not wait for the whole prompt
    assert jobs[0] == "layer" and jobs[-1] == "layer" and "round" in jobs[1:-1]
