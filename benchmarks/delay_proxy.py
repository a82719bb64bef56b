"""A TCP proxy that delays every byte by a fixed time in each direction: a stand-in for a link
between hosts where `tc netem` is not available.

    python benchmarks/delay_proxy.py --listen 127.0.0.1:6000 --to 127.0.0.1:50052 --delay-ms 5
"""

from __future__ import annotations

import argparse
import asyncio


async def _pipe(reader, writer, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def receive():
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay_s, data))
        queue.put_nowait((0.0, b""))

    async def send():
        while True:
            due, data = await queue.get()
            if not data:
                break
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    await asyncio.gather(receive(), send(), return_exceptions=True)


async def serve(listen: str, target: str, delay_s: float) -> None:
    to_host, to_port = target.rsplit(":", 1)

    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pipe(client_reader, up_writer, delay_s), _pipe(up_reader, client_writer, delay_s)
        )

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="one way")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.to, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
