# T packed tokens, N document capacity (max_docs)
"""Behaviour of usp_graph.AttentionMetadata: constructors, views, `to()` and validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from usp_graph import AttentionMetadata
from usp_graph.masks import cu_seqlens_from_positions, cu_seqlens_from_starts, document_starts


def cu_list(meta: AttentionMetadata) -> list[int]:
    return meta.cu_seqlens.tolist()


def cu_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- from_lengths -------------------------------------------------------------------------------


def test_from_lengths_gives_int32_cumulative_starts_then_total() -> None:
    meta = AttentionMetadata.from_lengths([3, 1, 4])
    assert meta.cu_seqlens.dtype == torch.int32
    assert meta.cu_seqlens.dim() == 1
    assert cu_list(meta) == [0, 3, 4, 8]


def test_from_lengths_tail_slots_repeat_the_total_when_max_docs_exceeds_documents() -> None:
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=5)
    assert cu_list(meta) == [0, 3, 8, 8, 8, 8]
    assert meta.max_docs == 5


def test_from_lengths_max_docs_equal_to_document_count_has_no_padding() -> None:
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=2)
    assert cu_list(meta) == [0, 3, 8]


def test_from_lengths_default_max_seqlen_is_the_longest_document() -> None:
    assert AttentionMetadata.from_lengths([2, 7, 3]).max_seqlen == 7


def test_from_lengths_keeps_an_explicit_max_seqlen_above_the_longest_document() -> None:
    meta = AttentionMetadata.from_lengths([2, 7, 3], max_seqlen=16)
    assert meta.max_seqlen == 16
    assert cu_list(meta) == [0, 2, 9, 12]


def test_from_lengths_accepts_max_seqlen_equal_to_the_longest_document() -> None:
    assert AttentionMetadata.from_lengths([2, 7], max_seqlen=7).max_seqlen == 7


def test_from_lengths_total_tokens_is_the_sum_of_lengths() -> None:
    meta = AttentionMetadata.from_lengths([2, 7, 3], max_docs=6)
    assert meta.total_tokens == 12
    assert meta.cu_seqlens[-1].item() == 12


def test_from_lengths_zero_length_documents_repeat_a_boundary() -> None:
    meta = AttentionMetadata.from_lengths([0, 4, 0, 2])
    assert cu_list(meta) == [0, 0, 4, 4, 6]
    assert meta.max_docs == 4
    assert meta.total_tokens == 6


def test_from_lengths_all_empty_documents_give_zero_tokens_and_zero_max_seqlen() -> None:
    meta = AttentionMetadata.from_lengths([0, 0])
    assert cu_list(meta) == [0, 0, 0]
    assert meta.total_tokens == 0
    assert meta.max_seqlen == 0


def test_from_lengths_accepts_an_integer_tensor_like_a_list() -> None:
    from_tensor = AttentionMetadata.from_lengths(torch.tensor([3, 0, 5], dtype=torch.int64))
    from_list = AttentionMetadata.from_lengths([3, 0, 5])
    assert torch.equal(from_tensor.cu_seqlens, from_list.cu_seqlens)
    assert from_tensor.max_seqlen == from_list.max_seqlen
    assert from_tensor.total_tokens == from_list.total_tokens


def test_from_lengths_accepts_a_tuple() -> None:
    assert cu_list(AttentionMetadata.from_lengths((1, 2))) == [0, 1, 3]


def test_from_lengths_does_not_modify_its_lengths_argument() -> None:
    lengths = torch.tensor([3, 5])
    AttentionMetadata.from_lengths(lengths, max_docs=4)
    assert torch.equal(lengths, torch.tensor([3, 5]))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_from_lengths_device_places_cu_seqlens_on_that_device(device: str | torch.device) -> None:
    meta = AttentionMetadata.from_lengths([3, 5], device=device)
    assert meta.cu_seqlens.device == torch.device("cpu")
    assert cu_list(meta) == [0, 3, 8]


def test_from_lengths_device_meta_keeps_shape_and_static_fields() -> None:
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=4, device="meta")
    assert meta.cu_seqlens.device.type == "meta"
    assert meta.cu_seqlens.shape == (5,)
    assert meta.cu_seqlens.dtype == torch.int32
    assert (meta.total_tokens, meta.max_seqlen, meta.max_docs) == (8, 5, 4)


# ---- from_position_ids --------------------------------------------------------------------------


def test_from_position_ids_1d_starts_a_document_at_every_zero() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3]))
    assert cu_list(meta) == [0, 3, 5, 9]
    assert meta.max_seqlen == 4
    assert meta.total_tokens == 9


def test_from_position_ids_1d_first_token_starts_a_document_even_when_not_zero() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([5, 6, 0, 1]))
    assert cu_list(meta) == [0, 2, 4]


def test_from_position_ids_2d_every_row_start_is_a_boundary_even_when_not_zero() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([[3, 4, 0, 1], [5, 0, 1, 2]]))
    assert cu_list(meta) == [0, 2, 4, 5, 8]


def test_from_position_ids_2d_zero_inside_a_row_starts_a_document() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]))
    assert cu_list(meta) == [0, 4, 6, 8]


def test_from_position_ids_2d_row_start_at_zero_is_a_single_boundary() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert cu_list(meta) == [0, 3, 6]
    assert meta.max_docs == 2


def test_from_position_ids_starts_a_document_wherever_a_position_does_not_count_up() -> None:
    """transformers' reading of packed position ids (find_packed_sequence_indices): restarts at 1
    or 2 (RoBERTa-style), a jump, a repeat each start a document, not only a 0."""
    pos = torch.tensor([2, 3, 4, 2, 3, 1, 7, 8, 8, 9, 0])
    meta = AttentionMetadata.from_position_ids(pos)
    assert cu_list(meta) == [0, 3, 5, 6, 8, 10, 11]
    masks_rule = cu_seqlens_from_positions(pos[None], 7)  # the graph's own rule
    assert masks_rule.tolist() == cu_list(meta)


def test_from_position_ids_pads_to_max_docs_and_keeps_explicit_max_seqlen() -> None:
    meta = AttentionMetadata.from_position_ids(torch.tensor([0, 1, 0]), max_docs=4, max_seqlen=8)
    assert cu_list(meta) == [0, 2, 3, 3, 3]
    assert meta.max_seqlen == 8


# ---- from_document_ids --------------------------------------------------------------------------


def test_from_document_ids_1d_starts_a_document_where_the_id_changes() -> None:
    meta = AttentionMetadata.from_document_ids(torch.tensor([7, 7, 7, 2, 2, 9]))
    assert cu_list(meta) == [0, 3, 5, 6]
    assert meta.max_seqlen == 3


def test_from_document_ids_accepts_unsorted_ids() -> None:
    meta = AttentionMetadata.from_document_ids(torch.tensor([2, 2, 1, 1, 1, 0]))
    assert cu_list(meta) == [0, 2, 5, 6]


def test_from_document_ids_two_runs_of_the_same_id_are_two_documents() -> None:
    meta = AttentionMetadata.from_document_ids(torch.tensor([1, 1, 2, 1, 1]))
    assert cu_list(meta) == [0, 2, 3, 5]
    assert meta.max_docs == 3


def test_from_document_ids_2d_row_start_splits_a_run_of_the_same_id() -> None:
    meta = AttentionMetadata.from_document_ids(torch.tensor([[0, 0, 1, 1], [1, 1, 2, 2]]))
    assert cu_list(meta) == [0, 2, 4, 6, 8]


def test_from_document_ids_2d_single_id_gives_one_document_per_row() -> None:
    meta = AttentionMetadata.from_document_ids(torch.zeros(3, 4, dtype=torch.int64))
    assert cu_list(meta) == [0, 4, 8, 12]


def test_from_document_ids_pads_to_max_docs() -> None:
    meta = AttentionMetadata.from_document_ids(torch.tensor([4, 4, 5]), max_docs=3)
    assert cu_list(meta) == [0, 2, 3, 3]


# ---- per_sample ---------------------------------------------------------------------------------


def test_per_sample_gives_one_document_per_batch_row() -> None:
    meta = AttentionMetadata.per_sample(3, 4)
    assert cu_list(meta) == [0, 4, 8, 12]
    assert (meta.max_docs, meta.max_seqlen, meta.total_tokens) == (3, 4, 12)


def test_per_sample_device_places_cu_seqlens_on_that_device() -> None:
    assert AttentionMetadata.per_sample(2, 5, device="meta").cu_seqlens.device.type == "meta"


# ---- views: lengths(), max_docs, to() -----------------------------------------------------------


def test_lengths_returns_document_lengths_with_zero_padding_slots() -> None:
    assert AttentionMetadata.from_lengths([3, 0, 5], max_docs=5).lengths() == [3, 0, 5, 0, 0]


def test_max_docs_is_cu_seqlens_entries_minus_one() -> None:
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=7)
    assert meta.max_docs == 7
    assert meta.max_docs == meta.cu_seqlens.numel() - 1


def test_to_returns_new_metadata_with_same_fields() -> None:
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=3, max_seqlen=6)
    moved = meta.to("cpu")
    assert isinstance(moved, AttentionMetadata)
    assert moved is not meta
    assert torch.equal(moved.cu_seqlens, meta.cu_seqlens)
    assert (moved.max_seqlen, moved.total_tokens, moved.max_docs) == (6, 8, 3)


def test_to_meta_moves_cu_seqlens_and_leaves_the_original_on_cpu() -> None:
    meta = AttentionMetadata.from_lengths([3, 5])
    moved = meta.to(torch.device("meta"))
    assert moved.cu_seqlens.device.type == "meta"
    assert meta.cu_seqlens.device.type == "cpu"
    assert cu_list(meta) == [0, 3, 8]


# ---- direct construction ------------------------------------------------------------------------


def test_direct_construction_accepts_valid_padded_boundaries() -> None:
    meta = AttentionMetadata(cu_tensor([0, 3, 8, 8]), 5, 8)
    assert meta.max_docs == 3
    assert meta.lengths() == [3, 5, 0]


def test_direct_construction_validates_boundaries() -> None:
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the token count 9"):
        AttentionMetadata(cu_tensor([0, 3, 8]), 5, 9)


def test_direct_construction_validates_max_seqlen_against_documents() -> None:
    with pytest.raises(ValueError, match=r"document 1 has 5 tokens, more than max_seqlen=4"):
        AttentionMetadata(cu_tensor([0, 3, 8]), 4, 8)


def test_direct_construction_skips_value_checks_on_meta_tensors() -> None:
    meta = AttentionMetadata(torch.empty(4, dtype=torch.int32, device="meta"), 5, 8)
    assert meta.max_docs == 3


# ---- properties ---------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=12)
nonempty_lengths_st = lengths_st.filter(lambda lens: any(lens))


@settings(max_examples=50, deadline=None, database=None)
@given(lengths=lengths_st, extra_slots=st.integers(min_value=0, max_value=4))
def test_from_lengths_then_lengths_round_trips_with_zero_padding(
    lengths: list[int], extra_slots: int
) -> None:
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + extra_slots)
    assert meta.lengths() == lengths + [0] * extra_slots
    assert meta.total_tokens == sum(lengths)
    assert meta.max_seqlen == max(lengths)


@settings(max_examples=50, deadline=None, database=None)
@given(lengths=nonempty_lengths_st)
def test_from_position_ids_matches_from_lengths_without_empty_documents(lengths: list[int]) -> None:
    positions = torch.cat([torch.arange(n) for n in lengths if n])
    from_pos = AttentionMetadata.from_position_ids(positions)
    from_len = AttentionMetadata.from_lengths([n for n in lengths if n])
    assert cu_list(from_pos) == cu_list(from_len)
    assert from_pos.max_seqlen == from_len.max_seqlen
    assert from_pos.total_tokens == from_len.total_tokens


@settings(max_examples=50, deadline=None, database=None)
@given(lengths=nonempty_lengths_st)
def test_from_document_ids_matches_from_lengths_without_empty_documents(lengths: list[int]) -> None:
    nonempty = [n for n in lengths if n]
    ids = torch.cat([torch.full((n,), i % 2) for i, n in enumerate(nonempty)])  # adjacent ids differ
    assert cu_list(AttentionMetadata.from_document_ids(ids)) == cu_list(
        AttentionMetadata.from_lengths(nonempty)
    )


def test_document_starts_and_boundaries_of_random_position_ids_equal_a_token_by_token_reading() -> None:
    """The device rule (few kernels, as eager attention launches it per forward) against the rule
    read one token at a time: a row start, or a position that is not its predecessor's + 1; then
    the boundaries at every capacity, a short one included (its last documents left out)."""
    g = torch.Generator().manual_seed(11)
    for case in range(400):
        b, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 24, (1,), generator=g))
        if case % 2:  # packed documents, length-1 ones included
            lens = torch.randint(1, 6, (b * length,), generator=g).tolist()
            pos = torch.cat([torch.arange(n) for n in lens])[: b * length].view(b, length)
        else:  # anything: repeats, jumps, negative positions
            pos = torch.randint(-2, 5, (b, length), generator=g)
        flat = pos.reshape(-1).tolist()
        want = [t % length == 0 or flat[t] != flat[t - 1] + 1 for t in range(b * length)]
        starts = document_starts(pos)
        assert starts.dtype == torch.bool and starts.tolist() == want
        bounds = [t for t, s in enumerate(want) if s] + [b * length]
        for cap in (None, 1, len(bounds) - 1, len(bounds), b * length + 1):
            cap_n = b * length + 1 if cap is None else cap
            cu = cu_seqlens_from_starts(starts, cap)
            assert cu.dtype == torch.int32
            assert cu.tolist() == (bounds + [b * length] * cap_n)[:cap_n]
    assert document_starts(torch.zeros(1, 0, dtype=torch.long)).shape == (0,)
