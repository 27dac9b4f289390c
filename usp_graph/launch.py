"""Run a function on N local gloo ranks in spawned processes and bring back what each returned.

    from usp_graph.launch import RankPool, run_ranks

    def check(rank, world_size, seed):           # module level: it is pickled by reference
        ...                                      # torch.distributed is initialized (gloo)
        return {"out": tensor}                   # anything torch.save can write

    results = run_ranks(check, 2, seed)          # fresh processes: [rank 0's result, rank 1's]
    with RankPool(2) as pool:                    # processes kept between calls (imports paid once)
        a, b = pool.run(check, 2, seed), pool.run(check, 2, seed + 1)

The CLI demo and the test suite both run ranks through this module.

Why it is built this way:
- spawn, never fork: forking after torch ran a parallel op can hang the child (FACTS.md).
- every call gets a fresh default process group from a `file://` store in the pool's private
  temporary directory (no ports to clash), destroyed when the call ends: group names, timeouts
  and subgroups never carry from one call to the next, and a pool's worker resets the other
  process-wide state a call may change (environment, RNG seed, grad mode, default dtype,
  deterministic mode, dynamo caches) before taking the next one.
- results come back as `torch.save` bytes over a pipe: tensors sent through a multiprocessing queue
  vanish when the sending process exits first. The call itself goes through a file, so sending it
  never blocks on a rank that is still importing torch.
- a rank that raises sends its traceback and exits; the parent raises `RankError` with every
  failing rank's traceback (first failure first) and keeps the results of the ranks that
  succeeded. Once one rank failed, the others get the process group timeout (plus a margin) to
  finish or fail on their own, which is what a test of fault handling wants to see; then they are
  killed. A pool whose call failed is emptied and spawns fresh ranks for its next call.
- the timeout only guards against hangs: by default `USP_RANKS_TIMEOUT` seconds (900 when unset),
  counted from the call (a new pool's spawning included). A rank still running then has its Python
  stacks dumped (faulthandler, SIGUSR1) into the error, every rank is killed, and the parent raises
  `TimeoutError`. Processes and temporary directories are always cleaned up.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RankError", "RankPool", "RanksFailed", "default_timeout", "run_local_ranks", "run_ranks"]

_OK, _ERR, _READY = b"O", b"E", b"R"
_FAIL_MARGIN_S = 5.0  # after a failure, the others get pg_timeout + this to report their own errors
_EXIT_GRACE_S = 10.0  # after every rank reported, how long they get to clean up (or exit)
_TIMEOUT_ENV = "USP_RANKS_TIMEOUT"
_DEFAULT_TIMEOUT_S = 900.0


def default_timeout() -> float:
    """Seconds a call may run before it counts as hung: ``USP_RANKS_TIMEOUT``, else 900."""
    raw = os.environ.get(_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{_TIMEOUT_ENV} must be a positive number of seconds; got {raw!r}")
    return value


class RankError(RuntimeError):
    """One or more ranks failed. `failures`: rank -> traceback text (or exit description), in the
    order they were seen; `results`: rank -> result of the ranks that returned normally."""

    def __init__(self, message: str, failures: dict[int, str], results: dict[int, Any]):
        super().__init__(message)
        self.failures = failures
        self.results = results


RanksFailed = RankError  # the demo's older name


def _reset_process_state(env: dict[str, str], seed: int, dtype: torch.dtype, deterministic: bool) -> None:
    """Undo what one call may have changed process-wide, so the next call starts as a fresh rank would."""
    os.environ.clear()
    os.environ.update(env)
    torch.manual_seed(seed)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def _worker(
    rank: int,
    world_size: int,
    workdir: str,
    jobs: multiprocessing.connection.Connection,
    results: multiprocessing.connection.Connection,
) -> None:
    stack_file = open(os.path.join(workdir, f"stacks.{rank}"), "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)  # ranks share the cores
    import torch.distributed as dist

    env, seed = dict(os.environ), torch.initial_seed()
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    while True:
        try:
            job_path = jobs.recv_bytes().decode()
        except (EOFError, OSError):  # the pool closed
            break
        ok = False
        try:
            with open(job_path, "rb") as f:
                fn, args, kwargs, store, pg_timeout_s = torch.load(f, weights_only=False)
            dist.init_process_group(
                "gloo",
                init_method="file://" + store,
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
            results.send_bytes(payload)
        except OSError:  # the parent is gone (it gave up on us); nobody is listening
            os._exit(1)
        if not ok:
            # Skip destroy_process_group and interpreter teardown: after a failed collective
            # gloo's destructors can abort (SIGABRT), and nothing is left to flush.
            break
        try:
            # Leave together: a rank that leaves while a peer still reads from it can break the
            # peer's last collective. A failure here only means a peer is gone; the result is sent.
            dist.barrier()
            dist.destroy_process_group()
            _reset_process_state(env, seed, dtype, deterministic)
            results.send_bytes(_READY)
        except BaseException:
            break
    stack_file.close()
    # os._exit skips interpreter teardown (on purpose, above) and with it multiprocessing's exit
    # finalizers, which unlink the named semaphores this process made (e.g. the lock tqdm creates
    # when fx's Interpreter runs): run those, or the parent's resource tracker reports them leaked.
    multiprocessing.util._run_finalizers(0)
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


class RankPool:
    """`world_size` spawned gloo ranks that run one call after another (`run`), each call in its
    own fresh default process group. Spawned at the first call; a failed or hung call empties the
    pool (its ranks are killed) and the next call spawns fresh ones, or, with ``respawn=True``, the
    fresh ones are spawned at once, so they import while the caller goes on. `close` (or leaving a
    `with` block) ends the ranks."""

    def __init__(self, world_size: int, *, respawn: bool = False):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.respawn = respawn
        self._procs: list[Any] = []
        self._jobs: list[multiprocessing.connection.Connection] = []
        self._results: list[multiprocessing.connection.Connection] = []
        self._workdir: str | None = None
        self._calls = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether ranks are spawned and every one of them is still running."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Spawn the ranks now (they import while the caller goes on) unless they are running."""
        if not self.alive:
            self.close(grace=0.0)
            self._spawn()

    def _spawn(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._workdir = tempfile.mkdtemp(prefix="usp_graph_ranks_")
        for rank in range(self.world_size):
            job_reader, job_writer = ctx.Pipe(duplex=False)
            result_reader, result_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, self._workdir, job_reader, result_writer),
                name=f"usp-rank{rank}",
                daemon=True,
            )
            proc.start()
            job_reader.close()  # each end lives in one process only: EOF means the other side is gone
            result_writer.close()
            self._procs.append(proc)
            self._jobs.append(job_writer)
            self._results.append(result_reader)

    def close(self, *, grace: float = _EXIT_GRACE_S) -> None:
        """End the ranks: idle ones exit on their own within `grace` seconds, the rest are killed."""
        for conn in self._jobs:
            conn.close()  # an idle rank reads EOF and exits
        end = time.monotonic() + grace
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self._results:
            conn.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._procs, self._jobs, self._results, self._workdir = [], [], [], None

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        pg_timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """``fn(rank, world_size, *args, **kwargs)`` on every rank; their results, by rank.

        `fn` must be a module-level function. The default process group is initialized (gloo) with
        `pg_timeout` seconds (default: timeout / 2) as its timeout, so a collective whose peer is
        gone fails on its own before the pool gives up. Raises `RankError` (with every failing
        rank's traceback) when a rank raises or dies, and `TimeoutError` (with the stacks of the
        stuck ranks) when ranks are still running after `timeout` seconds (default:
        `default_timeout()`)."""
        if timeout is None:
            timeout = default_timeout()
        if pg_timeout is None:
            pg_timeout = timeout / 2
        start = time.monotonic()
        self.start()
        assert self._workdir is not None
        self._calls += 1
        job_path = os.path.join(self._workdir, f"call.{self._calls}")
        store = os.path.join(self._workdir, f"store.{self._calls}")
        with open(job_path, "wb") as f:
            torch.save((fn, args, kwargs, store, pg_timeout), f)
        healthy = False
        try:
            for conn in self._jobs:
                conn.send_bytes(job_path.encode())
            results = self._collect(start + timeout, timeout, pg_timeout)
            healthy = self._await_ready()
            return results
        finally:
            if not healthy:
                self.close(grace=0.0)
                if self.respawn:
                    self._spawn()
            else:
                for path in (job_path, store):
                    if os.path.exists(path):
                        os.unlink(path)

    def _collect(self, deadline: float, timeout: float, pg_timeout: float) -> list[Any]:
        world_size, procs, readers = self.world_size, self._procs, self._results
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
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
        stacks = self._dump_stacks(sorted(pending)) if pending else ""
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
                f"were killed (USP_RANKS_TIMEOUT sets the default). Ranks that finished: {sorted(results)}."
                f"\n{stacks}"
            )
        return [results[r] for r in range(world_size)]

    def _await_ready(self) -> bool:
        """Whether every rank left the call's process group and is ready for the next call."""
        end = time.monotonic() + _EXIT_GRACE_S
        for reader in self._results:
            left = end - time.monotonic()
            try:
                if left <= 0 or not reader.poll(left) or reader.recv_bytes() != _READY:
                    return False
            except (EOFError, OSError):
                return False
        return True

    def _dump_stacks(self, ranks: list[int]) -> str:
        """Ask the stuck ranks for their Python stacks (faulthandler on SIGUSR1) and read them back."""
        assert self._workdir is not None
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        out = []
        for r in ranks:
            try:
                with open(os.path.join(self._workdir, f"stacks.{r}")) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            out.append(f"rank {r} stacks:\n{text or '(none: the process did not answer)'}")
        return "\n".join(out)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    pg_timeout: float | None = None,
    pool: RankPool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on `world_size` gloo ranks; their results, by rank.

    pool: a `RankPool` of `world_size` ranks to run on (kept afterwards); None: fresh spawned ranks
    (a pool used once), all gone when this returns or raises. See `RankPool.run` for the timeouts
    and errors."""
    if pool is not None:
        if not isinstance(pool, RankPool):
            raise TypeError(f"pool must be a usp_graph.launch.RankPool or None, got {type(pool).__name__}")
        if pool.world_size != world_size:
            raise ValueError(
                f"pool has {pool.world_size} ranks but world_size is {world_size}; pass a pool of that size"
            )
        return pool.run(fn, *args, timeout=timeout, pg_timeout=pg_timeout, **kwargs)
    with RankPool(world_size) as fresh:
        return fresh.run(fn, *args, timeout=timeout, pg_timeout=pg_timeout, **kwargs)


def run_local_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float | None = None
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` fresh spawned ranks; their return values, by rank."""
    return run_ranks(fn, world, *args, timeout=timeout)
