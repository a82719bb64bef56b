"""What one gRPC round trip costs here, with no model work: a unary call against one message
on an open bidirectional stream, each back to back ("hot") and after 75 ms of idleness, as a
round's calls are (they follow a target forward of that length).

    python benchmarks/rpc_floor.py [--calls 150] [--payload 7000] [--idle-ms 75]

The server is a separate process on loopback, echoing `--payload` bytes (about the hidden rows
an EAGLE-3 round carries).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc

from specd.launch import free_port


def _same(data: bytes) -> bytes:
    return data


async def serve(address: str) -> None:
    async def unary(request, context):
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    handlers = grpc.method_handlers_generic_handler(
        "floor.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers,))
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


async def measure(address: str, calls: int, payload: bytes, idle_s: float) -> dict:
    channel = grpc.aio.insecure_channel(address)
    await channel.channel_ready()
    unary = channel.unary_unary("/floor.Echo/Unary", _same, _same)
    call = channel.stream_stream("/floor.Echo/Stream", _same, _same)()

    async def on_stream(data: bytes) -> bytes:
        await call.write(data)
        return await call.read()

    results = {}
    for name, send in (("unary", unary), ("stream", on_stream)):
        for _ in range(20):  # warm-up
            await send(payload)
        hot, after_idle = [], []
        for _ in range(calls):
            start = time.perf_counter()
            await send(payload)
            hot.append(time.perf_counter() - start)
            await asyncio.sleep(idle_s)
            start = time.perf_counter()
            await send(payload)
            after_idle.append(time.perf_counter() - start)
        results[name] = (statistics.median(hot), statistics.median(after_idle))
    call.cancel()
    await channel.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--payload", type=int, default=7000, help="bytes each way")
    parser.add_argument("--idle-ms", type=float, default=75.0)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", address])
    try:
        results = asyncio.run(
            measure(address, args.calls, b"x" * args.payload, args.idle_ms / 1000)
        )
    finally:
        server.kill()
        server.wait()
    print(f"| call | hot (ms) | after {args.idle_ms:g} ms idle (ms) |")
    print("| --- | ---: | ---: |")
    for name, (hot, after_idle) in results.items():
        print(f"| {name} | {1000 * hot:.2f} | {1000 * after_idle:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
