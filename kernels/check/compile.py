"""`python -m specmesh.kernels.check.compile [--arch 90]`: compile every kernel for a CUDA GPU,
without one.

The interpreter runs a kernel as Python; Triton's compiler is stricter (globals must be
constexprs, loop-carried values keep their type, dot operands have minimum sizes). This
compiles each kernel with the argument types and constants its wrapper launches it with, to
PTX and a cubin (ptxas ships in the Triton wheel), so a machine without a GPU catches what
only a GPU run would. Run it without TRITON_INTERPRET (Triton reads it when a kernel is
defined); compiled kernels are cached under ~/.triton/cache.
"""

from __future__ import annotations

import argparse
import os

import triton
from specmesh.kernels.triton import accept, attention, kv_blocks, kv_move
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

I32 = "i32"


def variants() -> list[tuple[triton.JITFunction, dict[str, str], dict[str, object]]]:
    """(kernel, types of its runtime arguments, its constexprs) as the wrappers launch them."""
    found = []
    for dtype, precision in (("fp32", "ieee"), ("bf16", "tf32")):
        data = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), f"*{dtype}")
        plan = {"mask_offset_ptr": "*i64", "masks_ptr": "*i8", "scale": "fp32"}
        plan |= dict.fromkeys(("q_start_ptr", "num_cached_ptr", "num_new_ptr"), "*i32")
        plan |= dict.fromkeys(("tables_ptr", "tile_seq_ptr", "tile_first_ptr"), "*i32")
        for group, tile in ((4, 16), (3, 1)):  # a prefill or tree tile; decode rows, GQA of 3
            consts = {"GROUP": group, "TILE_TOKENS": tile, "PAGE": 16, "BLOCK_N": 32}
            consts |= {"BLOCK_R": max(16, triton.next_power_of_2(group * tile))}
            consts |= {"BLOCK_D": 128, "PRECISION": precision}
            found.append((attention._attention_kernel, data | plan, consts))
        blocks = {"storage_ptr": f"*{dtype}", "buffer_ptr": f"*{dtype}", "plane_size": "i64"}
        blocks |= dict.fromkeys(("block_ids_ptr", "num_tokens_ptr", "offsets_ptr"), "*i64")
        for to_buffer in (True, False):
            consts = {"PAGE": 16, "TO_BUFFER": to_buffer, "BLOCK": kv_blocks.BLOCK}
            found.append((kv_blocks._blocks_kernel, blocks, consts))
        move = {"storage_ptr": f"*{dtype}", "plane_size": "i64"}
        move |= dict.fromkeys(("tables_ptr", "starts_ptr", "path_ptr", "length_ptr"), "*i32")
        found.append((kv_move._commit_kernel, move, {"PAGE": 16, "BLOCK": kv_move.BLOCK}))
    trees = dict.fromkeys(("tokens_ptr", "parents_ptr", "path_ptr", "length_ptr"), "*i32")
    trees |= {"emitted_ptr": "*i32"}
    found.append((accept._greedy_kernel, trees | {"target_ptr": "*i32"}, {"BLOCK": 16}))
    sampling = trees | {"probs_ptr": "*fp32", "noise_ptr": "*fp32"}
    found.append((accept._sampling_kernel, sampling, {"BLOCK": 16, "BLOCK_V": accept.BLOCK_V}))
    return found


def compile_all(arch: int) -> list[str]:
    """Compile every variant for sm_<arch>; returns the kernels' names."""
    names = []
    for kernel, types, consts in variants():
        # Arguments not named are ints (strides, sizes, counts).
        signature = {
            name: "constexpr" if name in consts else types.get(name, I32)
            for name in kernel.arg_names
        }
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        triton.compile(source, target=GPUTarget("cuda", arch, 32))
        names.append(kernel.__name__)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m specmesh.kernels.check.compile", description=__doc__
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    names = compile_all(args.arch)
    print(f"sm_{args.arch}: compiled {len(names)} variants of {', '.join(sorted(set(names)))}")


if __name__ == "__main__":
    main()
