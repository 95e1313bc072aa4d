"""The examples run as a user runs them (a subprocess, on the bundled testbed model, on the CPU), with small sizes:
the main job of README's first command (examples/quickstart.py) and batched generation (examples/generate.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import base_moe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTBED = os.path.join(ROOT, "testbed")


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, the same on any machine
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def testbed_predictors(tmp_path_factory):
    """Predictors for the testbed from a short calibration on its calibration text."""
    from transformers import AutoModelForCausalLM

    from base_moe.cli import load_token_ids

    model = AutoModelForCausalLM.from_pretrained(TESTBED, local_files_only=True).eval()
    ids = load_token_ids(os.path.join(TESTBED, "calib.txt"), TESTBED, tokens=4096, seq=64, byte_level=True)
    path = tmp_path_factory.mktemp("predictors") / "testbed.safetensors"
    base_moe.calibrate(model, ids, batch_size=16, progress=False).save(str(path))
    return path


def test_quickstart_main_job(tmp_path):
    out = tmp_path / "quickstart.json"
    done = run_example("quickstart.py", "--device", "cpu", "--calib-bytes", "4096", "--batch", "4", "--seq", "64",
                       "--prefill", "8", "--batches", "2", "--policies", "base,router_sq,oracle", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    budgets = sorted({r["budget"] for r in result["results"]})
    assert len(budgets) == 2 and all(b >= 1 for b in budgets)  # a third and a half of the measured dense union
    assert {(r["policy"], r["budget"]) for r in result["results"]} == {
        (p, b) for p in ("base", "router_sq", "oracle") for b in budgets}
    assert all(r["active"] <= r["budget"] for r in result["results"])
    for b in budgets:  # the summary line per budget names base, the best baseline and the oracle
        assert f"budget {b}: base +" in done.stdout and "oracle +" in done.stdout
        gap_of_router_sq(done.stdout, result, b)
    assert "dense" in done.stdout and "nan" not in done.stdout.lower()


def gap_of_router_sq(stdout: str, result: dict, budget: int) -> None:
    """The summary line's gap (the only baseline here, router_sq, minus base, paired over the batches) is the mean
    and standard error of the JSON's per-batch differences."""
    line = next(s for s in stdout.splitlines() if s.startswith(f"budget {budget}: base +"))
    found = re.search(r"router_sq minus base, paired over 2 batches: ([-+][0-9.]+) \+- ([0-9.]+)\)", line)
    assert found, line
    rows = {r["policy"]: r["bits_per_batch"] for r in result["results"] if r["budget"] == budget}
    gaps = [b - a for a, b in zip(rows["base"], rows["router_sq"])]
    assert float(found[1]) == pytest.approx(sum(gaps) / 2, abs=6e-4)
    assert float(found[2]) == pytest.approx(abs(gaps[0] - gaps[1]) / 2, abs=6e-4)  # stdev / sqrt(2) of two values


def test_quickstart_rejects_a_prefill_past_the_sequence():
    done = run_example("quickstart.py", "--device", "cpu", "--seq", "64", "--prefill", "64")
    assert done.returncode != 0 and "prefill" in done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--json", "{tmp}/no/out.json"], "--json .* does not exist"),
    (["--plot", "{tmp}/out.xyz"], "--plot .*: matplotlib writes"),
    (["--device", "tpu"], "--device 'tpu' is not a device|--device tpu: base_moe runs on cpu or cuda"),
])
def test_quickstart_checks_outputs_and_device_before_the_work(tmp_path, flags, message):
    """A bad output path or device stops the script before calibration, not after the evaluation."""
    done = run_example("quickstart.py", *[f.format(tmp=tmp_path) for f in flags])
    assert done.returncode != 0 and re.search(message, done.stderr), done.stderr
    assert "calibrat" not in done.stdout


def test_quickstart_rejects_a_sequence_past_the_context():
    done = run_example("quickstart.py", "--device", "cpu", "--seq", "512")
    message = "--seq 512 is longer than the model's context (max_position_embeddings 256)"
    assert done.returncode != 0 and message in done.stderr


@pytest.mark.parametrize("policy", ["base", "router_sq"])
def test_generate_under_a_budget(policy, testbed_predictors):
    args = ["--policy", policy, "--budget", "2", "--max-new-tokens", "4"]
    if policy == "base":
        args += ["--predictors", str(testbed_predictors)]
    done = run_example("generate.py", TESTBED, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("--- ") == 4  # one line per prompt
    assert "4 x 4 tokens in" in done.stdout and f"budget 2, policy {policy}, fill backfill" in done.stdout


def test_generate_needs_predictors_for_base():
    done = run_example("generate.py", TESTBED, "--policy", "base", "--budget", "2")
    assert done.returncode == 2 and "needs --predictors" in done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--budget", "2", "--predictors", "{tmp}/none.safetensors"], "--predictors .*none.safetensors' is not a file"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--policy", "router_sq"], "--policy given, but this setting runs the model dense"),
    (["--fill", "drop"], "--fill given, but this setting runs the model dense"),
    (["--policy", "dense", "--budget", "4"], "--budget given, but this setting runs the model dense"),
])
def test_generate_refuses_arguments_before_the_model_loads(tmp_path, flags, message):
    """A missing file, a bad count, or options that a dense run would ignore stop the script at once (usage error)."""
    done = run_example("generate.py", TESTBED, *[f.format(tmp=tmp_path) for f in flags])
    assert done.returncode == 2 and re.search(message, done.stderr), done.stderr


def test_quickstart_refuses_more_batches_than_the_held_out_text_holds():
    done = run_example("quickstart.py", "--device", "cpu", "--batches", "65")
    assert done.returncode == 2 and "need 266240 held-out bytes; the testbed's held-out text has" in done.stderr
    assert "calibrat" not in done.stdout
