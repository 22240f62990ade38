"""KV block packing (`kernels.triton.kv_blocks`) against `KVExchange`, what prefill exports
and decode loads.

Prefill's `KVExchange.export` puts each block's blob in a transport (an in-process one
here); `pack_blocks` must produce those very bytes, every sequence's blocks in one buffer.
Decode's `KVExchange.load` writes the blobs into its own blocks, skipping a leading block its
prefix cache holds; `unpack_blocks` of the received bytes must leave its cache exactly the
same. Sequences end in partial blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from specmesh.kernels.check.caches import block_tables, dtype_name, make_cache
from specmesh.kernels.check.result import Result
from specmesh.kernels.triton.kv_blocks import blob_offsets, pack_blocks, unpack_blocks
from specmesh.shared.kvcache.exchange import KVExchange
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.transport import KVTransport


class MemoryTransport(KVTransport):
    """Blobs in a dict: where the reference exports to and loads from."""

    def __init__(self) -> None:
        super().__init__()
        self.blobs: dict[str, bytes] = {}

    def put_many(self, items: dict[str, bytes], ttl_s: float) -> None:
        self.blobs.update(items)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.blobs.get(key) for key in keys]

    def count_present(self, keys: list[str]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.blobs), len(keys))

    def touch(self, keys: list[str], ttl_s: float) -> None:
        pass

    def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.blobs.pop(key, None)

    def clear(self) -> None:
        self.blobs.clear()

    def close(self) -> None:
        pass


class Block(NamedTuple):
    seq: int
    index: int  # in the sequence's table
    tokens: int  # block_size, or fewer in a sequence's last block


def check(device: str, dtype: torch.dtype, small: bool) -> list[Result]:
    gen = torch.Generator().manual_seed(3)
    lengths = [14, 8, 3] if small else [1000, 517, 64, 16, 2000]
    prefill, decode, reference = (make_cache(device, dtype, small, gen) for _ in range(3))
    reference.storage.copy_(decode.storage)
    exporter = KVExchange(prefill, MemoryTransport(), "check", 60.0, "check")
    keys = [exporter.keys(torch.randint(64, (n,), generator=gen).tolist()) for n in lengths]
    page = prefill.block_size
    blocks = [
        Block(i, j, min(page, n - j * page))
        for i, n in enumerate(lengths)
        for j in range(len(keys[i]))
    ]
    tables = block_tables(lengths, prefill, gen)
    packed = _pack_matches_export(exporter, keys, tables, blocks)
    tables = block_tables(lengths, decode, gen)
    loaded = _unpack_matches_load(exporter.transport, keys, tables, blocks, decode, reference)
    block_shape = tuple(prefill.storage[:, :, :page].shape)
    shape = f"{len(blocks)} blocks {block_shape}, tokens {lengths}, {dtype_name(dtype)}"
    return [
        Result.exact("kv blocks pack (export)", shape, packed),
        Result.exact("kv blocks unpack (load)", shape, loaded),
    ]


def _pack_matches_export(
    exporter: KVExchange, keys: list[list[str]], tables: list[list[int]], blocks: list[Block]
) -> bool:
    """Prefill: every block of every sequence in one buffer, against export's blobs."""
    for table, k in zip(tables, keys, strict=True):
        exporter.export(table, k)
    storage, sizes = exporter.kv_cache.storage, [b.tokens for b in blocks]
    ids = [tables[b.seq][b.index] for b in blocks]
    buffer = pack_blocks(storage, ids, sizes, exporter.kv_cache.block_size)
    offsets = blob_offsets(storage, sizes)
    blobs = exporter.transport.blobs
    return all(
        _bytes(buffer[offsets[n] : offsets[n + 1]]) == blobs[keys[b.seq][b.index]]
        for n, b in enumerate(blocks)
    )


def _unpack_matches_load(
    transport: MemoryTransport,
    keys: list[list[str]],
    tables: list[list[int]],
    blocks: list[Block],
    decode: KVCache,
    reference: KVCache,
) -> bool:
    """Decode: the blobs into its own blocks, the first sequence's first block held already;
    `reference` (equal to `decode` before) loads through KVExchange."""
    loader = KVExchange(reference, transport, "check", 60.0, "check")
    for i, (table, k) in enumerate(zip(tables, keys, strict=True)):
        loader.load(table, k, first_block=1 if i == 0 else 0)
    wanted = [b for b in blocks if (b.seq, b.index) != (0, 0)]
    received = b"".join(transport.blobs[keys[b.seq][b.index]] for b in wanted)
    incoming = torch.frombuffer(bytearray(received), dtype=torch.uint8)
    unpack_blocks(
        incoming.view(decode.storage.dtype).to(decode.storage.device),
        decode.storage,
        [tables[b.seq][b.index] for b in wanted],
        [b.tokens for b in wanted],
        decode.block_size,
    )
    return torch.equal(decode.storage, reference.storage)


def _bytes(values: torch.Tensor) -> bytes:
    return values.view(torch.uint8).cpu().numpy().tobytes()
