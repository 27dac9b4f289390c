"""Red-team tests for graph files (issue 17): a crafted corpus of hostile files and a seeded
mutation fuzzer that reaches replay, both run in worker subprocesses so that a segfault or a hang
fails a test (naming the seed and case) instead of killing pytest.

Allowed outcomes of any file: a `GraphFileError` at load; at replay, a `GraphFileError` (e.g.
`GraphReplayError`) or the ValueError/TypeError of input validation (`check_inputs` /
`flat_inputs`) before any op runs; or a replay that runs. Never a crash, a hang, another exception,
a changed global RNG state, a changed caller tensor (values, shape, strides, requires_grad), a
file written, or outputs that differ between two replays with the heap disturbed in between
(heap content or uninitialized memory in an output; CPU ops are deterministic).

    pytest tests/test_graphfile_redteam.py                                   # 1000 cases (CI)
    USP_REDTEAM_CASES=50000 USP_REDTEAM_SEED=7 pytest tests/test_graphfile_redteam.py -s   # nightly
    python -m tests.test_graphfile_redteam --case 0:123     # rerun one fuzz case (seed:case) here

The seed rotates: unless USP_REDTEAM_SEED is set it is the UTC day number, so reruns the same day
see the same cases and each day's runs see new ones (a failure names its seed and case). Each run
covers every mutation class of `tests.graphfile_corpus.mutate` and every base (checked).

USP_REDTEAM_WORKERS sets the number of worker processes (default: CPUs, at most 4).
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from tests.graphfile_corpus import (
    BASES,
    EXPECT,
    GM_OPS,
    GM_SYM,
    MUTATION_CLASSES,
    STEP,
    Crafted,
    build_bases,
    crafted_corpus,
    example_inputs,
    mutate,
    mutation_classes,
    use_bases,
)

CASES = int(os.environ.get("USP_REDTEAM_CASES", "1000"))
SEED = int(os.environ.get("USP_REDTEAM_SEED") or int(time.time() // 86400))  # the UTC day unless set
WORKERS = int(os.environ.get("USP_REDTEAM_WORKERS", str(min(4, os.cpu_count() or 1))))
HANG_S = 60.0  # no result from a worker for this long: the case in flight hangs
BOUNDED_S = 20.0  # what a crafted resource file may cost (load + replay)
MEMORY_FACTOR, MEMORY_SLACK = 8, 256 << 20  # peak RSS of a parse: at most 8x the file + 256 MiB
WORKER_MEMORY = 8 << 30  # address-space limit of a worker: a runaway allocation fails, not the host
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("memory_safety", "side_effects", "names", "schema_gaps", "resources", "replay_time")

# ---- one file, checked (runs in a worker) ---------------------------------------------------------


def _caller_tensors(inputs: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(inputs)
    out = [t for t in leaves if isinstance(t, torch.Tensor)]
    for x in inputs if isinstance(inputs, tuple) else ():
        if hasattr(x, "cu_seqlens"):  # AttentionMetadata
            out.append(x.cu_seqlens)
    return out


def _snapshot(ts: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(t.detach().clone(), t.requires_grad, tuple(t.shape), t.stride(), t.storage_offset()) for t in ts]


def _changed(ts: list[torch.Tensor], snap: list[tuple[Any, ...]]) -> list[int]:
    bad = []
    for i, (t, (v, rg, shape, stride, offset)) in enumerate(zip(ts, snap, strict=True)):
        same = (t.requires_grad, tuple(t.shape), t.stride(), t.storage_offset()) == (
            rg,
            shape,
            stride,
            offset,
        ) and torch.equal(t.detach(), v)
        if not same:
            bad.append(i)
    return bad


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _bitwise_equal(a: Any, b: Any) -> bool:
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_raw_bytes(x), _raw_bytes(y)):
                return False
        elif repr(x) != repr(y):
            return False
    return True


def _disturb_heap(seed: int) -> None:
    """Allocate, fill with random bytes and free buffers of many sizes: memory a later allocation
    reuses holds different garbage than before, so an output that reads it changes."""
    g = torch.Generator().manual_seed(seed)
    bufs = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for n in (16, 48, 64, 96, 128, 256, 512, 1024, 4096, 16384, 65536, 1 << 18, 1 << 20)
        for _ in range(4)
    ]
    junk = [bytearray(os.urandom(n)) for n in (64, 256, 1024, 4096)]
    del bufs, junk


_FLAT_STEP: list[Any] = []


def _flat_step_inputs() -> tuple[Any, ...]:
    """The train step's positional inputs (for a train-step file loaded with loads_graph_module)."""
    from usp_graph.graphfile import loads

    if not _FLAT_STEP:
        _FLAT_STEP.append(loads(build_bases()[STEP], values=False))
    return tuple(_FLAT_STEP[0].flat_inputs(*example_inputs(STEP)))


def _load(data: bytes, base: str, flat: bool) -> Any:
    from usp_graph.graphfile import GraphFileVersionWarning, loads, loads_graph_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphFileVersionWarning)
        return loads(data) if base == STEP and not flat else loads_graph_module(data)


def _replay(loaded: Any, base: str, flat: bool, inputs: Any) -> Any:
    return loaded.replay(*inputs) if base == STEP and not flat else loaded(*inputs)


def _validate_inputs(loaded: Any, base: str, flat: bool, inputs: Any) -> None:
    if base == STEP and not flat:
        loaded.flat_inputs(*inputs)
    else:
        loaded.check_inputs(inputs)


def _inputs(base: str, flat: bool, rows: int) -> Any:
    return _flat_step_inputs() if flat else example_inputs(base, rows=rows)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def check_file(
    data: bytes,
    base: str,
    *,
    flat: bool = False,
    rows: int = 4,
    reference: bytes | None = None,
    marker: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Load `data`, replay it on the base's example inputs (twice, with the heap disturbed in
    between) and return {"outcome", "problems", "seconds"}; `problems` lists every broken rule."""
    from usp_graph.graphfile import GraphFileError

    problems: list[str] = []
    if marker and os.path.exists(marker):
        os.unlink(marker)
    rng_state = torch.get_rng_state()
    start = time.perf_counter()
    try:
        loaded = _load(data, base, flat)
    except GraphFileError as e:
        outcome = f"load:{type(e).__name__}"
    except Exception as e:  # noqa: BLE001 - any other exception is a loader bug
        outcome = "load:raw"
        problems.append(f"{_short(e)} at load\n{traceback.format_exc()[-1500:]}")
    else:
        inputs = _inputs(base, flat, rows)
        caller = _caller_tensors(inputs)
        snap = _snapshot(caller)
        try:
            _validate_inputs(loaded, base, flat, inputs)
        except GraphFileError as e:
            outcome = f"replay:{type(e).__name__}"
        except (ValueError, TypeError) as e:
            outcome = f"inputs:{type(e).__name__}"
        except Exception as e:  # noqa: BLE001
            outcome = "inputs:raw"
            problems.append(f"{_short(e)} from input validation")
        else:
            try:
                first = _replay(loaded, base, flat, inputs)
            except GraphFileError as e:
                outcome = f"replay:{type(e).__name__}"
            except Exception as e:  # noqa: BLE001
                outcome = "replay:raw"
                problems.append(f"{_short(e)} at replay\n{traceback.format_exc()[-1500:]}")
            else:
                outcome = "ran"
                _disturb_heap(seed)
                try:
                    second = _replay(loaded, base, flat, inputs)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"the second replay raised {_short(e)} after the first ran")
                else:
                    if not _bitwise_equal(first, second):
                        problems.append(
                            "outputs differ between two replays with the heap disturbed in between: heap "
                            "content or uninitialized memory reaches an output"
                        )
                if reference is not None:
                    try:
                        expected = _replay(
                            _load(reference, base, flat), base, flat, _inputs(base, flat, rows)
                        )
                    except Exception as e:  # noqa: BLE001
                        problems.append(f"the reference file failed: {_short(e)}")
                    else:
                        if not _bitwise_equal(first, expected):
                            problems.append("replays to other outputs than the same file with plain names")
        changed = _changed(caller, snap)
        if changed:
            problems.append(
                f"caller tensors {changed} (of {len(caller)}) changed (values, shape, strides or requires_grad)"
            )
    if not torch.equal(torch.get_rng_state(), rng_state):
        problems.append("the global RNG state changed")
        torch.set_rng_state(rng_state)
    if marker and os.path.exists(marker):
        problems.append(f"wrote {marker}")
        os.unlink(marker)
    return {"outcome": outcome, "problems": problems, "seconds": round(time.perf_counter() - start, 3)}


def fuzz_case(seed: int, case: int) -> tuple[bytes, str, bool, str]:
    """(mutated bytes, base, load a train step as a plain graph module, what was done) of one case."""
    rng = random.Random(f"{seed}:{case}")
    r = rng.random()
    base = STEP if r < 0.15 else (GM_SYM if r < 0.45 else GM_OPS)
    flat = base == STEP and rng.random() < 0.25
    data, what = mutate(build_bases()[base], rng)
    return data, base, flat, what


# ---- worker process -------------------------------------------------------------------------------


def _worker(job_path: str, result_path: str) -> None:
    with open(job_path) as fh:
        job = json.load(fh)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    torch.set_num_threads(1)
    bases = {}
    for name in BASES:
        with open(os.path.join(job["bases"], f"{name}.json"), "rb") as fh:
            bases[name] = fh.read()
    use_bases(bases)
    with open(result_path, "a", buffering=1) as out:
        for item in job["items"]:
            out.write(json.dumps({"start": item["id"]}) + "\n")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
            if item["kind"] == "fuzz":
                data, base, flat, what = fuzz_case(item["seed"], item["case"])
                result = check_file(data, base, flat=flat, seed=item["case"])
                result["what"] = f"{base}{' (as graph module)' if flat else ''}: {what}"
            else:
                with open(item["path"], "rb") as fh:
                    data = fh.read()
                reference = None
                if item.get("reference"):
                    with open(item["reference"], "rb") as fh:
                        reference = fh.read()
                result = check_file(
                    data, item["base"], rows=item["rows"], reference=reference, marker=item.get("marker")
                )
                result["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss
            result["id"] = item["id"]
            out.write(json.dumps(result) + "\n")


# ---- driving workers (runs in pytest) -------------------------------------------------------------


def _drive(
    items: list[dict[str, Any]], bases_dir: str, folder: str, results: dict[str, dict[str, Any]]
) -> None:
    """Run `items` in a worker; a crash or hang is that item's result, and a new worker goes on."""
    remaining = list(items)
    attempt = 0
    while remaining:
        attempt += 1
        tag = f"{remaining[0]['id'].replace(':', '_')}_{attempt}"
        job_path = os.path.join(folder, f"job_{tag}.json")
        result_path = os.path.join(folder, f"result_{tag}.jsonl")
        log_path = os.path.join(folder, f"log_{tag}.txt")
        with open(job_path, "w") as fh:
            json.dump({"bases": bases_dir, "items": remaining}, fh)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.test_graphfile_redteam", "--worker", job_path, result_path],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            last_size, last_progress, hung = -1, time.monotonic(), False
            while proc.poll() is None:
                time.sleep(0.1)
                size = os.path.getsize(result_path) if os.path.exists(result_path) else 0
                if size != last_size:
                    last_size, last_progress = size, time.monotonic()
                elif time.monotonic() - last_progress > HANG_S:
                    proc.kill()
                    proc.wait()
                    hung = True
        in_flight = None
        if os.path.exists(result_path):
            with open(result_path) as fh:
                for line in fh:
                    if not line.endswith("\n"):
                        break
                    rec = json.loads(line)
                    if "start" in rec:
                        in_flight = rec["start"]
                    else:
                        results[rec["id"]] = rec
                        in_flight = None
        done = {i["id"] for i in remaining if i["id"] in results}
        if proc.returncode == 0 and not hung:
            missing = [i["id"] for i in remaining if i["id"] not in done]
            assert not missing, f"worker exited without results for {missing[:5]}"
            return
        with open(log_path, "rb") as fh:
            log_tail = fh.read()[-3000:].decode(errors="replace")
        if in_flight is None:
            raise RuntimeError(
                f"a red-team worker failed outside any case (exit {proc.returncode}):\n{log_tail}"
            )
        why = f"hung (no result for {HANG_S:.0f} s)" if hung else f"crashed (exit code {proc.returncode})"
        results[in_flight] = {"id": in_flight, "outcome": "crash", "problems": [f"the worker {why}\n{log_tail}"],
                              "seconds": None}  # fmt: skip
        remaining = [i for i in remaining if i["id"] not in results]


def run_items(
    items: list[dict[str, Any]], bases_dir: str, folder: str, *, workers: int
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    isolated = [[i] for i in items if i.get("isolated")]
    shared = [i for i in items if not i.get("isolated")]
    groups = [shared[k::workers] for k in range(workers)] + isolated
    errors: list[BaseException] = []
    lock = threading.Semaphore(workers)

    def run(group: list[dict[str, Any]]) -> None:
        with lock:
            try:
                _drive(group, bases_dir, folder, results)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups if g]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def bases_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("redteam_bases")
    for name, data in build_bases().items():
        (folder / f"{name}.json").write_bytes(data)
    return str(folder)


@pytest.fixture(scope="module")
def corpus() -> dict[str, Crafted]:
    return {c.name: c for c in crafted_corpus(build_bases())}


def _fuzz_items() -> list[dict[str, Any]]:
    return [{"id": f"{SEED}:{case}", "kind": "fuzz", "seed": SEED, "case": case} for case in range(CASES)]


@pytest.fixture(scope="module")
def runs(corpus, bases_dir, tmp_path_factory) -> dict[str, dict[str, dict[str, Any]]]:
    """Every crafted file and fuzz case, checked by one set of worker processes (each worker pays
    its imports once): {"crafted": name -> result, "fuzz": "seed:case" -> result}."""
    folder = tmp_path_factory.mktemp("redteam_crafted")
    items = []
    for c in corpus.values():
        path = folder / f"{c.name}.json"
        path.write_bytes(c.data)
        item = {"id": c.name, "kind": "crafted", "path": str(path), "base": c.base, "rows": c.rows,
                "marker": c.marker, "isolated": c.isolated}  # fmt: skip
        if c.reference is not None:
            (folder / f"{c.name}.reference.json").write_bytes(c.reference)
            item["reference"] = str(folder / f"{c.name}.reference.json")
        items.append(item)
    fuzz = _fuzz_items()
    assert not {i["id"] for i in items} & {i["id"] for i in fuzz}
    results = run_items(items + fuzz, bases_dir, str(folder), workers=WORKERS)
    return {
        "crafted": {i["id"]: results[i["id"]] for i in items},
        "fuzz": {i["id"]: results[i["id"]] for i in fuzz},
    }


@pytest.fixture(scope="module")
def crafted(corpus, runs) -> tuple[dict[str, Crafted], dict[str, dict[str, Any]]]:
    return corpus, runs["crafted"]


def _allowed(outcome: str) -> bool:
    return outcome == "ran" or (
        outcome.split(":")[0] in ("load", "replay", "inputs") and not outcome.endswith(":raw")
    )


def _verdict(c: Crafted, r: dict[str, Any]) -> str | None:
    """Why the result breaks the crafted file's expectation (None: it meets it)."""
    o = r["outcome"]
    if r["problems"]:
        return f"{o}: " + " | ".join(p.splitlines()[0] for p in r["problems"])
    refused = _allowed(o) and o.split(":")[0] in ("load", "replay")
    ok = {
        "load_error": o.startswith("load:"),
        "refused": refused,
        "replay_error": o == "replay:GraphReplayError",
        "refused_or_correct": o.startswith("load:") or o == "ran",
        "bounded": _allowed(o),
        "no_side_effects": _allowed(o),
    }[c.expect]
    if not ok:
        return f"{o}, but {EXPECT[c.expect]}"
    if c.expect == "bounded":
        if r["seconds"] is not None and r["seconds"] > BOUNDED_S:
            return f"{o} after {r['seconds']:.1f} s, over {BOUNDED_S:.0f} s"
        if c.isolated and r.get("rss_growth", 0) > MEMORY_FACTOR * len(c.data) + MEMORY_SLACK:
            return f"{o}, peak memory grew {r['rss_growth'] >> 20} MiB for a {len(c.data) >> 20} MiB file"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("cls", CLASSES)
def test_crafted_files_of_each_class_meet_their_expected_outcome(crafted, cls):
    corpus, results = crafted
    cases = [c for c in corpus.values() if c.cls == cls]
    assert len(cases) >= 5, f"the corpus has only {len(cases)} {cls} files"
    failures = [f"{c.name} (expects {c.expect}): {v}" for c in cases if (v := _verdict(c, results[c.name]))]
    counts = Counter(results[c.name]["outcome"] for c in cases)
    print(f"\n{cls}: {len(cases)} files, outcomes {dict(sorted(counts.items()))}")
    assert not failures, f"{len(failures)} of {len(cases)} crafted {cls} files:\n" + "\n".join(failures)


def test_every_crafted_file_has_a_valid_fingerprint(corpus):
    from usp_graph.graphfile.document import fingerprint

    for c in corpus.values():
        if c.isolated or len(c.data) > 4 << 20:
            continue
        try:
            doc = json.loads(c.data)
        except RecursionError:
            continue  # nested past the parser: checked by the loader
        assert doc["fingerprint"] == fingerprint(doc), c.name


@pytest.mark.slow
def test_seeded_mutations_load_and_replay_with_only_allowed_outcomes(runs):
    results = runs["fuzz"]
    assert len(results) == CASES
    outcomes = Counter(r["outcome"] for r in results.values())
    seconds = sum(r["seconds"] or 0.0 for r in results.values())
    print(f"\n{CASES} red-team fuzz cases (seed {SEED}, {WORKERS} workers, {seconds:.0f} s in cases): "
          f"{dict(sorted(outcomes.items()))}")  # fmt: skip
    bad = [r for r in results.values() if r["problems"] or not _allowed(r["outcome"])]
    if bad:
        lines = []
        for r in sorted(bad, key=lambda r: int(r["id"].split(":")[1]))[:8]:
            seed, case = map(int, r["id"].split(":"))
            what = r.get("what") or fuzz_case(seed, case)[3]
            lines.append(
                f"case {case} (seed {seed}; rerun: python -m tests.test_graphfile_redteam --case {seed}:{case}): "
                f"{what}\n  {r['outcome']}: " + "\n  ".join(r["problems"])[:1500]
            )
        pytest.fail(f"{len(bad)} of {CASES} cases broke the rules:\n" + "\n".join(lines))
    reached = sum(n for o, n in outcomes.items() if not o.startswith("load:"))
    assert reached >= CASES // 10, f"only {reached} of {CASES} mutants reached replay: the mutations miss"
    classes, bases = Counter(), Counter()
    for r in results.values():
        what = r.get("what") or fuzz_case(*map(int, r["id"].split(":")))[3]
        base = what.split(":", 1)[0].split(" ", 1)[0]
        bases[base] += 1
        classes.update(mutation_classes(what))
    assert set(classes) == set(MUTATION_CLASSES), (
        f"mutation classes not run: {set(MUTATION_CLASSES) - set(classes)}"
    )
    assert set(bases) == set(BASES), f"bases not mutated: {set(BASES) - set(bases)}"


# Fuzz cases that once broke a rule or the fuzzer itself, rerun every day whatever the day's seed.
REGRESSION_CASES = {
    "20790:175": "the first edit replaced the graph section, the second edited a node: KeyError 'nodes' in the mutator",
    "52:22": "the first edit made a node's args a string, the second inserted into it: AttributeError in the mutator",
}


@pytest.mark.parametrize("case", sorted(REGRESSION_CASES))
def test_fuzz_cases_that_once_failed_now_have_an_allowed_outcome(case):
    seed, n = map(int, case.split(":"))
    data, base, flat, what = fuzz_case(seed, n)
    result = check_file(data, base, flat=flat, seed=n)
    assert _allowed(result["outcome"]) and not result["problems"], (REGRESSION_CASES[case], what, result)


def _main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        _worker(argv[1], argv[2])
        return
    if argv[:1] == ["--case"]:
        seed, case = map(int, argv[1].split(":"))
        data, base, flat, what = fuzz_case(seed, case)
        print(what)
        with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as fh:
            fh.write(data)
        print(f"mutated file: {fh.name}")
        print(json.dumps(check_file(data, base, flat=flat, seed=case), indent=1))
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    _main(sys.argv[1:])
