"""Run a function on N local gloo ranks in fresh (spawned) processes, with a deadline.

Used by the CLI demo; a small cousin of the test suite's harness. Each rank initializes the
default process group from a `file://` store in a private temp dir (no ports), results come back
as `torch.save` bytes over a pipe (tensors put on a queue vanish when the sender exits first), a
failing rank's traceback is re-raised in the parent, and every process is gone when this returns.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing.connection
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_local_ranks", "RanksFailed"]


class RanksFailed(RuntimeError):
    """A rank raised, died, or missed the deadline; the message holds each rank's report."""


def _child(fn, rank, world, store, pg_timeout, args, conn):
    ok, payload = True, None
    try:
        torch.set_num_threads(1)  # ranks share the cores; also avoids fork-after-threads trouble
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        payload = fn(rank, world, *args)
    except BaseException:
        ok, payload = False, traceback.format_exc()
    buf = io.BytesIO()
    torch.save((ok, payload), buf)
    conn.send_bytes(buf.getvalue())
    conn.close()
    os._exit(0)  # skip gloo teardown, which can abort after a failed collective


def run_local_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """`fn(rank, world, *args)` on `world` spawned ranks; their return values, by rank."""
    ctx = torch.multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="usp_ranks_")
    procs, conns = [], []
    try:
        for rank in range(world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world, os.path.join(workdir, "store"), timeout / 2, args, send),
                daemon=True,
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(conns))
        while pending and time.monotonic() < deadline:
            ready = multiprocessing.connection.wait(
                list(pending.values()), timeout=deadline - time.monotonic()
            )
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    ok, payload = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)
                except EOFError:
                    ok, payload = False, f"rank {rank} died (exit code {procs[rank].exitcode})"
                (results if ok else failures)[rank] = payload
            if failures:
                deadline = min(deadline, time.monotonic() + 10)  # the others get a moment to report
        for rank in pending:
            failures[rank] = f"rank {rank} did not finish within {timeout:.0f} s"
        if failures:
            report = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
            raise RanksFailed(f"{len(failures)} of {world} ranks failed:\n{report}")
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
