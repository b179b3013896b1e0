"""Full dequantization to dense K/V (keys back in the unrotated domain)."""

import pytest
import torch

from conftest import KERNEL_FORMATS, PRESETS, KernelRecorder, codebook_kwargs, make_config, planes_config_of, stored_cache
from tqgen import reference
from tqgen.layout import Layout
from tqgen.testing import DEQUANT_TOLERANCE, relative_error

SLOTS_FORMATS = [f"{p}-d128" for p in sorted(PRESETS)] + ["k3v4-d96", "k8v4-d64", "k3v4-d72"]


def _config(cache_layout, spec):
    if cache_layout == "planes":
        return planes_config_of(spec)
    preset, head_dim = spec.split("-d")
    return make_config(preset, head_dim=int(head_dim))


@pytest.mark.parametrize("cache_layout,spec", [("slots", spec) for spec in SLOTS_FORMATS]
                         + [("planes", spec) for spec in KERNEL_FORMATS], ids=str)
def test_dequantize_matches_reference(device, build_module, cache_layout, spec):
    config = _config(cache_layout, spec)
    head_dim = config.head_dim
    module = build_module(config)
    batch, cache = stored_cache(module, config, [1, 15, 17, 70, 0], device)
    kwargs = codebook_kwargs(module, config, device)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, **kwargs)
    want_keys, want_values = reference.dequantize(Layout.from_config(config), cache, batch.block_table, batch.seq_lens,
                                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert keys.shape == (5, 2, 70, head_dim)
    assert relative_error(keys, want_keys) < DEQUANT_TOLERANCE
    assert relative_error(values, want_values) < DEQUANT_TOLERANCE
    # Past each sequence's end: zeros (the whole of sequence 4, which is empty).
    for b, n in enumerate(batch.seq_lens.tolist()):
        assert torch.all(keys[b, :, n:] == 0) and torch.all(values[b, :, n:] == 0)


def test_dequantized_keys_approximate_the_originals(device, build_module):
    """Quantization error, not only agreement with the reference: unrotation must be right."""
    config = make_config("k4v4")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [64], device, num_kv_heads=1)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32)
    original_keys = batch.key.float().transpose(0, 1).unsqueeze(0)
    original_values = batch.value.float().transpose(0, 1).unsqueeze(0)
    assert relative_error(keys, original_keys) < 0.15  # 4-bit Lloyd-Max: about 0.1
    assert relative_error(values, original_values) < 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_outputs(device, build_module, dtype):
    config = make_config("k3v3")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [33, 8], device)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=dtype, max_len=40)
    exact_keys, exact_values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32,
                                                 max_len=40)
    assert keys.dtype == dtype and keys.shape == (2, 2, 40, 128)
    if dtype == torch.float16:
        assert torch.equal(keys, exact_keys.to(dtype)) and torch.equal(values, exact_values.to(dtype))
    else:  # Triton's interpreter rounds fp32 -> bf16 toward zero; allow one bf16 step.
        for got, exact in ((keys, exact_keys), (values, exact_values)):
            assert torch.all((got.float() - exact).abs() <= exact.abs() * 2**-7)


def test_dequantize_rejects_bad_arguments(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [20], device)
    with pytest.raises(module.LaunchError, match="dtype must be"):
        module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.int8)
    with pytest.raises(module.LaunchError, match="seq_lens has 2 entries"):
        module.dequantize(cache, batch.block_table, torch.cat([batch.seq_lens, batch.seq_lens]))
    with pytest.raises(module.LaunchError, match="rotation must be"):
        module.dequantize(cache, batch.block_table, batch.seq_lens, rotation=torch.eye(64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unrotation_in_chunks_equals_one_gemm(device, build_module, monkeypatch, dtype):
    """Keys are un-rotated by GEMMs over chunks of rows; chunk edges must not show."""
    config = make_config("k3v4", head_dim=96)  # random rotation: not its own transpose
    module = build_module(config)
    batch, cache = stored_cache(module, config, [37, 5], device)
    whole = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=dtype)
    monkeypatch.setattr(module, "_UNROTATE_ROWS", 7)  # 2 x 2 x 37 rows: 22 chunks, the last partial
    chunked = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=dtype)
    # A GEMM library may sum in another order for another row count: equal up to rounding.
    torch.testing.assert_close(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=0)


@pytest.mark.parametrize("cache_layout", ["slots", "planes"])
@pytest.mark.parametrize("preset", ["k3v4", "k4v4"])
def test_hadamard_keys_are_unrotated_in_the_kernel_and_other_matrices_after_it(device, build_module, monkeypatch,
                                                                               preset, cache_layout):
    """The config's Hadamard rotation (the tensor default_rotation returns) is undone inside tq_dequantize
    (UNROTATE: a Walsh-Hadamard transform, no GEMM); the same matrix passed as another tensor takes the GEMMs
    after the kernel. Both give the reference's keys, and the same values."""
    config = make_config(preset, cache_layout=cache_layout)
    module = build_module(config)
    batch, cache = stored_cache(module, config, [37, 5], device)
    kernel = KernelRecorder(module.tq_dequantize)
    monkeypatch.setattr(module, "tq_dequantize", kernel)
    calls = [module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, rotation=rotation)
             for rotation in (None, module.default_rotation(device).clone())]
    assert [launch["UNROTATE"] for _, _, launch in kernel.launches] == [True, False]
    want_keys, want_values = reference.dequantize(Layout.from_config(config), cache, batch.block_table,
                                                  batch.seq_lens, module.default_rotation(device),
                                                  module.default_centroids(device))
    for keys, values in calls:
        assert relative_error(keys, want_keys) < DEQUANT_TOLERANCE
        assert torch.equal(values, calls[0][1])
    # fp32 sums of 128 products of magnitude ~1 in two orders (butterflies, a GEMM): apart by a few 1e-6.
    torch.testing.assert_close(calls[0][0], calls[1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["k3v4-d128", "k3v4-d96"], ids=["hadamard", "random-rotation"])
def test_rotated_keys_are_returned_before_the_unrotation(device, build_module, monkeypatch, spec):
    """rotated_keys=True: y = n * c_hat as stored (keys @ rotation), in the output dtype, no GEMM after the kernel."""
    preset, head_dim = spec.split("-d")
    config = make_config(preset, head_dim=int(head_dim))
    module = build_module(config)
    batch, cache = stored_cache(module, config, [37, 5], device)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32)
    kernel = KernelRecorder(module.tq_dequantize)
    monkeypatch.setattr(module, "tq_dequantize", kernel)
    monkeypatch.setattr(module, "_UNROTATE_ROWS", 0)  # a GEMM after the kernel would now fail
    rotated, rotated_values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32,
                                                rotated_keys=True)
    half, _ = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float16, rotated_keys=True)
    assert all(not launch.get("UNROTATE", False) for _, _, launch in kernel.launches)
    assert kernel.launches[1][1][4].dtype == torch.float16  # written by the kernel in the output dtype
    assert torch.equal(rotated_values, values) and torch.equal(half, rotated.to(torch.float16))
    rotation = module.default_rotation(device)
    torch.testing.assert_close(rotated @ rotation.t(), keys, rtol=1e-4, atol=1e-5)


def test_outputs_of_2_to_the_31_elements_are_written_where_they_belong(device, build_module, monkeypatch):
    """The kernel's output offsets are int64: at 17 KV heads x 2**20 positions x 128 the last head starts at element
    2**31, which an int32 product (kv_head * head stride) wrapped to before the buffer (a segfault on the CPU). Only
    the first tile of each (sequence, head) is launched: the rest of the two 4.25 GiB outputs is never touched."""
    config = make_config("k3v4")
    module = build_module(config)
    heads = 17
    batch, cache = stored_cache(module, config, [20], device, num_kv_heads=heads)
    want_keys, want_values = module.dequantize(cache, batch.block_table, batch.seq_lens, max_len=32)
    launch = module._launch
    monkeypatch.setattr(module, "_launch", lambda kernel, grid, *args, **constants: launch(
        kernel, (1, *grid[1:]), *args, **constants))
    max_len = (1 << 31) // ((heads - 1) * config.head_dim)
    try:
        keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, max_len=max_len)
    except (RuntimeError, MemoryError) as error:  # a machine that refuses 8.5 GiB of address space (not a GPU fault)
        if "alloc" not in str(error).lower() and not isinstance(error, MemoryError):
            raise
        pytest.skip(f"the two outputs' 8.5 GiB could not be allocated: {error}")
    assert keys[0, -1].data_ptr() - keys.data_ptr() == 2**31 * keys.element_size()
    assert torch.equal(keys[:, :, :32], want_keys) and torch.equal(values[:, :, :32], want_values)


def test_a_captured_dequantize_needs_max_len_and_reads_no_seq_lens(build_module, monkeypatch):
    """max_len=None takes max(seq_lens), read on the host: inside a CUDA-graph capture that read is refused by CUDA
    (and its value would be baked into the graph's output shape and grid, wrong for a replay with longer sequences).
    A captured call without max_len is refused in one line naming it, before anything is read; with max_len it
    runs as outside a capture."""
    config = make_config("k3v4")
    module = build_module(config)
    device = "cpu"
    batch, cache = stored_cache(module, config, [20, 7], device)
    want_keys, want_values = module.dequantize(cache, batch.block_table, batch.seq_lens, max_len=24)
    monkeypatch.setattr(module, "_capturing", lambda tensor: True)  # a capture, as the CPU can stand in for one

    class Unreadable(torch.Tensor):  # seq_lens whose values cannot be read on the host, as in a capture
        def max(self, *args, **kwargs):
            raise AssertionError("seq_lens read on the host while capturing")

    seq_lens = batch.seq_lens.as_subclass(Unreadable)
    with pytest.raises(module.LaunchError, match=r"^dequantize: .*max_len"):
        module.dequantize(cache, batch.block_table, seq_lens)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, max_len=24)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
