"""Why quant_linear multiplies activations at int16, not int8: greedy text when each
matmul's input is rounded to int16 or int8 per 32 values, against the same model unrounded.

    python benchmarks/bench_activation_bits.py [--model DIR] [--prompts 20]
        [--new-tokens 64] [--bits 16,8] [--modules q_proj,lm_head,...]

transformers' fp32 model, its weights as they are; the input of every `nn.Linear` (or of
those named in `--modules`, by their last name) rounded per block of 32 values with the
block's largest magnitude as the scale: quant_linear's int16 blocks, or the int8 blocks of
llama.cpp's Q8 dot products. Prints, per bit width, on how many of the held-out chat
prompts the greedy tokens equal the unrounded run's, and the token at which each first
differs (`--new-tokens`: none did).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from specmesh.shared.model.fetch import fetch_default_model
from transformers import AutoModelForCausalLM, AutoTokenizer

HELDOUT = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())
BLOCK = 32
PLAIN_FORWARD = torch.nn.Linear.forward

Forward = Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded per 32 values to `bits`-bit integers times
    the block's scale max |x| / (2^(bits-1) - 1)."""
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(1e-30)), 0.0)
    return (q * scale).reshape(x.shape)


def rounding_forward(bits: int, names: dict[torch.nn.Module, str], only: set[str]) -> Forward:
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not only or names[self] in only:
            x = rounded(x, bits)
        return PLAIN_FORWARD(self, x)

    return forward


def greedy(model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            outs.append(out[0, ids.shape[1] :].tolist())
    return outs


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bits", default="16,8")
    parser.add_argument("--modules", default="", help="only these Linears (last name)")
    args = parser.parse_args()
    path = Path(args.model) if args.model else fetch_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = {m: name.rsplit(".", 1)[-1] for name, m in model.named_modules()}
    only = {m for m in args.modules.split(",") if m}
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for text in HELDOUT[: args.prompts]
    ]
    reference = greedy(model, prompts, args.new_tokens)
    where = ", ".join(sorted(only)) if only else "every Linear"
    print(f"{len(prompts)} prompts, {args.new_tokens} greedy tokens; rounded: {where}")
    for bits in map(int, args.bits.split(",")):
        torch.nn.Linear.forward = rounding_forward(bits, names, only)
        outs = greedy(model, prompts, args.new_tokens)
        torch.nn.Linear.forward = PLAIN_FORWARD
        same = sum(o == r for o, r in zip(outs, reference, strict=True))
        firsts = [first_difference(o, r) for o, r in zip(outs, reference, strict=True)]
        print(f"int{bits}: {same} of {len(prompts)} identical; first differing token {firsts}")


if __name__ == "__main__":
    main()
