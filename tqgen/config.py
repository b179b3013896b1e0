"""The YAML config: schema, defaults and validation.

One config describes one cache format plus the target it is built for. Every
field has a default except the three that define the format (`key_format`,
`value_bits`, `head_dim`). A wrong config is refused with a `ConfigError` whose
single line names the file, the field, what was given and what is allowed.

Example (configs/k3v4-d128.yaml)::

    key_format: mse
    key_bits: 3
    value_bits: 4
    head_dim: 128
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import reprlib
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ConfigError

KEY_FORMATS = ("mse", "fp8")
MSE_KEY_BITS = (2, 3, 4)
VALUE_BITS = (2, 3, 4, 8)
ARCHES = ("sm80", "sm86", "sm89", "sm90", "sm100", "auto")
# The archs a module is rendered for, oldest first: an `arch: auto` build renders each (tqgen/dispatch.py).
KNOWN_ARCHES = tuple(arch for arch in ARCHES if arch != "auto")
ROTATIONS = ("hadamard", "random")
OUTPUT_DTYPES = ("auto", "float16", "bfloat16", "float32")
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 64, 256, 8
BLOCK_SIZES = tuple(2**i for i in range(0, 10))  # 1 .. 512 tokens per page
# "slots": the cache vLLM's TurboQuant backend allocates, byte-compatible (the default; docs/format.md).
# "planes": tqgen's own page-planar layout, same bytes per token, aligned for wide loads (layout.py).
CACHE_LAYOUTS = ("slots", "planes")
PLANES_MIN_BLOCK_SIZE = 8  # every plane of a page then starts 16-byte aligned


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated, fully resolved cache-format config.

    `arch` may still be "auto" here: `resolve_arch` turns it into the current
    machine's arch before rendering one module, and `tqgen build` renders one
    module per known arch plus a dispatcher (tqgen/dispatch.py).
    """

    key_format: str
    key_bits: int
    value_bits: int
    head_dim: int
    block_size: int = 16
    norm_correction: bool = False
    rotation: str | None = None
    rotation_seed: int = 0
    arch: str = "auto"
    output_dtype: str = "auto"
    cache_layout: str = "slots"
    name: str = ""

    @property
    def is_power_of_two_dim(self) -> bool:
        return self.head_dim & (self.head_dim - 1) == 0

    def short_name(self) -> str:
        """The preset vocabulary: k3v4, k8v4, ... (fp8 keys count as 8 bits)."""
        return f"k{self.key_bits}v{self.value_bits}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def canonical_json(self) -> str:
        """Sorted JSON of every resolved field except the cosmetic `name`.

        The default cache_layout ("slots") is left out, so configs written before
        that field existed keep their hash (and their tuned launches).
        """
        fields = self.to_dict()
        fields.pop("name")
        if fields["cache_layout"] == "slots":
            fields.pop("cache_layout")
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def artifact_name(self) -> str:
        """A file name that spells out every specialization of the kernels; for arch "auto" (the
        dispatcher over one module per arch) the same name without the arch."""
        key = "kfp8" if self.key_format == "fp8" else f"kmse{self.key_bits}"
        parts = [key, f"v{self.value_bits}", f"d{self.head_dim}", f"p{self.block_size}"]
        if self.key_format == "mse":
            parts.append("nc" if self.norm_correction else "nonc")
            parts.append(self.rotation if self.rotation == "hadamard" else f"random{self.rotation_seed}")
        if self.output_dtype != "auto":
            parts.append({"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[self.output_dtype])
        if self.cache_layout != "slots":
            parts.append(self.cache_layout)
        if self.arch != "auto":
            parts.append(self.arch)
        return "tq_" + "_".join(parts)


# A config's name is cosmetic: it titles the emitted modules' docstrings, which stay within 120 columns.
NAME_MAX_LENGTH = 80


def is_valid_name(name: str) -> bool:
    return len(name) <= NAME_MAX_LENGTH and all(" " <= char <= "~" for char in name)


# field name -> (expected python type(s), description of allowed values)
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), f"a string of at most {NAME_MAX_LENGTH} printable ASCII characters"),
    "key_format": ((str,), " or ".join(KEY_FORMATS)),
    "key_bits": ((int,), "2, 3 or 4 for mse keys; 8 for fp8 keys"),
    "value_bits": ((int,), ", ".join(map(str, VALUE_BITS[:-1])) + " or 8"),
    "head_dim": ((int,), f"a multiple of {HEAD_DIM_STEP} from {HEAD_DIM_MIN} to {HEAD_DIM_MAX}"),
    "block_size": ((int,), "a power of two from 1 to 512"),
    "norm_correction": ((bool,), "true or false"),
    "rotation": ((str,), "hadamard or random"),
    "rotation_seed": ((int,), "an integer from 0 to 2**63-1"),
    "arch": ((str,), ", ".join(ARCHES)),
    "output_dtype": ((str,), ", ".join(OUTPUT_DTYPES)),
    "cache_layout": ((str,), " or ".join(CACHE_LAYOUTS)),
}
_REQUIRED = ("key_format", "value_bits", "head_dim")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


# Bounded rendering of YAML values in messages: an alias bomb, a recursive alias or
# a 10**5000 must cost no more to show than a short list does.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 4, 4, 50, 40, 50


def _shown(value: Any) -> str:
    """A short, one-line rendering of a parsed YAML value (booleans and null as YAML spells them)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):  # ints past Python's str-conversion limit
        text = f"<{_type_name(value)} too large to show>"
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def from_mapping(data: Any, source: str = "<config>") -> Config:
    """Validate a parsed YAML document and apply the defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, "<document>", f"got {_type_name(data)}, expected a mapping of config fields")
    for field in data:
        if not isinstance(field, str) or field not in _FIELDS:
            allowed = ", ".join(_FIELDS)
            shown = field if isinstance(field, str) and field.isprintable() else _shown(field)  # one line
            raise ConfigError(source, shown, f"unknown field; allowed fields are {allowed}")
    for field, value in data.items():
        types, allowed = _FIELDS[field]
        # bool is an int in Python; a YAML `true` is never a valid bit width.
        ok = isinstance(value, types) and not (bool not in types and isinstance(value, bool))
        if not ok:
            raise ConfigError(source, field, f"got {_shown(value)} ({_type_name(value)}), allowed {allowed}")
    for field in _REQUIRED:
        if field not in data:
            raise ConfigError(source, field, f"missing; allowed {_FIELDS[field][1]}")

    def refuse(field: str) -> None:
        raise ConfigError(source, field, f"got {_shown(data[field])}, allowed {_FIELDS[field][1]}")

    if not is_valid_name(data.get("name", "")):
        refuse("name")
    key_format = data["key_format"]
    if key_format not in KEY_FORMATS:
        refuse("key_format")
    head_dim = data["head_dim"]
    if not (HEAD_DIM_MIN <= head_dim <= HEAD_DIM_MAX and head_dim % HEAD_DIM_STEP == 0):
        refuse("head_dim")
    value_bits = data["value_bits"]
    if value_bits not in VALUE_BITS:
        refuse("value_bits")
    block_size = data.get("block_size", 16)
    if block_size not in BLOCK_SIZES:
        refuse("block_size")
    arch = data.get("arch", "auto")
    if arch not in ARCHES:
        refuse("arch")
    output_dtype = data.get("output_dtype", "auto")
    if output_dtype not in OUTPUT_DTYPES:
        refuse("output_dtype")
    seed = data.get("rotation_seed", 0)
    if not 0 <= seed < 2**63:
        refuse("rotation_seed")
    cache_layout = data.get("cache_layout", "slots")
    if cache_layout not in CACHE_LAYOUTS:
        refuse("cache_layout")
    if cache_layout == "planes" and block_size < PLANES_MIN_BLOCK_SIZE:
        raise ConfigError(source, "block_size", f"got {block_size} with cache_layout 'planes', which needs pages "
                          f"of at least {PLANES_MIN_BLOCK_SIZE} tokens (so that every plane is 16-byte aligned)")

    power_of_two = head_dim & (head_dim - 1) == 0
    if key_format == "fp8":
        key_bits = data.get("key_bits", 8)
        if key_bits != 8:
            raise ConfigError(source, "key_bits", f"got {_shown(key_bits)}, fp8 keys are 8 bits (leave key_bits out or set 8)")
        for field in ("norm_correction", "rotation", "rotation_seed"):
            if field in data:
                raise ConfigError(source, field, f"got {_shown(data[field])}, but fp8 keys are not rotated; "
                                  "this field applies to mse keys only")
        norm_correction, rotation = False, None
    else:
        key_bits = data.get("key_bits", 4)
        if key_bits not in MSE_KEY_BITS:
            raise ConfigError(source, "key_bits", f"got {_shown(key_bits)}, allowed 2, 3 or 4 for mse keys")
        norm_correction = data.get("norm_correction", True)
        rotation = data.get("rotation", "hadamard" if power_of_two else "random")
        if rotation not in ROTATIONS:
            refuse("rotation")
        if rotation == "hadamard" and not power_of_two:
            raise ConfigError(source, "rotation", f"got 'hadamard' with head_dim {head_dim}; a Hadamard matrix "
                              "needs a power-of-two head_dim, use 'random' (any head_dim)")
        if rotation == "hadamard" and "rotation_seed" in data:
            raise ConfigError(source, "rotation_seed", f"got {_shown(seed)} with rotation 'hadamard', which has "
                              "no seed; remove it or use rotation 'random'")

    if cache_layout == "planes" and 3 in (key_bits, value_bits) and head_dim % 16:
        raise ConfigError(source, "head_dim", f"got {head_dim} with 3-bit codes and cache_layout 'planes', which "
                          "needs a multiple of 16 there (so that every 3-bit record has an even size)")
    return Config(
        key_format=key_format, key_bits=key_bits, value_bits=value_bits, head_dim=head_dim,
        block_size=block_size, norm_correction=norm_correction, rotation=rotation,
        rotation_seed=seed if rotation == "random" else 0, arch=arch, output_dtype=output_dtype,
        cache_layout=cache_layout, name=data.get("name") or f"k{key_bits}v{value_bits}-d{head_dim}",
    )


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; construct_mapping reports it
                duplicate = False
            if duplicate:
                raise _DuplicateKey(problem=f"field {_shown(key)} is given twice", problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


# A config nests one level at most (no field takes a list of lists); deeper flow collections are
# refused before parsing, which PyYAML does recursively: a few thousand brackets took it seconds
# to reach Python's recursion limit. Both refusals, before parsing and on recursion, say the same.
_MAX_FLOW_DEPTH = 32
_TOO_DEEP = "not valid YAML: nested too deeply"


def _flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow collections ([...] and {...}) in text, outside quotes and comments."""
    depth = deepest = 0
    for line in text.splitlines():
        quote = None
        for index, char in enumerate(line):
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#" and (index == 0 or line[index - 1].isspace()):
                break
            elif char in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif char in "]}":
                depth -= 1
    return deepest


def load(path: str | os.PathLike) -> Config:
    """Read and validate one YAML config file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "<file>", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(source, "<file>", "is a directory, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, "<file>", f"cannot be read ({exc.__class__.__name__}: {exc})") from None
    if _flow_depth(text) > _MAX_FLOW_DEPTH:
        raise ConfigError(source, "<yaml>", _TOO_DEEP)
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "invalid syntax"
        raise ConfigError(source, "<yaml>", f"not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(source, "<yaml>", _TOO_DEEP) from None
    except (ValueError, TypeError, OverflowError) as exc:  # scalars yaml cannot build: 2001-13-45, 10**5000
        raise ConfigError(source, "<yaml>", f"not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    if data is None:
        raise ConfigError(source, "<document>", "the file is empty; expected a mapping of config fields")
    if isinstance(data, dict) and "name" not in data:
        if not is_valid_name(Path(path).stem):
            raise ConfigError(source, "name", f"not set, and the file's name {Path(path).stem!r} cannot stand for it: "
                              f"set name: to {_FIELDS['name'][1]}")
        data = {**data, "name": Path(path).stem}
    return from_mapping(data, source)


def resolve_arch(config: Config, device_capability: tuple[int, int] | None = None) -> Config:
    """Replace arch 'auto' by the current GPU's arch.

    Without a GPU (CPU-only machines, the Triton interpreter) 'auto' resolves to
    sm80: its portable fp8 decode is correct on every arch.
    """
    if config.arch != "auto":
        return config
    if device_capability is None:
        device_capability = _current_capability()
    if device_capability is None:
        arch = "sm80"
    else:
        # Unknown parts map onto the nearest arch we render for, never upward (the dispatcher of an
        # arch-auto module picks its variant by the same rule).
        arch = arch_for_capability(tuple(device_capability)) or "sm80"
    return dataclasses.replace(config, arch=arch)


def arch_capability(arch: str) -> tuple[int, int]:
    """The compute capability an arch's code is for: "sm90" -> (9, 0), "sm100" -> (10, 0)."""
    number = int(arch[2:])
    return number // 10, number % 10


def arch_for_capability(capability: tuple[int, int]) -> str | None:
    """The newest known arch whose capability is at most `capability`, or None for an older device."""
    fitting = [arch for arch in KNOWN_ARCHES if arch_capability(arch) <= tuple(capability)]
    return max(fitting, key=arch_capability, default=None)


def _current_capability() -> tuple[int, int] | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()
