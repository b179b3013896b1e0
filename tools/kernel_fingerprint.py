"""Compile every kernel of configs offline (no GPU) and fingerprint the PTX.

    python3 tools/kernel_fingerprint.py OUT.json [--ptx-dir DIR] [--configs configs/*.yaml] [--arch sm90 ...]

For a refactor of the templates: run it before and after, then compare the two files
(`--compare OLD.json NEW.json`). Each kernel is compiled with the specializations its
launchers give it (tile sizes, warps, stages, the constexpr switches), and its PTX is
hashed without the lines that only locate source (`.loc`, `.file`, debug sections), so a
change of comments, names of Python locals in the launcher, or line numbers leaves the
hash alone while any change to what the GPU executes shows up.

Runs without TRITON_INTERPRET (triton compiles for a GPUTarget offline; nothing is launched).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ptx_probe, beside this file

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tqgen  # noqa: E402
from tqgen import config as config_mod  # noqa: E402

POINTER_TYPES = {"query_ptr": "*fp16", "cache_ptr": "*u8", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "slot_mapping_ptr": "*i64", "key_ptr": "*fp16", "value_ptr": "*fp16", "out_ptr": "*fp16",
                 "value_out_ptr": "*fp16", "prepared_ptr": "*fp16", "rotation_ptr": "*fp32",
                 "split_counters_ptr": "*i32"}
FLOAT_ARGS = ("score_scale",)


# Self-contained on purpose (tools/ptx_probe.py has a similar compile helper): tools/migrate_tuned.py runs
# this file inside checkouts of older commits, whose tools differ.
def compile_kernel(kernel, constants, warps, stages, capability, source_type=ASTSource,
                   unaligned=("stride_cache_head", "stride_cache_pos"), **options):
    """Compile with a real launch's specializations: pointers 16-byte aligned, strides named stride_* multiples
    of 16 except those in `unaligned` (a slots cache's head and position strides), every other argument an
    i32."""
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*fp32")
            attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
            if name.startswith("stride_") and name not in unaligned:
                attributes[(index,)] = [["tt.divisibility", 16]]
    source = source_type(kernel, signature, constants, attributes)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(num_warps=warps, num_stages=stages, **options))


def stripped_ptx(ptx: str) -> str:
    """PTX without source locations and debug sections."""
    out, skipping = [], False
    for line in ptx.splitlines():
        text = line.strip()
        if text.startswith(".section") and ".debug" in text:
            skipping = True
            continue
        if skipping:
            if text == "}":
                skipping = False
            continue
        if text.startswith((".loc", ".file", "$L__func_begin", "$L__func_end", "$L__tmp")) or text.startswith("//"):
            continue
        out.append(re.sub(r"\$L__tmp\d+", "", line))
    return "\n".join(out) + "\n"


def _head_major_view(module):
    """A slots module's Gluon stage-1 constants for the head-major cache of vLLM and make_cache, which the tuner
    times (TOKEN_STRIDE; with MSE keys also HEAD_STRIDE_PHASE, 0 at 16-token pages: every page starts at a word)."""
    import ptx_probe  # imported where used: tools/migrate_tuned.py runs this file in checkouts that predate it

    return ptx_probe.slots_view_constants(module, module.SLOT_BYTES, module.PAGE_SIZE * module.SLOT_BYTES)


def specializations(module):
    """(name, kernel, constants, warps, stages, source_type, options) of every launch worth fingerprinting."""
    names = set(dir(module))
    specs = []
    stage1 = module.tq_decode_stage1
    # Every (tile, warps, stages) the committed tuned files time, and a few beyond.
    for block_kv, warps, stages in ((32, 1, 1), (32, 1, 3), (32, 2, 1), (64, 1, 1), (64, 1, 3), (64, 2, 1), (64, 2, 2),
                                    (32, 4, 1)):
        for dependent in (False, True):
            for rotate in ((False, True) if "ROTATE_QUERY" in stage1.arg_names else (None,)):
                constants = dict(GROUP_SIZE=4, BLOCK_H=16, BLOCK_KV=block_kv, DEPENDENT_LAUNCH=dependent)
                if rotate is not None:
                    constants["ROTATE_QUERY"] = rotate
                label = f"stage1_kv{block_kv}_w{warps}_st{stages}_dep{int(dependent)}" + (
                    "" if rotate is None else f"_rot{int(rotate)}")
                specs.append((label, stage1, constants, warps, stages, ASTSource, {}))
    if "tq_decode_stage1_mma" in names:
        from triton.experimental.gluon._runtime import GluonASTSource

        for block_kv in (32, 64):
            for group_size, dependent, stages in ((4, False, 1), (1, True, 1), (8, False, 1), (16, False, 1),
                                                  (4, False, 2), (4, False, 3), (1, True, 2)):
                constants = module._mma_stage1_constants(block_kv, group_size, dependent, stages)
                if "TOKEN_STRIDE" in module.tq_decode_stage1_mma.arg_names:  # slots: the head-major cache of vLLM
                    constants = dict(constants, **_head_major_view(module))
                options = dict(module._mma_stage1_options(block_kv, group_size))
                warps = options.pop("num_warps")
                specs.append((f"stage1_mma_kv{block_kv}_g{group_size}_dep{int(dependent)}_st{stages}",
                              module.tq_decode_stage1_mma, constants, warps, 1, GluonASTSource, options))
                if "ROTATE_QUERY" in module.tq_decode_stage1_mma.arg_names and group_size in (1, 4):
                    constants = module._mma_stage1_constants(block_kv, group_size, dependent, stages, rotate_query=True)
                    specs.append((f"stage1_mma_kv{block_kv}_g{group_size}_dep{int(dependent)}_st{stages}_rot1",
                                  module.tq_decode_stage1_mma, constants, warps, 1, GluonASTSource, options))
    if "tq_decode_stage1_merged" in names:  # stage 1 merging its own splits (decode's merge_in_stage1)
        for block_kv, warps, stages in ((32, 1, 1), (64, 1, 1), (64, 2, 1), (32, 4, 1)):
            # DEPENDENT_LAUNCH: where the single-token kernel would signal its dependents (the merging one must not).
            constants = dict(GROUP_SIZE=4, BLOCK_H=16, BLOCK_KV=block_kv, DEPENDENT_LAUNCH=True, BLOCK_SPLITS=64)
            if "ROTATE_QUERY" in module.tq_decode_stage1_merged.arg_names:
                constants["ROTATE_QUERY"] = True
            specs.append((f"stage1_merged_kv{block_kv}_w{warps}_st{stages}", module.tq_decode_stage1_merged,
                          constants, warps, stages, ASTSource, {}))
    if "tq_decode_stage1_mma_merged" in names:
        for block_kv, group_size, stages in ((32, 4, 1), (32, 4, 2), (64, 1, 2), (32, 8, 1), (32, 16, 2)):
            keywords = dict(module._mma_stage1_keywords(block_kv, group_size, True, stages, False, block_splits=64))
            if "TOKEN_STRIDE" in module.tq_decode_stage1_mma_merged.arg_names:
                keywords.update(_head_major_view(module))
            if "ROTATE_QUERY" in keywords:
                keywords["ROTATE_QUERY"] = True
            keywords.pop("launch_pdl")
            warps = keywords.pop("num_warps")
            options = {"maxnreg": keywords.pop("maxnreg")} if "maxnreg" in keywords else {}
            specs.append((f"stage1_mma_merged_kv{block_kv}_g{group_size}_st{stages}",
                          module.tq_decode_stage1_mma_merged, keywords, warps, 1, GluonASTSource, options))
    for dependent in (False, True):
        specs.append((f"stage2_dep{int(dependent)}", module.tq_decode_stage2,
                      dict(BLOCK_SPLITS=8, DEPENDENT_LAUNCH=dependent), 4, 3, ASTSource, {}))
    if "tq_prepare_query" in names:
        inner = min(triton.next_power_of_2(module.HEAD_DIM), 128)
        inner = inner if triton.next_power_of_2(module.HEAD_DIM) <= 128 else 64
        specs.append(("prepare_query", module.tq_prepare_query,
                      dict(BLOCK_ROWS=16, BLOCK_COLS=16, BLOCK_INNER=inner), 1, 3, ASTSource, {}))
    store = module.tq_store
    for block_t, warps in ((8, 2), (4, 2)):
        if "KEYS_ROTATED" not in store.arg_names:
            rotations = (None,)
        else:  # keys rotated by torch always, except under the config's Hadamard rotation
            rotations = (False, True) if module.CONFIG["rotation"] == "hadamard" else (True,)
        for rotated in rotations:
            constants = dict(BLOCK_T=block_t)
            if rotated is not None:
                constants["KEYS_ROTATED"] = rotated
            label = f"store_t{block_t}_w{warps}" + ("" if rotated is None else f"_rot{int(rotated)}")
            specs.append((label, store, constants, warps, 1, ASTSource, {}))
    specs.append(("dequantize", module.tq_dequantize, dict(BLOCK_T=32), 4, 3, ASTSource, {}))
    return specs


def fingerprint(config_path, arch, ptx_dir=None, only=()):
    config = config_mod.resolve_arch(dataclass_arch(config_mod.load(config_path), arch))
    module = tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-fingerprint-"))
    capability = int(arch[2:])
    # A planes cache's head stride is its page size, a multiple of 16 bytes for the shipped formats: launches
    # specialize it so, and the cp.async ring's 16-byte copies compile only with it.
    planes = module.CONFIG.get("cache_layout") == "planes" and module.PAGE_BYTES % 16 == 0
    unaligned = ("stride_cache_pos",) if planes else ("stride_cache_head", "stride_cache_pos")
    result = {}
    for label, kernel, constants, warps, stages, source_type, options in specializations(module):
        if only and not label.startswith(tuple(only)):
            continue
        try:
            compiled = compile_kernel(kernel, constants, warps, stages, capability, source_type, unaligned,
                                      **options)
        except Exception as exc:  # a launch the launchers never make, or a broken kernel: recorded, not fatal
            result[label] = f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}"
            continue
        ptx = stripped_ptx(compiled.asm["ptx"])
        result[label] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
        if ptx_dir:
            folder = os.path.join(ptx_dir, f"{os.path.basename(config_path).removesuffix('.yaml')}-{arch}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{label}.ptx"), "w") as handle:
                handle.write(ptx)
    return result


def dataclass_arch(config, arch):
    import dataclasses

    return dataclasses.replace(config, arch=arch)


def compare(old_path, new_path) -> int:
    old, new = (json.load(open(path)) for path in (old_path, new_path))
    differing = 0
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, {}), new.get(key, {})
        for label in sorted(set(a) | set(b)):
            if a.get(label) != b.get(label):
                differing += 1
                print(f"{key} {label}: {a.get(label)} -> {b.get(label)}")
    total = sum(len(v) for v in new.values())
    print(f"{differing} of {total} kernels differ")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="JSON file to write")
    parser.add_argument("--configs", nargs="+", default=sorted(glob.glob("configs/*.yaml")))
    parser.add_argument("--arch", nargs="+", default=["sm90"])
    parser.add_argument("--ptx-dir", help="also write each stripped PTX here")
    parser.add_argument("--only", nargs="+", default=[], metavar="PREFIX",
                        help="only kernels whose label starts so, e.g. stage1_ stage2_ prepare_query")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("OUT is required unless --compare")
    document = {}
    for path in args.configs:
        for arch in args.arch:
            document[f"{os.path.basename(path)}:{arch}"] = fingerprint(path, arch, args.ptx_dir, args.only)
            print(f"{path} {arch}: {len(document[f'{os.path.basename(path)}:{arch}'])} kernels", flush=True)
    with open(args.out, "w") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
