"""Moves K/V blocks of a paged cache through the KV transport (prefill -> decode).

A block is stored under the chained hash of its tokens (the same hash the
prefix cache uses; a partial last block hashes the tokens it has), behind a
fingerprint of the model, so equal keys always mean equal K/V: any service can
reuse a stored prefix, and writers of the same key never conflict. The fingerprint
also travels with the hand-off (PrefillReply), so decode refuses K/V made for another
model, dtype, KV dtype or block size rather than missing every block. Target features
for EAGLE drafters (the outputs of chosen layers at each position) travel the same
way, one blob per block under the block's key and a tag naming the layers, so a
drafter's head starts warm at the first decode step.
"""

from __future__ import annotations

import hashlib

import torch
from specmesh.shared.core.images import PromptImages
from specmesh.shared.kvcache.block_manager import block_hash, block_salt
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.telemetry import TRANSPORT_BYTES
from specmesh.shared.transport import KVTransport


def model_fingerprint(model: LlamaForCausalLM, kv_cache: KVCache) -> str:
    """Differs between models, dtypes, KV dtypes and block sizes (K/V of one is no use to
    another). The first embedding rows stand in for the weights: fine-tunes of one config
    differ."""
    weight = model.embed_tokens.weight[:64].detach().float().cpu().contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((model.config, weight.dtype, model.embed_tokens.weight.dtype)).encode())
    h.update(str(kv_cache.block_size).encode())
    if (
        kv_cache.dtype != model.embed_tokens.weight.dtype
    ):  # else the same bytes as before the option
        h.update(f"kv {kv_cache.dtype}".encode())
    h.update(weight.numpy().tobytes())
    return h.hexdigest()


def kv_description(model_name: str, model: LlamaForCausalLM, kv_cache: KVCache) -> str:
    """What model_fingerprint stands for, in words: an error refusing another service's
    K/V names both sides' (the hashes alone cannot say which setting differs)."""
    cfg = model.config
    dtype, kv_dtype = (
        str(t).removeprefix("torch.") for t in (model.embed_tokens.weight.dtype, kv_cache.dtype)
    )
    return (
        f"{model_name} ({cfg.architecture}, {cfg.num_layers} layers), {dtype}, "
        f"KV {kv_dtype}, block size {kv_cache.block_size}"
    )


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

    def keys(self, token_ids: list[int], images: PromptImages | None = None) -> list[str]:
        """One key per block of `token_ids`, the last one covering a partial block; chained
        as the prefix cache's block hashes are, `images` salting the blocks they begin in."""
        bs, keys, prev = self.kv_cache.block_size, [], None
        for start in range(0, len(token_ids), bs):
            salt = block_salt(images, start // bs, bs)
            prev = block_hash(token_ids[start : start + bs], prev, salt)
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

    def load(
        self,
        block_table: list[int],
        keys: list[str],
        first_block: int,
        source: str | None = None,
    ) -> None:
        """Fill blocks first_block.. of a sequence's table from the transport (the direct
        store at `source`, if any)."""
        wanted = keys[first_block:]
        blobs = self.transport.source(source).get_many(wanted)
        for i, (key, data) in enumerate(zip(wanted, blobs, strict=True), first_block):
            if data is None:
                raise KeyError(f"KV block {key} is no longer in the transport")
            self._write(block_table[i], key, data)
            self.read.inc(len(data))

    def export_features(
        self, keys: list[str], tag: str, features: torch.Tensor, first_block: int
    ) -> None:
        """Store the feature rows of blocks first_block.. (`features` starts at that block)."""
        bs, items = self.kv_cache.block_size, {}
        for i, key in enumerate(keys[first_block:]):
            rows = features[i * bs : i * bs + _block_tokens(key)]
            items[f"{key}-features-{tag}"] = rows.contiguous().view(torch.uint8).cpu().numpy()
        self.transport.put_many({k: v.tobytes() for k, v in items.items()}, self.ttl_s)
        self.written.inc(sum(v.nbytes for v in items.values()))

    def load_features(
        self, keys: list[str], tag: str, dtype: torch.dtype, source: str | None = None
    ) -> tuple[int, torch.Tensor] | None:
        """The stored feature rows (hidden states, in the model's `dtype`, which the KV dtype
        need not be) of the longest run of blocks ending at the last one: (its first
        position, rows), or None if the last block has none."""
        reader = self.transport.source(source)
        blobs = reader.get_many([f"{key}-features-{tag}" for key in keys])
        first = len(blobs)
        while first > 0 and blobs[first - 1] is not None:
            first -= 1
        if first == len(blobs):
            return None
        rows = [
            torch.frombuffer(bytearray(b), dtype=dtype).view(_block_tokens(key), -1)
            for key, b in zip(keys[first:], blobs[first:], strict=True)
        ]
        self.read.inc(sum(len(b) for b in blobs[first:]))
        return first * self.kv_cache.block_size, torch.cat(rows)

    def _slots(self, block_id: int, key: str) -> slice:
        start = block_id * self.kv_cache.block_size
        return slice(start, start + _block_tokens(key))

    def _block(self, block_id: int, key: str) -> list[torch.Tensor]:
        """What a blob holds of a block: its K/V, then (hybrid models) its state slot."""
        kv = self.kv_cache.storage[:, :, self._slots(block_id, key)]
        return [kv, *self.kv_cache.state_tensors(block_id)]

    def _read(self, block_id: int, key: str) -> bytes:
        parts = self._block(block_id, key)
        return b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in parts)

    def _write(self, block_id: int, key: str, data: bytes) -> None:
        """Copy a stored block into the cache; KeyError (compute it instead) when its size
        or values are not what this cache holds: a bad blob costs its request a recompute."""
        targets = self._block(block_id, key)
        sizes = [t.numel() * t.element_size() for t in targets]
        if len(data) != sum(sizes):
            raise KeyError(f"KV block {key} has {len(data)} bytes, not {sum(sizes)}")
        values, offset = [], 0
        for target, size in zip(targets, sizes, strict=True):
            raw = torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
            values.append(raw.view(target.dtype).view(target.shape))
            offset += size
        if not all(torch.isfinite(v.float()).all() for v in values):  # float(): fp8 has none
            raise KeyError(f"KV block {key} holds NaN or infinite values")
        for target, value in zip(targets, values, strict=True):
            target.copy_(value)


def _block_tokens(key: str) -> int:
    """Tokens in the block a key names (its last part; a partial last block has fewer)."""
    return int(key.rsplit("-", 1)[1])


def feature_tag(layers: tuple[int, ...], normed: bool) -> str:
    """Names which target features a blob holds (as Drafter.target_features)."""
    return "-".join(map(str, layers)) + ("n" if normed else "")
