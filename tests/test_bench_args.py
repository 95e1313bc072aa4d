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
