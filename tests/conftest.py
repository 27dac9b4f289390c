"""Suite-wide settings: the `slow` marker for tests in modules that do not mark themselves, the
early start of long subprocess checks (`tests.background`), and the end of the pooled gloo ranks
(`tests.dist`) and of those subprocesses when the session ends, and the order in which xdist
workers take the test files (`LONG_FIRST`).

`slow` marks a test that spawns ranks or processes, or runs for seconds: ``python -m pytest -q``
(and CI) runs every test; ``-m "not slow"`` is the quick loop. Modules mark their own tests where
they can (``pytestmark``, ``@pytest.mark.slow``); `SLOW` names the rest. A name here that no
longer matches a test of its module is an error, so the list cannot go stale silently.
"""

from __future__ import annotations

import os

import pytest

from tests import background
from tests.dist import close_pools, warm

SLOW: dict[str, tuple[str, ...]] = {
    "test_bad_inputs.py": ("test_zero_heads_do_not_crash_the_process",),
    "test_compile.py": (
        "test_cp_compiled_every_strategy_matches_one_process_on_2_ranks",
        "test_backend_usp_is_found_through_the_entry_point_without_importing_usp_graph",
        "test_importing_usp_graph_after_torch_found_the_entry_point_registers_once",
    ),
    "test_cross.py": ("test_cross_attention_under_cp_with_replicated_text_matches_one_process",),
    "test_cudnn.py": (
        "test_importing_usp_graph_does_not_import_cudnn",
        "test_kernel_setting_accepts_cudnn_from_the_environment",
    ),
    "test_diffusers.py": ("test_flux_context_parallel_ulysses_and_ring_match_one_process",),
    "test_flex.py": ("test_kernel_setting_is_checked",),
    "test_graphfile.py": (
        "test_llama_and_flux_loaded_in_a_fresh_process_replay_10_adamw_steps_bitwise_equal_to_eager",
        "test_cp_graphs_saved_per_rank_replay_in_fresh_ranks_bitwise_equal_to_eager_cp",
    ),
    "test_graphfile_limits.py": (
        "test_the_nested_power_guard_of_the_issue_is_refused_at_load_not_evaluated",
        "test_loading_a_fifo_or_a_device_is_refused_not_waited_on",
        "test_usp_graph_inspect_on_a_folder_holding_a_fifo_exits_2_instead_of_hanging",
        "test_bad_values_exit_2_without_a_traceback_from_the_command_line",
    ),
    "test_masks.py": ("test_option_documents_under_cp_gathers_the_position_ids_of_every_rank",),
    "test_trace.py": (
        "test_cp_train_steps_replayed_equal_eager_cp_bitwise_on_2_ranks",
        "test_cp_flux_train_steps_replayed_equal_eager_cp_bitwise_on_2_ranks",
    ),
    "test_transformers.py": ("test_llama_context_parallel_ulysses_and_ring_match_one_process",),
    "test_window.py": ("test_long_documents_run_in_row_blocks_exactly",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[str, set[str]] = {}
    for item in items:
        module = item.path.name
        names = SLOW.get(module)
        if names is None:
            continue
        name = getattr(item, "originalname", item.name)
        seen.setdefault(module, set()).add(name)
        if name in names:
            item.add_marker(pytest.mark.slow)
    stale = [f"{m}::{n}" for m, found in seen.items() for n in SLOW[m] if n not in found]
    # Only a run of the whole suite collects every module whole (-k deselects later).
    if stale and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
    _order_files(items)


# Under xdist (`--dist loadfile --no-loadscope-reorder`, pyproject) a worker takes whole files in
# collection order. These run longest (wall seconds on 2 busy cores: multi-process, subprocess and
# tracing-heavy files), longest first, so the many short files fill the end and neither core idles
# while the other finishes one long file; every other file follows, files with more tests first
# (xdist's own default order). A name here that is gone is only skipped: the order is a hint.
LONG_FIRST: tuple[str, ...] = (
    "test_collective_faults.py",
    "test_hf.py",
    "test_trace.py",
    "test_graphfile.py",
    "test_optable.py",
    "test_cli.py",
    "test_compile.py",
    "test_diffusers.py",
    "test_train_recipe.py",
    "test_transformers.py",
    "test_collectives.py",
    "test_graphfile_redteam.py",
    "test_backend_pipeline.py",
    "test_cp.py",
    "test_window_cp.py",
    "test_graphfile_limits.py",
    "test_clients.py",
    "test_train_recipe_bad.py",
)


def _order_files(items: list[pytest.Item]) -> None:
    """Order whole files for the xdist workers: `LONG_FIRST`, then by test count (stable)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[str(item.path)] = counts.get(str(item.path), 0) + 1
    rank = {name: i for i, name in enumerate(LONG_FIRST)}

    def key(item: pytest.Item) -> tuple[int, int]:
        return rank.get(item.path.name, len(LONG_FIRST)), -counts[str(item.path)]

    items.sort(key=key)  # stable: tests keep their order within a file


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected tests' early subprocesses (`tests.background`) and the 2-rank pool."""
    if session.config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Each xdist worker collects every test but runs only those the scheduler hands it: a job
        # starts with its test instead (`background.result`), and ranks spawn at the first call.
        return
    for item in session.items:
        for mark in item.iter_markers("start_early"):
            background.start(*mark.args, **mark.kwargs)
    if any(item.get_closest_marker("slow") for item in session.items):
        warm(2)  # most multi-rank tests run on 2 ranks


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_pools()
    background.stop_all()
