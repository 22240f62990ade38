"""Moves K/V blocks of a paged cache through the KV transport (prefill -> decode).

A block is stored under the chained hash of its tokens (the same hash the
prefix cache uses; a partial last block hashes the tokens it has), behind a
fingerprint of the model, so equal keys always mean equal K/V: any service can
reuse a stored prefix, and writers of the same key never conflict.
"""

from __future__ import annotations

import hashlib

import torch

from shared.kvcache.block_manager import block_hash
from shared.kvcache.kv_cache import KVCache
from shared.model.llama import LlamaForCausalLM
from shared.telemetry import TRANSPORT_BYTES
from shared.transport import KVTransport


def model_fingerprint(model: LlamaForCausalLM, block_size: int) -> str:
    """Differs between models, dtypes and block sizes (K/V of one is no use to another).
    The first embedding rows stand in for the weights: fine-tunes of one config differ."""
    weight = model.embed_tokens.weight[:64].detach().float().cpu().contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((model.config, weight.dtype, model.embed_tokens.weight.dtype)).encode())
    h.update(str(block_size).encode())
    h.update(weight.numpy().tobytes())
    return h.hexdigest()


class KVExchange:
    def __init__(
        self,
        kv_cache: KVCache,
        transport: KVTransport,
        fingerprint: str,
        ttl_s: float,
        service: str,
    ) -> None:
        """`service` labels the transport byte counters (specmesh_kv_transport_bytes)."""
        self.written = TRANSPORT_BYTES.labels(service, "write")
        self.read = TRANSPORT_BYTES.labels(service, "read")
        self.kv_cache = kv_cache
        self.transport = transport
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s

    def keys(self, token_ids: list[int]) -> list[str]:
        """One key per block of `token_ids`, the last one covering a partial block."""
        bs, keys, prev = self.kv_cache.block_size, [], None
        for start in range(0, len(token_ids), bs):
            prev = block_hash(token_ids[start : start + bs], prev)
            keys.append(f"{self.fingerprint}-{prev:016x}-{min(bs, len(token_ids) - start)}")
        return keys

    def stored_blocks(self, keys: list[str]) -> int:
        """How many leading blocks of `keys` the transport holds."""
        return self.transport.count_present(keys)

    def export(self, block_table: list[int], keys: list[str]) -> None:
        """Store the blocks behind `keys` that the transport lacks; refresh the others."""
        stored = self.transport.count_present(keys)
        self.transport.touch(keys[:stored], self.ttl_s)
        items = {key: self._read(block_table[i], key) for i, key in enumerate(keys) if i >= stored}
        if items:
            self.transport.put_many(items, self.ttl_s)
            self.written.inc(sum(map(len, items.values())))

    def load(self, block_table: list[int], keys: list[str], first_block: int) -> None:
        """Fill blocks first_block.. of a sequence's table from the transport."""
        wanted = keys[first_block:]
        for i, (key, data) in enumerate(
            zip(wanted, self.transport.get_many(wanted), strict=True), first_block
        ):
            if data is None:
                raise KeyError(f"KV block {key} is no longer in the transport")
            self._write(block_table[i], key, data)
            self.read.inc(len(data))

    def _slots(self, block_id: int, key: str) -> slice:
        start = block_id * self.kv_cache.block_size
        return slice(start, start + int(key.rsplit("-", 1)[1]))

    def _read(self, block_id: int, key: str) -> bytes:
        block = self.kv_cache.storage[:, :, self._slots(block_id, key)]
        return block.contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def _write(self, block_id: int, key: str, data: bytes) -> None:
        storage = self.kv_cache.storage
        target = storage[:, :, self._slots(block_id, key)]
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        target.copy_(raw.view(storage.dtype).view(target.shape))
