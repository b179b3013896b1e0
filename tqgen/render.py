"""Render the Jinja templates into one specialized Python module's source.

Only what the config needs is rendered: no branches for other formats, layout
offsets and bit widths as literals, the fp8 decode chosen for the arch. Same
inputs, byte-identical output: nothing machine- or time-dependent enters.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from pathlib import Path

import jinja2

from . import __version__, buckets, codebook
from .config import Config
from .layout import SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, Layout, row_alignment

MODULE_TEMPLATE = "module.py.jinja"
# First arch with a hardware e4m3 -> fp16 converter that Triton uses.
_FP8_HARDWARE_ARCHES = ("sm89", "sm90", "sm100")


def template_dir() -> Path:
    """templates/ of a checkout, or the copy packaged into an installed wheel."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_templates", package.parent / "templates"):
        if (candidate / MODULE_TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"tqgen templates not found next to {package}")


def template_hash() -> str:
    """SHA-256 over every template's name and bytes."""
    digest = hashlib.sha256()
    root = template_dir()
    for path in sorted(root.glob("*.jinja")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _embedded_sources(module) -> list[str]:
    return [inspect.getsource(getattr(module, name)).rstrip() for name in module.EMBEDDED]


def _tuned_literal(tuned: dict) -> str:
    """The baked table as a readable, deterministic Python literal."""
    if not tuned:
        return "{}"
    lines = ["{"]
    for device in sorted(tuned):
        entry = tuned[device]
        lines.append(f"    {device!r}: {{")
        lines.append(f"        'triton_version': {entry['triton_version']!r},")
        lines.append(f"        'source': {entry['source']!r},")
        lines.append("        'buckets': {")
        for key in sorted(entry["buckets"], key=buckets.bucket_sort_key):
            lines.append(f"            {key!r}: {tuple(entry['buckets'][key])!r},")
        lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _tuning_summary(tuned: dict) -> str:
    if not tuned:
        return "none; launches come from the heuristic in `decode_launch_defaults` unless passed."
    parts = [f"{device}: {len(entry['buckets'])} buckets from {entry['source']}" for device, entry in sorted(tuned.items())]
    return "; ".join(parts) + "; other shapes and devices use `decode_launch_defaults`."


def code_search(bits: int) -> list[str]:
    """Statements that set `codes` to each element's key code by a binary search over the
    2**bits - 1 sorted decision boundaries (scalars `boundary{j}`), for the store kernel.

    Bit `bits - 1 - level` (`code_bit{i}`, booleans) compares `rotated` with the middle
    boundary of the interval the bits above it chose: 2**level candidates, narrowed pairwise
    by tl.where over those bits, newest first. Intermediate thresholds are named
    (`threshold{i}_{fold}_{k}`) to keep each line short.
    """
    lines = []
    for level in range(bits):
        bit = bits - 1 - level
        width = 1 << (bits - level)  # boundaries + 1 per candidate interval
        candidates = [f"boundary{prefix * width + width // 2 - 1}" for prefix in range(1 << level)]
        for fold, decided in enumerate(range(bit + 1, bits)):  # newest decided bit first
            pairs = [f"tl.where(code_bit{decided}, {candidates[k + 1]}, {candidates[k]})"
                     for k in range(0, len(candidates), 2)]
            if len(pairs) == 1:
                candidates = pairs
                break
            candidates = [f"threshold{bit}_{fold}_{k}" for k in range(len(pairs))]
            lines += [f"{name} = {pair}" for name, pair in zip(candidates, pairs)]
        lines.append(f"code_bit{bit} = rotated >= {candidates[0]}")
    lines.append(f"codes = code_bit{bits - 1}.to(tl.int32) << {bits - 1}")
    lines += [f"codes |= code_bit{bit}.to(tl.int32)" + (f" << {bit}" if bit else "") for bit in range(bits - 2, -1, -1)]
    return lines


def centroid_square_select(bits: int) -> list[str]:
    """Statements that set `centroid_square` to each element's squared centroid from the bits
    `code_search` decided (`code_bit{i}`) and scalars `centroid_square{j}`: a tree of tl.where
    over the bits, highest (the search's first) first: 2**bits - 1 selects and no memory access,
    for the store's norm correction. Intermediate values are named (`square{i}_{k}`) to keep
    each line short."""
    names = [f"centroid_square{j}" for j in range(2**bits)]
    lines = []
    for bit in range(bits - 1, -1, -1):
        half = len(names) // 2
        pairs = [f"tl.where(code_bit{bit}, {names[half + k]}, {names[k]})" for k in range(half)]
        names = [f"square{bit}_{k}" for k in range(half)] if half > 1 else ["centroid_square"]
        lines += [f"{name} = {pair}" for name, pair in zip(names, pairs)]
    return lines


def nibble_selector(layout: Layout, bits: int, word: str, first_code: int) -> str:
    """Expression that moves codes first_code..first_code+3 of a group word into the four
    nibbles of a byte-permute selector (code k at bits 4k..). Bits moved by the same shift
    share one mask, so a bit stream costs a shift and a mask per distinct distance."""
    masks: dict[int, int] = {}  # right shift -> mask of the destination bits
    for k in range(4):
        for bit in range(bits):
            target = 4 * k + bit
            shift = layout.group_word_bit(bits, first_code + k, bit) - target
            masks[shift] = masks.get(shift, 0) | (1 << target)
    terms = []
    for shift, mask in sorted(masks.items()):
        moved = word if shift == 0 else f"({word} >> {shift})" if shift > 0 else f"({word} << {-shift})"
        terms.append(f"({moved} & 0x{mask:X})")
    return terms[0][1:-1] if len(terms) == 1 else " | ".join(terms)


def mma_stage1(layout: Layout, arch: str) -> bool:
    """Whether decode stage 1 of this layout has the Gluon kernel on mma.sync (decode_stage1_mma.py.jinja):
    the page-planar layout at a head_dim its tiles divide (a power of two from 64: each lane decodes whole
    units of a record, a quarter of a key and an eighth of a value), with
    - MSE keys, or fp8 keys on an arch with a hardware e4m3 converter;
    - 4-bit values, or 3-bit values from head_dim 128 (a lane's low-bit words then fill 32-bit loads)."""
    keys_ok = not layout.key_fp8 or arch in _FP8_HARDWARE_ARCHES
    values_ok = layout.value_bits == 4 or (layout.value_bits == 3 and layout.head_dim >= 128)
    return layout.planes and keys_ok and values_ok and layout.head_dim in (64, 128, 256)


def split_value_codes(layout: Layout) -> list[tuple[str, int]]:
    """For the Gluon kernel's split 3-bit values: per code k of a group (0..7), the expression that
    leaves code k at bits p..p+2 of each 16-bit half of `low`, `(low >> 8)` and `high` (a register
    pairing two tokens' 16-bit low words, and their high bytes), and p.

    The two low bits are masked where they lie (bits 0..7 of `low` or of `low >> 8`); the high bit
    is shifted in beside them. No other bit survives the masks, so each half reads as the fp16
    subnormal code * 2**(p - 24), exact; p <= 7 keeps the code below the exponent bits (10..14).
    """
    terms = []
    for code in range(8):
        low_bit = layout.group_word_bit(3, code, 0)
        assert layout.group_word_bit(3, code, 1) == low_bit + 1, "split low bits must be adjacent"
        source, position = ("low", low_bit) if low_bit < 8 else ("(low >> 8)", low_bit - 8)
        shift = position + 2 - (layout.group_word_bit(3, code, 2) - 16)
        assert position <= 7 and -7 <= shift <= 8, (code, position, shift)
        high = "high" if shift == 0 else f"(high << {shift})" if shift > 0 else f"(high >> {-shift})"
        low_mask = (3 << position) * 0x10001
        high_mask = (4 << position) * 0x10001
        terms.append((f"({source} & 0x{low_mask:08X}) | ({high} & 0x{high_mask:08X})", position))
    return terms


def context(config: Config, tuned: dict | None = None) -> dict:
    """Everything the templates may read, computed from the (arch-resolved) config."""
    if config.arch == "auto":
        raise ValueError("resolve the arch (config.resolve_arch) before rendering")
    layout = Layout.from_config(config)
    has_mma_stage1 = mma_stage1(layout, config.arch)
    fp8_hardware = config.arch in _FP8_HARDWARE_ARCHES
    min_capability = (8, 9) if (layout.key_fp8 and fp8_hardware) else (8, 0)
    config_items = [(k, json.dumps(v)) for k, v in config.to_dict().items() if v is not None]
    return {
        "version": __version__,
        "config": config,
        "config_items": config_items,
        "config_literal": repr(dict(sorted(config.to_dict().items()))),
        "config_hash": config.hash(),
        "template_hash": template_hash(),
        "arch": config.arch,
        "L": layout.constants(),
        "layout_fields": layout.fields(),
        "D": config.head_dim,
        "D_PAD": _next_power_of_two(config.head_dim),
        # Groups of 8 codes per code plane in decode; >= 16 because tl.dot needs K >= 16.
        "GROUPS": max(16, _next_power_of_two(config.head_dim // 8)),
        "PAGE": config.block_size,
        "planes": layout.planes,
        "layout_records": layout.records(),
        "split_3bit": layout.has_split_codes,
        # The arguments that locate a token in the cache, as the kernels' helpers take them.
        "cache_at": "page_base, pos" if layout.planes else "slot_base",
        # Where the KV-head dim of the cache tensor is, and the strides its kernels take.
        "HEADS_DIM": 1 if layout.planes else 2,
        "row_alignment": row_alignment,  # for the kernels' tl.multiple_of hints
        "split_orders": (SPLIT_LOW_ORDER, SPLIT_HIGH_ORDER),
        "word_bit": layout.group_word_bit,  # where each code bit of a group sits in its loaded word
        "nibble_selector": lambda bits, word, first_code: nibble_selector(layout, bits, word, first_code),
        "code_search": code_search,  # store: the binary search for a key code
        "centroid_square_select": centroid_square_select,  # store: its centroid's square, by the same bits
        # int32 registers per codebook byte table (common.py.jinja): 4 entries each, 8 entries at least.
        "table_registers": max(2, 2**config.key_bits // 4),
        "cache_strides": ("kv_cache.stride(0), kv_cache.stride(1)" if layout.planes
                          else "kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)"),
        "cache_shape": (f"[num_blocks, num_kv_heads, {layout.page_bytes}] (page-planar)" if layout.planes
                        else f"[num_blocks, {config.block_size}, num_kv_heads, {layout.slot_bytes}]"),
        "halfword_loads": layout.halfword_aligned,
        "key_fp8": layout.key_fp8,
        # MSE keys under the config's Hadamard rotation: store rotates them by a Walsh-Hadamard transform.
        "hadamard_keys": not layout.key_fp8 and config.rotation == "hadamard",
        # ... and planes decode rotates the query in stage 1 the same way: at head_dim 128, the only
        # one timed (64 would need padded code planes; at 256 ptxas puts twice the stack of the other
        # path in stage 1, untimed). Slots decode keeps tq_prepare_query until its tuned launches are
        # re-timed. MSE keys always take the code-plane path that this branch of stage 1 feeds.
        "stage1_rotates_query": (not layout.key_fp8 and config.rotation == "hadamard" and layout.planes
                                 and config.head_dim == 128),
        # Planes configs at a power-of-two head_dim from 64 (see mma_stage1): decode stage 1 also gets
        # the tensor-core kernel of decode_stage1_mma.py.jinja (Gluon), used on GPUs that can.
        "mma_stage1": has_mma_stage1,
        "split_value_codes": split_value_codes(layout) if layout.split_high_bits(layout.value_bits) else [],
        "fp8_hardware": fp8_hardware,
        # common.py.jinja's PTX helpers (and their _INTERPRETED switch): planes MSE keys' codebook
        # lookup and the Gluon stage 1's value codes. store.py.jinja defines the switch otherwise.
        "ptx_helpers": layout.planes and (has_mma_stage1 or not layout.key_fp8),
        "min_capability": min_capability,
        "norm_correction": config.norm_correction,
        # Where the norm correction happens: in the store ("planes") or in every reader ("slots").
        "key_norm_corrected": layout.key_norm_corrected,
        "norm_correction_at_decode": layout.norm_correction_at_decode,
        "levels": list(codebook.lloyd_max_levels(config.key_bits)) if not layout.key_fp8 else [],
        "embedded_sources": _embedded_sources(codebook),
        "bucket_sources": _embedded_sources(buckets),
        "tuned_literal": _tuned_literal(tuned or {}),
        "tuning_summary": _tuning_summary(tuned or {}),
        "output_dtype_literal": "None" if config.output_dtype == "auto" else f"torch.{config.output_dtype}",
    }


def _tidy(source: str) -> str:
    """PEP 8 spacing whatever the templates' whitespace: no trailing spaces, two
    blank lines before each top-level definition, never more than two in a row."""
    out: list[str] = []
    for line in source.splitlines():
        line = line.rstrip()
        top_level = line.startswith(("@", "def ", "class "))
        if top_level and out and not out[-1].startswith(("@", "#")):
            while out and out[-1] == "":
                out.pop()
            out.extend(["", ""])
        out.append(line)
    text = "\n".join(out).strip("\n") + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)


# What decode's tuned launches depend on: the decode kernels, the helpers they call and the
# launcher that the tuner times (query preparation, grids, stage 2's launch).
DECODE_KERNEL_TEMPLATES = ("common.py.jinja", "decode_prepare.py.jinja", "decode_stage1.py.jinja",
                           "decode_stage1_mma.py.jinja", "decode_stage2.py.jinja", "decode_launcher.py.jinja")


def decode_kernel_hash(config: Config) -> str:
    """SHA-256 of the rendered decode path for one config: the query kernel (fp8 keys do
    without it but keep its template in the hash), stage 1, stage 2, the helpers they
    share (common.py.jinja, which also holds store's and dequantize's helpers) and the
    `decode` launcher.

    Tuned launches are keyed on this rather than on `template_hash`: an edit to the
    store or dequantize kernels, their launchers or the launch heuristic keeps the
    tuning; any change to what the tuner timed, for this config and arch, drops it.
    """
    environment = _environment()
    values = context(config)
    digest = hashlib.sha256()
    for name in DECODE_KERNEL_TEMPLATES:
        rendered = environment.get_template(name).render(**values)
        if rendered.strip():  # a template that renders nothing for this config leaves its hash as it was
            digest.update(name.encode() + b"\0" + rendered.encode() + b"\0")
    return digest.hexdigest()


def render(config: Config, tuned: dict | None = None) -> str:
    """The complete source of the module for one config.

    `tuned` maps a device name to {"triton_version", "source", "buckets":
    {bucket key: (block_kv, num_warps, num_stages, num_splits)}} (see emit.tuned_launches).
    """
    source = _environment().get_template(MODULE_TEMPLATE).render(**context(config, tuned))
    source = _tidy(source)
    compile(source, f"<{config.artifact_name()}>", "exec")  # a template bug fails here, not at import
    return source
