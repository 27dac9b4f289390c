"""Repeat the two-rank clean-exit run of tests/test_collective_faults.py and count what went wrong.

    PYTHONPATH=. python tools/exit_repeat.py --runs 200 --parallel 2    # both doors, as the test
    PYTHONPATH=. python tools/exit_repeat.py --runs 200 --doors eager

One run: 2 fresh gloo ranks train one step through each door of `--doors` (eager: a checkpointed
Ulysses step in attention_mode, one issued all_to_all left in flight; compiled: backend usp with
option cp), then leave the process group to the exit handler (`_train_then_exit`). A run fails when a rank exits nonzero, its
log holds "terminate called" or "Abort" (the C++ runtime's abort), or a gloo thread is left once the
exit handler ran (the abort's cause). `--parallel` runs that many runs at once. Prints one line per
failed run and a summary; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_collective_faults import DOORS, _exit_run  # noqa: E402 - after the path


def one_run(tmp: str, run: int, doors: str) -> str | None:
    """What went wrong in run `run` (None: nothing)."""
    problems = []
    for r, (code, text) in enumerate(_exit_run(tmp, f"run{run}", doors)):
        if code != 0:
            problems.append(f"rank {r} exit code {code}")
        if "terminate called" in text or "Abort" in text:
            problems.append(f"rank {r} aborted")
        if "after the exit handler, gloo threads: 0" not in text:
            problems.append(f"rank {r} gloo threads left: {text[-600:]!r}")
    return "; ".join(problems) or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument(
        "--doors", default=DOORS, help=f"comma-separated, of eager and compiled (default {DOORS})"
    )
    args = parser.parse_args()
    unknown = set(args.doors.split(",")) - {"eager", "compiled"}
    if unknown:
        parser.error(f"--doors: unknown {sorted(unknown)}; the doors are eager and compiled")
    failed = 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(one_run, tmp, run, args.doors) for run in range(args.runs)]
        for run, future in enumerate(futures):
            problem = future.result()
            if problem is not None:
                failed += 1
                print(f"run {run}: {problem}", flush=True)
            if (run + 1) % 10 == 0:
                print(f"{run + 1} runs, {failed} failed, {time.monotonic() - t0:.0f} s", flush=True)
    print(f"doors {args.doors}: {failed} of {args.runs} runs failed ({time.monotonic() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
