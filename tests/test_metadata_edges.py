# T packed tokens, N document capacity (max_docs)
"""AttentionMetadata at the edges (issue 17, item 4): sizes past int32, bad devices and absurd
capacities are ValueError/TypeError naming the value, before any tensor is built or moved."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from usp_graph import AttentionMetadata, documents
from usp_graph.metadata import INT32_MAX, MAX_DOCS

M = AttentionMetadata
# Every public constructor, called with keyword `extra` (device, max_docs, max_seqlen).
CONSTRUCTORS = {
    "from_lengths": lambda **kw: M.from_lengths([3, 4], **kw),
    "from_position_ids": lambda **kw: M.from_position_ids(torch.tensor([0, 1, 2, 0, 1, 2, 3]), **kw),
    "from_document_ids": lambda **kw: M.from_document_ids(torch.tensor([5, 5, 5, 6, 6, 6, 6]), **kw),
}


@pytest.mark.parametrize(
    "lengths, message",
    [
        ([2**31], r"document 0 has 2147483648 tokens, over 2147483647 \(2\*\*31 - 1\): cu_seqlens is int32"),
        ([5, 2**40], r"document 1 has 1099511627776 tokens"),
        ([2**30, 2**30], r"hold 2147483648 tokens in total, over the 2147483647"),
        ([INT32_MAX - 1, 1, 1], r"hold 2147483648 tokens in total"),
    ],
)
def test_lengths_past_int32_are_a_value_error_naming_the_value(lengths, message):
    with pytest.raises(ValueError, match=message):
        M.from_lengths(lengths)
    with pytest.raises(ValueError, match=message):
        M.from_lengths(torch.tensor(lengths, dtype=torch.int64))


def test_the_largest_int32_total_is_accepted():
    meta = M.from_lengths([INT32_MAX - 1, 1])
    assert meta.total_tokens == INT32_MAX and meta.cu_seqlens.tolist() == [0, INT32_MAX - 1, INT32_MAX]


def test_per_sample_past_int32_or_capacity_is_a_value_error():
    with pytest.raises(ValueError, match=r"batch_size \* seq_len = 4 \* 1073741824 = 4294967296 tokens"):
        M.per_sample(4, 2**30)
    with pytest.raises(ValueError, match=r"batch_size=1000000000 document slots is over the 16777216"):
        M.per_sample(10**9, 1)


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_max_seqlen_past_int32_is_a_value_error(name):
    with pytest.raises(ValueError, match=r"max_seqlen=2147483648 is over 2147483647"):
        CONSTRUCTORS[name](max_seqlen=2**31)


def test_direct_construction_refuses_totals_and_bounds_past_int32():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"total_tokens must be in \[0, 2\*\*31 - 1\].*got 2147483648"):
        M(cu, 3, 2**31)
    with pytest.raises(ValueError, match=r"max_seqlen must be in \[0, 2\*\*31 - 1\].*got 4294967296"):
        M(cu, 2**32, 3)


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_a_huge_max_docs_is_refused_without_allocating(name):
    tracemalloc.start()
    try:
        with pytest.raises(
            ValueError, match=r"max_docs=1000000000 document slots is over the 16777216 \(2\*\*24\)"
        ):
            CONSTRUCTORS[name](max_docs=10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_the_largest_capacity_builds_as_a_tensor_not_a_list():
    tracemalloc.start()
    try:
        meta = M.from_lengths([3, 4], max_docs=MAX_DOCS)
        _, peak = tracemalloc.get_traced_memory()  # tensor storage is not traced; a list would be
    finally:
        tracemalloc.stop()
    assert meta.max_docs == MAX_DOCS and meta.cu_seqlens[:4].tolist() == [0, 3, 7, 7]
    assert int(meta.cu_seqlens[-1]) == 7
    assert peak < 2**22


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only build of torch")
@pytest.mark.parametrize("name", CONSTRUCTORS)
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda")])
def test_cuda_on_a_cpu_build_is_a_value_error_naming_the_device(name, device):
    with pytest.raises(
        ValueError, match=r"device=.*, but this torch has no usable CUDA device.*use device=.cpu."
    ):
        CONSTRUCTORS[name](device=device)


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_a_bogus_device_string_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match=r"device='bogus' is not a device: use 'cpu', 'cuda'"):
        CONSTRUCTORS[name](device="bogus")
    with pytest.raises(ValueError, match=r"device=-1: a CUDA device index is >= 0"):
        CONSTRUCTORS[name](device=-1)


@pytest.mark.parametrize("name", CONSTRUCTORS)
@pytest.mark.parametrize("device", [3.5, True, torch.float32, ["cpu"]])
def test_a_device_of_the_wrong_type_is_a_type_error_not_a_dtype(name, device):
    with pytest.raises(TypeError, match=r"device must be a torch.device, a string .* got "):
        CONSTRUCTORS[name](device=device)


def test_per_sample_and_to_check_the_device_too():
    with pytest.raises(TypeError, match=r"got 3.5 \(float\)"):
        M.per_sample(2, 3, device=3.5)
    meta = M.from_lengths([3])
    with pytest.raises(ValueError, match=r"device='bogus' is not a device"):
        meta.to("bogus")
    with pytest.raises(TypeError, match=r"got 3.5 \(float\)"):
        meta.to(3.5)
    assert meta.to("cpu").cu_seqlens.tolist() == [0, 3]
    assert M.from_lengths([3], device="meta").cu_seqlens.is_meta


def test_good_devices_still_work():
    for device in ("cpu", torch.device("cpu"), None):
        assert M.from_lengths([2, 2], device=device).cu_seqlens.device == torch.device("cpu")


def test_documents_refuses_query_and_key_metadata_on_different_devices():
    q = M.from_lengths([3, 4])
    kv = M.from_lengths([2, 2], device="meta")
    with pytest.raises(ValueError, match=r"metadata is on cpu and kv on meta"):
        with documents(q, kv=kv):
            pass


@pytest.mark.parametrize("door", ["attention_mode", "documents", "documents_kv"])
def test_metadata_on_the_meta_device_is_refused_by_every_door_with_a_value_error(door):
    """Metadata on the meta device holds no values: each door says so (it used to fail inside with
    "Cannot copy out of meta tensor"): documents when the block opens, attention_mode at the first
    attention call on real tensors (a model on the meta device may check its shapes with it,
    tests/test_meta_ops.py). Building it there stays allowed."""
    import torch.nn.functional as F

    from usp_graph import attention_mode

    on_meta = AttentionMetadata.from_lengths([3, 5], device="meta")
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="meta device, which holds no values.*device='cpu' or 'cuda'"):
        if door == "attention_mode":
            with attention_mode(on_meta):
                F.scaled_dot_product_attention(q, q, q)
        else:
            with documents(on_meta, kv=on_meta if door == "documents_kv" else None):
                pass
