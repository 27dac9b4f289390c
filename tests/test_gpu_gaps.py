"""`tools/gpu_gaps.py`: the GPU's idle gaps in a profiler trace, with the host work around each."""

from __future__ import annotations

from tools.gpu_gaps import idle_gaps


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_gaps_are_measured_between_merged_kernels_and_named_by_the_host_work_around_them():
    trace = {
        "traceEvents": [
            _x("cpu_op", "step", 0, 1000),
            _x("cpu_op", "attention", 90, 300),
            _x("cpu_op", "aten::item", 100, 250),  # a host read: the GPU drains, then waits
            _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=1),
            _x("cuda_runtime", "cudaLaunchKernel", 30, 5, correlation=2),
            _x("cuda_runtime", "cudaLaunchKernel", 360, 5, correlation=3),
            _x("cuda_driver", "cuLaunchKernel", 370, 5, correlation=4),  # a triton launch
            _x("kernel", "gemm", 40, 100, correlation=1),
            _x("kernel", "norm", 120, 40, correlation=2),  # overlaps gemm (another stream): one busy span
            _x("kernel", "flash_fwd", 400, 50, correlation=3),
            _x("kernel", "tiny", 460, 5, correlation=4),  # a 10 us gap: counted in idle, not listed
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 300},  # not a duration event
        ]
    }
    found = idle_gaps(trace, top=5, min_us=20)
    assert found["busy_ms"] == 0.175  # 40-160, 400-450, 460-465
    assert found["idle_ms"] == 0.25  # 240 + 10
    assert found["span_ms"] == 0.425
    assert found["counted"] == 1
    (gap,) = found["gaps"]
    assert gap["us"] == 240.0 and gap["at_ms"] == 0.12
    assert gap["host"] == ["step", "attention", "aten::item"]
    assert gap["then"] == "flash_fwd"
    assert gap["launched_by"] == ["step", "attention"]


def test_a_trace_without_kernels_has_no_gaps():
    found = idle_gaps({"traceEvents": [_x("cpu_op", "step", 0, 10)]})
    assert found == {"busy_ms": 0.0, "idle_ms": 0.0, "span_ms": 0.0, "gaps": [], "counted": 0}
