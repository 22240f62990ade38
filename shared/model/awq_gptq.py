"""AWQ and GPTQ int4 checkpoints (`--quantization awq|gptq`, SGLang's names; like SGLang,
found from config.json's quantization_config when unset): their packed groups read into
GGML Q4_1 blocks, which the CPU kernels multiply (kernels/cpu/quant.cpp).

Both store, for a projection W [N, K] (N outputs, K inputs) and each group of G inputs,
4-bit q, an fp16 scale s and a 4-bit zero z per output: w = s (q - z). A Q4_1 block (32
inputs) holds w = d q + m: with 32 dividing G, d = s and q are copied exactly and m = -s z
is rounded to fp16 (an error of at most 2^-11 |s z| <= s / 128, a 128th of a step).

Layouts (int32 words of 8 nibbles, nibble j at bits 4j..4j+3):
- GPTQ (AutoGPTQ/GPTQModel, checkpoint_format "gptq"): qweight [K/8, N], input 8i + j in
  nibble j of row i; qzeros [K/G, N/8], output 8c + j in nibble j of column c, stored as
  z - 1 ("gptq_v2" stores z); scales [K/G, N]; g_idx [K], each input's group: k // G
  unless act-order (desc_act) permuted them, which runs of 32 inputs cannot hold (refused).
- AWQ (AutoAWQ, version "gemm"): qweight [K, N/8] and qzeros [K/G, N/8], output
  8c + AWQ_ORDER[j] in nibble j of column c (its GEMM kernel's interleave); scales [K/G, N].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from specmesh.shared.model.quantize import Q, QuantBlocks

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # an int32's 8 nibbles, lowest first
AWQ_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # the output in each nibble of a word
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a projection's tensors (g_idx: GPTQ's)
NEEDED = {"qweight", "qzeros", "scales"}


@dataclass(frozen=True)
class Int4Layout:
    method: str  # "awq" or "gptq"
    group_size: int  # inputs per scale and zero; -1: a whole row
    zero_offset: int  # added to each stored zero: 1 for GPTQ's v1 format

    @classmethod
    def from_config(cls, method: str, quant: dict[str, Any]) -> Int4Layout:
        """The layout config.json's quantization_config describes; ValueError for what is
        not served: other than 4 bits, groups not a multiple of 32, act-order GPTQ, AWQ
        other than GEMM with zeros, GPTQ repacked for another kernel."""
        bits, group = quant.get("bits"), quant.get("group_size", -1)
        if bits != 4:
            raise ValueError(f"{method} with {bits}-bit weights: only 4-bit is served")
        if group != -1 and (not isinstance(group, int) or group <= 0 or group % 32):
            raise ValueError(
                f"{method} group_size {group} is not served: Q4_1 blocks of 32 inputs share "
                f"one scale, so groups must be multiples of 32 (or -1, a whole row)"
            )
        if method == "awq":
            _check_awq(quant)
            return cls(method, group, 0)
        return cls(method, group, _gptq_zero_offset(quant))

    def unpacked(
        self, prefix: str, parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A projection's (q uint8 [N, K], zeros [K/G, N], scales fp16 [K/G, N])."""
        qweight, qzeros = parts["qweight"], parts["qzeros"]
        if self.method == "awq":
            q, zeros = _awq_nibbles(qweight).T, _awq_nibbles(qzeros)
        else:
            q, zeros = _nibbles(qweight.T), _nibbles(qzeros) + self.zero_offset
        scales = parts["scales"].to(torch.float16)
        groups = 1 if self.group_size == -1 else q.shape[1] // self.group_size
        if scales.shape != zeros.shape or scales.shape != (groups, q.shape[0]):
            raise ValueError(
                f"{prefix}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not "
                f"fit a weight of {tuple(q.shape)} in groups of {self.group_size}"
            )
        if "g_idx" in parts:
            _check_groups(prefix, parts["g_idx"], q.shape[1] // groups)
        return q, zeros, scales


def _check_awq(quant: dict[str, Any]) -> None:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm" or not quant.get("zero_point", True):
        raise ValueError(
            f"AWQ version {version!r} zero_point {quant.get('zero_point')} is not served "
            f"(AutoAWQ's GEMM layout with zero points is)"
        )


def _gptq_zero_offset(quant: dict[str, Any]) -> int:
    if quant.get("desc_act"):
        raise ValueError(
            "act-order GPTQ (desc_act: true) is not served: its groups are not runs of "
            "inputs, which Q4_1 blocks need; quantize with desc_act=False"
        )
    form = quant.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {form!r} is not served (gptq, gptq_v2 are)")
    return 1 if form == "gptq" else 0


def _check_groups(prefix: str, g_idx: torch.Tensor, group: int) -> None:
    """GPTQ's g_idx must be k // G: any other order is act-order."""
    if not torch.equal(g_idx.long(), torch.arange(len(g_idx)) // group):
        raise ValueError(
            f"{prefix}.g_idx reorders the inputs (act-order GPTQ), which is not served: "
            f"Q4_1 blocks need groups of consecutive inputs"
        )


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble j of word c at 8c + j."""
    return ((words[..., None] >> SHIFTS) & 15).to(torch.uint8).flatten(-2)


def _awq_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble j of word c at 8c + AWQ_ORDER[j]."""
    return _nibbles(words).unflatten(-1, (-1, 8))[..., AWQ_ORDER.argsort()].flatten(-2)


def q4_1(
    prefix: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = s (q - z) in groups (q [N, K], zeros and scales [groups, N]) as Q4_1 blocks,
    uint8 [N, K/32 * 20] (each: fp16 d, fp16 m, 16 bytes of nibbles, byte j holding inputs
    j and j + 16), and the fp32 weight [N, K] they give, d q + m."""
    n, k = q.shape
    per_group = k // 32 // len(scales)  # blocks in a group
    d = scales.T.repeat_interleave(per_group, dim=1).contiguous()  # fp16 [N, K/32]
    m = (-(d.float() * zeros.T.repeat_interleave(per_group, dim=1))).half()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError(f"{prefix}.scales has non-finite values (or overflow fp16 times zeros)")
    q = q.reshape(n, k // 32, 32)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    scale_bytes = [t[..., None].view(torch.uint8) for t in (d, m)]
    blocks = torch.cat([*scale_bytes, nibbles], dim=-1).view(n, -1)
    weight = d.float()[..., None] * q.float() + m.float()[..., None]
    return blocks, weight.view(n, k)


def int4_weights(
    tensors: Iterator[tuple[str, torch.Tensor]], layout: Int4Layout, blocks: QuantBlocks
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each quantized projection's parts (`{p}.qweight`, `.qzeros`,
    `.scales`, GPTQ's `.g_idx`) replaced by `{p}.weight`, fp32 [N, K] as its Q4_1 blocks give
    it; the blocks go into `blocks` under that name. Parts are gathered as they come (one
    projection's may span shards) and converted after the last tensor."""
    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part in PARTS:
            pending[prefix][part] = tensor
        else:
            yield name, tensor
    for prefix, parts in pending.items():
        if missing := NEEDED - parts.keys():
            raise ValueError(f"{prefix} lacks {sorted(missing)}: an incomplete checkpoint")
        q, zeros, scales = layout.unpacked(prefix, parts)
        if q.shape[1] % 32:
            raise ValueError(f"{prefix} has {q.shape[1]} inputs, not a multiple of 32")
        rows, weight = q4_1(prefix, q, zeros, scales)
        blocks[f"{prefix}.weight"] = (rows, Q.Q4_1)
        yield f"{prefix}.weight", weight
