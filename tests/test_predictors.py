"""Predictors: the safetensors file (round trip, determinism, standard readers) and the compatibility check."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import base_moe
from base_moe import Predictors
from base_moe.predictors import FORMAT, FORMAT_VERSION


def make_predictors(layers=(0, 1, 3), experts: int = 8, hidden: int = 32, seed: int = 0) -> Predictors:
    g = torch.Generator().manual_seed(seed)
    weight = {i: torch.randn(experts, hidden, generator=g) for i in layers}
    bias = {i: torch.randn(experts, generator=g) for i in layers}
    mean = {i: torch.randn(experts, generator=g) for i in layers}
    expert_r2 = {i: torch.rand(experts, generator=g) for i in layers}
    similarity = {i: torch.rand(experts, experts, generator=g) for i in layers}
    r2 = {i: 0.1 + 0.2 * k + 1e-17 * k for k, i in enumerate(layers)}
    metadata = {
        "model_type": "qwen3_moe", "hidden_size": hidden, "num_experts": experts, "tokens": 1234, "ridge": 1e-3,
        "routing": {"top_k": 2, "scoring": "SOFTMAX"}, "model_name_or_path": "/models/tiné",
    }
    return Predictors(weight, bias, mean, r2, metadata, expert_r2, similarity)


def test_save_load_round_trip_is_bit_exact(tmp_path):
    p = make_predictors()
    path = tmp_path / "p.safetensors"
    p.save(path)
    q = Predictors.load(path)
    assert q.layers == p.layers == [0, 1, 3]
    for field in ("weight", "bias", "mean_log_norm", "expert_r2", "similarity"):
        for i in p.layers:
            a, b = getattr(p, field)[i], getattr(q, field)[i]
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (field, i)
    assert q.r2 == p.r2  # floats survive JSON exactly
    assert q.metadata == p.metadata
    assert q.metadata["format"] == "base_moe.predictors" and q.metadata["format_version"] == 2  # with similarity
    assert q.hidden_size == 32 and q.num_experts == {0: 8, 1: 8, 3: 8}


def test_file_is_deterministic_and_readable_by_safetensors(tmp_path):
    p = make_predictors()
    p.save(tmp_path / "a.safetensors")
    make_predictors().save(tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()

    tensors = load_file(tmp_path / "a.safetensors")  # any safetensors reader opens it
    assert sorted(tensors) == sorted(
        f"layers.{i}.{f}" for i in (0, 1, 3) for f in ("weight", "bias", "mean_log_norm", "expert_r2", "similarity")
    )
    assert tensors["layers.3.weight"].shape == (8, 32) and torch.equal(tensors["layers.1.bias"], p.bias[1])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["model_type"]) == "qwen3_moe" and json.loads(meta["layers"]) == [0, 1, 3]
    assert json.loads(meta["r2"])["3"] == p.r2[3]


def read_header(path) -> tuple[int, bytes, list]:
    """A safetensors file's header length field, its header bytes and the header's (key, value) pairs in file order."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length]
    return length, header, json.loads(header, object_pairs_hook=list)


def test_file_header_is_padded_and_sorted(tmp_path):
    """The bytes are the format's, not only what one reader accepts: the JSON header padded with spaces to a multiple
    of 8 bytes (the tensor data then starts 8-byte aligned), ``__metadata__`` first with its keys sorted, then the
    tensors sorted by name, their data right after the header."""
    pads = set()
    for extra in range(8):  # header lengths of every residue mod 8: every padding length is written
        p = make_predictors()
        p.metadata["note"] = "x" * extra
        path = tmp_path / f"p{extra}.safetensors"
        p.save(path)
        length, header, pairs = read_header(path)
        assert length % 8 == 0, (extra, length)
        text = header.rstrip(b" ")
        pads.add(length - len(text))
        assert header[len(text):] == b" " * (length - len(text)) and length - len(text) < 8 and text.endswith(b"}")
        names = [name for name, _ in pairs]
        assert names[0] == "__metadata__" and names[1:] == sorted(p.tensors())
        metadata_keys = [key for key, _ in pairs[0][1]]
        assert metadata_keys == sorted(p.metadata) and metadata_keys != list(p.metadata)  # sorted, not as inserted
        end = max(dict(info)["data_offsets"][1] for _, info in pairs[1:])
        assert path.stat().st_size == 8 + length + end
    assert pads == set(range(8))


def test_bytes_do_not_depend_on_the_metadatas_insertion_order(tmp_path):
    """Equal metadata inserted in another order (at the top level and inside a nested value) gives the same bytes:
    the keys and each value's JSON are sorted."""
    p = make_predictors()
    q = make_predictors()
    q.metadata = {k: q.metadata[k] for k in reversed(q.metadata)}
    q.metadata["routing"] = {k: q.metadata["routing"][k] for k in reversed(q.metadata["routing"])}
    assert q.metadata == p.metadata and list(q.metadata) != list(p.metadata)
    assert list(q.metadata["routing"]) != list(p.metadata["routing"])
    p.save(tmp_path / "p.safetensors")
    q.save(tmp_path / "q.safetensors")
    assert (tmp_path / "p.safetensors").read_bytes() == (tmp_path / "q.safetensors").read_bytes()
    p.save(tmp_path / "again.safetensors")  # and a second save of one object: the same bytes again
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "p.safetensors").read_bytes()


def test_the_formats_own_metadata_is_the_predictors(tmp_path):
    """format, format_version, layers and r2 describe the file: a caller's other "format" is refused (a file that
    load() refuses would be written), a caller's "layers" gives way to the predictors' own, and metadata replaced after
    construction still saves a loadable file."""
    p = make_predictors()
    with pytest.raises(ValueError, match="metadata 'format' names the file format, 'base_moe.predictors'; got 'mine'"):
        Predictors(p.weight, p.bias, p.mean_log_norm, p.r2, {"format": "mine"})
    q = Predictors(p.weight, p.bias, p.mean_log_norm, p.r2, {"format": FORMAT, "layers": [7], "r2": {"7": 1.0}})
    assert q.metadata["layers"] == q.layers == [0, 1, 3] and q.metadata["r2"] == {str(i): p.r2[i] for i in p.layers}
    p.metadata = {"model_type": "olmoe"}
    p.save(tmp_path / "p.safetensors")
    loaded = Predictors.load(tmp_path / "p.safetensors")
    assert loaded.metadata["model_type"] == "olmoe" and loaded.metadata["format_version"] == FORMAT_VERSION
    assert loaded.layers == p.layers


def test_a_file_without_similarity_is_version_1(tmp_path):
    """Version 2 only where the file holds what version-1 readers do not know (the similarity), so that they read
    every other file and tell a user to upgrade for those."""
    p = make_predictors()
    plain = Predictors(p.weight, p.bias, p.mean_log_norm, p.r2, p.metadata, p.expert_r2)
    plain.save(tmp_path / "p.safetensors")
    assert Predictors.load(tmp_path / "p.safetensors").metadata["format_version"] == 1
    assert p.metadata["format_version"] == 2


def test_nan_r2_survives(tmp_path):
    p = make_predictors(layers=(2,))
    p.r2[2] = math.nan  # edited after construction: save() writes the current values
    p.save(tmp_path / "p.safetensors")
    assert math.isnan(Predictors.load(tmp_path / "p.safetensors").r2[2])


def test_load_rejects_other_files(tmp_path):
    save_file({"weight": torch.zeros(2)}, tmp_path / "other.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not a base_moe predictors file"):
        Predictors.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=f"{tmp_path}: a directory, not a predictors file"):
        Predictors.load(tmp_path)


def test_broken_predictor_files_are_clear_errors(tmp_path):
    """Truncated, empty, malformed or non-finite files: a ValueError naming the file and the problem."""
    good = tmp_path / "good.safetensors"
    make_predictors(layers=(0, 1)).save(good)
    meta = {"format": json.dumps("base_moe.predictors"), "format_version": "1"}
    layer0 = {"layers.0.weight": torch.zeros(4, 8), "layers.0.bias": torch.zeros(4),
              "layers.0.mean_log_norm": torch.zeros(4)}
    cases = {
        "truncated": (good.read_bytes()[:-20], "not a readable safetensors file"),
        "empty": (b"", "not a readable safetensors file"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}: {message}"):
            Predictors.load(tmp_path / name)
    files = {
        "no_tensors": ({}, meta, "at least one layer"),
        "one_dim": ({"layers.0.weight": torch.zeros(4), "layers.0.bias": torch.zeros(4),
                     "layers.0.mean_log_norm": torch.zeros(4)}, meta, r"must be \[experts, hidden_size\]"),
        "bad_name": ({"layers.x.weight": torch.zeros(4, 8)}, meta, "unexpected tensor 'layers.x.weight'"),
        "bad_version": ({}, {**meta, "format_version": json.dumps("2b")}, "format_version must be an int"),
        "nan": ({"layers.0.weight": torch.full((4, 8), math.nan), "layers.0.bias": torch.zeros(4),
                 "layers.0.mean_log_norm": torch.zeros(4)}, meta, "NaN or infinite"),
        "inf_bias": ({**layer0, "layers.0.bias": torch.tensor([0.0, math.inf, 0.0, 0.0])}, meta, "NaN or infinite"),
        "nan_mean": ({**layer0, "layers.0.mean_log_norm": torch.tensor([0.0, 0.0, math.nan, 0.0])}, meta,
                     "NaN or infinite"),
        "newer": (layer0, {**meta, "format_version": str(FORMAT_VERSION + 1)},
                  "newer than this base_moe understands"),
        "unicode_digit": ({"layers.\u00b2.weight": torch.zeros(4, 8)}, meta, "unexpected tensor"),
        "r2_list": (layer0, {**meta, "r2": json.dumps([0.5])}, "metadata r2 must map layer numbers to numbers"),
        "r2_text": (layer0, {**meta, "r2": json.dumps({"0": "good"})}, "metadata r2 must map"),
        "expert_r2_shape": ({**layer0, "layers.0.expert_r2": torch.zeros(3, 3)}, meta, r"expert_r2 must be \[4\]"),
    }
    with pytest.raises(RuntimeError, match="device"):  # the caller's device, not the file, is at fault
        Predictors.load(good, device="bogus")
    for name, (tensors, metadata, message) in files.items():
        save_file(tensors, tmp_path / name, metadata=metadata)
        with pytest.raises(ValueError, match=f"{name}: .*{message}"):
            Predictors.load(tmp_path / name)


def test_inconsistent_shapes_are_refused():
    with pytest.raises(ValueError, match="r2 names layers \\[1, 2\\] that have no predictor"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)}, r2={0: 0.5, 1: 0.4, 2: 0.3})
    with pytest.raises(ValueError, match="expert_r2 names layers \\[1\\]"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)}, expert_r2={1: torch.zeros(4)})
    with pytest.raises(ValueError, match="same layers"):
        Predictors({0: torch.zeros(4, 8)}, {1: torch.zeros(4)}, {0: torch.zeros(4)})
    with pytest.raises(ValueError, match=r"must be \[4\]"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(5)}, {0: torch.zeros(4)})
    with pytest.raises(ValueError, match="similarity names layers \\[1\\]"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)}, similarity={1: torch.eye(4)})
    with pytest.raises(ValueError, match=r"similarity must be a finite \[4, 4\] matrix, got \(4, 5\)"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)}, similarity={0: torch.zeros(4, 5)})
    with pytest.raises(ValueError, match=r"similarity must be a finite"):
        Predictors({0: torch.zeros(4, 8)}, {0: torch.zeros(4)}, {0: torch.zeros(4)},
                   similarity={0: torch.full((4, 4), math.nan)})
    with pytest.raises(ValueError, match="one hidden size"):
        Predictors({0: torch.zeros(4, 8), 1: torch.zeros(4, 6)}, {i: torch.zeros(4) for i in (0, 1)},
                   {i: torch.zeros(4) for i in (0, 1)})


# ---------------------------------------------------------------------------------------------
# check_compatible on real (tiny) models
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibrated():
    from test_calibrate import tiny_qwen3_moe

    model = tiny_qwen3_moe(layers=2, hidden=32, experts=8)
    return base_moe.calibrate(model, torch.randint(0, 256, (4, 16)), holdout=0.25, progress=False)


def test_matching_model_is_accepted(calibrated):
    from test_calibrate import tiny_qwen3_moe

    calibrated.check_compatible(tiny_qwen3_moe(layers=2, hidden=32, experts=8, seed=1))  # other weights, same shape


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=3, hidden=32, experts=8), r"MoE layers: predictors have 0-1, the model has 0-2"),
        (dict(layers=2, hidden=48, experts=8), r"hidden size: predictors have 32, the model has \[48\]"),
        (dict(layers=2, hidden=32, experts=4), r"expert count \(predictors vs model\): layer 0: 8 vs 4, layer 1: 8 vs 4"),
        # both differences named (the expert count was left out where the hidden size differed too)
        (dict(layers=2, hidden=48, experts=4),
         r"hidden size: predictors have 32, the model has \[48\]\n  expert count"),
    ],
)
def test_mismatched_model_is_refused(calibrated, kwargs, message):
    from test_calibrate import tiny_qwen3_moe

    with pytest.raises(ValueError, match=message) as err:
        calibrated.check_compatible(tiny_qwen3_moe(**kwargs))
    assert "predictors do not match this model" in str(err.value) and "calibrate" in str(err.value)


@pytest.mark.parametrize("layers, cut", [(4, False), (5, True)])
def test_expert_count_mismatch_names_four_layers_then_cuts(layers, cut):
    """The expert-count difference is named for the first four layers, with "..." only where more differ."""
    from test_calibrate import tiny_qwen3_moe

    E, H = 8, 32
    predictors = Predictors({i: torch.zeros(E, H) for i in range(layers)}, {i: torch.zeros(E) for i in range(layers)},
                            {i: torch.zeros(E) for i in range(layers)})
    with pytest.raises(ValueError, match="expert count") as err:
        predictors.check_compatible(tiny_qwen3_moe(layers=layers, hidden=H, experts=4))
    (line,) = [line for line in str(err.value).splitlines() if "expert count" in line]
    assert line.count(" vs 4") == 4 and line.endswith("layer 3: 8 vs 4" + " ..." * cut), line


def test_other_model_type_is_refused(calibrated):
    from test_calibrate import tiny_qwen3_moe

    other = Predictors(
        calibrated.weight, calibrated.bias, calibrated.mean_log_norm, calibrated.r2,
        {**calibrated.metadata, "model_type": "olmoe"},
    )
    with pytest.raises(ValueError, match=r"model type: predictors are for 'olmoe', the model is 'qwen3_moe'"):
        other.check_compatible(tiny_qwen3_moe(layers=2))


# ---------------------------------------------------------------------------------------------
# Edge cases found by mutation testing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positional", [False, True])
def test_to_converts_every_tensor(positional):
    """``to(dtype=...)`` and, as with tensors, ``to(dtype)`` with the dtype first."""
    p = make_predictors()
    q = p.to(torch.float64) if positional else p.to(dtype=torch.float64)
    for field in ("weight", "bias", "mean_log_norm", "expert_r2", "similarity"):
        for i in p.layers:
            a, b = getattr(p, field)[i], getattr(q, field)[i]
            assert b.dtype == torch.float64 and torch.equal(b, a.double()), (field, i)
    assert q.r2 == p.r2 and q.metadata == p.metadata


def test_to_refuses_two_dtypes():
    with pytest.raises(TypeError, match="dtype both positionally and as dtype="):
        make_predictors().to(torch.float64, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.complex64])
def test_to_refuses_a_dtype_that_is_not_floating(dtype):
    with pytest.raises(TypeError, match=f"to\\(\\) takes a floating dtype, got {dtype}"):
        make_predictors().to(dtype)
    with pytest.raises(TypeError, match="takes a floating dtype"):
        make_predictors().to(dtype=dtype)


def test_layers_without_r2_have_nan(tmp_path):
    """No held-out R^2 given for a layer: NaN (unknown), not a measured 0."""
    p = make_predictors(layers=(0, 2))
    q = Predictors(p.weight, p.bias, p.mean_log_norm, {2: 0.5})
    assert math.isnan(q.r2[0]) and q.r2[2] == 0.5 and math.isnan(q.metadata["r2"]["0"])
    q.save(tmp_path / "p.safetensors")
    assert math.isnan(Predictors.load(tmp_path / "p.safetensors").r2[0])


def test_a_tensor_of_an_unknown_field_is_refused(tmp_path):
    tensors = {"layers.0.weight": torch.zeros(4, 8), "layers.0.bias": torch.zeros(4),
               "layers.0.mean_log_norm": torch.zeros(4), "layers.0.scale": torch.zeros(4)}
    meta = {"format": json.dumps("base_moe.predictors"), "format_version": "1"}
    save_file(tensors, tmp_path / "extra", metadata=meta)
    with pytest.raises(ValueError, match="extra: unexpected tensor 'layers.0.scale'"):
        Predictors.load(tmp_path / "extra")
