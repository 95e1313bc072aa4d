"""The benchmarks' shared measurements: a graph's microseconds per call, the median, and the device-to-device copy
bandwidth every fraction of the copy divides by; on the CPU, with CUDA's streams, graphs and events faked."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402


def fake_cuda(monkeypatch, elapsed_ms):
    """torch.cuda's streams, graphs, events and synchronize on the CPU: code run "on a stream" or "under capture"
    just runs, a replay does nothing, and each event pair's elapsed_time is the next of ``elapsed_ms``."""
    elapsed = iter(elapsed_ms)

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    for name, value in dict(Stream=lambda: stream, current_stream=lambda: stream,
                            stream=lambda s: contextlib.nullcontext(), graph=lambda g: contextlib.nullcontext(),
                            CUDAGraph=lambda: types.SimpleNamespace(replay=lambda: None), Event=Event,
                            synchronize=lambda: None).items():
        monkeypatch.setattr(torch.cuda, name, value)


def test_graph_time_is_microseconds_per_call_of_each_replay(monkeypatch):
    """The graph holds ``rounds`` passes over ``calls``: a replay's milliseconds become microseconds per call."""
    fake_cuda(monkeypatch, elapsed_ms=[0.6, 1.2, 0.9])
    ran = []
    calls = [lambda i=i: ran.append(i) for i in range(3)]
    assert common.graph_time_us(calls, replays=3, rounds=4) == pytest.approx([50.0, 100.0, 75.0])  # 0.6 ms / 12
    assert ran == [0, 1, 2] + [0, 1, 2] * 4  # the warm-up, then the 4 rounds captured


def test_median():
    assert common.median([4.0, 1.0, 9.0]) == 4.0
    assert common.median([10.0, 1.0, 3.0, 2.0]) == 2.5  # the middle two's mean: not the mean, min or upper middle


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    """Bytes per second of a device copy, read + written (as the expert op's bytes read are its HBM traffic), over the
    median copy time."""
    fake_cuda(monkeypatch, elapsed_ms=[2.0, 1.0, 4.0])
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *args, device=None, **kwargs: randint(*args, **kwargs))
    assert common.copy_bandwidth(nbytes=1000, repeats=3, warmup_s=0.0) == pytest.approx(2 * 1000 / 2e-3)
