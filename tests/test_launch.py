"""Launching kernels (shared/launch.py.jinja): after a kernel's first launch for a specialization, every
launcher calls the compiled kernel directly instead of triton's launch path.

On the CPU: the key refines triton's own specialization (two arguments with one key always get one compiled
kernel from triton), constants are keyed apart where triton's values differ, and an entry binds the right
trailing values. On the GPU: the direct launches give the bits of triton's path for decode, decode_multi, store
and dequantize, and arguments triton compiles apart (a query 2 bytes off a 16-byte boundary, odd strides) get
entries of their own.
"""

import functools
import types

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from conftest import HAS_CUDA, codebook_kwargs, make_config, planes_config
from tqgen import testing


@pytest.fixture(scope="module")
def k3v4(build_module):
    return build_module(make_config("k3v4"))


def _specialization(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def _argument_corpus():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    buffer = torch.zeros(64, dtype=torch.uint8)
    tensors = [buffer.view(dtype)[offset:] for dtype in (torch.float16, torch.float32, torch.int32)
               for offset in (0, 1, 2, 4)] + [buffer[offset:] for offset in (0, 1, 8, 16)]
    return ints + tensors + [0.0, 1.0, 1.5, True, False, None]


def test_argument_key_refines_tritons_specialization(k3v4):
    """Wherever two arguments share _argument_key, triton specializes them alike (so one compiled kernel serves
    both); the converse need not hold (a finer key only compiles nothing and costs an entry)."""
    pytest.importorskip("triton._C.libtriton", reason="triton's native specialization")
    corpus = _argument_corpus()
    for first in corpus:
        for second in corpus:
            if k3v4._argument_key(first) == k3v4._argument_key(second):
                assert _specialization(first) == _specialization(second), (first, second)
    aligned, misaligned = torch.zeros(16, dtype=torch.float16), torch.zeros(16, dtype=torch.float16)[1:]
    assert k3v4._argument_key(aligned) != k3v4._argument_key(misaligned)
    assert k3v4._argument_key(16) != k3v4._argument_key(17) != k3v4._argument_key(1)


def test_constant_key_keeps_values_triton_compiles_apart(k3v4):
    key = k3v4._constant_key
    assert key(True) != key(1) and key(1) != key(1.0) and key(0) != key(None) and key(False) != key(0)
    assert key(16) == key(16) and key((1, 2)) == key((1, 2)) and key((1, 2)) != key((2, 1)) != key((True, 2))
    layout, equal_layout = object(), object()
    assert key(layout) == key(layout) and key(layout) != key(equal_layout)  # by identity
    layouts = (layout, equal_layout)
    assert key(layouts) == key(layouts) and key(layouts) != key((layout, equal_layout))


def _kernel_with_constants(x_ptr, n, stride, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 7, LAST: tl.constexpr = None):
    pass


def test_fast_launch_entry_binds_the_trailing_parameters(k3v4):
    kernel = JITFunction(_kernel_with_constants)
    compiled = object()
    constants = {"BLOCK": 16, "num_warps": 4, "LAST": 2}
    entry = k3v4._fast_launch_entry(kernel, 3, constants, compiled)
    assert entry[0] is compiled and entry[1] == (16, 7, 2) and entry[2] == (kernel, constants, 16, 4, 2)
    assert entry[3] is None  # no launcher handles on this compiled kernel: compiled[grid] calls it
    # a runtime parameter passed by keyword is bound by value; a tensor by keyword takes triton's path every time
    assert k3v4._fast_launch_entry(kernel, 2, {"stride": 3, "BLOCK": 16}, compiled)[1] == (3, 16, 7, None)
    assert k3v4._fast_launch_entry(kernel, 2, {"stride": torch.zeros(1), "BLOCK": 16}, compiled) is None
    assert k3v4._fast_launch_entry(kernel, 3, {}, compiled) is None  # BLOCK has no value: triton raised already
    with pytest.raises(TypeError, match="pass constexpr parameters by keyword"):
        k3v4._fast_launch_entry(kernel, 4, {}, compiled)


def test_compiled_runner_takes_the_launchers_handles_or_none(k3v4, monkeypatch):
    """The launcher, the driver's stream lookup, function handle and packed metadata of a compiled kernel whose
    handles are loaded; None where any is missing (another triton's compiled kernel) or not loaded yet."""
    import triton

    def get_current_stream(device):
        return 0

    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_stream=get_current_stream)))  # this machine may have no GPU

    class Compiled:
        function, packed_metadata = 7, ("metadata",)

        def run(self, *args):
            pass

    compiled = Compiled()
    runner = k3v4._compiled_runner(compiled)
    assert runner == (compiled.run, get_current_stream, 7, ("metadata",))
    compiled.function = None  # handles not loaded
    assert k3v4._compiled_runner(compiled) is None
    del Compiled.run
    assert k3v4._compiled_runner(Compiled()) is None


def test_tritons_settings_are_part_of_the_key(k3v4, monkeypatch):
    """Triton adds its debug and instrumentation settings to every compile's options, and profilers switch them at
    run time: a changed setting must not find a kernel compiled under the old one; a stage-inspection hook (newer
    triton: part of triton's own key) sends every launch down triton's path."""
    import triton

    if not hasattr(triton, "knobs"):
        pytest.skip("triton < 3.4 has no knobs: _launch always takes triton's path there")
    plain = k3v4._triton_settings()
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    debug = k3v4._triton_settings()
    monkeypatch.setattr(triton.knobs.compilation, "instrumentation_mode", "consan")
    assert plain != debug != k3v4._triton_settings() is not None
    if hasattr(triton.knobs.runtime, "add_stages_inspection_hook"):
        monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", lambda: ("key", "hash"))
        assert k3v4._triton_settings() is None


def test_tritons_settings_read_on_triton_3_4_and_3_5(k3v4, monkeypatch):
    """Triton 3.4 and 3.5 (torch 2.8's and 2.9's; pyproject allows triton >= 3.2) have triton.knobs, so _launch
    takes its direct path there, but their compilation knobs have no instrumentation_mode (nor
    fpsan_homomorphic_casts) and their launch path adds only knobs.runtime.debug to the options (runtime/jit.py,
    JITFunction.run). _triton_settings must give the settings that triton has, not raise on every launch."""
    import triton

    if not hasattr(triton, "knobs"):
        pytest.skip("triton < 3.4 has no knobs: _launch always takes triton's path there")
    monkeypatch.setattr(triton.knobs, "compilation", types.SimpleNamespace())  # 3.4's and 3.5's, as read here
    plain = k3v4._triton_settings()
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    assert plain is not None and k3v4._triton_settings() not in (plain, None)


def test_cdiv_and_next_power_of_2_match_triton(k3v4):
    import triton

    for n in range(1, 300):
        assert k3v4._next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64):
            assert k3v4._cdiv(n, d) == triton.cdiv(n, d)


# --- on the GPU ----------------------------------------------------------------------------------------------------

def _triton_launches(monkeypatch):
    """A list that counts triton's own launches (JITFunction.run) from now on."""
    calls = []
    original = JITFunction.run

    def counting(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counting)
    return calls


@pytest.mark.parametrize("spec", ["k3v4-planes", "k8v4-planes", "k3v4", "k8v4"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_direct_launches_give_the_bits_of_tritons_path(build_module, monkeypatch, spec, batch):
    preset, _, layout = spec.partition("-")
    config = planes_config(preset) if layout else make_config(preset)
    module = build_module(config)
    problem = testing.random_problem(module, config, batch, 1024, 32, 8, "cuda",
                                     torch.Generator("cuda").manual_seed(batch))
    cache, table, lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    codebook = codebook_kwargs(module, config, "cuda")
    # the same query 2 bytes off a 16-byte boundary, and with rows of an odd stride: other specializations
    shifted = torch.empty(query.numel() + 1, dtype=query.dtype, device="cuda")[1:].view_as(query)
    shifted.copy_(query)
    strided = torch.empty(batch, 32, 136, dtype=query.dtype, device="cuda")[..., 4:132]
    strided.copy_(query)
    decode = functools.partial(module.decode, kv_cache=cache, block_table=table, seq_lens=lens, **codebook)

    monkeypatch.setattr(module, "_FAST_LAUNCH", False)
    expected = [decode(q) for q in (query, shifted, strided)]
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)
    module._fast_launches.clear()
    first, entries = [], [0]
    for q in (query, shifted, strided):  # triton's path, each query adding entries of its own specialization
        first.append(decode(q))
        entries.append(len(module._fast_launches))
    assert entries[0] < entries[1] < entries[2] < entries[3], entries
    launches = _triton_launches(monkeypatch)
    again = [decode(q) for q in (query, shifted, strided)]
    assert launches == [] and len(module._fast_launches) == entries[-1]  # every launch direct
    for want, got, direct in zip(expected, first, again):
        assert torch.equal(want, got) and torch.equal(want, direct)


@pytest.mark.parametrize("spec", ["k3v4-planes", "k8v4"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_store_decode_multi_and_dequantize_launch_directly(build_module, monkeypatch, spec):
    preset, _, layout = spec.partition("-")
    config = planes_config(preset) if layout else make_config(preset)
    module = build_module(config)
    codebook = codebook_kwargs(module, config, "cuda")
    generator = torch.Generator("cuda").manual_seed(3)
    problem = testing.random_problem(module, config, 4, 512, 16, 4, "cuda", generator)
    cache, table, lens = (problem[k] for k in ("cache", "block_table", "seq_lens"))
    key = torch.randn(300, 4, 128, device="cuda", generator=generator, dtype=torch.float16)
    value = torch.randn(300, 4, 128, device="cuda", generator=generator, dtype=torch.float16)
    slots = torch.randperm(cache.shape[0] * module.PAGE_SIZE, device="cuda", generator=generator)[:300]
    multi_query = torch.randn(4, 3, 16, 128, device="cuda", generator=generator, dtype=torch.float16)
    if hasattr(module, "STORE_MMA_MIN_TOKENS"):
        monkeypatch.setattr(module, "STORE_MMA_MIN_TOKENS", 1)  # the keys' tensor-core store too

    def run():
        stored = cache.clone()
        module.store(key, value, stored, slots, **codebook)
        multi = module.decode_multi(multi_query, stored, table, lens, **codebook)
        return stored, multi, *module.dequantize(stored, table, lens)

    monkeypatch.setattr(module, "_FAST_LAUNCH", False)
    expected = run()
    monkeypatch.setattr(module, "_FAST_LAUNCH", True)
    run()
    launches = _triton_launches(monkeypatch)
    direct = run()
    assert launches == []
    for want, got in zip(expected, direct):
        assert torch.equal(want, got)
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "debug", True)  # a new setting: triton's path again, and its kernel
    module.dequantize(direct[0], table, lens)
    assert [kernel.__name__ for kernel in launches] == ["tq_dequantize"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_direct_launches_call_a_profilers_launch_hooks(build_module, monkeypatch):
    """Profilers (proton) add launch hooks at run time: a direct launch then goes through the compiled kernel's
    runner, which calls them with the launch's metadata, and gives the same bits; without hooks it does not."""
    import triton

    config = planes_config("k3v4")
    module = build_module(config)
    problem = testing.random_problem(module, config, 2, 1024, 32, 8, "cuda", torch.Generator("cuda").manual_seed(5))
    cache, table, lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    decode = functools.partial(module.decode, query, cache, table, lens, **codebook_kwargs(module, config, "cuda"))
    expected = decode()  # the entries
    assert not module._launch_hooks_set()
    launches = _triton_launches(monkeypatch)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    chain = triton.knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # triton >= 3.5: a chain of hooks
        chain.add(hook)
        try:
            assert module._launch_hooks_set()
            got = decode()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
        got = decode()
    assert launches == [] and torch.equal(expected, got)
    assert "tq_decode_stage1_mma" in seen and seen[-1] == "tq_decode_stage2", seen
    seen.clear()
    assert torch.equal(decode(), expected) and seen == []
