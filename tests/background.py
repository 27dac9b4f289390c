"""Subprocess checks that start when collection ends and run on a free core while the suite goes on.

A test marked ``@pytest.mark.start_early(name, argv)`` has `argv` started in the background as soon
as pytest has selected it (`tests/conftest.py`); the test then calls `result(name, argv)`, which
waits for it (starting it first when nothing did, e.g. under another runner). An argument
``"{tmp}"`` becomes a fresh temporary directory of the job's own (`folder`). Every job still
running at the end of the session is killed and its directory removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence

__all__ = ["folder", "result", "start", "stop_all"]

_jobs: dict[str, tuple[subprocess.Popen, str, float]] = {}
_folders: dict[str, str] = {}


def start(
    name: str, argv: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None
) -> None:
    """Start `argv` as job `name` (once), its stdout and stderr going to a temporary file."""
    if name in _jobs:
        return
    if "{tmp}" in argv:
        _folders[name] = tempfile.mkdtemp(prefix=f"usp_graph_{name}_")
        argv = [_folders[name] if a == "{tmp}" else a for a in argv]
    fd, path = tempfile.mkstemp(prefix=f"usp_graph_{name}_", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    _jobs[name] = (proc, path, time.monotonic())


def result(
    name: str,
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """The exit code and output of job `name` (started here if it was not yet); TimeoutExpired
    (the job killed) when it runs past `timeout` seconds from its start."""
    start(name, argv, cwd=cwd, env=env)
    proc, path, started = _jobs[name]
    try:
        proc.wait(max(0.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        with open(path, errors="replace") as f:
            output = f.read()
    return proc.returncode, output


def folder(name: str) -> str:
    """The temporary directory that ``"{tmp}"`` stood for in job `name`'s arguments."""
    return _folders[name]


def stop_all() -> None:
    """Kill every job still running and remove the logs and directories."""
    while _jobs:
        proc, path, _ = _jobs.popitem()[1]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(path)
    while _folders:
        shutil.rmtree(_folders.popitem()[1], ignore_errors=True)
