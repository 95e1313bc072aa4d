"""Measurement helpers shared by the benchmarks: CUDA-graph timing, the copy-bandwidth reference, and the
run metadata every results JSON carries (machine, versions, commit, command, date)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import torch

from base_moe import evaluate


def require_cuda(script: str) -> None:
    """Exit with a message, not a traceback, where there is no GPU or base_moe lacks its CUDA kernels."""
    import base_moe

    if not base_moe.cuda_available():
        sys.exit(f"{script} needs a CUDA GPU and base_moe built with its CUDA kernels")


def names_from(text: str, known, option: str) -> list[str]:
    """The comma-separated names of an option, every one checked before any work (a misspelt second model used to
    fail after the first one's whole run)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        sys.exit(f"{option}: unknown {unknown or 'empty list'}; known: {', '.join(known)}")
    return names


def positive_ints(text: str, option: str) -> list[int]:
    """The comma-separated positive integers of an option, checked before any work."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        sys.exit(f"{option} takes positive integers separated by commas, got {text!r}")
    return values


def graph_time_us(calls, replays: int = 25, rounds: int = 1) -> list[float]:
    """Capture ``rounds`` passes over ``calls`` in one CUDA graph (after a warm-up outside capture) and replay
    it ``replays`` times; returns the microseconds per call of each replay. Rotate inputs across ``calls`` so
    the L2 cache does not hold them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return [start.elapsed_time(end) * 1e3 / (rounds * len(calls)) for start, end in events]


def median(values: list[float]) -> float:
    """The median (the mean of the two middle values for an even count; before session 53 the upper one)."""
    return statistics.median(values)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 15, warmup_s: float = 0.5) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of ``repeats`` copies of random
    bytes), after ``warmup_s`` seconds of copies: on a GPU fresh from idle the first copies ran up to 5% slower (H200,
    3.98 vs 4.14-4.21 TB/s), which would flatter every fraction of the copy."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        dst.copy_(src)
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / median(times)


def git_commit() -> str:
    """The commit measured (base_moe.evaluate.git_commit: $BASE_MOE_COMMIT, else git), "unknown" without either."""
    return evaluate.git_commit() or "unknown"


def run_metadata(**extra) -> dict:
    """Machine, versions, commit, command line, date and BASE_MOE_* knobs of this run, plus ``extra``."""
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return dict(
        machine=props.name if props else platform.processor(),
        multiprocessors=props.multi_processor_count if props else None,
        host=platform.node(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers_version,
        python=platform.python_version(),
        git_commit=git_commit(),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        knobs={name: value for name, value in sorted(os.environ.items()) if name.startswith("BASE_MOE_")},
        **extra,
    )


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
