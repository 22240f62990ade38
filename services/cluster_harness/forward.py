"""The gateway at 127.0.0.1:<port> of the root namespace (`scripts/cluster up --port`):
a TCP forwarder to its address on the bridge. Loopback is private to each namespace, so
no address of the gateway's own namespace can be 127.0.0.1 here.

    python -m specmesh.services.cluster_harness.forward LISTEN_PORT TARGET_HOST TARGET_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():  # a half-close reaches the other end
            writer.write_eof()
    except OSError:
        writer.close()  # a reset on one side resets the other


async def _serve(listen_port: int, target_host: str, target_port: int) -> None:
    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()  # the gateway is down or cut off: the client sees it at once
            return
        with contextlib.closing(writer), contextlib.closing(target_writer):
            await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))

    server = await asyncio.start_server(connect, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main() -> None:
    listen_port, target_host, target_port = sys.argv[1:]
    try:
        asyncio.run(_serve(int(listen_port), target_host, int(target_port)))
    except OSError as exc:
        sys.exit(f"forwarder: cannot listen on 127.0.0.1:{listen_port}: {exc}")


if __name__ == "__main__":
    main()
