"""Benchmark: naive vs chunked ("fused") log-probs at T=2048, V=32768, H=256 (fp32, CPU).

Not collected by a plain `pytest` (the file name does not match `test_*.py`); run it explicitly:

    pytest tests/bench_logprobs.py --benchmark-only

Each benchmark records in `benchmark.extra_info`:
- `analytic_peak_logits_bytes`: bytes of the largest logits block alive at once, [T, V] fp32 for naive and
  [chunk, V] fp32 for fused (the log-softmax, exp and product temporaries are the same size again, each);
- `analytic_peak_bytes`: 4x that (logits, log-softmax, exp, product) plus the outputs;
- `measured_peak_rss_delta_bytes`: peak RSS (Linux VmHWM, reset through /proc/self/clear_refs) minus RSS
  before the call, measured once in a fresh subprocess (torch's CPU allocations are invisible to
  tracemalloc); None where /proc is unavailable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from reference_impl.forward.logprobs import fused_logprobs, naive_logprobs

T, V, H = 2048, 32768, 256
CHUNK = 256

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    from reference_impl.forward.logprobs import fused_logprobs, naive_logprobs

    def hwm():  # peak RSS of this process image (VmHWM; ru_maxrss would carry the parent's over exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    t, v, h, chunk, kind = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(t, h, generator=g), torch.randn(v, h, generator=g) * 0.05
    targets = torch.randint(0, v, (t,), generator=g)
    fused_logprobs(hidden[:2], weight, targets[:2], chunk_tokens=1)  # warm up kernels, not the big buffers
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    before = psutil.Process().memory_info().rss
    with torch.no_grad():
        if kind == "naive":
            naive_logprobs(hidden, weight, targets)
        else:
            fused_logprobs(hidden, weight, targets, chunk_tokens=chunk)
    print(json.dumps({"before": before, "peak": hwm()}))
    """
)


def _measured_peak_delta(kind: str) -> int | None:
    """Peak RSS delta (bytes) of one call in a fresh process; None where it cannot be measured."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(T), str(V), str(H), str(CHUNK), kind],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None
    return max(0, r["peak"] - r["before"])


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.05
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets


def _record(benchmark, kind: str, rows: int) -> None:
    block = rows * V * 4
    benchmark.extra_info.update(
        {
            "T": T,
            "V": V,
            "H": H,
            "chunk_tokens": CHUNK if kind == "fused" else T,
            "analytic_peak_logits_bytes": block,
            "analytic_peak_bytes": 4 * block + 2 * T * 4,
            "measured_peak_rss_delta_bytes": _measured_peak_delta(kind),
        }
    )


def test_bench_naive(benchmark, inputs) -> None:
    hidden, weight, targets = inputs
    with torch.no_grad():
        lp, _ = benchmark.pedantic(naive_logprobs, args=(hidden, weight, targets), rounds=1, iterations=1)
    assert lp.shape == (T,)
    _record(benchmark, "naive", T)


def test_bench_fused(benchmark, inputs) -> None:
    hidden, weight, targets = inputs
    with torch.no_grad():
        lp, _ = benchmark.pedantic(
            fused_logprobs, args=(hidden, weight, targets), kwargs={"chunk_tokens": CHUNK}, rounds=1, iterations=1
        )
    assert lp.shape == (T,)
    _record(benchmark, "fused", CHUNK)
    assert benchmark.extra_info["analytic_peak_logits_bytes"] * (T // CHUNK) == T * V * 4
