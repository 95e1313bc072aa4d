"""The benchmarks' command lines: names and variants checked before any work, the user's kernel knobs left alone."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_layer  # noqa: E402
from common import names_from  # noqa: E402


def test_variant_knobs():
    assert bench_layer.variant_knobs("default") == {}
    assert bench_layer.variant_knobs("WS-80+nopdl+half") == {
        "BASE_MOE_EXPERTS_CONFIG": "WS", "BASE_MOE_WS_N": "80", "BASE_MOE_EXPERTS_PDL": "0",
        "BASE_MOE_EXPERTS_GATE_UP_TILES": "half",
    }
    with pytest.raises(ValueError, match="unknown part 'T64'"):
        bench_layer.variant_knobs("T64")


def test_names_from():
    assert names_from("a,b,", {"a": 1, "b": 2}, "--models") == ["a", "b"]
    with pytest.raises(SystemExit, match=r"--models: unknown \['c'\]"):
        names_from("a,c", {"a": 1, "b": 2}, "--models")


def test_bench_layer_checks_its_arguments_and_keeps_the_users_knobs(monkeypatch, capsys):
    """The main table runs with the user's BASE_MOE_EXPERTS_* settings; only the variants section sets its own."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "W128")
    monkeypatch.setattr(bench_layer, "require_cuda", lambda script: sys.exit("stop before the GPU"))
    for argv, message in [(["--models", "qwen3-30b-a3b,nope"], "unknown"),
                          (["--variants", "W64,T64"], "variant 'T64': unknown part 'T64'"),  # argparse's error
                          (["--no-variants"], "stop before the GPU")]:
        monkeypatch.setattr(sys, "argv", ["bench_layer.py", *argv])
        with pytest.raises(SystemExit) as info:
            bench_layer.main()
        assert message in str(info.value.code) + capsys.readouterr().err
        assert os.environ["BASE_MOE_EXPERTS_CONFIG"] == "W128"


def test_bench_layer_variants_restore_the_users_knobs(monkeypatch):
    """A variant sets its knobs and clears the others only while it runs; the rows after it (and the JSON's record)
    see the user's settings again, unset ones unset."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "W128")
    monkeypatch.delenv("BASE_MOE_EXPERTS_PDL", raising=False)
    with bench_layer.variant("T32+nopdl"):
        assert os.environ["BASE_MOE_EXPERTS_CONFIG"] == "T32" and os.environ["BASE_MOE_EXPERTS_PDL"] == "0"
    with bench_layer.variant("default"):
        assert "BASE_MOE_EXPERTS_CONFIG" not in os.environ
    assert os.environ["BASE_MOE_EXPERTS_CONFIG"] == "W128" and "BASE_MOE_EXPERTS_PDL" not in os.environ
    with pytest.raises(ValueError, match="unknown part"):
        with bench_layer.variant("T64x"):
            pass
    assert os.environ["BASE_MOE_EXPERTS_CONFIG"] == "W128"


@pytest.mark.parametrize("script, argv, message", [
    ("bench_layer", ["--variants-only", "--no-variants"], "--variants-only times the Qwen3 configuration variants"),
    ("bench_layer", ["--variants-only", "--models", "olmoe-1b-7b"], "it needs qwen3-30b-a3b in --models"),
    ("bench_select", ["--replays", "0"], "--replays: expected an integer >= 1, got 0"),
    ("bench_e2e", ["--variants", "foo"], "unknown variant 'foo'"),
    ("bench_e2e", ["--variants", "base_M0"], "unknown variant 'base_M0'"),
    ("bench_e2e", ["--repeats", "0"], "--repeats: expected an integer >= 1, got 0"),
    ("bench_e2e", ["--decode", "-1"], "--decode: expected an integer >= 1"),
    ("bench_e2e", ["--layers", "x"], "--layers: expected an integer, got 'x'"),
])
def test_bad_arguments_are_usage_errors_before_the_gpu(monkeypatch, capsys, script, argv, message):
    """Counts below 1, unknown or empty variants and contradictory flags stop the script as usage errors (argparse's
    exit 2), not as a traceback or a run that times nothing on the GPU."""
    module = __import__(script)
    monkeypatch.setattr(module, "require_cuda", lambda name: sys.exit("stop before the GPU"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("script, argv", [
    ("bench_layer", ["--variants-only"]), ("bench_select", ["--replays", "3"]),
    ("bench_e2e", ["--variants", "base_M1,hf_grouped_mm", "--repeats", "1", "--decode", "2"]),
])
def test_good_arguments_reach_the_gpu_check(monkeypatch, script, argv):
    module = __import__(script)
    monkeypatch.setattr(module, "require_cuda", lambda name: sys.exit("stop before the GPU"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit, match="stop before the GPU"):
        module.main()
