#!/usr/bin/env python3
"""A TCP proxy on loopback that holds every chunk DELAY seconds each way: a store
across a network, for scripts/bench-s3.sh. Usage: delay-proxy.py LISTEN_PORT TARGET_PORT DELAY_S"""
import asyncio
import sys

LISTEN, TARGET, DELAY = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            await asyncio.sleep(DELAY)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def handle(client_r, client_w):
    server_r, server_w = await asyncio.open_connection("127.0.0.1", TARGET)
    await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", LISTEN)
    async with server:
        await server.serve_forever()


asyncio.run(main())
