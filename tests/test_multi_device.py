"""Several GPUs in one process: each launcher runs its kernels on its cache's device, whichever is current.

Triton launches on the current device's current stream whatever device the tensors are on, so a
launcher handed cuda:1 tensors while cuda:0 is current makes cuda:1 current for the call; with the
cache's device current already it enters no context. Everything the module keeps per device is keyed
by the device index ("cuda" is the current one). On the CPU these run against a stand-in for
torch.cuda's current device; with two GPUs (`pytest -m gpu`) the same calls run on both.
"""

import contextlib
import inspect
import types

import pytest
import torch
import triton

from conftest import HAS_CUDA, INTERPRET, KernelRecorder, codebook_kwargs, make_config, planes_config, stored_cache
from tqgen import reference
from tqgen.layout import Layout
from tqgen.testing import DECODE_TOLERANCE, DEQUANT_TOLERANCE, paged_batch, relative_error

LAUNCHERS = ("store", "decode", "decode_multi", "decode_ragged", "dequantize")
KV_HEADS, GROUP = 2, 4


class FakeCurrentDevice:
    """Stands in for torch.cuda's current device: current_device() and the torch.cuda.device(index)
    context, which makes `index` current until it exits. Records each switch and each query."""

    def __init__(self, current):
        self.current, self.switches, self.queries = current, [], 0

    def current_device(self):
        self.queries += 1
        return self.current

    @contextlib.contextmanager
    def device(self, index):
        self.switches.append(index)
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "device", self.device)
        return self


class ReportsCuda(torch.Tensor):
    """An empty CPU tensor that reports a CUDA device: what the launchers' device switch reads."""

    @property
    def device(self):
        return torch.device("cuda", self.reported_index)


def reporting_cuda(index):
    tensor = torch.Tensor._make_subclass(ReportsCuda, torch.zeros(0, dtype=torch.uint8))
    tensor.reported_index = index
    return tensor


class Marker:
    """A distinct argument value, to see that a re-issued call passes on every argument as given."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Marker({self.name})"


def module_of(spec, build_module):
    preset, layout = spec.split("-")
    return build_module(make_config(preset, cache_layout=layout))


SPECS = ["k3v4-slots", "k8v4-planes"]  # MSE and fp8 keys: their launchers take different arguments


# --------------------------------------------------------------------------
# CPU: the device switch against a stand-in for the current device
# --------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("spec", SPECS)
def test_a_cache_on_another_device_makes_it_current_for_the_call(build_module, monkeypatch, spec, launcher):
    """With cuda:0 current and the cache on cuda:1, the launcher runs the call again inside
    torch.cuda.device(1), with every argument as given, and cuda:0 is current again afterwards,
    also when the call raises."""
    module = module_of(spec, build_module)
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    launch = getattr(module, launcher)
    parameters = inspect.signature(launch).parameters
    arguments = {name: Marker(name) for name in parameters}
    arguments["kv_cache"] = reporting_cuda(1)
    positional = [arguments[name] for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = {name: arguments[name] for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert len(positional) + len(keywords) == len(parameters)

    calls = []

    def reissued(*args, **kwargs):
        calls.append((cuda.current, inspect.signature(launch).bind(*args, **kwargs).arguments))
        return "the call's result"

    monkeypatch.setattr(module, launcher, reissued)  # the launcher re-issues the call through its module name
    assert launch(*positional, **keywords) == "the call's result"
    assert cuda.switches == [1] and cuda.current == 0
    (current_in_call, forwarded), = calls
    assert current_in_call == 1
    assert forwarded.keys() == arguments.keys()
    assert all(forwarded[name] is value for name, value in arguments.items()), forwarded

    def refused(*args, **kwargs):
        assert cuda.current == 1
        raise module.LaunchError(f"{launcher}: refused on cuda:1")

    monkeypatch.setattr(module, launcher, refused)
    with pytest.raises(module.LaunchError, match="refused on cuda:1"):
        launch(*positional, **keywords)
    assert cuda.switches == [1, 1] and cuda.current == 0


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_cache_on_the_current_device_enters_no_context(build_module, monkeypatch, launcher):
    """cuda:1 current and the cache there: no switch, the launcher goes straight to its checks
    (which refuse this empty stand-in cache)."""
    module = build_module(make_config("k3v4"))
    cuda = FakeCurrentDevice(current=1).install(monkeypatch)
    launch = getattr(module, launcher)
    parameters = inspect.signature(launch).parameters
    arguments = [reporting_cuda(1) if name == "kv_cache" else Marker(name) for name, p in parameters.items()
                 if p.kind is p.POSITIONAL_OR_KEYWORD]
    monkeypatch.setattr(module, launcher, lambda *args, **kwargs: pytest.fail("the call was re-issued"))
    with pytest.raises(module.LaunchError, match=f"^{launcher}: kv_cache must be"):
        launch(*arguments)
    assert cuda.switches == [] and cuda.queries >= 1 and cuda.current == 1


def test_the_switch_is_none_unless_a_cuda_tensor_is_elsewhere(build_module, monkeypatch):
    module = build_module(make_config("k3v4"))
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    for not_cuda in (torch.zeros(2), torch.zeros(2, device="meta"), [1, 2], None):
        assert module._device_switch(not_cuda) is None
    assert cuda.queries == 0, "only a CUDA tensor asks for the current device"
    assert module._device_switch(reporting_cuda(0)) is None
    switch = module._device_switch(reporting_cuda(3))
    with switch:
        assert cuda.current == 3
    assert cuda.current == 0 and cuda.switches == [3]


@pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("spec", SPECS)
def test_cpu_tensors_take_no_device_switch(build_module, monkeypatch, spec):
    """The interpreter's launches never ask for a CUDA device: real calls on CPU tensors."""
    preset, layout = spec.split("-")
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    batch, cache = stored_cache(module, config, [5, 20], "cpu")
    query = torch.randn(2, KV_HEADS * GROUP, config.head_dim)
    out = module.decode(query, cache, batch.block_table, batch.seq_lens)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens)
    assert torch.isfinite(out).all() and keys.shape == (2, KV_HEADS, 20, config.head_dim)
    assert cuda.queries == 0 and cuda.switches == []


@pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")
def test_a_call_spread_over_two_devices_is_refused_naming_the_argument_alike(build_module):
    """The CPU counterpart of the two-GPU refusal test below, a "meta" tensor standing in for one on the
    other GPU: every argument on another device than the cache, a workspace buffer among them, is refused
    in the same words, `<fn>: <argument> is on <device>, expected <the cache's device> like the cache`."""
    config = make_config("k3v4")
    module = build_module(config)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    batch = paged_batch(config, [20, 5], KV_HEADS, generator=torch.Generator().manual_seed(0))
    cache = module.make_cache(batch.num_blocks, KV_HEADS, cpu)
    query = torch.randn(2, KV_HEADS * GROUP, config.head_dim)
    table, lens = batch.block_table, batch.seq_lens
    rotation_elsewhere = torch.empty(config.head_dim, config.head_dim, device=meta)
    calls = {
        "store: key is on meta": lambda: module.store(batch.key.to(meta), batch.value, cache, batch.slot_mapping),
        "store: slot_mapping is on meta": lambda: module.store(batch.key, batch.value, cache,
                                                               batch.slot_mapping.to(meta)),
        "decode: query is on meta": lambda: module.decode(query.to(meta), cache, table, lens),
        "decode: seq_lens is on meta": lambda: module.decode(query, cache, table, lens.to(meta)),
        "decode: rotation is on meta": lambda: module.decode(query, cache, table, lens, rotation=rotation_elsewhere),
        "decode: workspace.partial_out is on meta": lambda: module.decode(
            query, cache, table, lens, workspace=module.DecodeWorkspace(2, KV_HEADS * GROUP, 8, meta)),
        "dequantize: block_table is on meta": lambda: module.dequantize(cache, table.to(meta), lens),
    }
    for message, call in calls.items():
        with pytest.raises(module.LaunchError) as caught:
            call()
        assert str(caught.value) == f"{message}, expected cpu like the cache"


def test_vllm_drop_ins_work_with_the_cache_s_device_current(monkeypatch):
    """tqgen.vllm's entry points, cache on cuda:1 with cuda:0 current, as in a CUDA graph captured on cuda:1 while
    cuda:0 is current: torch.cuda.is_current_stream_capturing asks the current device's stream, and the drop-ins'
    own work before the module's launcher (the codebook checks and copies, which must not read values on the host
    in a capture, nor be kept from one) must see that capture. So from the first lookup on, each call runs with the
    cache's device current (cuda:0 current again after it, also when it raises), and with it current already it
    switches nothing."""
    from tqgen import vllm

    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.current == 1)  # captured on cuda:1
    seen = []

    def module_lookup(fn, device, *arguments):
        seen.append((fn, cuda.current, torch.cuda.is_current_stream_capturing()))
        raise vllm.VllmArgumentError(f"{fn}: no module here")

    monkeypatch.setattr(vllm, "_module", module_lookup)
    cache = torch.Tensor._make_subclass(ReportsCuda, torch.zeros(4, 16, KV_HEADS, 134, dtype=torch.uint8))
    cache.reported_index = 1
    table, lens, codebook = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.eye(128)
    key, k_out = torch.zeros(1, KV_HEADS, 128), torch.zeros(1, KV_HEADS, 32, 128, dtype=torch.float16)
    arguments = vllm.preset_arguments("turboquant_4bit_nc", 128)
    calls = {
        "triton_turboquant_decode_attention": lambda: vllm.triton_turboquant_decode_attention(
            torch.zeros(1, KV_HEADS * GROUP, 128), cache, table, lens, codebook, torch.zeros(16), 0.1, **arguments),
        "triton_turboquant_store": lambda: vllm.triton_turboquant_store(
            key, key, cache, torch.zeros(1, dtype=torch.int64), codebook, torch.zeros(15), 4, 66, 4),
        "_tq_full_dequant_kv": lambda: vllm._tq_full_dequant_kv[(32, KV_HEADS)](
            cache, table, torch.zeros(16), k_out, k_out.clone(), *k_out.stride()[:3], *k_out.stride()[:3],
            *cache.stride()[:3], table.stride(0), HEAD_DIM=128, BLOCK_SIZE=16, NUM_KV_HEADS=KV_HEADS, MSE_BYTES=64,
            KPS=66, VQB=4, VAL_DATA_BYTES=64, MSE_BITS=4, KEY_FP8=0, BLOCK_D=128, NORM_CORRECTION=1),
    }
    for fn, call in calls.items():
        with pytest.raises(vllm.VllmArgumentError, match=f"^{fn}: no module here$"):
            call()
        assert seen[-1] == (fn, 1, True), seen
        assert cuda.current == 0
    assert cuda.switches == [1] * len(calls)
    cuda.current = 1  # the cache's device current already: no switch
    for fn, call in calls.items():
        with pytest.raises(vllm.VllmArgumentError, match=f"^{fn}: no module here$"):
            call()
        assert seen[-1] == (fn, 1, True)
    assert cuda.switches == [1] * len(calls)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("elsewhere", ["K_out_ptr", "V_out_ptr"])
def test_vllm_dequantize_refuses_an_output_on_another_device_naming_it(elsewhere):
    """vLLM's dequantize kernel writes K_out / V_out where the cache is: one on another device (a "meta" tensor
    standing in for the other GPU) is refused before any work, naming it, not filled by a copy across devices."""
    from tqgen import vllm

    cache = torch.zeros(4, 16, KV_HEADS, 134, dtype=torch.uint8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    outputs = {name: torch.zeros(1, KV_HEADS, 32, 128, dtype=torch.float16,
                                 device="meta" if name == elsewhere else "cpu") for name in ("K_out_ptr", "V_out_ptr")}
    k_out, v_out = outputs["K_out_ptr"], outputs["V_out_ptr"]
    with pytest.raises(vllm.VllmArgumentError) as refusal:
        vllm._tq_full_dequant_kv[(32, KV_HEADS)](
            cache, table, torch.zeros(16), k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3],
            *cache.stride()[:3], table.stride(0), HEAD_DIM=128, BLOCK_SIZE=16, NUM_KV_HEADS=KV_HEADS, MSE_BYTES=64,
            KPS=66, VQB=4, VAL_DATA_BYTES=64, MSE_BITS=4, KEY_FP8=0, BLOCK_D=128, NORM_CORRECTION=1)
    assert str(refusal.value) == f"_tq_full_dequant_kv: {elsewhere} is on meta, expected cpu like KV_cache_ptr"


# --------------------------------------------------------------------------
# CPU: per-device caches, keyed by the device index
# --------------------------------------------------------------------------
class FakeGpus:
    """torch.cuda's per-device queries for two different GPUs: SM count, name, compute capability.
    A device without an index is the current one, as in torch."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.sm_counts = {0: 132, 1: 46}
        self.names = {0: "NVIDIA H200", 1: "A GPU tuned for nothing"}
        self.capabilities = {0: (9, 0), 1: (7, 5)}

    def index(self, device):
        device = torch.device(device)
        return self.cuda.current if device.index is None else device.index

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
            multi_processor_count=self.sm_counts[self.index(device)]))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.names[self.index(device)])
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: self.capabilities[self.index(device)])


def test_per_device_caches_are_keyed_by_the_device_index(build_module, monkeypatch):
    """SM counts, tuned launches, the device check and the Hopper-only dependent launch are each
    looked up once per device index: "cuda" is whichever device is current when asked, and one
    device's answer is never another's."""
    module = build_module(planes_config("k3v4"))
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    FakeGpus(cuda).install(monkeypatch)
    monkeypatch.setattr(module, "_per_device", {})
    monkeypatch.setattr(module, "_interpreting", lambda: False)  # as on a GPU: dependent launches are asked for
    group, batch, context = 4, 8, 4096
    tuned = (64, 1, 2, 8)
    monkeypatch.setattr(module, "TUNED_LAUNCHES", {"NVIDIA H200": {
        "triton_version": triton.__version__, "source": "test",
        "buckets": {module.bucket_key(group, batch, context): tuned}}})
    gpu0, gpu1, current = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda")
    untuned = module.heuristic_launch(batch, KV_HEADS, context, 46)
    assert untuned != tuned

    assert module._sm_count(gpu0) == 132 and module._sm_count(current) == 132
    assert module.decode_launch(batch, KV_HEADS, group, context, current) == tuned
    assert module._dependent_launch(current)
    module._check_device("decode", current)
    cuda.current = 1  # the same questions about "cuda" now mean device 1
    assert module._sm_count(current) == 46 and module._sm_count(gpu1) == 46
    assert module.decode_launch(batch, KV_HEADS, group, context, current) == untuned
    assert not module._dependent_launch(current)
    with pytest.raises(module.LaunchError, match=r"^decode: this module was built for .*; cuda is 7\.5"):
        module._check_device("decode", current)
    module._check_device("decode", gpu0)  # device 0's answer is still its own
    assert module.decode_launch(batch, KV_HEADS, group, context, gpu0) == tuned
    assert module._sm_count(gpu0) == 132 and module._dependent_launch(gpu0)
    # Keyed by "cuda:<index>", and by the indexed torch.device objects the calls passed: never by "cuda".
    assert {str(device) for _, device in module._per_device} == {"cuda:0", "cuda:1"}


def test_cached_answers_for_cuda_are_the_current_device_s(build_module, monkeypatch):
    """_cached makes a value once per device index; "cuda" and "cuda:<current>" share it."""
    module = build_module(make_config("k3v4"))
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    monkeypatch.setattr(module, "_per_device", {})
    made = []

    def make():
        made.append(cuda.current)
        return object()

    first = module._cached("probe", "cuda", make)
    assert module._cached("probe", torch.device("cuda", 0), make) is first
    cuda.current = 1
    second = module._cached("probe", "cuda", make)
    assert second is not first and module._cached("probe", "cuda:1", make) is second
    assert made == [0, 1]


def test_a_capture_is_asked_of_the_device_whose_stream_would_record_the_work(build_module, monkeypatch):
    """torch.cuda.is_current_stream_capturing asks the current device's stream, but torch's work for cuda:1 (a
    workspace's zeros, a default codebook's copy) goes to cuda:1's stream whichever device is current. So a capture
    on cuda:1 with cuda:0 current refuses a workspace built for cuda:1 and a capture on cuda:0 does not; the current
    device is the same after each answer."""
    module = build_module(make_config("k3v4"))
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.current == 1)  # captured on cuda:1
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert module._capturing_on(gpu1) and not module._capturing_on(gpu0)
    assert not module._capturing_on(torch.device("cuda")) and not module._capturing_on(torch.device("cpu"))
    assert cuda.current == 0 and cuda.switches == [1]
    with pytest.raises(module.LaunchError, match="^DecodeWorkspace: built inside a CUDA-graph capture"):
        module.DecodeWorkspace(2, KV_HEADS * GROUP, 4, "cuda:1")
    assert cuda.current == 0


def test_a_default_made_for_cuda_is_found_by_the_indexed_device_that_asks(build_module, monkeypatch):
    """A default codebook made for "cuda" is kept under "cuda:<current>"; asking whether a tensor on cuda:0 is it
    (_is_kept, which makes nothing) finds it through the tensor's indexed device, and keeps it under that device
    object for the next call's lookup; another device's tensor is not it, and "cuda" itself is never a key."""
    module = build_module(make_config("k3v4"))
    cuda = FakeCurrentDevice(current=0).install(monkeypatch)
    monkeypatch.setattr(module, "_per_device", {})
    rotation = module._cached("rotation", "cuda", lambda: torch.eye(128))
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert set(module._per_device) == {("rotation", "cuda:0")}
    assert module._kept("rotation", gpu0) is rotation and module._kept("rotation", gpu1) is None
    assert set(module._per_device) == {("rotation", "cuda:0"), ("rotation", gpu0)}
    assert module._kept("rotation", torch.device("cuda")) is None  # "cuda" means no device until a call asks
    on_gpu0 = types.SimpleNamespace(device=gpu0, data_ptr=rotation.data_ptr)
    on_gpu1 = types.SimpleNamespace(device=gpu1, data_ptr=rotation.data_ptr)
    assert module._is_kept("rotation", on_gpu0) and not module._is_kept("rotation", on_gpu1)
    assert not module._is_kept("centroids", on_gpu0) and ("centroids", "cuda:0") not in module._per_device
    assert cuda.current == 0


# --------------------------------------------------------------------------
# GPU: two devices
# --------------------------------------------------------------------------
TWO_GPUS = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
KERNELS = ("tq_store", "tq_store_gluon", "tq_prepare_query", "tq_decode_stage1", "tq_decode_stage1_mma", "tq_decode_stage2",
           "tq_dequantize")


def record_launch_devices(module, monkeypatch):
    """Wrap each of the module's kernels: returns the list of (kernel, current device at launch)."""
    launches = []

    class DeviceRecorder(KernelRecorder):
        def __init__(self, name, kernel):
            super().__init__(kernel)
            self.name = name

        def __getitem__(self, grid):
            launches.append((self.name, torch.cuda.current_device()))
            return super().__getitem__(grid)

    for name in KERNELS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, DeviceRecorder(name, getattr(module, name)))
    return launches


def same_gpus():
    return (torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1)
            and torch.cuda.get_device_capability(0) == torch.cuda.get_device_capability(1))


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("seq_lens", [[300], [1, 77, 300]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("spec", ["k3v4-slots", "k3v4-planes", "k8v4-planes"])
def test_launchers_on_the_second_gpu_match_the_first_while_it_is_current(build_module, monkeypatch, spec, seq_lens):
    """cuda:0 current throughout: store, decode and dequantize on cuda:1 tensors launch every kernel
    with cuda:1 current, give what the same calls give on cuda:0 and match the reference."""
    preset, layout = spec.split("-")
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    launches = record_launch_devices(module, monkeypatch)
    results = {}
    with torch.cuda.device(0):
        for index in (0, 1):
            device = torch.device("cuda", index)
            kwargs = codebook_kwargs(module, config, device)
            batch = paged_batch(config, seq_lens, KV_HEADS, device=device, generator=torch.Generator().manual_seed(3))
            query = torch.randn(len(seq_lens), KV_HEADS * GROUP, config.head_dim,
                                generator=torch.Generator().manual_seed(4)).to(device)
            cache = module.make_cache(batch.num_blocks, KV_HEADS, device)
            launches.clear()
            module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
            out = module.decode(query, cache, batch.block_table, batch.seq_lens, **kwargs)
            keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, **kwargs)
            torch.cuda.synchronize(device)
            assert torch.cuda.current_device() == 0
            launched = {name for name, _ in launches}
            assert {"tq_decode_stage2", "tq_dequantize"} <= launched and launched & {"tq_store", "tq_store_gluon"}, \
                launches
            assert all(current == index for _, current in launches), launches
            results[index] = [t.cpu() for t in (cache, out, keys, values)]
            cpu_codebook = {name: tensor.cpu() for name, tensor in kwargs.items()}
            layout_of = Layout.from_config(config)
            table, lens = batch.block_table.cpu(), batch.seq_lens.cpu()
            want = reference.decode(layout_of, query.cpu(), results[index][0], table, lens,
                                    cpu_codebook.get("rotation"), cpu_codebook.get("centroids"))
            assert relative_error(results[index][1], want) < DECODE_TOLERANCE[torch.float32]
            want_keys, want_values = reference.dequantize(layout_of, results[index][0], table, lens,
                                                          cpu_codebook.get("rotation"), cpu_codebook.get("centroids"))
            assert relative_error(results[index][2], want_keys) < DEQUANT_TOLERANCE
            assert relative_error(results[index][3], want_values) < DEQUANT_TOLERANCE
    if same_gpus():  # the same kernels and launches on the same model: the same bits
        for name, first, second in zip(("cache", "out", "keys", "values"), results[0], results[1]):
            assert torch.equal(first, second), f"{name} on cuda:1 differs from cuda:0"


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("current_in_capture", [1, 0], ids=["cuda1_current", "cuda0_current"])
@pytest.mark.parametrize("spec", ["k3v4-planes", "k8v4-slots"])
def test_decode_captured_on_the_second_gpu_replays_like_plain_calls(build_module, spec, current_in_capture):
    """cuda:0 current; decode on cuda:1 with a DecodeWorkspace, captured on a cuda:1 stream (which
    makes cuda:1 current, or with cuda:0 made current again inside the capture: the launcher must
    launch on cuda:1's capture stream and see that it is capturing), replays for new contents."""
    preset, layout = spec.split("-")
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    device = torch.device("cuda", 1)
    batch_size, max_blocks, num_splits = 4, 8, 8
    with torch.cuda.device(0):
        kwargs = codebook_kwargs(module, config, device)
        batch = paged_batch(config, [max_blocks * config.block_size] * batch_size, KV_HEADS, device=device,
                            generator=torch.Generator().manual_seed(5), extra_table_columns=0)
        cache = module.make_cache(batch.num_blocks, KV_HEADS, device)
        module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
        query = torch.empty(batch_size, KV_HEADS * GROUP, config.head_dim, device=device)
        block_table, seq_lens = batch.block_table.clone(), batch.seq_lens.clone()
        out = torch.empty_like(query)
        workspace = module.DecodeWorkspace(batch_size, KV_HEADS * GROUP, num_splits, device)

        def fill(seed):
            generator = torch.Generator().manual_seed(seed)
            query.copy_(torch.randn(query.shape, generator=generator))
            seq_lens.copy_(torch.randint(0, max_blocks * config.block_size + 1, (batch_size,), generator=generator))
            block_table.copy_(batch.block_table[torch.randperm(batch_size, generator=generator)])

        def run():
            module.decode(query, cache, block_table, seq_lens, out=out, workspace=workspace, num_splits=num_splits,
                          **kwargs)

        fill(1)
        run()  # compiles on cuda:1 and fills the per-device caches outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            with torch.cuda.device(current_in_capture):
                run()
        assert torch.cuda.current_device() == 0
        for seed in (2, 3):
            fill(seed)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            want = module.decode(query, cache, block_table, seq_lens, num_splits=num_splits, **kwargs)
            assert torch.isfinite(out).all()
            assert relative_error(out, want) < 1e-6


@pytest.mark.gpu
@TWO_GPUS
def test_cached_defaults_are_per_gpu(build_module):
    module = build_module(make_config("k3v4"))
    with torch.cuda.device(0):
        rotations = [module.default_rotation(f"cuda:{index}") for index in (0, 1)]
        centroids = [module.default_centroids(torch.device("cuda", index)) for index in (0, 1)]
        for index in (0, 1):
            assert rotations[index].device == centroids[index].device == torch.device("cuda", index)
        assert module.default_rotation("cuda") is rotations[0]
        with torch.cuda.device(1):
            assert module.default_rotation("cuda") is rotations[1]
            assert module.default_centroids("cuda") is centroids[1]
            assert module._sm_count(torch.device("cuda")) == torch.cuda.get_device_properties(1).multi_processor_count
        assert torch.equal(rotations[0].cpu(), rotations[1].cpu())
        assert torch.equal(centroids[0].cpu(), centroids[1].cpu())
    assert all(device != "cuda" for _, device in module._per_device), "a cache keyed by a device without index"


@pytest.mark.gpu
@TWO_GPUS
def test_a_call_spread_over_two_gpus_is_refused_naming_the_argument(build_module):
    config = make_config("k3v4")
    module = build_module(config)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with torch.cuda.device(0):
        batch, cache = stored_cache(module, config, [20, 5], gpu1)
        before = cache.clone()
        query = torch.randn(2, KV_HEADS * GROUP, config.head_dim, device=gpu1)
        table, lens = batch.block_table, batch.seq_lens
        calls = {
            "store: key is on cuda:0": lambda: module.store(batch.key.to(gpu0), batch.value, cache, batch.slot_mapping),
            "store: slot_mapping is on cuda:0":
                lambda: module.store(batch.key, batch.value, cache, batch.slot_mapping.to(gpu0)),
            "decode: query is on cuda:0": lambda: module.decode(query.to(gpu0), cache, table, lens),
            "decode: seq_lens is on cuda:0": lambda: module.decode(query, cache, table, lens.to(gpu0)),
            "decode: rotation is on cuda:0":
                lambda: module.decode(query, cache, table, lens, rotation=module.default_rotation(gpu0)),
            "decode: workspace.partial_out is on cuda:0": lambda: module.decode(
                query, cache, table, lens, workspace=module.DecodeWorkspace(2, KV_HEADS * GROUP, 8, gpu0)),
            "dequantize: block_table is on cuda:0": lambda: module.dequantize(cache, table.to(gpu0), lens),
            "dequantize: centroids is on cuda:0":
                lambda: module.dequantize(cache, table, lens, centroids=module.default_centroids(gpu0)),
        }
        for message, call in calls.items():
            with pytest.raises(module.LaunchError) as caught:
                call()
            assert str(caught.value) == f"{message}, expected cuda:1 like the cache"
        assert torch.equal(cache, before)
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_launchers_on_the_current_gpu_enter_no_device_context(build_module, monkeypatch):
    """One GPU per process, the common case: the hot path constructs no torch.cuda.device."""
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    device = torch.device("cuda", torch.cuda.current_device())
    kwargs = codebook_kwargs(module, config, device)
    batch, cache = stored_cache(module, config, [40, 7], device)
    query = torch.randn(2, KV_HEADS * GROUP, config.head_dim, device=device)

    def calls():
        module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
        module.decode(query, cache, batch.block_table, batch.seq_lens, **kwargs)
        module.dequantize(cache, batch.block_table, batch.seq_lens, **kwargs)

    calls()  # compile first: only the calls themselves are watched
    contexts = []
    real_device = torch.cuda.device
    monkeypatch.setattr(torch.cuda, "device", lambda index: contexts.append(index) or real_device(index))
    calls()
    monkeypatch.undo()  # torch.cuda.synchronize enters torch.cuda.device itself
    torch.cuda.synchronize()
    assert contexts == []
    assert module._device_switch(cache) is None


def vllm_step_captured(cache_dtype, device, current, tmp_path, monkeypatch):
    """A vLLM decode step (store the new tokens, decode) through tqgen.vllm's drop-ins on `device` with cuda:`current`
    current throughout: warmed up, then captured on a stream of `device` with cuda:`current` made current again inside
    the capture, with a codebook (PiT, midpoints, centroids) first seen there (fresh tensors, their values read on the
    host by no call: a drop-in that missed the capture would read them there, which a capture refuses). Replayed
    for new tokens, queries and lengths, it matches tqgen's reference."""
    from tqgen import codebook as codebook_mod
    from tqgen import vllm

    monkeypatch.setenv("TQGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(vllm, "_modules", {})
    monkeypatch.setattr(vllm, "_modules_by_config", {})
    monkeypatch.setattr(vllm, "_layout", "slots")
    head_dim, block_size, batch, width, context = 128, 16, 2, 4, 40
    num_q_heads, num_blocks = KV_HEADS * GROUP, batch * width
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    key_bits = vllm.VLLM_PRESETS[cache_dtype][0]
    generator = torch.Generator().manual_seed(7)

    def tokens(count):
        key = torch.randn(count, KV_HEADS, head_dim, generator=generator) * 2
        if key_bits == 8:
            key = key.to(torch.float8_e4m3fn).float()
        return key.half().to(device), torch.randn(count, KV_HEADS, head_dim, generator=generator).half().to(device)

    def slots_at(positions):  # the slot of position positions[b] of each sequence b
        blocks = torch.arange(num_blocks, dtype=torch.int64).view(batch, width)
        return blocks.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size

    with torch.cuda.device(current):
        pi = codebook_mod.hadamard_matrix(head_dim).to(device)  # vLLM's PiT for a power-of-two head_dim
        centroids = torch.tensor(codebook_mod.centroids(4 if key_bits == 8 else key_bits, head_dim), device=device)
        midpoints = (centroids[1:] + centroids[:-1]) / 2
        allocation = torch.zeros(num_blocks, KV_HEADS, block_size, vllm.slot_size_aligned(cache_dtype, head_dim),
                                 dtype=torch.uint8, device=device)
        cache = allocation.transpose(1, 2)
        block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, width)
        format_args = (arguments["mse_bits"], arguments["key_packed_size"], arguments["value_quant_bits"])
        key, value = tokens(batch * context)
        prefill = torch.cat([slots_at(torch.full((batch,), p)) for p in range(context)]).view(context, batch).t()
        vllm.triton_turboquant_store(key, value, cache, prefill.flatten().to(device), pi, midpoints, *format_args,
                                     key_fp8=arguments["key_fp8"])
        step_key, step_value = tokens(batch)
        step_slots = torch.full((batch,), -1, dtype=torch.int32, device=device)
        query = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float16, device=device)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        mid_o_buf = torch.empty(batch, num_q_heads, 8, head_dim + 1, device=device)
        output_buf = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float16, device=device)

        def step(pit, mids, cents):
            vllm.triton_turboquant_store(step_key, step_value, cache, step_slots, pit, mids, *format_args,
                                         key_fp8=arguments["key_fp8"])
            return vllm.triton_turboquant_decode_attention(
                query, cache, block_table, seq_lens, pit, cents, head_dim**-0.5, PiT=pit, mid_o_buf=mid_o_buf,
                output_buf=output_buf, max_num_kv_splits=8, **arguments)

        step(pi, midpoints, centroids)  # builds the module and compiles the kernels on `device`, outside the capture
        torch.cuda.synchronize(device)
        fresh = (pi.clone(), midpoints.clone(), centroids.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            with torch.cuda.device(current):
                out = step(*fresh)
        assert torch.cuda.current_device() == current and out.data_ptr() == output_buf.data_ptr()
        config = make_config(TQGEN_VLLM_PRESET[cache_dtype], head_dim=head_dim)
        for lengths in ([context + 1, context + 1], [context + 1, 9]):
            new_key, new_value = tokens(batch)
            step_key.copy_(new_key)
            step_value.copy_(new_value)
            lengths = torch.tensor(lengths)
            step_slots.copy_(slots_at(lengths - 1))
            seq_lens.copy_(lengths)
            query.copy_(torch.randn(query.shape, generator=generator))
            output_buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            codebook_args = (None, None) if key_bits == 8 else (pi.cpu(), centroids.cpu())
            want = reference.decode(Layout.from_config(config), query.cpu(), cache.cpu(), block_table.cpu(),
                                    seq_lens.cpu(), *codebook_args, head_dim**-0.5)
            assert relative_error(output_buf.cpu(), want) < DECODE_TOLERANCE[torch.float16]


TQGEN_VLLM_PRESET = {"turboquant_k3v4_nc": "k3v4", "turboquant_k8v4": "k8v4"}


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("cache_dtype", sorted(TQGEN_VLLM_PRESET))
def test_vllm_step_captured_on_the_second_gpu_while_the_first_is_current(cache_dtype, tmp_path, monkeypatch):
    with torch.cuda.device(0):
        vllm_step_captured(cache_dtype, torch.device("cuda", 1), 0, tmp_path, monkeypatch)
        assert torch.cuda.current_device() == 0
