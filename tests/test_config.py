"""The YAML config loader: shipped configs, defaults, refusals, hashing, arch resolution."""

import dataclasses
import hashlib
import re
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tqgen import config as config_mod
from tqgen.config import Config, from_mapping, load, resolve_arch
from tqgen.errors import ConfigError, TqgenError

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))

BASE = {"key_format": "mse", "value_bits": 4, "head_dim": 128}
DROP = object()  # marks a field to remove from BASE


def _mentions(message: str, text: str) -> bool:
    """`text` appears in `message` as a whole token (so "8" does not match inside "fp8")."""
    return re.search(r"(?<![\w.])" + re.escape(text) + r"(?![\w.])", message) is not None


def _write(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _write_fields(tmp_path: Path, overrides: dict) -> Path:
    fields = {k: v for k, v in {**BASE, **overrides}.items() if v is not DROP}
    return _write(tmp_path, yaml.safe_dump(fields, sort_keys=False))


def _refusal(action) -> ConfigError:
    """Run `action`, expect a ConfigError with a one-line message, and return it."""
    with pytest.raises(ConfigError) as info:
        action()
    assert isinstance(info.value, TqgenError)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, f"multi-line error: {message!r}"
    return info.value


# --------------------------------------------------------------------------
# shipped configs
# --------------------------------------------------------------------------
def test_shipped_configs_are_present():
    names = {path.stem for path in SHIPPED}
    assert {"k8v4-d128", "k4v4-d128", "k3v4-d128", "k3v3-d128"} <= names
    assert any(load(path).head_dim == 96 for path in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    config = load(path)
    assert isinstance(config, Config)
    assert config.name == path.stem  # a file's name defaults to its stem
    assert config.arch == "auto"
    assert config.short_name() == path.stem.split("-")[0]
    assert f"-d{config.head_dim}" in path.stem


@pytest.mark.parametrize(
    "stem, expected",
    [
        ("k8v4-d128", dict(key_format="fp8", key_bits=8, value_bits=4, head_dim=128,
                           norm_correction=False, rotation=None, rotation_seed=0)),
        ("k4v4-d128", dict(key_format="mse", key_bits=4, value_bits=4, head_dim=128,
                           norm_correction=True, rotation="hadamard")),
        ("k3v4-d128", dict(key_format="mse", key_bits=3, value_bits=4, head_dim=128,
                           norm_correction=True, rotation="hadamard")),
        ("k3v3-d128", dict(key_format="mse", key_bits=3, value_bits=3, head_dim=128,
                           norm_correction=True, rotation="hadamard")),
        ("k3v4-d96", dict(key_format="mse", key_bits=3, value_bits=4, head_dim=96,
                          rotation="random", rotation_seed=0)),
    ],
)
def test_shipped_config_fields(stem, expected):
    config = load(CONFIG_DIR / f"{stem}.yaml")
    actual = {field: getattr(config, field) for field in expected}
    assert actual == expected
    assert config.block_size == 16 and config.output_dtype == "auto"


# --------------------------------------------------------------------------
# defaults
# --------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim, rotation", [(64, "hadamard"), (128, "hadamard"), (256, "hadamard"),
                                                (96, "random"), (136, "random")])
def test_mse_defaults(head_dim, rotation):
    config = from_mapping({"key_format": "mse", "value_bits": 4, "head_dim": head_dim}, "<defaults>")
    assert (config.block_size, config.arch, config.output_dtype) == (16, "auto", "auto")
    assert (config.key_bits, config.norm_correction, config.rotation) == (4, True, rotation)
    assert config.rotation_seed == 0
    assert config.name == f"k4v4-d{head_dim}"


def test_fp8_defaults():
    config = from_mapping({"key_format": "fp8", "value_bits": 4, "head_dim": 128}, "<defaults>")
    assert (config.key_bits, config.norm_correction, config.rotation, config.rotation_seed) == (8, False, None, 0)
    assert (config.block_size, config.arch, config.output_dtype) == (16, "auto", "auto")
    assert config.short_name() == "k8v4"


def test_load_applies_defaults_and_names_the_config_after_the_file(tmp_path):
    path = _write(tmp_path, "key_format: mse\nvalue_bits: 4\nhead_dim: 96\n", "my-format.yaml")
    config = load(path)
    assert config.name == "my-format"
    assert (config.key_bits, config.rotation, config.block_size, config.arch) == (4, "random", 16, "auto")


def test_explicit_values_override_defaults():
    config = from_mapping({**BASE, "key_bits": 2, "block_size": 64, "norm_correction": False, "rotation": "random",
                           "rotation_seed": 7, "arch": "sm89", "output_dtype": "bfloat16", "cache_layout": "planes",
                           "name": "custom"})
    assert dataclasses.asdict(config) == {
        "key_format": "mse", "key_bits": 2, "value_bits": 4, "head_dim": 128, "block_size": 64,
        "norm_correction": False, "rotation": "random", "rotation_seed": 7, "arch": "sm89",
        "output_dtype": "bfloat16", "cache_layout": "planes", "name": "custom",
    }


# --------------------------------------------------------------------------
# refusals of field values: (overrides of BASE, field, given, allowed)
# --------------------------------------------------------------------------
FIELD_REFUSALS = [
    pytest.param({"bogus": 1}, "bogus", None, "key_format", id="unknown-field"),
    pytest.param({"keybits": 3}, "keybits", None, "key_bits", id="misspelled-field"),
    # wrong types
    pytest.param({"head_dim": "128"}, "head_dim", "'128'", "multiple of 8", id="head_dim-string"),
    pytest.param({"key_bits": True}, "key_bits", "true", "2, 3 or 4", id="key_bits-bool"),
    pytest.param({"value_bits": 4.0}, "value_bits", "4.0", "2, 3, 4 or 8", id="value_bits-float"),
    pytest.param({"arch": ["sm75"]}, "arch", "sm75", "sm80", id="arch-list"),
    pytest.param({"norm_correction": "yes please"}, "norm_correction", "'yes please'", "true or false",
                 id="norm_correction-string"),
    pytest.param({"key_format": None}, "key_format", "null", "mse or fp8", id="key_format-null"),
    # out of range
    pytest.param({"head_dim": 60}, "head_dim", "60", "64 to 256", id="head_dim-60"),
    pytest.param({"head_dim": 100}, "head_dim", "100", "multiple of 8", id="head_dim-100"),
    pytest.param({"head_dim": 264}, "head_dim", "264", "64 to 256", id="head_dim-264"),
    pytest.param({"value_bits": 5}, "value_bits", "5", "2, 3, 4 or 8", id="value_bits-5"),
    pytest.param({"key_bits": 5}, "key_bits", "5", "2, 3 or 4", id="mse-key_bits-5"),
    pytest.param({"block_size": 24}, "block_size", "24", "power of two", id="block_size-24"),
    pytest.param({"arch": "sm70"}, "arch", "'sm70'", "sm80", id="arch-sm70"),
    pytest.param({"key_format": "int4"}, "key_format", "'int4'", "mse or fp8", id="key_format-int4"),
    pytest.param({"output_dtype": "int8"}, "output_dtype", "'int8'", "bfloat16", id="output_dtype-int8"),
    pytest.param({"rotation": "random", "rotation_seed": -1}, "rotation_seed", "-1", "2**63-1",
                 id="rotation_seed-negative"),
    pytest.param({"name": "x" * 81}, "name", None, "at most 80 printable ASCII", id="name-81-characters"),
    pytest.param({"name": "caf\u00e9"}, "name", "'caf\u00e9'", "printable ASCII", id="name-non-ascii"),
    pytest.param({"name": "a\nb"}, "name", "'a\\nb'", "printable ASCII", id="name-newline"),
    # impossible combinations
    pytest.param({"head_dim": 96, "rotation": "hadamard"}, "rotation", "'hadamard'", "'random'",
                 id="hadamard-with-head_dim-96"),
    pytest.param({"key_format": "fp8", "norm_correction": True}, "norm_correction", "true", "mse",
                 id="fp8-with-norm_correction"),
    pytest.param({"key_format": "fp8", "rotation": "random"}, "rotation", "'random'", "mse",
                 id="fp8-with-rotation"),
    pytest.param({"key_format": "fp8", "key_bits": 4}, "key_bits", "4", "8", id="fp8-with-key_bits-4"),
    pytest.param({"rotation": "hadamard", "rotation_seed": 3}, "rotation_seed", "3", "'random'",
                 id="rotation_seed-with-hadamard"),
    # missing required fields
    pytest.param({"key_format": DROP}, "key_format", None, "mse or fp8", id="missing-key_format"),
    pytest.param({"value_bits": DROP}, "value_bits", None, "2, 3, 4 or 8", id="missing-value_bits"),
    pytest.param({"head_dim": DROP}, "head_dim", None, "multiple of 8", id="missing-head_dim"),
]


@pytest.mark.parametrize("overrides, field, given, allowed", FIELD_REFUSALS)
def test_bad_field_is_refused_with_one_line_naming_file_field_value_and_allowed(
        tmp_path, overrides, field, given, allowed):
    path = _write_fields(tmp_path, overrides)
    error = _refusal(lambda: load(path))
    message = str(error)
    assert (error.source, error.field) == (str(path), field)
    assert message.startswith(f"{path}: {field}: "), message
    if given is not None:
        assert _mentions(message, given), f"given value {given!r} not in {message!r}"
    assert _mentions(message, allowed), f"allowed {allowed!r} not in {message!r}"
    if overrides.get(field) is DROP:
        assert "missing" in message
    if field not in config_mod._FIELDS:
        assert "unknown field" in message


@pytest.mark.parametrize("overrides, field, given, allowed", FIELD_REFUSALS)
def test_from_mapping_names_its_source(overrides, field, given, allowed):
    data = {k: v for k, v in {**BASE, **overrides}.items() if v is not DROP}
    message = str(_refusal(lambda: from_mapping(data, "<inline config>")))
    assert message.startswith(f"<inline config>: {field}: ")


# --------------------------------------------------------------------------
# refusals of whole files: (file text or None for "no such file", key phrase)
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, phrase",
    [
        pytest.param(None, "no such file", id="missing-file"),
        pytest.param("", "empty", id="empty-file"),
        pytest.param("# only a comment\n", "empty", id="comment-only"),
        pytest.param("   \n\n", "empty", id="blank-lines"),
        pytest.param("- key_format: mse\n- value_bits: 4\n", "mapping", id="yaml-list"),
        pytest.param("just a string\n", "mapping", id="yaml-scalar"),
    ],
)
def test_bad_file_is_refused(tmp_path, text, phrase):
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    message = str(_refusal(lambda: load(path)))
    assert message.startswith(f"{path}: ")
    assert phrase in message


@pytest.mark.parametrize(
    "text, line",
    [
        pytest.param("value_bits: 4\nhead_dim: 128\nkey_format: [mse\n", None, id="unclosed-list"),
        pytest.param("key_format: [mse\nvalue_bits: 4\nhead_dim: 128\n", None, id="unclosed-list-first-line"),
        pytest.param("key_format: mse\n\tvalue_bits: 4\n", 2, id="tab-indent"),
        pytest.param("key_format: mse\nvalue_bits: 4: 5\n", 2, id="nested-colon"),
    ],
)
def test_unparsable_yaml_is_refused_naming_the_line(tmp_path, text, line):
    path = _write(tmp_path, text)
    message = str(_refusal(lambda: load(path)))
    assert message.startswith(f"{path}: ")
    match = re.search(r"\bline (\d+)", message)
    assert match, f"no line number in {message!r}"
    if line is not None:
        assert int(match.group(1)) == line
    else:  # the parser notices an unclosed bracket later; it must still point inside the file
        assert 1 <= int(match.group(1)) <= text.count("\n") + 1


@pytest.mark.parametrize("depth", [33, 5000])
def test_deeply_nested_yaml_is_refused_before_parsing(tmp_path, depth):
    path = _write(tmp_path, f"key_format: mse\nvalue_bits: 4\nhead_dim: {'[' * depth}128{']' * depth}\n")
    started = time.perf_counter()
    message = str(_refusal(lambda: load(path)))
    assert message == f"{path}: <yaml>: not valid YAML: nested too deeply"
    assert time.perf_counter() - started < 0.5  # PyYAML alone took seconds to hit the recursion limit


def test_brackets_in_quotes_and_comments_are_not_nesting(tmp_path):
    many = "[" * 40
    path = _write(tmp_path, f"# {many}\nkey_format: mse  # {many}\nvalue_bits: 4\nhead_dim: 128\nname: '{many}'\n")
    assert load(path).name == many


def test_directory_is_refused(tmp_path):
    message = str(_refusal(lambda: load(tmp_path)))
    assert message.startswith(f"{tmp_path}: ")
    assert "directory" in message


@pytest.mark.parametrize("kind, phrase", [("missing", "no such file"), ("directory", "is a directory")])
def test_load_of_an_emitted_module_that_is_not_a_file_is_refused_in_one_line(tmp_path, kind, phrase):
    """tqgen.load takes a YAML config or an emitted .py module: either missing is the same one-line error."""
    from tqgen import emit

    path = tmp_path / "tq_module.py"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(TqgenError) as info:
        emit.load(path)
    assert str(info.value) == f"{path}: {phrase}, expected an emitted module (.py)"


def test_undecodable_file_is_refused(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00key_format: mse\n")
    message = str(_refusal(lambda: load(path)))
    assert message.startswith(f"{path}: ")


def test_a_file_name_that_cannot_be_the_default_name_asks_for_one(tmp_path):
    """A config without `name:` is named after its file: a file name too long to title the emitted modules within
    120 columns is refused in one line that says to set `name:`; with it set, the file loads."""
    path = tmp_path / ("llama-3.1-70b-instruct-" * 4 + "k3v4.yaml")
    path.write_text(yaml.safe_dump(BASE))
    message = str(_refusal(lambda: load(path)))
    assert message.startswith(f"{path}: name: ") and "set name:" in message and "\n" not in message
    path.write_text(yaml.safe_dump({**BASE, "name": "llama-70b-k3v4"}))
    assert load(path).name == "llama-70b-k3v4"


def test_unknown_field_with_a_newline_in_its_name_still_gives_one_line(tmp_path):
    path = _write(tmp_path, '"head\\ndim": 128\nkey_format: mse\nvalue_bits: 4\n')
    message = str(_refusal(lambda: load(path)))
    assert "head\\ndim" in message and "unknown field" in message


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from([2, 3, 4, 8, 16, 64, 96, 128, 256, "mse", "fp8", "hadamard", "random", "auto", "sm90",
                     "float16"]),
)
_FIELD_NAMES = st.one_of(st.sampled_from(sorted(config_mod._FIELDS)), st.text(max_size=8))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_FIELD_NAMES, st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3)), max_size=8))
def test_any_mapping_gives_a_config_or_a_one_line_config_error(data):
    try:
        config = from_mapping(data, "<prop>")
    except ConfigError as exc:
        assert "\n" not in str(exc) and "\r" not in str(exc)
        assert str(exc).startswith("<prop>: ")
    else:
        assert config.key_format in config_mod.KEY_FORMATS
        assert (config.rotation is None) == (config.key_format == "fp8")
        assert config.rotation != "hadamard" or config.is_power_of_two_dim


# --------------------------------------------------------------------------
# hash and artifact name
# --------------------------------------------------------------------------
HASH_BASE = {"key_format": "mse", "key_bits": 3, "value_bits": 4, "head_dim": 128}
HASH_VARIANTS = {
    "key_format": {"key_format": "fp8", "key_bits": DROP},
    "key_bits": {"key_bits": 2},
    "value_bits": {"value_bits": 8},
    "head_dim": {"head_dim": 64},
    "block_size": {"block_size": 32},
    "norm_correction": {"norm_correction": False},
    "rotation": {"rotation": "random"},
    "rotation_seed": {"rotation": "random", "rotation_seed": 7},
    "arch": {"arch": "sm90"},
    "output_dtype": {"output_dtype": "float16"},
}


def _variant(overrides: dict) -> Config:
    return from_mapping({k: v for k, v in {**HASH_BASE, **overrides}.items() if v is not DROP}, "<variant>")


def test_hash_is_stable_for_equal_configs(tmp_path):
    first = load(CONFIG_DIR / "k3v4-d128.yaml")
    copy = _write(tmp_path, (CONFIG_DIR / "k3v4-d128.yaml").read_text(), "k3v4-d128.yaml")
    assert load(copy) == first and load(copy).hash() == first.hash()
    assert from_mapping(dict(HASH_BASE)).hash() == from_mapping(dict(reversed(list(HASH_BASE.items())))).hash()
    assert re.fullmatch(r"[0-9a-f]{64}", first.hash())
    assert first.hash() == hashlib.sha256(first.canonical_json().encode()).hexdigest()


def test_hash_is_pinned():
    # Emitted modules and caches are identified by this hash; a change here must be deliberate.
    config = from_mapping(dict(HASH_BASE))
    assert config.canonical_json() == (
        '{"arch":"auto","block_size":16,"head_dim":128,"key_bits":3,"key_format":"mse",'
        '"norm_correction":true,"output_dtype":"auto","rotation":"hadamard","rotation_seed":0,"value_bits":4}'
    )


def test_hash_ignores_name():
    a = from_mapping({**HASH_BASE, "name": "alpha"})
    b = from_mapping({**HASH_BASE, "name": "beta"})
    assert a != b
    assert a.hash() == b.hash()
    assert a.artifact_name() == b.artifact_name()


@pytest.mark.parametrize("field", sorted(HASH_VARIANTS))
def test_hash_and_artifact_name_change_with_each_kernel_field(field):
    base, changed = _variant({}), _variant(HASH_VARIANTS[field])
    assert getattr(base, field) != getattr(changed, field)
    assert base.hash() != changed.hash()
    assert base.artifact_name() != changed.artifact_name()


def test_hash_variants_are_pairwise_distinct():
    configs = [_variant({})] + [_variant(overrides) for overrides in HASH_VARIANTS.values()]
    assert len({c.hash() for c in configs}) == len(configs)
    assert len({c.artifact_name() for c in configs}) == len(configs)


def test_shipped_artifact_names_differ():
    for capability in ((9, 0), (8, 0)):
        names = [resolve_arch(load(path), capability).artifact_name() for path in SHIPPED]
        assert len(set(names)) == len(names), names
        for name in names:
            assert name.startswith("tq_") and name.isidentifier(), name


# --------------------------------------------------------------------------
# arch resolution
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability, arch",
    [((9, 0), "sm90"), ((8, 0), "sm80"), ((8, 6), "sm86"), ((8, 7), "sm86"), ((8, 9), "sm89"),
     ((10, 0), "sm100"), ((12, 0), "sm100")],
)
def test_resolve_auto_arch_from_capability(capability, arch):
    config = from_mapping(dict(BASE))
    resolved = resolve_arch(config, capability)
    assert resolved.arch == arch
    assert dataclasses.replace(resolved, arch="auto") == config  # nothing else changes
    assert config.arch == "auto"  # the input is not mutated


def test_resolve_auto_arch_without_gpu_is_sm80(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: no GPU, whatever the machine has
    assert resolve_arch(from_mapping(dict(BASE)), None).arch == "sm80"


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm90", "sm100"])
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), None])
def test_resolve_leaves_explicit_arch_untouched(arch, capability):
    config = from_mapping({**BASE, "arch": arch})
    assert resolve_arch(config, capability) == config
