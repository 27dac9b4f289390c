"""The rank launcher (`usp_graph.launch`): pooled ranks start each call as fresh ranks would."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.dist import RankError, run_ranks
from usp_graph import launch
from usp_graph.distributed import group_timeout

_PROBE = "USP_LAUNCH_TEST_PROBE"


def _state(rank: int, world: int) -> dict:
    """What a call sees of the process, then changes to it that the next call must not see."""
    seen = {
        "pid": os.getpid(),
        "probe": os.environ.get(_PROBE),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "world_timeout": group_timeout(),
        "subgroup": dist.new_group(list(range(world))).group_name,
        "sum": float(_all_reduce(torch.ones(1))),
    }
    os.environ[_PROBE] = "set by an earlier call"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return seen


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return os.getpid()


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def _keeps_a_named_semaphore(rank: int, world: int) -> int:
    global _SEMAPHORE
    _SEMAPHORE = multiprocessing.RLock()  # lives as long as the rank, like the lock tqdm makes
    return rank


def test_default_timeout_reads_the_environment(monkeypatch):
    monkeypatch.delenv("USP_RANKS_TIMEOUT", raising=False)
    assert launch.default_timeout() == 900.0
    monkeypatch.setenv("USP_RANKS_TIMEOUT", "30")
    assert launch.default_timeout() == 30.0
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("USP_RANKS_TIMEOUT", bad)
        with pytest.raises(ValueError, match="USP_RANKS_TIMEOUT must be a positive number"):
            launch.default_timeout()


def test_run_ranks_refuses_a_pool_of_another_size_before_spawning_anything():
    pool = launch.RankPool(4)
    with pytest.raises(ValueError, match="pool has 4 ranks but world_size is 2; pass a pool of that size"):
        launch.run_ranks(_pid, 2, pool=pool)
    assert not pool.alive and pool._procs == []
    with pytest.raises(TypeError, match="pool must be a usp_graph.launch.RankPool or None, got int"):
        launch.run_ranks(_pid, 2, pool=2)


@pytest.mark.slow
def test_each_pooled_call_starts_with_a_fresh_process_group_and_process_state():
    first = run_ranks(_state, 2, pg_timeout=11)
    second = run_ranks(_state, 2, pg_timeout=13)
    for a, b in zip(first, second, strict=True):
        assert a["pid"] == b["pid"]  # the same processes
        for seen, seconds in ((a, 11), (b, 13)):
            assert seen["probe"] is None and seen["dtype"] == torch.float32 and seen["grad"]
            assert seen["world_timeout"] == datetime.timedelta(seconds=seconds)
            assert seen["subgroup"] == "1" and seen["sum"] == 2.0  # group names start over


@pytest.mark.slow
def test_a_failed_call_reports_the_traceback_and_the_next_call_gets_fresh_ranks():
    before = run_ranks(_pid, 2)
    with pytest.raises(RankError, match="deliberate failure on rank 1") as info:
        run_ranks(_fails_on_rank_1, 2, pg_timeout=5)
    assert list(info.value.failures) == [1] and info.value.results == {0: before[0]}
    after = run_ranks(_pid, 2)
    assert not set(after) & set(before)


@pytest.mark.slow
def test_run_local_ranks_runs_fresh_processes_and_returns_results_by_rank():
    pids = launch.run_local_ranks(_pid, 2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:  # gone when it returns
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_ranks_leave_no_named_semaphore_behind():
    # A rank ends with os._exit; the semaphores it made must still be unlinked, else the resource
    # tracker warns at the parent's exit that they leaked.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "from tests.test_launch import _keeps_a_named_semaphore as f\n"
        "from usp_graph import launch\n"
        "print(launch.run_ranks(f, 2))\n"  # fresh ranks run in a pool of their own
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0,", "1]"]
    assert "leaked semaphore" not in done.stderr, done.stderr
