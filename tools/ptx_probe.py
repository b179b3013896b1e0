"""Compile decode stage 1 of a config for sm90 without a GPU and count its global loads.

    python3 tools/ptx_probe.py CONFIG [--block-kv 32] [--warps 1] [--stages 1] [--ptx OUT.ptx]
                               [--variants base nocorr ...]
    python3 tools/ptx_probe.py CONFIG --store 16:4 [4:2 ...] [--store-variants nofwht nosearch nocodes]
    python3 tools/ptx_probe.py CONFIG --block-kv 64 --sass [--variants base nocorr ...]
    python3 tools/ptx_probe.py CONFIG --mma [--block-kv 64] [--group-size 4] [--sass]
    python3 tools/ptx_probe.py CONFIG --warpgroup --q-len 8 [--block-kv 64] [--group-size 4] [--sass]

--sass disassembles the cubin triton built (sm90a) with the cuobjdump bundled with it and prints the
SASS opcode mix of stage 1's main loop (the longest backward branch): what one tile
costs each thread, counted the way the GPU executes it.

--store compiles the store kernel instead, at block_t:num_warps (keys rotated in the
kernel where the config's rotation allows it): registers, SASS and PTX instructions,
comparisons (setp), shared-memory stores and the mix of global stores; --store-variants adds
the edited kernels of tools/ablate_store.py.

--mma compiles the Gluon stage 1 on mma.sync (planes configs, Plan.mma_stage1) instead of
the tl.dot kernel: registers, MMAs and shared-memory traffic (none at --stages 1; the cp.async
ring's copies and reads from --stages 2 on).

--warpgroup compiles decode_multi's warpgroup stage 1 (4 warps on wgmma, Plan.multi_warpgroup) instead. With
--sass, the loop's forward branches are listed by the instructions they skip; "(cp.async)" marks the ring's next
tile, taken on every tile but a split's last ones, the others are the rare branches (the tile masks, the
columns' exact max).

--variants compiles the variants of tools/ablate_stage1.py side by side: registers,
spills and shared-memory traffic show what each part of the kernel costs before any
GPU time is spent.

Triton compiles to PTX offline; the load mix (16-byte `ld.global.v4`, 16- and
32-bit scalar loads, `cp.async` copies when pipelined) shows whether the
kernel's loads were vectorized, which the interpreter cannot tell. Registers
and spills come from the ptxas bundled with triton; they follow the local
triton version, which may differ from the GPU machine's.
"""

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tqgen  # noqa: E402
from tqgen import config as config_mod, render  # noqa: E402

POINTER_TYPES = {"query_ptr": "*fp16", "cache_ptr": "*u8", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32"}
# Strides a real launch passes as 1 (a contiguous query's head dim), which triton's launcher then specializes as the
# constant 1 (as it does any int argument equal to 1).
UNIT_STRIDES = ("stride_query_dim",)


def _compile_sm90(kernel, constants: dict, pointer_types: dict, aligned_strides: tuple[str, ...], warps: int,
                  stages: int, source_type=ASTSource, **options):
    """Compile for sm90 with a real launch's specializations: pointers 16-byte aligned, UNIT_STRIDES the constant 1,
    the named strides multiples of 16, every other argument a 32-bit int (score_scale a float); options are
    further compile options (maxnreg)."""
    signature, attributes = {}, {}
    constants = {**constants, **{name: 1 for name in UNIT_STRIDES if name in kernel.arg_names}}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp32")
            attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "score_scale" else "i32"
            if name.startswith(aligned_strides):
                attributes[(index,)] = [["tt.divisibility", 16]]
    source = source_type(kernel, signature, constants, attributes)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages, **options))


def compile_stage1(module, block_kv: int, warps: int, stages: int, rotate_query: bool = False):
    """Stage 1 for group size 4; rotate_query compiles the specialization that rotates the query
    itself (planes MSE configs, up to _ROTATE_QUERY_MAX_BATCH sequences)."""
    kernel = module.tq_decode_stage1
    constants = {"GROUP_SIZE": 4, "BLOCK_H": 16, "BLOCK_KV": block_kv}
    if "DEPENDENT_LAUNCH" in kernel.arg_names:
        constants["DEPENDENT_LAUNCH"] = False  # what every launch above batch 1 compiles
    if "ROTATE_QUERY" in kernel.arg_names:
        constants["ROTATE_QUERY"] = rotate_query
    elif rotate_query:
        raise SystemExit("--rotate-query: this config's stage 1 does not rotate the query")
    return _compile_sm90(kernel, constants, POINTER_TYPES, ("stride_",), warps, stages)


def _slots_cache_specialization(module, head_major: bool) -> tuple[dict, tuple[str, ...]]:
    """A slots cache's launch of the Gluon stage 1: its TOKEN_STRIDE and which strides a launch specializes as
    multiples of 16. Head-major (vLLM's allocation and make_cache's, 8 KV heads): a position is one slot on, a head
    one page; position-major: a position is 8 slots on, a head one slot, rarely a multiple of 16."""
    if "TOKEN_STRIDE" not in module.tq_decode_stage1_mma.arg_names:  # planes
        return {}, ("stride_",)
    if head_major:
        return slots_view_constants(module, module.SLOT_BYTES, module.PAGE_SIZE * module.SLOT_BYTES), ("stride_",)
    return slots_view_constants(module, 8 * module.SLOT_BYTES, module.SLOT_BYTES), (
        "stride_cache_block", "stride_cache_pos", "stride_query", "stride_table")


def slots_view_constants(module, token_stride: int, head_stride: int) -> dict:
    """The Gluon stage 1's constants of a slots cache view with these position and head strides: TOKEN_STRIDE and,
    MSE keys (2-byte aligned fields), HEAD_STRIDE_PHASE, as the module's launchers pass them."""
    constants = {"TOKEN_STRIDE": token_stride}
    if "HEAD_STRIDE_PHASE" in module.tq_decode_stage1_mma.arg_names:
        constants["HEAD_STRIDE_PHASE"] = head_stride % 4
    return constants


def compile_stage1_mma(module, block_kv: int, group_size: int = 4, dependent_launch: bool = False, stages: int = 1,
                       rotate_query: bool = False, head_major: bool = True):
    """The Gluon stage 1 (tq_decode_stage1_mma) with the constants decode gives it (one warp); stages >= 2
    compiles its cp.async ring of that many tiles; rotate_query the specialization that rotates the caller's
    query itself (MSE keys under the config's Hadamard rotation); head_major (slots configs) the cache as
    vLLM and make_cache allocate it, else position-major."""
    from triton.experimental.gluon._runtime import GluonASTSource

    extra = {"rotate_query": True} if rotate_query else {}
    constants = module._mma_stage1_constants(block_kv, group_size, dependent_launch, stages, **extra)
    cache_constants, aligned = _slots_cache_specialization(module, head_major)
    options = dict(module._mma_stage1_options(block_kv, group_size))
    return _compile_sm90(module.tq_decode_stage1_mma, {**constants, **cache_constants}, POINTER_TYPES, aligned,
                         options.pop("num_warps"), 1, GluonASTSource, **options)


def compile_multi_stage1_mma(module, block_kv: int, group_size: int, q_len: int, dependent_launch: bool = False,
                             stages: int = 1, head_major: bool = True, rotate_query: bool = False):
    """The Gluon stage 1 of decode_multi (tq_decode_multi_stage1_mma) with the constants decode_multi gives it:
    the query tokens that fit in 16 MMA columns (query tokens x heads) per program; head_major as
    compile_stage1_mma's; rotate_query the specialization that rotates the caller's fp16 query itself (MSE
    keys under the config's Hadamard rotation at head_dim 128)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = module._multi_mma_constants(block_kv, group_size, q_len, dependent_launch, stages,
                                            rotate_query=rotate_query)
    cache_constants, aligned = _slots_cache_specialization(module, head_major)
    # decode_multi's options on a full GPU (one_wave False: decode's register cap where it has one)
    options = dict(module._multi_mma_options(block_kv, constants["TOKENS_PER_PROGRAM"] * group_size, False))
    return _compile_sm90(module.tq_decode_multi_stage1_mma, {**constants, **cache_constants}, POINTER_TYPES, aligned,
                         options.pop("num_warps"), 1, GluonASTSource, **options)


def compile_multi_stage1_wg(module, group_size: int, q_len: int, dependent_launch: bool = False, block_kv: int = 64,
                            rotate_query: bool = False):
    """decode_multi's warpgroup stage 1 (tq_decode_multi_stage1_wg, Plan.multi_warpgroup) with the constants
    decode_multi gives it for tiles of block_kv tokens, on 4 warps; rotate_query the specialization that rotates
    the caller's fp16 query itself."""
    from triton.experimental.gluon._runtime import GluonASTSource

    extra = {"rotate_query": True} if rotate_query else {}
    constants = module._multi_wg_constants(group_size, q_len, dependent_launch and not rotate_query, block_kv,
                                           **extra)
    options = module._multi_wg_options(block_kv)
    return _compile_sm90(module.tq_decode_multi_stage1_wg, constants, POINTER_TYPES, ("stride_",), 4, 1,
                         GluonASTSource, **options)


def compile_store_keys_mma(module):
    """The store's key kernel on the tensor cores (Plan.store_keys_mma) for fp16 keys."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = module.tq_store_keys_mma
    pointer_types = {"key_ptr": "*fp16", "boundaries_ptr": "*fp32", "centroids_ptr": "*fp32",
                     "slot_mapping_ptr": "*i64", "cache_ptr": "*u8"}
    constants = dict(PAGE_SIZE=module.PAGE_SIZE, BLOCK_T=module.STORE_MMA_TOKENS)
    for name in ("KEY_CODE_PLANE", "KEY_CODE_BYTES", "KEY_HIGH_BITS_AT", "KEY_NORM_PLANE", "KEY_NORM_OFFSET"):
        if name in kernel.arg_names:  # planes or slots, split or packed codes
            constants[name] = getattr(module, name)
    # A slots cache's head stride is the slot size (2 mod 4 here): specialized as unaligned, as a launch would.
    aligned = ("stride_key", "stride_cache_block", "stride_cache_pos") if "stride_cache_pos" in kernel.arg_names \
        else ("stride_",)
    return _compile_sm90(kernel, constants, pointer_types, aligned, 1, 1, GluonASTSource)


def compile_store_gluon(module, block_t: int, symmetric: bool = True):
    """The Gluon store (Plan.store_gluon) for fp16 keys and values, into make_cache's cache (slots: head-major)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = module.tq_store_gluon
    pointer_types = {"key_ptr": "*fp16", "value_ptr": "*fp16", "boundaries_ptr": "*fp32", "centroids_ptr": "*fp32",
                     "slot_mapping_ptr": "*i64", "cache_ptr": "*u8", "search_table_ptr": "*i64"}
    constants = dict(BLOCK_T=block_t, SYMMETRIC_CODEBOOK=symmetric)
    # A slots cache's head stride is the slot size (2 mod 4): unaligned, as a launch specializes it.
    aligned = ("stride_key", "stride_value", "stride_cache_block", "stride_cache_pos") \
        if "stride_cache_pos" in kernel.arg_names else ("stride_",)
    return _compile_sm90(kernel, constants, pointer_types, aligned, 1, 1, GluonASTSource)


def compile_store(module, block_t: int, warps: int):
    """The store kernel for fp16 keys and values."""
    kernel = module.tq_store
    constants = {"BLOCK_T": block_t}
    if "KEYS_ROTATED" in kernel.arg_names:
        constants["KEYS_ROTATED"] = module.CONFIG["rotation"] != "hadamard"
    if "KEYS" in kernel.arg_names:  # the key path too (without it where tq_store_keys_mma writes the keys)
        constants["KEYS"] = True
    if "WORDS" in kernel.arg_names:  # a cache whose address and strides allow 32-bit stores (make_cache's)
        constants["WORDS"] = True
    if "SYMMETRIC_CODEBOOK" in kernel.arg_names:  # the default codebook's boundaries
        constants["SYMMETRIC_CODEBOOK"] = True
    pointer_types = {"key_ptr": "*fp16", "value_ptr": "*fp16", "slot_mapping_ptr": "*i64", "cache_ptr": "*u8"}
    # A slots cache's head stride is the slot size, which is rarely a multiple of 16 (a launch then
    # specializes it as unaligned); its block and position strides are, with 16-token pages and 8 heads.
    aligned = ("stride_key", "stride_value", "stride_cache_block", "stride_cache_pos")
    if module.SLOT_BYTES % 16 == 0 or "stride_cache_pos" not in kernel.arg_names:
        aligned += ("stride_cache_head",)
    return _compile_sm90(kernel, constants, pointer_types, aligned, warps, 1)


def sass_count(cubin: bytes) -> int:
    """SASS instructions in the whole cubin (cuobjdump's listing)."""
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", disassemble(cubin), flags=re.MULTILINE))


def store_variant_modules(config, module, names):
    """(name, module) for the shipped store and each of tools/ablate_store.py's VARIANTS in names."""
    from ablate_stage1 import import_source  # beside this file
    from ablate_store import VARIANTS

    source, folder, out = render.render(config), tempfile.mkdtemp(prefix="tqgen-ptx-"), [("shipped", module)]
    for name in names:
        old, new = VARIANTS[name]
        if old not in source:
            raise SystemExit(f"store variant {name!r} does not apply to {config.name}")
        out.append((name, import_source(source.replace(old, new), f"{config.name}_{name}".replace("-", "_"), folder)))
    return out


def report_store(config, module, launches, variants=()) -> None:
    for (name, variant), launch in itertools.product(store_variant_modules(config, module, variants), launches):
        block_t, warps = map(int, launch.split(":"))
        compiled = compile_store(variant, block_t, warps)
        ptx = compiled.asm["ptx"]
        instructions = [line for line in ptx.splitlines() if line.startswith("\t") and line.strip()
                        and not line.strip().startswith(("//", ".", "{", "}")) and not line.strip().endswith(":")]
        stores = collections.Counter(re.findall(r"st\.global(?:\.\w+)*", ptx))
        label = "" if name == "shipped" else f" [{name}]"
        print(f"{config.name} store{label} {block_t}:{warps} (triton {triton.__version__}, sm90a): {ptxas_usage(ptx)}; "
              f"{sass_count(compiled.asm['cubin'])} SASS, {len(instructions)} PTX instructions, setp x{ptx.count('setp')}, st.shared x{ptx.count('st.shared')}; "
              + ", ".join(f"{kind} x{count}" for kind, count in stores.most_common()), flush=True)


def ptxas_usage(ptx: str) -> str:
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one accepts the newer PTX versions
        path = _bundled_tool(name)
        if not os.path.exists(path):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
            handle.write(ptx)
        result = subprocess.run([path, "-arch=sm_90a", "-v", handle.name, "-o", os.devnull],
                                capture_output=True, text=True)
        os.unlink(handle.name)
        found = re.findall(r"Used \d+ registers|\d+ bytes cumulative stack size", result.stderr)
        if found:
            return ", ".join(found)
    return "ptxas not available"


def _bundled_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(cubin: bytes) -> str:
    """cuobjdump's SASS listing of a cubin triton built, with the cuobjdump bundled with it."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        return subprocess.run([_bundled_tool("cuobjdump"), "-sass", path], check=True, capture_output=True,
                              text=True).stdout


def sass_loop_mix(cubin: bytes) -> str:
    """The opcode mix of the kernel's longest loop, from cuobjdump's SASS of the cubin triton built (sm90a).
    Forward branches inside the loop are listed with the instructions each can skip: the Gluon stage 1's
    copies of the tile ahead (skipped only near a split's end) and its rescale of out^T (skipped unless the
    running max moves, so most tiles skip it)."""
    return loop_mix(disassemble(cubin))


# A branch's target address: "BRA 0x1e60", "BRA `(.L_x_3) 0x...", or predicated on a second operand "BRA P4, 0x3d90".
_BRANCH_TARGET = re.compile(r"BRA\s+(?:!?U?P\w+,\s*)?(?:`\()?\S*?0x([0-9a-f]+)")


def loop_mix(sass: str) -> str:
    """sass_loop_mix of a cuobjdump listing."""
    instructions = []  # (address, opcode, line)
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", line)
        if found:
            instructions.append((int(found.group(1), 16), found.group(2), line))
    loop = None  # (start, end) of the longest backward branch
    for address, opcode, line in instructions:
        target = _BRANCH_TARGET.search(line) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            if loop is None or address - start > loop[1] - loop[0]:
                loop = (start, address)
    if loop is None:
        return "no loop"
    inside = [(address, opcode, line) for address, opcode, line in instructions if loop[0] <= address <= loop[1]]
    body = [opcode.split(".")[0] for _, opcode, _ in inside]
    mix = collections.Counter(body).most_common(12)
    skips = []  # instructions jumped over by each predicated forward branch that lands inside the loop
    for address, opcode, line in inside:
        target = _BRANCH_TARGET.search(line) if opcode.startswith("BRA") else None
        if target and address < int(target.group(1), 16) <= loop[1]:
            skipped = [op for a, op, _ in inside if address < a < int(target.group(1), 16)]
            # A region that holds cp.async copies is the ring's next tile: taken on most tiles, not a rare branch.
            skips.append(f"{len(skipped)}{' (cp.async)' if any(op.startswith('LDGSTS') for op in skipped) else ''}")
    branches = f" (forward branches in it skip {', '.join(map(str, skips))})" if skips else ""
    return f"{len(body)} SASS instructions in the loop{branches}: " + ", ".join(f"{op} {count}" for op, count in mix)


def compare_variants(config, names, block_kv, warps, stages, sass=False) -> None:
    import ablate_stage1  # beside this file
    from tqgen import render

    source = render.render(config)
    folder = tempfile.mkdtemp(prefix="tqgen-ptx-")
    print(f"{config.name} kv{block_kv} w{warps} st{stages} (ptxas of triton {triton.__version__}, sm90a)")
    print("| variant | registers, stack | st.shared | ld.shared + ldmatrix | bar.sync | mma | prmt |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        text = ablate_stage1.variant(source, name)
        module = ablate_stage1.import_source(text, name, folder)
        compiled = compile_stage1(module, block_kv, warps, stages)
        ptx = compiled.asm["ptx"]
        print(f"| {name} | {ptxas_usage(ptx)} | {ptx.count('st.shared')} | "
              f"{ptx.count('ld.shared') + ptx.count('ldmatrix')} | {ptx.count('bar.sync')} | "
              f"{ptx.count('mma.sync')} | {ptx.count('prmt')} |", flush=True)
        if sass:
            print(f"|   | {sass_loop_mix(compiled.asm['cubin'])} | | | | | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--block-kv", type=int, default=32)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--ptx", help="also write the PTX here")
    parser.add_argument("--variants", nargs="+", help="compare variants (see the docstring)")
    parser.add_argument("--store", nargs="+", metavar="BLOCK_T:WARPS", help="compile the store kernel instead")
    parser.add_argument("--store-variants", nargs="+", default=[], metavar="VARIANT",
                        help="with --store: also compile these variants of tools/ablate_store.py")
    parser.add_argument("--sass", action="store_true", help="also print the SASS opcode mix of stage 1's loop")
    parser.add_argument("--mma", action="store_true", help="compile the Gluon stage 1 on mma.sync instead")
    parser.add_argument("--group-size", type=int, default=4, help="query heads per KV head (--mma)")
    parser.add_argument("--q-len", type=int, default=1,
                        help="with --mma: compile decode_multi's stage 1 for this many query tokens (2-8)")
    parser.add_argument("--rotate-query", action="store_true",
                        help="compile stage 1 (or --warpgroup) as it rotates the query itself (planes MSE)")
    parser.add_argument("--warpgroup", action="store_true",
                        help="compile decode_multi's warpgroup stage 1 (Plan.multi_warpgroup) for --q-len x "
                             "--group-size columns and --block-kv 64 or 128")
    parser.add_argument("--position-major", action="store_true",
                        help="with --mma, slots configs: the cache in position-major order (default: head-major, vLLM's)")
    args = parser.parse_args()
    config = config_mod.resolve_arch(config_mod.load(args.config), (9, 0))
    if args.store:
        report_store(config, tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-ptx-")), args.store,
                     args.store_variants)
        return
    if args.variants:
        compare_variants(config, args.variants, args.block_kv, args.warps, args.stages, args.sass)
        return
    module = tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-ptx-"))
    if args.warpgroup:
        if not hasattr(module, "tq_decode_multi_stage1_wg"):
            raise SystemExit(f"--warpgroup: {args.config} has no warpgroup stage 1 (Plan.multi_warpgroup)")
        if args.block_kv not in module._WG_TILES:
            raise SystemExit(f"--warpgroup: --block-kv must be one of {module._WG_TILES}, got {args.block_kv}")
        compiled = compile_multi_stage1_wg(module, args.group_size, args.q_len, block_kv=args.block_kv,
                                           rotate_query=args.rotate_query)
    elif args.mma:
        if not hasattr(module, "tq_decode_stage1_mma"):
            raise SystemExit(f"--mma: {args.config} has no Gluon stage 1 (Plan.mma_stage1)")
        if args.q_len > 1:
            compiled = compile_multi_stage1_mma(module, args.block_kv, args.group_size, args.q_len,
                                                stages=args.stages, head_major=not args.position_major,
                                                rotate_query=args.rotate_query)
        else:
            compiled = compile_stage1_mma(module, args.block_kv, args.group_size, stages=args.stages,
                                          rotate_query=args.rotate_query, head_major=not args.position_major)
    else:
        compiled = compile_stage1(module, args.block_kv, args.warps, args.stages, args.rotate_query)
    ptx = compiled.asm["ptx"]
    if args.ptx:
        with open(args.ptx, "w") as handle:
            handle.write(ptx)
    loads = collections.Counter(re.findall(r"ld\.global(?:\.\w+)*", ptx))
    if args.warpgroup:
        launch = f"warpgroup, group {args.group_size}, q_len {args.q_len}"
    elif args.mma:
        launch = f"mma, group {args.group_size}, q_len {args.q_len}, st{args.stages}"
    else:
        launch = f"w{args.warps} st{args.stages}"
    products = (f"wgmma x{ptx.count('wgmma.mma_async')}" if args.warpgroup else f"mma.sync x{ptx.count('mma.sync')}")
    print(f"{args.config} kv{args.block_kv} {launch}: {ptxas_usage(ptx)}; {products}, shfl x{ptx.count('shfl.sync')}")
    print("  global loads: " + ", ".join(f"{kind} x{count}" for kind, count in loads.most_common()))
    print(f"  cp.async x{len(re.findall(r'cp[.]async[.]c[ag]', ptx))}, "
          f"ld.shared x{len(re.findall(r'ld[.]shared', ptx))}, st.shared x{len(re.findall(r'st[.]shared', ptx))}")
    if args.sass:
        print("  " + sass_loop_mix(compiled.asm["cubin"]))


if __name__ == "__main__":
    main()
