"""Run a function on N gloo ranks, each in a fresh process, and bring back what each returned.

    from tests.dist import run_ranks

    def _check(rank, world_size, seed):       # module level: it is pickled by reference
        ...                                   # torch.distributed is initialized (gloo)
        return {"out": tensor}                # anything torch.save can write

    results = run_ranks(_check, 2, seed)      # [rank 0's result, rank 1's result]

Why it is built this way:
- spawn, never fork: forking after torch ran a parallel op can hang the child (FACTS.md).
- a `file://` store in a fresh temporary directory per call: no ports to clash between tests.
- results come back as `torch.save` bytes over a pipe: tensors sent through a multiprocessing queue
  vanish when the sending process exits first.
- a rank that raises sends its traceback; the parent raises `RankError` with every failing rank's
  traceback (first failure first) and keeps the results of the ranks that succeeded. Once one rank
  failed, the others get the process group timeout (plus a margin) to finish or fail on their own,
  which is what a test of fault handling wants to see; then they are killed.
- a rank that is still running at `timeout` (counted from the start, spawning included) has its
  Python stacks dumped (faulthandler, SIGUSR1) into the error, then every rank is killed and the
  parent raises `TimeoutError`. Processes and the temporary directory are always cleaned up.

Spawning costs ~1-4 s (each process imports torch and the test module): batch many checks per call.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "run_ranks"]

_OK, _ERR = b"O", b"E"
_FAIL_MARGIN_S = 5.0  # after a failure, the others get pg_timeout + this to report their own errors
_EXIT_GRACE_S = 10.0  # after every rank reported, how long they get to exit before being killed


class RankError(RuntimeError):
    """One or more ranks failed. `failures`: rank -> traceback text (or exit description), in the
    order they were seen; `results`: rank -> result of the ranks that returned normally."""

    def __init__(self, message: str, failures: dict[int, str], results: dict[int, Any]):
        super().__init__(message)
        self.failures = failures
        self.results = results


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    pg_timeout_s: float,
    args: tuple,
    kwargs: dict,
    conn: multiprocessing.connection.Connection,
) -> None:
    stack_file = open(os.path.join(workdir, f"stacks.{rank}"), "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    ok = False
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(workdir, "store"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        payload = _OK + buf.getvalue()
        ok = True
    except BaseException:
        payload = _ERR + traceback.format_exc().encode()
    try:
        conn.send_bytes(payload)
        conn.close()
    except OSError:  # the parent is gone (it gave up on us); nobody is listening
        os._exit(1)
    if ok and dist.is_initialized():
        # Leave together: a rank that exits while a peer still reads from it can break the peer's
        # last collective. A failed barrier only means a peer is gone; the result is already sent.
        try:
            dist.barrier()
        except Exception:
            pass
    # Skip destroy_process_group and interpreter teardown: after a failed collective gloo's
    # destructors can abort (SIGABRT), and nothing is left to flush.
    stack_file.close()
    os._exit(0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` gloo ranks; return their results.

    `fn` must be a module-level function. Each rank runs in a fresh spawned process with one thread
    and the default process group initialized (gloo, `file://` store) with `pg_timeout` seconds
    (default: timeout / 2) as its timeout, so a collective whose peer is gone fails on its own
    before the harness gives up. Raises `RankError` (with every failing rank's traceback) when a rank
    raises or dies, and `TimeoutError` (with the stacks of the stuck ranks) when ranks are still
    running after `timeout` seconds. All processes are gone when this returns or raises.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if pg_timeout is None:
        pg_timeout = timeout / 2
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="usp_graph_ranks_")
    procs: list[Any] = []
    readers: list[multiprocessing.connection.Connection] = []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    clean = False
    try:
        start = time.monotonic()
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, workdir, pg_timeout, args, kwargs, writer),
                name=f"usp-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only write end: EOF means it is gone
            procs.append(proc)
            readers.append(reader)
        deadline = start + timeout
        pending = set(range(world_size))
        first_failure_at: float | None = None
        while pending:
            limit = deadline
            if first_failure_at is not None:
                limit = min(deadline, first_failure_at + pg_timeout + _FAIL_MARGIN_S)
            now = time.monotonic()
            if now >= limit:
                break
            waitables = {readers[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
            for ready in multiprocessing.connection.wait(list(waitables), timeout=limit - now):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                try:
                    msg = readers[rank].recv_bytes() if readers[rank].poll() else None
                except EOFError:
                    msg = None
                if msg is None:  # it exited (or closed its pipe) without a word: give it a moment to go
                    procs[rank].join(1.0)
                    failures[rank] = (
                        f"rank {rank} {_describe_exit(procs[rank].exitcode)} without reporting a result"
                    )
                elif msg[:1] == _OK:
                    results[rank] = torch.load(io.BytesIO(msg[1:]), weights_only=False)
                else:
                    failures[rank] = msg[1:].decode(errors="replace")
                pending.discard(rank)
                if rank in failures and first_failure_at is None:
                    first_failure_at = time.monotonic()
        stacks = _dump_stacks(procs, sorted(pending), workdir) if pending else ""
        if failures:
            parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in failures.items()]
            if pending:
                parts.append(
                    f"--- ranks {sorted(pending)} had not finished {pg_timeout + _FAIL_MARGIN_S:.0f} s after the "
                    f"first failure (or by the {timeout} s timeout) and were killed ---\n{stacks}"
                )
            raise RankError(
                f"{len(failures)} of {world_size} ranks failed (first: rank {next(iter(failures))}):\n"
                + "\n".join(parts),
                failures,
                results,
            )
        if pending:
            raise TimeoutError(
                f"ranks {sorted(pending)} of {world_size} were still running after {timeout} s; all ranks "
                f"were killed. Ranks that finished: {sorted(results)}.\n{stacks}"
            )
        clean = True
        return [results[r] for r in range(world_size)]
    finally:
        if clean:  # every rank reported a result and is leaving on its own (barrier, exit)
            grace_end = time.monotonic() + _EXIT_GRACE_S
            for proc in procs:
                proc.join(max(0.0, grace_end - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for reader in readers:
            reader.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _dump_stacks(procs: list[Any], ranks: list[int], workdir: str) -> str:
    """Ask the stuck ranks for their Python stacks (faulthandler on SIGUSR1) and read them back."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    out = []
    for r in ranks:
        try:
            with open(os.path.join(workdir, f"stacks.{r}")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        out.append(f"rank {r} stacks:\n{text or '(none: the process did not answer)'}")
    return "\n".join(out)
