"""Drop-in replacements for vLLM's TurboQuant kernels, run by tqgen-built modules.

vLLM's TurboQuant attention backend (vllm/v1/attention/backends/turboquant_attn.py) imports its
kernels from vllm/v1/attention/ops/triton_turboquant_decode.py and triton_turboquant_store.py.
Importing the same names from here instead runs tqgen's kernels on the same cache, with the same
arguments and results:

    from tqgen.vllm import (_tq_full_dequant_kv, _tq_full_dequant_kv_qgroup4, _use_fp8_e4b15,
                            triton_turboquant_decode_attention, triton_turboquant_store)

Each call picks a tqgen module by (head_dim, key format and bits, value bits, norm correction, page
size, the cache's device and its compute capability), renders, writes and imports it on first use
(`tqgen.load`, into `TQGEN_CACHE_DIR`), and keeps it for the process: later calls render nothing,
open no file and never synchronize with the device, so they can be captured in a CUDA graph.

How vLLM's arguments map onto tqgen's (docs/format.md):

- The cache. vLLM allocates `(num_blocks, num_kv_heads, block_size, slot)` uint8 and passes the
  kernels `kv_cache.transpose(1, 2)`, a `[num_blocks, block_size, num_kv_heads, slot]` view with
  head-major strides: exactly the tensor a "slots" module takes (any strides, bytes of a slot
  contiguous). A position-major cache of that shape works the same.
- The rotation. vLLM codes a key as `(k / (||k|| + 1e-8)) @ PiT` and scores `q @ PiT` (`Pi.T` when
  PiT is None); tqgen codes `(k / ...) @ R` and scores `q @ R`. So R = PiT, for any orthogonal
  matrix. A PiT equal to the normalized Sylvester Hadamard matrix (to 1e-6, as vLLM builds it) is
  replaced by the module's own, which the store applies by a Walsh-Hadamard transform in its kernel;
  any other matrix takes tqgen's general path (a torch matmul before the store's kernel).
- The codebook. Decode reads the caller's centroids. vLLM's store takes the midpoints between sorted
  centroids instead: they go to tqgen's store as its decision boundaries, but where they are the default
  codebook's (to 1e-6), which the store searches by half (symmetric about 0) where it can.
- Decode's buffers. tqgen's split-KV partials (per split: D fp32 outputs and one log-sum-exp) are
  carved out of vLLM's `mid_o_buf` `[B, Hq, max_num_kv_splits, D + 1]` fp32, which holds exactly
  that much at the full split count, and the rotated query (fp16) out of what fewer splits leave
  (else a tensor kept for the buffer's address, never freed: a CUDA graph may write it). The
  output is written into `output_buf[:B]`. Missing or unfit buffers are allocated and, as vLLM
  does, recorded on `buf_holder` (`_tq_mid_o_buf`, `_tq_output_buf`). `lse_buf` is not written:
  tqgen's reduction returns the output only, and vLLM's backend never reads it back.
- Splits: the tuned (or heuristic) split count of the decode bucket, at most `max_num_kv_splits`; for
  a block table of fixed width (vLLM's) it is fixed per batch size, as CUDA graphs need.

The cache layout (`TQGEN_VLLM_CACHE_LAYOUT`, or `set_cache_layout` before the first call):

- "slots" (the default): docs/format.md's slots, byte for byte what vLLM's own kernels read and write.
- "planes": the same allocation holds tqgen's page-planar layout instead. vLLM's head-major tensor is
  `(num_blocks, num_kv_heads, block_size, slot)`, so each KV head's page is `block_size * slot` contiguous
  bytes, exactly a page of a planes cache (docs/format.md); store, decode and dequantize here read and
  write it as one, and decode runs the planes kernels (1.1-1.4x faster than slots, BENCHMARKS.md). The bytes
  are then tqgen's, not vLLM's: every kernel that touches the cache must come from here (vLLM's backend
  imports nothing else that reads it), the cache must be vLLM's head-major allocation, and MSE keys
  need norm correction (every vLLM MSE preset has it) and the default codebook (vLLM's Lloyd-Max
  centroids), whose squares the store folds into the stored norms. A codebook tensor is checked on
  its first call outside a CUDA-graph capture.

Differences from vLLM's kernels, all deliberate:
- A sequence of length 0 decodes to zeros (vLLM's reduction divides 0 by 0 there).
- fp8 keys are e4m3fn on every GPU; vLLM's kernels use Triton's e4b15 on compute capability below
  8.9, so `_use_fp8_e4b15` answers 0 and a call passing FP8_E4B15=1 is refused.
- The store writes docs/format.md's slots at every GQA group size (`kv_group_size` changes nothing):
  store, decode and dequantize here all read and write that layout.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import os
import weakref

import torch

from . import config as config_mod
from . import emit

# vLLM's cache dtypes (vllm/model_executor/layers/quantization/turboquant/config.py): key bits
# (8 = fp8), value bits, norm correction.
VLLM_PRESETS = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
MSE_KEY_BITS = (3, 4)  # what vLLM's store packs
VALUE_BITS = (3, 4)  # what vLLM's store and decode read and write
# A caller's PiT within this relative distance of the Sylvester Hadamard matrix takes the module's own
# (applied by a Walsh-Hadamard transform): vLLM builds it in fp32, one rounding from tqgen's.
HADAMARD_RTOL = 1e-6
CACHE_LAYOUTS = ("slots", "planes")
LAYOUT_VARIABLE = "TQGEN_VLLM_CACHE_LAYOUT"
# The planes layout folds the squares of the default centroids into the stored key norms: a caller's centroids
# (or midpoints) must be these to within this fraction of the largest.
PLANES_CODEBOOK_RTOL = 1e-4
# A caller's midpoints within this fraction of the largest of the default codebook's (another solver's rounding of the
# same levels) take the module's own, whose symmetry halves the store's search of 4-bit keys: a code can then differ
# from a search over the caller's only for a rotated coordinate that close to a boundary, less than the rounding of
# the rotation itself moves it.
STORE_MIDPOINTS_RTOL = 1e-6


class VllmArgumentError(ValueError):
    """A call these drop-ins cannot serve; the message is one line naming the argument."""


def _refuse(fn: str, message: str):
    raise VllmArgumentError(f"{fn}: {message}")


def _refused_by_module(fn: str, error: Exception):
    """A built module's LaunchError (its message names the module's function and the argument) as this
    function's VllmArgumentError, so that callers catch one type."""
    raise VllmArgumentError(f"{fn}: {error}") from None


def preset_arguments(cache_dtype: str, head_dim: int) -> dict:
    """The format arguments vLLM's backend passes its kernels for a cache dtype and head dim:
    mse_bits, key_packed_size, value_quant_bits, key_fp8, norm_correction."""
    if cache_dtype not in VLLM_PRESETS:
        raise VllmArgumentError(f"cache dtype {cache_dtype!r} is not one of {', '.join(VLLM_PRESETS)}")
    return format_arguments(*VLLM_PRESETS[cache_dtype], head_dim)


def format_arguments(key_bits: int, value_bits: int, norm_correction: bool, head_dim: int) -> dict:
    """The format arguments of vLLM's kernels for key bits (8: fp8 keys), value bits, norm correction
    and head dim, as its backend computes them."""
    key_fp8 = key_bits == 8
    return dict(mse_bits=0 if key_fp8 else key_bits,
                key_packed_size=head_dim if key_fp8 else math.ceil(head_dim * key_bits / 8) + 2,
                value_quant_bits=value_bits, key_fp8=key_fp8, norm_correction=norm_correction)


def slot_size_aligned(cache_dtype: str, head_dim: int) -> int:
    """Bytes per token and KV head (the last dim of vLLM's cache): key, value codes, scale, zero, even."""
    arguments = preset_arguments(cache_dtype, head_dim)
    size = arguments["key_packed_size"] + math.ceil(head_dim * arguments["value_quant_bits"] / 8) + 4
    return size + size % 2


# --- the cache layout ----------------------------------------------------------------------------
_layout = None  # "slots" or "planes", from TQGEN_VLLM_CACHE_LAYOUT on first use unless set before


def _checked_layout(layout: str) -> str:
    if layout not in CACHE_LAYOUTS:
        raise VllmArgumentError(f"cache layout {layout!r} is not one of {', '.join(CACHE_LAYOUTS)}")
    return layout


def cache_layout() -> str:
    """The layout the drop-ins read and write in vLLM's cache: "slots" or "planes" (module doc)."""
    global _layout
    if _layout is None:
        value = os.environ.get(LAYOUT_VARIABLE, "slots")
        if value not in CACHE_LAYOUTS:
            raise VllmArgumentError(f"{LAYOUT_VARIABLE}={value!r} is not one of {', '.join(CACHE_LAYOUTS)}")
        _layout = value
    return _layout


def set_cache_layout(layout: str) -> None:
    """Pick the cache layout before the first call; once a drop-in has run it is fixed (caches written so far
    hold that layout), and asking for the other one is refused."""
    global _layout
    _checked_layout(layout)  # before any call too: a misspelt name would otherwise run slots silently
    if _modules and cache_layout() != layout:
        raise VllmArgumentError(f"the cache layout is {cache_layout()!r} since the first call of a drop-in (caches "
                                f"written since hold it); set {layout!r} before any call")
    _layout = layout


# cache_layout_for's module tables, by layout: kept from one use to the next (a tool that enters it around every
# few calls finds its modules built), apart from the process's own.
_modules_of_layout: dict = {}


@contextlib.contextmanager
def cache_layout_for(layout: str):
    """Run the drop-ins in a layout for a while, with modules of their own (the layout's, kept for its next use),
    then as before: for tools that compare both layouts in one process (tqgen bench). An engine picks one layout
    per process."""
    global _layout, _modules, _modules_by_config
    saved = _layout, _modules, _modules_by_config
    _layout = _checked_layout(layout)
    _modules, _modules_by_config = _modules_of_layout.setdefault(_layout, ({}, {}))
    try:
        yield
    finally:
        _layout, _modules, _modules_by_config = saved


def _planes(module) -> bool:
    return module.CONFIG.get("cache_layout") == "planes"  # configs leave the default ("slots") out


def _cache_view(fn, module, kv_cache):
    """The tensor the module takes: vLLM's [num_blocks, block_size, num_kv_heads, slot] itself for slots; for
    planes, each (block, KV head) page of the head-major allocation as [num_blocks, num_kv_heads, page bytes]."""
    if not _planes(module):
        return kv_cache
    num_blocks, block_size, num_kv_heads, slot_bytes = kv_cache.shape
    if slot_bytes != module.SLOT_BYTES:
        _refuse(fn, f"kv_cache slots are {slot_bytes} bytes (dim 3), this format's slot is {module.SLOT_BYTES} bytes")
    page_bytes = block_size * slot_bytes
    contiguous_pages = kv_cache.stride(3) == 1 and kv_cache.stride(1) == slot_bytes
    if not contiguous_pages or (num_kv_heads > 1 and kv_cache.stride(2) != page_bytes):
        _refuse(fn, f"the planes layout needs vLLM's head-major cache (each KV head's page contiguous: strides "
                f"(*, {slot_bytes}, {page_bytes}, 1)), got strides {tuple(kv_cache.stride())}")
    return kv_cache.as_strided((num_blocks, num_kv_heads, page_bytes), (kv_cache.stride(0), page_bytes, 1))


def _near(source, expected, rtol) -> bool:
    """Whether source (any dtype) has expected's shape and values within rtol of expected's largest magnitude."""
    return (tuple(source.shape) == tuple(expected.shape)
            and bool(torch.allclose(source.to(torch.float32), expected, rtol=0.0,
                                    atol=rtol * float(expected.abs().max()))))


def _default_codebook(fn, module, name, tensor, default):
    """Refuse a codebook tensor other than the module's default (planes: the store folds the default centroids'
    squares into the key norms); checked once per tensor and version, taken on trust in a capture."""
    def matches(source, capturing):
        if capturing:
            return True  # comparing reads values on the host; the eager calls before a capture check it
        return _near(source, default(source.device), PLANES_CODEBOOK_RTOL)

    if isinstance(tensor, torch.Tensor) and not _derive(("default-codebook", id(module), name), tensor, matches):
        _refuse(fn, f"{name} differ from the default Lloyd-Max codebook: the planes cache layout stores key norms "
                f"corrected by the default centroids ({LAYOUT_VARIABLE}=slots takes any codebook)")


# --- the modules -------------------------------------------------------------------------------
_modules: dict = {}  # the arguments' dispatch key -> module
_modules_by_config: dict = {}  # Config -> module (several argument spellings share one)


def _module(fn, device, head_dim, block_size, key_fp8, mse_bits, key_packed_size, value_quant_bits,
            norm_correction):
    """The module for a format on a device in the cache layout: a dictionary lookup after its first call."""
    layout = cache_layout()
    key = (device, head_dim, block_size, key_fp8, mse_bits, key_packed_size, value_quant_bits, norm_correction,
           layout)
    module = _modules.get(key)
    if module is None:
        config = _config(fn, device, head_dim, block_size, bool(key_fp8), mse_bits, key_packed_size,
                         value_quant_bits, bool(norm_correction), layout)
        module = _modules_by_config.get(config)
        if module is None:
            module = _modules_by_config[config] = emit.load(config)
        _modules[key] = module
    return module


def _config(fn, device, head_dim, block_size, key_fp8, mse_bits, key_packed_size, value_quant_bits,
            norm_correction, layout="slots") -> config_mod.Config:
    """The tqgen config of vLLM's format arguments, arch resolved for the device; one-line refusals."""
    lowest, highest, step = config_mod.HEAD_DIM_MIN, config_mod.HEAD_DIM_MAX, config_mod.HEAD_DIM_STEP
    if not (lowest <= head_dim <= highest and head_dim % step == 0):
        _refuse(fn, f"head_dim {head_dim} is not supported: tqgen builds multiples of {step} "
                f"from {lowest} to {highest}")
    if block_size not in config_mod.BLOCK_SIZES:
        _refuse(fn, f"kv_cache has pages of {block_size} tokens (dim 1), expected a power of two up to "
                f"{config_mod.BLOCK_SIZES[-1]}")
    if value_quant_bits not in VALUE_BITS:
        _refuse(fn, f"value_quant_bits {value_quant_bits!r} is not supported, expected 3 or 4")
    if key_fp8:
        fields = dict(key_format="fp8", value_bits=value_quant_bits)
        packed = head_dim
    else:
        if mse_bits not in MSE_KEY_BITS:
            _refuse(fn, f"mse_bits {mse_bits!r} is not supported for MSE keys, expected 3 or 4 (or key_fp8=True)")
        power_of_two = head_dim & (head_dim - 1) == 0
        # The module's own rotation is used only when the caller's PiT is the Hadamard matrix; for other
        # head dims it is never used (every call passes the caller's matrix).
        fields = dict(key_format="mse", key_bits=mse_bits, value_bits=value_quant_bits,
                      norm_correction=norm_correction, rotation="hadamard" if power_of_two else "random")
        packed = math.ceil(head_dim * mse_bits / 8) + 2
    if key_packed_size != packed:
        _refuse(fn, f"key_packed_size {key_packed_size!r} does not match the format: "
                f"{'fp8' if key_fp8 else f'{mse_bits}-bit MSE'} keys of head_dim {head_dim} take {packed} bytes")
    if layout == "planes":
        if not key_fp8 and not norm_correction:
            _refuse(fn, f"norm_correction=False: the planes cache layout stores norm-corrected key norms (every "
                    f"vLLM MSE preset corrects); {LAYOUT_VARIABLE}=slots decodes without")
        fields["cache_layout"] = "planes"
    try:
        config = config_mod.from_mapping(dict(fields, head_dim=head_dim, block_size=block_size), "<tqgen.vllm>")
    except config_mod.ConfigError as error:
        _refuse(fn, f"the {layout} cache layout cannot hold this format: {error}")
    # CPU tensors run in Triton's interpreter: the portable sm80 module, whatever GPU the machine has.
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (8, 0)
    return config_mod.resolve_arch(config, capability)


# --- the codebook ------------------------------------------------------------------------------
# Tensors derived from a caller's codebook tensors (rotations, fp32 copies): id(source) -> (a weak reference to
# source, {kind: (signature, derived)}), dropped when the source dies. A plain dictionary by id, not torch's
# WeakIdKeyDictionary, whose every lookup built a weak-reference object (two lookups a decode call). No size bound:
# an engine holds a codebook tensor or two per layer and calls in a fixed order, so a bounded cache shorter than
# that cycle would miss on every call.
_derived: dict = {}
# Per module and device: an empty decode workspace to copy.
_constants: dict = {}


def _capturing(tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of the current device: the drop-ins run with
    their cache's device current (_device_switch), so that is the stream their tensors' work goes to."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _device_switch(kv_cache):
    """torch.cuda.device(i) when kv_cache is on CUDA device i and another device is current, else None (as the
    modules' launchers switch). With the device current already: one query of the current device index."""
    if not isinstance(kv_cache, torch.Tensor):
        return None
    device = kv_cache.device
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return None
    return torch.cuda.device(device.index)


def _on_cache_device(function):
    """Runs a drop-in with its `kv_cache` argument's device current from its first step: torch.cuda's
    is_current_stream_capturing and current stream are the current device's, so a graph captured on cuda:1 while
    cuda:0 is current would go unseen by _derive (a codebook check reading values on the host inside the capture, a
    copy made in the capture kept for later calls)."""
    position = list(inspect.signature(function).parameters).index("kv_cache")

    @functools.wraps(function)
    def on_cache_device(*args, **kwargs):
        switch = _device_switch(args[position] if len(args) > position else kwargs.get("kv_cache"))
        if switch is None:
            return function(*args, **kwargs)
        with switch:
            return function(*args, **kwargs)

    return on_cache_device


def _derive(kind, source, make, fresh_in_capture=False):
    """make(source), once per source tensor, kind and contents version (in-place writes bump it). While a CUDA
    graph is being captured a source not derived before is derived without caching (`make` must then not
    synchronize), and with fresh_in_capture every source is: the graph then holds the copy kernel, so a replay
    reads the source as it is then (a weight reload writing it in place reaches the graph). An inference tensor
    (made under torch.inference_mode, where vLLM's forward builds its codebook) keeps no version counter: in-place
    writes to one go unseen."""
    version = None if source.is_inference() else source._version
    signature = (version, source.data_ptr(), source.shape, source.stride(), source.dtype, source.device)
    capturing = _capturing(source)
    held = _derived.get(id(source))
    entries = held[1] if held is not None and held[0]() is source else None  # not a dead tensor's id reused
    if entries is not None and not (capturing and fresh_in_capture):
        entry = entries.get(kind)
        if entry is not None and entry[0] == signature:
            return entry[1]
    derived = make(source, capturing=capturing)
    if not capturing:
        if entries is None:
            entries = {}
            _derived[id(source)] = (weakref.ref(source, functools.partial(_forget_derived, id(source))), entries)
        entries[kind] = (signature, derived)
    return derived


def _forget_derived(source_id, reference):
    """The weak reference's callback: drop a dead source's entry (unless a new tensor with its id replaced it)."""
    held = _derived.get(source_id)
    if held is not None and held[0] is reference:
        del _derived[source_id]


def _fp32(tensor):
    """The tensor as contiguous fp32 (itself when it already is: no lookup on the hot path)."""
    if not isinstance(tensor, torch.Tensor) or (tensor.dtype == torch.float32 and tensor.is_contiguous()):
        return tensor  # not a tensor: the module's launcher refuses it by name
    return _derive("fp32", tensor, lambda t, capturing: t.to(torch.float32).contiguous(), fresh_in_capture=True)


def _centroids(fn, module, centroids):
    """The caller's centroids as contiguous fp32; the planes layout takes only the default ones."""
    if _planes(module):
        _default_codebook(fn, module, "centroids", centroids, module.default_centroids)
    return _fp32(centroids)


def _decode_centroids(fn, module, centroids):
    """_centroids, or the module's own default tensor where the caller's are the default levels in fp16, which is
    all the Gluon decode reads of them (the same bits): decode takes its symmetric lookup of 4-bit keys for that
    tensor only, and vLLM passes a copy of its own. Decided once per tensor and version outside a capture; a
    tensor first seen inside one keeps its own path, which is correct for any centroids."""
    centroids = _centroids(fn, module, centroids)
    if not module.SYMMETRIC_KEY_LOOKUP or not isinstance(centroids, torch.Tensor):
        return centroids  # the same kernels either way (a non-tensor: the module's launcher refuses it by name)

    def default_if_equal(source, capturing):
        if capturing:  # comparing reads values on the host
            return None
        default = module.default_centroids(source.device)
        same = source.shape == default.shape and torch.equal(source.to(torch.float16), default.to(torch.float16))
        return default if same else None

    default = _derive(("default-centroids", id(module)), centroids, default_if_equal)
    return centroids if default is None else default


def _check_square(fn, name, matrix, head_dim):
    if not isinstance(matrix, torch.Tensor) or tuple(matrix.shape) != (head_dim, head_dim):
        shown = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        _refuse(fn, f"{name} must be a [{head_dim}, {head_dim}] tensor, got {shown}")


def _decode_rotation(fn, module, Pi, PiT, head_dim):
    """R = PiT, or Pi.T when PiT is None (vLLM's q_rot = q @ PiT), as contiguous fp32; the module's own
    Hadamard matrix where R equals it, so that decode may rotate the query inside its kernels."""
    name, matrix = ("Pi", Pi) if PiT is None else ("PiT", PiT)
    _check_square(fn, name, matrix, head_dim)
    if _is_module_hadamard(module, matrix):  # symmetric: Pi.T is Pi
        return module.default_rotation(matrix.device)
    if PiT is not None:
        return _fp32(PiT)
    return _derive("transpose", Pi, lambda t, capturing: t.t().to(torch.float32).contiguous(), fresh_in_capture=True)


def _store_rotation(fn, module, PiT, head_dim):
    """PiT as tqgen's store rotation: the module's own Hadamard matrix where PiT equals it (the store's
    kernel then rotates by a Walsh-Hadamard transform), else PiT as contiguous fp32."""
    _check_square(fn, "PiT", PiT, head_dim)
    return module.default_rotation(PiT.device) if _is_module_hadamard(module, PiT) else _fp32(PiT)


def _store_boundaries(module, midpoints) -> dict:
    """The store's codebook arguments for vLLM's midpoints: none where they are the default ones (to
    STORE_MIDPOINTS_RTOL) and the module's store searches half of those (STORE_SYMMETRIC_SEARCH: 4-bit keys, and
    3-bit ones at head_dim 128 on a GPU that runs Gluon; H100, 4-bit keys at 65536 tokens, 12% faster), else the
    midpoints as its boundaries. Decided once per tensor and version outside a capture and reused by a capture; a
    tensor first seen inside one keeps its own boundaries (correct for any)."""
    if not module.STORE_SYMMETRIC_SEARCH or not isinstance(midpoints, torch.Tensor):
        return dict(boundaries=_fp32(midpoints))

    def is_default(source, capturing):
        if capturing:  # comparing reads values on the host
            return False
        return _near(source, module.decision_boundaries(module.default_centroids(source.device)),
                     STORE_MIDPOINTS_RTOL)

    return {} if _derive(("default-midpoints", id(module)), midpoints, is_default) else dict(boundaries=_fp32(midpoints))


def _is_module_hadamard(module, matrix) -> bool:
    """Whether matrix is the module's own Hadamard rotation (symmetric: matrix and its transpose alike). Decided
    once per tensor and version outside a capture and reused by a capture; a tensor first seen inside a capture
    is taken as another matrix, whose general path is correct for any."""
    if module.CONFIG["rotation"] != "hadamard":
        return False

    def is_hadamard(source, capturing):
        if capturing:  # comparing reads values on the host
            return False
        hadamard = module.default_rotation(source.device)
        return bool(torch.allclose(source.to(torch.float32), hadamard, rtol=HADAMARD_RTOL, atol=0.0))

    return _derive(("hadamard", id(module)), matrix, is_hadamard)


# --- decode ------------------------------------------------------------------------------------
def _check_rank(fn, name, tensor, ndim, shape):
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
        shown = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        _refuse(fn, f"{name} must be {shape}, got {shown}")


@_on_cache_device
def triton_turboquant_decode_attention(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits,
                                       key_packed_size, value_quant_bits, key_fp8=False, norm_correction=False,
                                       PiT=None, mid_o_buf=None, output_buf=None, lse_buf=None, buf_holder=None,
                                       max_num_kv_splits=32):
    """Decode attention, one query token per sequence: [B, Hq, D] in the query's dtype (or output_buf[:B]).

    query [B, Hq, D]; kv_cache uint8 [num_blocks, block_size, Hk, slot] (vLLM's head-major cache
    transposed, or any strides); block_table int32 [B, max_blocks]; seq_lens int32 [B]; Pi, PiT
    fp32 [D, D]; centroids fp32 [2**mse_bits] (unused for fp8 keys). lse_buf is not written.
    """
    fn = "triton_turboquant_decode_attention"
    _check_rank(fn, "query", query, 3, "[batch, num_q_heads, head_dim]")
    _check_rank(fn, "kv_cache", kv_cache, 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]")
    batch, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2]
    device = kv_cache.device
    module = _module(fn, device, head_dim, block_size, key_fp8, mse_bits, key_packed_size, value_quant_bits,
                     norm_correction)
    kv_cache = _cache_view(fn, module, kv_cache)
    if not isinstance(max_num_kv_splits, int) or max_num_kv_splits < 1:
        _refuse(fn, f"max_num_kv_splits must be a positive int, got {max_num_kv_splits!r}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        _refuse(fn, f"query has {num_q_heads} heads, not a multiple of kv_cache's {num_kv_heads} KV heads (dim 2)")
    out = _decode_output(output_buf, buf_holder, batch, num_q_heads, head_dim, query.dtype, device)
    if batch == 0:
        return out
    # Its width picks the launch below: a block table of another rank is refused here, not by an IndexError.
    _check_rank(fn, "block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    # vLLM's kernel reads the first B rows of block_table and seq_lens: longer ones (padded for a CUDA graph)
    # are cut to B; shorter ones are refused by the module.
    if block_table.shape[0] > batch:
        block_table = block_table[:batch]
    if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 and seq_lens.shape[0] > batch:
        seq_lens = seq_lens[:batch]
    group_size = num_q_heads // num_kv_heads
    context = block_table.shape[1] * block_size  # what the module's decode buckets by when not told
    num_splits = min(module.decode_launch(batch, num_kv_heads, group_size, context, device)[3], max_num_kv_splits)
    workspace = _decode_workspace(module, mid_o_buf, buf_holder, batch, num_q_heads, head_dim, num_splits,
                                  max_num_kv_splits, device, needs_query=not key_fp8)
    codebook = {} if key_fp8 else {"rotation": _decode_rotation(fn, module, Pi, PiT, head_dim),
                                   "centroids": _decode_centroids(fn, module, centroids)}
    try:
        return module.decode(query, kv_cache, block_table, seq_lens, scale=scale, out=out, workspace=workspace,
                             num_splits=num_splits, validate=False, **codebook)
    except module.LaunchError as error:
        _refused_by_module(fn, error)


# The views of vLLM's buffers that the last calls took, by the memory the buffers are in: the buffers live as long as
# the engine, and a view built per call (slices, a DecodeWorkspace) was a sizeable part of a call's host time
# (tools/host_overhead.py). vLLM's backend takes them from its WorkspaceManager, which returns new views of one
# allocation on every call (a slice of a uint8 tensor, viewed as another dtype: no _base leads back to it), so views
# are found by the buffer's storage and keyed by its address, shape, strides and dtype. Only the latest storage of
# each kind is held (through the buffer that came with it, which keeps it allocated: no other storage can start at
# its address meanwhile); a buffer in another storage replaces its views (and the reference to it).
_buffer_views: dict = {}  # kind -> (buffer, its storage's address, {call key: view})


def _held_view(kind, buffer, key):
    """The view an earlier call built of this buffer's storage for `key` (None: no buffer), else None."""
    held = _buffer_views.get(kind)
    if key is None or held is None or (held[0] is not buffer and held[1] != buffer.untyped_storage().data_ptr()):
        return None
    return held[2].get(key)


def _hold_view(kind, buffer, key, view):
    """Keep `view` of `buffer` for later calls with `key` (dropping the views of any other storage of this kind)."""
    held = _buffer_views.get(kind)
    storage = buffer.untyped_storage().data_ptr()
    if held is None or held[1] != storage:
        held = _buffer_views[kind] = (buffer, storage, {})
    held[2][key] = view
    return view


def _decode_output(output_buf, buf_holder, batch, num_q_heads, head_dim, dtype, device):
    """output_buf[:batch] where it fits (vLLM's test: enough rows, the query's dtype), else a new tensor."""
    view_key = (output_buf.data_ptr(), output_buf.shape, output_buf.stride(), output_buf.dtype, batch, num_q_heads,
                head_dim, dtype, device) if isinstance(output_buf, torch.Tensor) else None
    view = _held_view("output", output_buf, view_key)
    if view is not None:
        return view
    if (isinstance(output_buf, torch.Tensor) and output_buf.dim() == 3 and output_buf.dtype == dtype
            and output_buf.device == device and output_buf.shape[0] >= batch and output_buf.shape[1] >= num_q_heads
            and output_buf.shape[2] >= head_dim and output_buf.stride(2) == 1):
        return _hold_view("output", output_buf, view_key, output_buf[:batch, :num_q_heads, :head_dim])
    out = torch.empty(batch, num_q_heads, head_dim, dtype=dtype, device=device)
    if buf_holder is not None:
        buf_holder._tq_output_buf = out
    return out


def _decode_workspace(module, mid_o_buf, buf_holder, batch, num_q_heads, head_dim, num_splits, max_splits, device,
                      needs_query):
    """A DecodeWorkspace over vLLM's mid_o_buf: the partial outputs [B, Hq, splits, D], then the partial
    log-sum-exps [B, Hq, splits] (together B * Hq * splits * (D + 1) floats, what mid_o_buf holds at
    max_splits), then the rotated fp16 query where room is left (16-byte aligned)."""
    view_key = (id(module), mid_o_buf.data_ptr(), mid_o_buf.shape, mid_o_buf.stride(), mid_o_buf.dtype, batch,
                num_q_heads, head_dim, num_splits, max_splits, device, needs_query) \
        if isinstance(mid_o_buf, torch.Tensor) else None
    workspace = _held_view("workspace", mid_o_buf, view_key)
    if workspace is not None:
        return workspace  # this buffer's workspace for this call's shape, built by an earlier call
    fits = (isinstance(mid_o_buf, torch.Tensor) and mid_o_buf.dtype == torch.float32 and mid_o_buf.device == device
            and mid_o_buf.dim() == 4 and mid_o_buf.shape[0] >= batch and mid_o_buf.shape[1] >= num_q_heads
            and mid_o_buf.shape[2] >= max_splits and mid_o_buf.shape[3] == head_dim + 1 and mid_o_buf.is_contiguous())
    if not fits:
        mid_o_buf = torch.empty(batch, num_q_heads, max_splits, head_dim + 1, dtype=torch.float32, device=device)
        if buf_holder is not None:
            buf_holder._tq_mid_o_buf = mid_o_buf
        counters = torch.zeros(batch * num_q_heads, dtype=torch.int32, device=device)  # this call's alone
        return _carve_workspace(module, mid_o_buf, counters, batch, num_q_heads, head_dim, num_splits, device,
                                needs_query)
    counters = _split_counters(mid_o_buf, device)
    kept = counters is not None
    if not kept:  # none kept yet, in a CUDA-graph capture: zeros of this call's own (the graph's), its view not held
        counters = torch.zeros(batch * num_q_heads, dtype=torch.int32, device=device)
    workspace = _carve_workspace(module, mid_o_buf, counters, batch, num_q_heads, head_dim, num_splits, device,
                                 needs_query, keep_query=True)
    return _hold_view("workspace", mid_o_buf, view_key, workspace) if kept else workspace


# Tensors of tqgen's own for each of vLLM's mid_o_buf addresses, by (device, address): decode's split counters
# (DecodeWorkspace.split_counters), and the rotated queries of the buffers with no room for them (at the full split
# count). Never freed, since a CUDA graph keeps their address and writes them on every replay (a buffer object
# replaced in _buffer_views must not take them with it), and kept apart per buffer, since buffers of calls that may
# run at once (two streams) differ.
_split_counter_store: dict = {}
_query_store: dict = {}
_outgrown_kept: list = []  # those replaced by larger ones for a larger buffer at the same address


def _kept_for_buffer(store, mid_o_buf, numel, make, device):
    """store's tensor of at least numel elements for mid_o_buf's address on device, made by make(numel) the first
    time (and again, larger, for a larger buffer at that address); with make None, the kept one or None."""
    key = (device, mid_o_buf.data_ptr())
    kept = store.get(key)
    fits = kept is not None and kept.numel() >= numel
    if fits or make is None:
        return kept if fits else None
    if kept is not None:
        _outgrown_kept.append(kept)
    kept = store[key] = make(numel)
    return kept


def _split_counters(mid_o_buf, device):
    """Int32 zeros for decode's merge in stage 1, one per row of mid_o_buf's first two dims, for every call over
    that buffer's memory (each call leaves them zero). vLLM's buffers hold whatever they held before: these are
    tqgen's. None while a CUDA graph is captured and none that serve the buffer are kept: zeros made in a capture
    are a memset that runs only when the graph replays, garbage to every other call until then."""
    make = None if _capturing(mid_o_buf) else lambda size: torch.zeros(size, dtype=torch.int32, device=device)
    return _kept_for_buffer(_split_counter_store, mid_o_buf, mid_o_buf.shape[0] * mid_o_buf.shape[1], make, device)


def _kept_query(mid_o_buf, batch, num_q_heads, head_dim, device):
    """An fp16 [batch, num_q_heads, head_dim] rotated query for every call over mid_o_buf's memory that has no room
    for it: one tensor per address, for the rows of mid_o_buf's first two dims."""
    kept = _kept_for_buffer(_query_store, mid_o_buf, mid_o_buf.shape[0] * mid_o_buf.shape[1] * head_dim,
                            lambda size: torch.empty(size, dtype=torch.float16, device=device), device)
    return kept[:batch * num_q_heads * head_dim].view(batch, num_q_heads, head_dim)


def _carve_workspace(module, mid_o_buf, split_counters, batch, num_q_heads, head_dim, num_splits, device, needs_query,
                     keep_query=False):
    """The DecodeWorkspace of one call's shape as views of mid_o_buf (_decode_workspace), with split_counters; a
    query with no room there is the buffer address's own (_kept_query) where keep_query, else the call's."""
    partial_floats = batch * num_q_heads * num_splits * head_dim
    lse_floats = batch * num_q_heads * num_splits
    query_start = -(-(partial_floats + lse_floats) // 4) * 4
    flat = mid_o_buf.view(-1)
    # A copy of an empty workspace of this module (whatever fields its class sets), given vLLM's buffers.
    key = ("workspace", id(module), num_q_heads, device)
    if key not in _constants:
        _constants[key] = module.DecodeWorkspace(0, num_q_heads, 1, device)
    workspace = copy.copy(_constants[key])
    workspace.max_batch, workspace.num_q_heads, workspace.max_splits = batch, num_q_heads, num_splits
    workspace.split_counters = split_counters
    workspace.partial_out = flat[:partial_floats].view(batch, num_q_heads, num_splits, head_dim)
    workspace.partial_lse = flat[partial_floats:partial_floats + lse_floats].view(batch, num_q_heads, num_splits)
    if needs_query:
        query_floats = batch * num_q_heads * head_dim // 2
        if query_start + query_floats <= flat.numel():
            workspace.query = flat[query_start:query_start + query_floats].view(torch.float16).view(
                batch, num_q_heads, head_dim)
        elif keep_query:
            workspace.query = _kept_query(mid_o_buf, batch, num_q_heads, head_dim, device)
        else:
            workspace.query = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float16, device=device)
    return workspace


# --- store -------------------------------------------------------------------------------------
@_on_cache_device
def triton_turboquant_store(key, value, kv_cache, slot_mapping, PiT, midpoints, mse_bits, key_packed_size,
                            value_quant_bits, key_fp8=False, kv_group_size=None):
    """Quantize key, value [N, Hk, D] into kv_cache [num_blocks, block_size, Hk, slot] at slot_mapping [N]
    (block * block_size + position; negative entries skipped). PiT fp32 [D, D] and midpoints fp32
    [2**mse_bits - 1] (ascending) are unused for fp8 keys; kv_group_size changes nothing (module doc)."""
    fn = "triton_turboquant_store"
    _check_rank(fn, "key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    _check_rank(fn, "kv_cache", kv_cache, 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]")
    if kv_group_size is not None and (not isinstance(kv_group_size, int) or kv_group_size < 1):
        _refuse(fn, f"kv_group_size must be None or a positive int, got {kv_group_size!r}")
    head_dim = key.shape[2]
    # Norm correction changes how slots are read, not what the store writes: one module serves both.
    module = _module(fn, kv_cache.device, head_dim, kv_cache.shape[1], key_fp8, mse_bits, key_packed_size,
                     value_quant_bits, True)
    kv_cache = _cache_view(fn, module, kv_cache)
    # vLLM's kernel stores key.shape[0] tokens and reads that many entries of slot_mapping: a longer one
    # (padded for a CUDA graph) has its tail ignored; a shorter one is refused (vLLM would read past it).
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1:
        if slot_mapping.shape[0] < key.shape[0]:
            _refuse(fn, f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens of key")
        slot_mapping = slot_mapping[:key.shape[0]]
    codebook = {}
    if not key_fp8:
        boundaries = 2**mse_bits - 1
        if not isinstance(midpoints, torch.Tensor) or tuple(midpoints.shape) != (boundaries,):
            shown = tuple(midpoints.shape) if isinstance(midpoints, torch.Tensor) else type(midpoints).__name__
            _refuse(fn, f"midpoints must be a [{boundaries}] tensor (between {2**mse_bits} sorted centroids), "
                    f"got {shown}")
        if _planes(module):
            _default_codebook(fn, module, "midpoints", midpoints,
                              lambda device: module.decision_boundaries(module.default_centroids(device)))
        codebook = dict(rotation=_store_rotation(fn, module, PiT, head_dim), **_store_boundaries(module, midpoints))
    try:
        module.store(key, value, kv_cache, slot_mapping, validate=False, **codebook)
    except module.LaunchError as error:
        _refused_by_module(fn, error)


# --- continuation prefill: the full dequantize kernel ---------------------------------------------
def _use_fp8_e4b15(device: int = 0) -> int:
    """0: these kernels keep fp8 keys as e4m3fn on every GPU (vLLM's use e4b15 below compute capability 8.9)."""
    return 0


class _KernelLaunch:
    """Launched as vLLM launches its Triton kernel, `kernel[grid](*args, **kwargs)`."""

    def __init__(self, run):
        self._run = run
        functools.update_wrapper(self, run)

    def __getitem__(self, grid):
        return functools.partial(self._run, grid)


def _full_dequant_kv(grid, KV_cache_ptr, Block_table_ptr, Centroids_ptr, K_out_ptr, V_out_ptr,
                     stride_ko_b, stride_ko_h, stride_ko_s, stride_vo_b, stride_vo_h, stride_vo_s,
                     stride_cache_block, stride_cache_pos, stride_cache_head, stride_bt_b,
                     HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS, MSE_BYTES, KPS, VQB, VAL_DATA_BYTES, MSE_BITS, KEY_FP8,
                     BLOCK_D, NORM_CORRECTION=0, FP8_E4B15=0, num_warps=None, num_stages=None):
    """vLLM's `_tq_full_dequant_kv[grid](...)`: for grid (positions, batch * NUM_KV_HEADS), K and V of
    every position < positions of each sequence's blocks, in fp16, into K_out / V_out [B, Hk, S, D]
    (given strides): keys in the rotated domain (n * c_hat, or the fp8 key), for the caller to
    multiply by Pi. num_warps and num_stages are the kernel's launch options: tqgen picks its own."""
    _full_dequant("_tq_full_dequant_kv", grid, KV_cache_ptr, Block_table_ptr, Centroids_ptr, K_out_ptr, V_out_ptr,
                  (stride_ko_b, stride_ko_h, stride_ko_s), (stride_vo_b, stride_vo_h, stride_vo_s),
                  (stride_cache_block, stride_cache_pos, stride_cache_head), stride_bt_b, HEAD_DIM, BLOCK_SIZE,
                  NUM_KV_HEADS, MSE_BYTES, KPS, VQB, VAL_DATA_BYTES, MSE_BITS, bool(KEY_FP8), bool(NORM_CORRECTION),
                  FP8_E4B15)


def _full_dequant_kv_qgroup4(grid, KV_cache_ptr, Block_table_ptr, Centroids_ptr, K_out_ptr, V_out_ptr,
                             stride_ko_b, stride_ko_h, stride_ko_s, stride_vo_b, stride_vo_h, stride_vo_s,
                             stride_cache_block, stride_cache_pos, stride_cache_head, stride_bt_b,
                             HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS, MSE_BYTES, VQB, VAL_DATA_BYTES, MSE_BITS, BLOCK_D,
                             NORM_CORRECTION=0, num_warps=None, num_stages=None):
    """The variant newer vLLM backends launch for MSE keys, 4-bit values and 4 query heads per KV head
    (their store then writes another layout). The store here writes slots at every group size, so this
    reads slots exactly as `_tq_full_dequant_kv` does."""
    _full_dequant("_tq_full_dequant_kv_qgroup4", grid, KV_cache_ptr, Block_table_ptr, Centroids_ptr, K_out_ptr,
                  V_out_ptr, (stride_ko_b, stride_ko_h, stride_ko_s), (stride_vo_b, stride_vo_h, stride_vo_s),
                  (stride_cache_block, stride_cache_pos, stride_cache_head), stride_bt_b, HEAD_DIM, BLOCK_SIZE,
                  NUM_KV_HEADS, MSE_BYTES, MSE_BYTES + 2, VQB, VAL_DATA_BYTES, MSE_BITS, False,
                  bool(NORM_CORRECTION), 0)


_tq_full_dequant_kv = _KernelLaunch(_full_dequant_kv)
_tq_full_dequant_kv_qgroup4 = _KernelLaunch(_full_dequant_kv_qgroup4)


@_on_cache_device
def _full_dequant(fn, grid, kv_cache, block_table, centroids, k_out, v_out, k_strides, v_strides, cache_strides,
                  block_table_stride, head_dim, block_size, num_kv_heads, mse_bytes, key_packed_size, value_bits,
                  value_bytes, mse_bits, key_fp8, norm_correction, fp8_e4b15):
    if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3 or not all(isinstance(g, int) for g in grid):
        _refuse(fn, f"grid must be a tuple (positions, batch * NUM_KV_HEADS), got {grid!r}")
    positions, programs = grid[0], grid[1] if len(grid) > 1 else 1
    if fp8_e4b15:
        _refuse(fn, "FP8_E4B15=1: these caches hold e4m3fn keys on every GPU (_use_fp8_e4b15 answers 0)")
    _check_rank(fn, "KV_cache_ptr", kv_cache, 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]")
    if (kv_cache.shape[1], kv_cache.shape[2]) != (block_size, num_kv_heads):
        _refuse(fn, f"KV_cache_ptr is {tuple(kv_cache.shape)}, BLOCK_SIZE {block_size} and NUM_KV_HEADS "
                f"{num_kv_heads} expect [num_blocks, {block_size}, {num_kv_heads}, slot_bytes]")
    if tuple(kv_cache.stride()[:3]) != tuple(cache_strides):
        _refuse(fn, f"stride_cache_block/pos/head {tuple(cache_strides)} are not KV_cache_ptr's strides "
                f"{tuple(kv_cache.stride()[:3])}")
    _check_rank(fn, "Block_table_ptr", block_table, 2, "[batch, max_blocks_per_seq]")
    if block_table.stride(0) != block_table_stride and block_table.shape[0] > 1:
        _refuse(fn, f"stride_bt_b {block_table_stride} is not Block_table_ptr's row stride {block_table.stride(0)}")
    if programs % num_kv_heads:
        _refuse(fn, f"grid[1] = {programs} is not a multiple of NUM_KV_HEADS {num_kv_heads}")
    module = _module(fn, kv_cache.device, head_dim, block_size, key_fp8, mse_bits, key_packed_size, value_bits,
                     norm_correction)
    if (not key_fp8 and mse_bytes != module.KEY_CODE_BYTES) or value_bytes != module.VALUE_CODE_BYTES:
        _refuse(fn, f"MSE_BYTES {mse_bytes} / VAL_DATA_BYTES {value_bytes} do not match the format "
                f"({module.KEY_CODE_BYTES} / {module.VALUE_CODE_BYTES} bytes)")
    kv_cache = _cache_view(fn, module, kv_cache)
    batch = programs // num_kv_heads
    if positions <= 0 or batch == 0:
        return
    if block_table.shape[0] < batch:
        _refuse(fn, f"grid[1] = {programs} is {batch} sequences of NUM_KV_HEADS {num_kv_heads}, Block_table_ptr has "
                f"{block_table.shape[0]} rows")
    # Refused before any work: what vLLM's kernel writes, K and V of every position, through the given strides.
    shape = (batch, num_kv_heads, positions, head_dim)
    k_out = _output_view(fn, "K_out_ptr", k_out, shape, k_strides, kv_cache.device)
    v_out = _output_view(fn, "V_out_ptr", v_out, shape, v_strides, kv_cache.device)
    seq_lens = torch.full((batch,), positions, dtype=torch.int32, device=kv_cache.device)
    # Keys in the rotated domain, as vLLM's kernel returns them (its caller multiplies by the rotation).
    codebook = {} if key_fp8 else {"rotated_keys": True, "centroids": _centroids(fn, module, centroids)}
    try:
        keys, values = module.dequantize(kv_cache, block_table[:batch], seq_lens, max_len=positions,
                                         dtype=torch.float16, validate=False, **codebook)
    except module.LaunchError as error:
        _refused_by_module(fn, error)
    k_out.copy_(keys)
    v_out.copy_(values)


def _output_view(fn, name, tensor, shape, strides, device):
    """The view of an output tensor that vLLM's kernel writes: `shape` at (*strides, 1) from the tensor's start, which
    must lie inside its storage, on the cache's device (vLLM's kernel writes it there; a copy across devices would
    hide a caller's mistake)."""
    if not isinstance(tensor, torch.Tensor):
        _refuse(fn, f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        _refuse(fn, f"{name} is on {tensor.device}, expected {device} like KV_cache_ptr")
    try:
        return tensor.as_strided(shape, (*strides, 1), tensor.storage_offset())
    except RuntimeError:  # out of the storage's bounds (or a negative stride)
        _refuse(fn, f"{name} cannot hold {list(shape)} (batch, NUM_KV_HEADS, grid[0], HEAD_DIM) at strides "
                f"{(*strides, 1)}: its storage has {tensor.untyped_storage().nbytes() // tensor.element_size()} "
                f"elements from offset {tensor.storage_offset()}")
