"""`UspOptions`: the ``options={...}`` of ``torch.compile(..., backend="usp")``, parsed and checked.

torch hands a string backend its options as one ``options=`` keyword argument (a plain dict), at
the first call of the compiled function. `UspOptions.parse` turns that dict into a frozen
dataclass: an unknown key is a `ValueError` listing the valid keys, a value of the wrong type is a
`TypeError` naming the key, and a `cp` that does not belong to the live process group is a
`ValueError` saying how to build one that does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["UspOptions", "INNER_COMPILERS", "DEFAULT_INNER", "resolve_inner"]

# aot_eager: AOTAutograd with no code generation; every op runs the kernel eager runs, so forward
# and gradients are bitwise equal to eager `attention_mode` (the exactness ladder of DESIGN.md).
# inductor: fused generated kernels; faster, equal to eager within rounding (fp32 ~1e-6), and on
# CPU it needs a C++ compiler and takes several times longer to compile.
# auto: inductor for a graph whose tensors are on a CUDA device, aot_eager otherwise.
INNER_COMPILERS = ("auto", "aot_eager", "inductor")
# What a user writes first is the fast form on a GPU: there aot_eager keeps every intermediate
# unfused (a 64K-token Llama step took 47 GiB against inductor's 28 and ran 0.87x transformers'
# flex_attention). On the CPU aot_eager stays: bit for bit eager, no toolchain, fast compiles.
DEFAULT_INNER = "auto"


def resolve_inner(inner: str, example_inputs: Any) -> str:
    """The inner compiler `inner` means for a graph with these example inputs: ``"auto"`` is
    ``"inductor"`` when any tensor among them (parameters and buffers are inputs of Dynamo's graphs)
    is on a CUDA device and ``"aot_eager"`` otherwise; the other names stand for themselves."""
    if inner != "auto":
        return inner
    import torch

    on_cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in example_inputs)
    return "inductor" if on_cuda else "aot_eager"


@dataclass(frozen=True)
class UspOptions:
    """What the ``usp`` backend does with each graph Dynamo hands it.

    cp: a `usp_graph.ContextParallel` (attention inputs are this rank's sequence shards, document
        metadata stays global) or None for a single process. It must belong to the initialized
        process group of this process.
    inner: the compiler after AOTAutograd: ``"auto"`` (default), ``"aot_eager"`` or ``"inductor"``.
        ``"aot_eager"`` runs every op as eager does: bitwise equal to eager `attention_mode`, quick to
        compile, but unfused (on a GPU slower, and more memory: every intermediate is its own
        tensor). ``"inductor"`` generates fused kernels: the speed and memory of plain
        ``torch.compile``, equal to eager within rounding; on the CPU it needs a C++ compiler.
        ``"auto"`` decides per compiled graph from its example inputs (`resolve_inner`): inductor
        when any of its tensors (parameters included) is on a CUDA device, aot_eager otherwise (a
        CPU graph keeps the bitwise form). Name ``"aot_eager"`` for bitwise work on a GPU.
    dump_dir: a directory; each compiled graph is written below it (readable graphs, a JSON
        summary, and graph files when `usp_graph` can write them). None: no dump.
    verify: run the verify pass on the rewritten graph and on the joint forward+backward graph
        (default True): no SDPA left unless reported, every usp op has its registered rule, every
        forward collective its adjoint in the backward. False disables both verify passes.
    disable: names of the backend's passes to disable (a str or a list; see
        `usp_graph.backend.backend_pipeline`, printable: ``rewrite_sdpa``, ``verify_rewrite``,
        ``joint`` (required), ``verify``), as ``Pipeline.disable`` does for the tracer. With
        ``rewrite_sdpa`` disabled every SDPA stays SDPA (refused under ``cp``; `documents` raises).
    dump_passes: True, or names of the backend's passes: write each one's graph before and after
        it runs into the graph's dump directory (``NN_<pass>.before.txt`` / ``.after.txt``), as
        ``Pipeline.with_dump`` does for the tracer; needs `dump_dir`. False (default): none.
    on_compile: called with a `usp_graph.backend.CompileReport` after each graph is compiled
        (sites rewritten and kept, metadata inputs, timings); None: nothing is called.
    documents: the name of the model argument holding position ids (e.g. ``"position_ids"``) that
        define the documents when no `usp_graph.documents(...)` block is active: a document starts
        at each row start and wherever a position is not its predecessor + 1 (positions restarting
        at 0 per document, the padding-free convention of transformers and TRL). `cu_seqlens` is
        then computed from that argument on its device, with no recompile when boundaries change;
        on accelerators it is cut to the call's document count (rounded up to 1, 2, 3, 4, 6, 8,
        12, ...) and longest document by one host read per call (empty slots and an over-long
        bound are kernel work). None (default): no argument defines documents (a mask the model
        builds from its position ids still does, sized the same way).
    max_docs: the document capacity of `documents`-derived metadata (default: sized to each call
        as above; set, this capacity with the row length as bound and no host read; a step with
        more documents fails with an error, never a wrong result).
    inductor: settings of ``torch._inductor.config`` (names, dotted for submodules, to values) for
        inductor's compiles (``inner="inductor"``, or ``"auto"`` on the graphs it gives inductor), as
        ``torch.compile(..., options=...)`` passes them to inductor (e.g. ``{"max_autotune": True}``);
        None (default): inductor's own, except that ``reorder_for_locality`` is off (it would move
        every issued collective next to its wait).
    """

    cp: Any = None
    inner: str = DEFAULT_INNER
    dump_dir: Path | None = None
    verify: bool = True
    disable: tuple[str, ...] = ()
    dump_passes: bool | tuple[str, ...] = False
    on_compile: Callable[[Any], None] | None = None
    documents: str | None = None
    max_docs: int | None = None
    inductor: Any = None  # given as a mapping; kept as a tuple of (name, value) pairs

    def __post_init__(self) -> None:
        from ..cp import ContextParallel

        if self.cp is not None and not isinstance(self.cp, ContextParallel):
            raise TypeError(
                f"option 'cp' must be a usp_graph.ContextParallel or None, got {type(self.cp).__name__}"
            )
        if not isinstance(self.inner, str):
            raise TypeError(
                f"option 'inner' must be a str, one of {list(INNER_COMPILERS)}, got {type(self.inner).__name__}"
            )
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"option 'inner' must be one of {list(INNER_COMPILERS)}, got {self.inner!r}")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)):
                raise TypeError(
                    f"option 'dump_dir' must be a str or os.PathLike or None, got {type(self.dump_dir).__name__}"
                )
            object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        if not isinstance(self.verify, bool):
            raise TypeError(f"option 'verify' must be a bool, got {type(self.verify).__name__}")
        object.__setattr__(self, "disable", _names("disable", self.disable))
        if not isinstance(self.dump_passes, bool):
            object.__setattr__(self, "dump_passes", _names("dump_passes", self.dump_passes))
        if self.dump_passes and self.dump_dir is None:
            raise ValueError(
                "option 'dump_passes' writes each pass's before/after graph below dump_dir; set that too"
            )
        self.pipeline()  # unknown or required pass names: a ValueError naming the option and the passes
        if self.on_compile is not None and not callable(self.on_compile):
            raise TypeError(
                f"option 'on_compile' must be callable or None, got {type(self.on_compile).__name__}"
            )
        if self.documents is not None and (
            not isinstance(self.documents, str) or not self.documents.isidentifier()
        ):
            raise TypeError(
                f"option 'documents' must be the name of the model argument holding position ids (e.g. "
                f"'position_ids') or None, got {self.documents!r}"
            )
        if self.max_docs is not None:
            if isinstance(self.max_docs, bool) or not isinstance(self.max_docs, int):
                raise TypeError(
                    f"option 'max_docs' must be an int or None, got {type(self.max_docs).__name__}"
                )
            if self.max_docs < 1:
                raise ValueError(f"option 'max_docs' must be >= 1, got {self.max_docs}")
            if self.documents is None:
                raise ValueError(
                    "option 'max_docs' sizes documents derived with option 'documents'; set that too"
                )
        if self.inductor is not None:
            object.__setattr__(self, "inductor", _inductor_settings(self.inductor, self.inner))
        if self.cp is not None:
            check_cp_matches_process_group(self.cp)

    def inner_for(self, example_inputs: Any) -> str:
        """The inner compiler for a graph with these example inputs (``"auto"`` resolved:
        `resolve_inner`)."""
        return resolve_inner(self.inner, example_inputs)

    def pipeline(self) -> Any:
        """The backend's `usp_graph.passes.Pipeline` under these options: `disable` (and, with
        ``verify=False``, both verify passes) disabled, `dump_passes` marked for dumping."""
        from .pipeline import backend_pipeline

        pipeline = backend_pipeline()
        off = list(self.disable) + ([] if self.verify else ["verify_rewrite", "verify"])
        try:
            pipeline = pipeline.disable(*off)
        except ValueError as e:
            raise ValueError(f"option 'disable': {e}") from None
        if self.dump_passes:
            try:
                pipeline = pipeline.with_dump(only=None if self.dump_passes is True else self.dump_passes)
            except ValueError as e:
                raise ValueError(f"option 'dump_passes': {e}") from None
        return pipeline

    @classmethod
    def keys(cls) -> list[str]:
        """The valid option names, sorted."""
        return sorted(f.name for f in fields(cls))

    @classmethod
    def parse(cls, options: Mapping[str, Any] | UspOptions | None) -> UspOptions:
        """``options={...}`` as given to ``torch.compile`` -> `UspOptions` (None: the defaults)."""
        if options is None:
            return cls()
        if isinstance(options, UspOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(
                f"options for backend 'usp' must be a dict with keys from {cls.keys()}, got {type(options).__name__}"
            )
        for key in options:
            if not isinstance(key, str):
                raise TypeError(f"option names must be str, got {key!r}")
        unknown = sorted(set(options) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for backend 'usp'; the valid options are {cls.keys()}"
            )
        return cls(**options)


def _names(key: str, value: Any) -> tuple[str, ...]:
    """A pass name or a sequence of them, as a tuple (`TypeError` naming the option and the
    backend's passes otherwise)."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        from .pipeline import backend_pipeline

        what = (
            "True, a pass name or a list of pass names"
            if key == "dump_passes"
            else "a pass name or a list of pass names"
        )
        raise TypeError(
            f"option {key!r} must be {what}, got {value!r}; the passes are {backend_pipeline().names}"
        )
    return tuple(names)


def check_cp_matches_process_group(cp: Any) -> None:
    """`ValueError` unless `cp`'s process groups are live groups of this process with `cp`'s sizes.

    A ContextParallel keeps its groups by name (ops find them by name); one built before
    ``destroy_process_group`` / a re-init, or in another process, names a group that is gone or is
    now a different one, and its collectives would fail or talk to the wrong ranks mid-step.
    """
    import torch.distributed as dist

    from ..distributed import resolve_group

    fix = "build the ContextParallel after torch.distributed.init_process_group, in this process"
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"option 'cp' needs torch.distributed initialized, and it is not; {fix}")
    try:
        pg = resolve_group(cp.group_name)
    except ValueError as e:
        raise ValueError(
            f"option 'cp' ({cp!r}) was built for process group {cp.group_name!r}, which is not a live group of "
            f"the initialized torch.distributed ({e}); {fix}"
        ) from None
    try:
        same = cp.group is pg
    except ValueError:  # cp's own group was destroyed: pg is another group of that name
        same = False
    if not same or pg.size() != cp.world or pg.rank() != cp.rank:
        raise ValueError(
            f"option 'cp' ({cp!r}) does not match the initialized process group: it was built for a group "
            f"{cp.group_name!r} of {cp.world} ranks (this rank {cp.rank}), but the live group of that name is another "
            f"one, with {pg.size()} ranks (this rank {pg.rank()}); {fix}"
        )
    for what in ("ring_group_name", "ulysses_group_name"):
        name = getattr(cp, what, None)
        if name is not None and name != cp.group_name:
            try:
                resolve_group(name)
            except ValueError as e:
                raise ValueError(
                    f"option 'cp': its {what[:-5]} {name!r} is not a live group ({e}); {fix}"
                ) from None


# Set by the backend itself around inductor's compile (its joint pass hook).
_BACKEND_INDUCTOR_SETTINGS = ("joint_custom_pre_pass",)


def _inductor_settings(given: Any, inner: str) -> tuple[tuple[str, Any], ...]:
    """Option `inductor` checked: a mapping of existing ``torch._inductor.config`` names, for
    ``inner="inductor"`` or ``"auto"``; as sorted (name, value) pairs (the options stay hashable)."""
    if isinstance(given, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in given):
        given = dict(given)  # already checked once (dataclasses.replace)
    if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
        raise TypeError(
            "option 'inductor' must be a dict of torch._inductor.config settings (name -> value), "
            f"got {type(given).__name__}"
        )
    if inner not in ("inductor", "auto"):
        raise ValueError(
            f"option 'inductor' configures inner='inductor' (or 'auto' on a GPU), but inner is {inner!r}; "
            "set inner='inductor'"
        )
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise ValueError(f"option 'inductor': {unknown} are not torch._inductor.config settings")
    own = sorted(k for k in given if k in _BACKEND_INDUCTOR_SETTINGS)
    if own:
        raise ValueError(f"option 'inductor': {own} are set by the usp backend itself")
    return tuple(sorted(given.items()))
