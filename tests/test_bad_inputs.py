# B batch, H query heads, G key/value heads, L sequence, K head dim, T packed tokens
"""Bad metadata and bad arguments: each raises the promised exception with a message that names the
offending value, and a failed call loses nothing (inputs unchanged, the next valid call works)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from usp_graph import AttentionMetadata, attention_mode, sdpa_to_usp, varlen_attn

REPO_ROOT = Path(__file__).resolve().parents[1]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class Watched:
    """Snapshots every argument handed to `watch` so a test can check the failed call changed none."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any]] = []

    def watch(self, x: Any) -> Any:
        self._saved.append((x, x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x)))
        return x

    def assert_unchanged(self) -> None:
        for now, before in self._saved:
            if isinstance(now, torch.Tensor):
                assert torch.equal(now, before)
            else:
                assert now == before


def document_causal_mask(meta: AttentionMetadata, batch: int, seq: int) -> torch.Tensor:
    """(B, 1, L, L) bool: query i sees key j iff both are in the same document and j <= i."""
    tokens = torch.arange(batch * seq)
    doc_BL = (torch.searchsorted(meta.cu_seqlens.long(), tokens, right=True) - 1).reshape(batch, seq)
    same_BLL = doc_BL.unsqueeze(-1) == doc_BL.unsqueeze(-2)
    return (same_BLL & torch.ones(seq, seq, dtype=torch.bool).tril()).unsqueeze(1)


def as_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


# ================================================================================================
# AttentionMetadata


def _valid_metadata_constructions_still_work() -> None:
    assert AttentionMetadata.from_lengths([3, 5], max_docs=3).cu_seqlens.tolist() == [0, 3, 8, 8]
    assert AttentionMetadata.from_position_ids(torch.tensor([0, 1, 0])).cu_seqlens.tolist() == [0, 2, 3]
    assert AttentionMetadata.from_document_ids(torch.tensor([1, 1, 2])).cu_seqlens.tolist() == [0, 2, 3]
    assert AttentionMetadata.per_sample(2, 3).cu_seqlens.tolist() == [0, 3, 6]
    assert AttentionMetadata(i32([0, 3, 8]), 5, 8).lengths() == [3, 5]


MetaCall = Callable[[Watched], object]

METADATA_CASES: list[Any] = [
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 5, 3, 8])), 8, 8),
        r"non-decreasing: cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 5",
        id="cu_not_monotonic",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([1, 3, 8])), 8, 8),
        r"must start at 0, got cu_seqlens\[0\] = 1",
        id="cu_not_starting_at_0",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 3, 8])), 8, 9),
        r"must end at the token count 9, got cu_seqlens\[-1\] = 8",
        id="cu_not_ending_at_token_count",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([1, 2, 3]), max_docs=2),
        r"3 documents exceed the capacity max_docs=2",
        id="more_documents_than_max_docs",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_position_ids(w.watch(torch.tensor([0, 0, 0])), max_docs=2),
        r"3 documents exceed the capacity max_docs=2",
        id="position_ids_more_documents_than_max_docs",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([2, 7]), max_seqlen=4),
        r"document 1 has 7 tokens, more than max_seqlen=4",
        id="from_lengths_document_longer_than_max_seqlen",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 2, 9])), 4, 9),
        r"document 1 has 7 tokens, more than max_seqlen=4",
        id="direct_document_longer_than_max_seqlen",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(torch.tensor([0, 3, 8])), 5, 8),
        r"cu_seqlens must be int32, got torch\.int64",
        id="cu_int64",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(torch.tensor([0.0, 3.0, 8.0])), 5, 8),
        r"cu_seqlens must be int32, got torch\.float32",
        id="cu_float",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 3, 8]).reshape(1, 3)), 5, 8),
        r"cu_seqlens must be 1-D .* got shape \(1, 3\)",
        id="cu_2d",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0])), 0, 0),
        r"at least 2 entries .* got shape \(1,\)",
        id="cu_one_entry",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch([0, 3, 8]), 5, 8),
        r"cu_seqlens must be a torch\.Tensor, got list",
        id="cu_not_a_tensor",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 3, 8])), -1, 8),
        r"max_seqlen must be in \[0, 2\*\*31 - 1\].*got -1",
        id="direct_negative_max_seqlen",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 3, 8])), 5.0, 8),
        r"max_seqlen must be an int, got 5\.0",
        id="direct_float_max_seqlen",
    ),
    pytest.param(
        lambda w: AttentionMetadata(w.watch(i32([0, 3, 8])), 5, True),
        r"total_tokens must be an int, got True",
        id="direct_bool_total_tokens",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, -1])),
        r"lengths\[1\] = -1 is negative",
        id="negative_length",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch(torch.tensor([3.0, 5.0]))),
        r"lengths must be an integer tensor, got dtype torch\.float32",
        id="float_lengths_tensor",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, 2.5])),
        r"lengths\[1\] must be an int, got 2\.5",
        id="float_in_lengths_list",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([])),
        r"lengths is empty",
        id="empty_lengths_list",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch(torch.zeros(0, dtype=torch.int64))),
        r"lengths is empty",
        id="empty_lengths_tensor",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, True])),
        r"lengths\[1\] must be an int, got True",
        id="bool_in_lengths_list",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch(torch.tensor([True, False]))),
        r"lengths must be an integer tensor, got dtype torch\.bool",
        id="bool_lengths_tensor",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(5),
        r"lengths must be a sequence of ints or an integer tensor, got int",
        id="lengths_not_a_sequence",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch(torch.tensor([[3, 5]]))),
        r"lengths must be 1-D, got a tensor of shape \(1, 2\)",
        id="lengths_2d_tensor",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, 5]), max_seqlen=-1),
        r"max_seqlen must be a non-negative int, got -1",
        id="from_lengths_negative_max_seqlen",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_position_ids(w.watch(torch.tensor([0, 1, -1, 0]))),
        r"negative position -1 at flat index 2",
        id="negative_position_ids",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_position_ids(w.watch(torch.tensor([0.0, 1.0]))),
        r"position_ids must be an integer tensor, got dtype torch\.float32",
        id="float_position_ids",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_position_ids(w.watch(torch.zeros(1, 2, 3, dtype=torch.int64))),
        r"position_ids must be 1-D or 2-D, got a tensor of shape \(1, 2, 3\)",
        id="position_ids_3d",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_position_ids(w.watch(torch.zeros(2, 0, dtype=torch.int64))),
        r"position_ids is empty",
        id="position_ids_empty",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_document_ids(w.watch(torch.zeros(2, 2, 2, dtype=torch.int64))),
        r"document_ids must be 1-D or 2-D, got a tensor of shape \(2, 2, 2\)",
        id="document_ids_3d",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_document_ids(w.watch(torch.tensor([0.5, 0.5]))),
        r"document_ids must be an integer tensor, got dtype torch\.float32",
        id="float_document_ids",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, 5]), max_docs=0),
        r"max_docs must be a positive int, got 0",
        id="max_docs_zero",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, 5]), max_docs=-2),
        r"max_docs must be a positive int, got -2",
        id="max_docs_negative",
    ),
    pytest.param(
        lambda w: AttentionMetadata.from_lengths(w.watch([3, 5]), max_docs=True),
        r"max_docs must be a positive int, got True",
        id="max_docs_bool",
    ),
    pytest.param(
        lambda w: AttentionMetadata.per_sample(0, 4),
        r"batch_size must be a positive int, got 0",
        id="per_sample_batch_zero",
    ),
    pytest.param(
        lambda w: AttentionMetadata.per_sample(2, 0),
        r"seq_len must be a positive int, got 0",
        id="per_sample_seq_len_zero",
    ),
]


@pytest.mark.parametrize(("call", "match"), METADATA_CASES)
def test_bad_metadata_raises_value_error_naming_the_value_and_loses_nothing(
    call: MetaCall, match: str
) -> None:
    w = Watched()
    with pytest.raises(ValueError, match=match):
        call(w)
    w.assert_unchanged()
    _valid_metadata_constructions_still_work()


# ================================================================================================
# varlen_attn


def _varlen_args() -> dict[str, Any]:
    """A valid call: T = 8 tokens in documents of 3 and 5, H = G = 4 heads, K = 8."""
    g = gen(0)
    q_THK, k_TGK, v_TGK = (torch.randn(8, 4, 8, generator=g) for _ in range(3))
    return dict(
        q=q_THK,
        k=k_TGK,
        v=v_TGK,
        cu_seqlens_q=i32([0, 3, 8]),
        cu_seqlens_k=i32([0, 3, 8]),
        max_seqlen_q=5,
        max_seqlen_k=5,
        is_causal=True,
    )


def _kv(heads: int, tokens: int = 8, dim: int = 8) -> dict[str, torch.Tensor]:
    g = gen(1)
    return {
        "k": torch.randn(tokens, heads, dim, generator=g),
        "v": torch.randn(tokens, heads, dim, generator=g),
    }


Overrides = Callable[[dict[str, Any]], dict[str, Any]]

VARLEN_CASES: list[Any] = [
    pytest.param(
        lambda a: {"q": a["q"].reshape(8, 32)},
        ValueError,
        r"q must be packed \(T, H, K\), got shape \(8, 32\)",
        id="q_not_3d",
    ),
    pytest.param(
        lambda a: {"k": a["k"].unsqueeze(0)},
        ValueError,
        r"k must be packed \(T, H, K\), got shape \(1, 8, 4, 8\)",
        id="k_not_3d",
    ),
    pytest.param(
        lambda a: {"q": [[0.0]]},
        TypeError,
        r"q must be a Tensor, got list",
        id="q_not_a_tensor",
    ),
    pytest.param(
        lambda a: {"k": a["k"].double()},
        ValueError,
        r"k is torch\.float64 on cpu, q is torch\.float32",
        id="mismatched_dtypes",
    ),
    pytest.param(
        lambda a: {"q": a["q"].long(), "k": a["k"].long(), "v": a["v"].long()},
        ValueError,
        r"must be floating point, got torch\.int64",
        id="integer_dtype",
    ),
    pytest.param(
        lambda a: {**_kv(heads=3), "enable_gqa": True},
        ValueError,
        r"q heads \(4\) divisible by k/v heads \(3\)",
        id="gqa_heads_not_divisible",
    ),
    pytest.param(
        lambda a: _kv(heads=2),
        ValueError,
        r"q has 4 heads but k/v have 2; pass enable_gqa=True",
        id="heads_differ_without_gqa",
    ),
    pytest.param(
        lambda a: {"v": a["v"][:7]},
        ValueError,
        r"k and v must have the same tokens and heads, got \(8, 4, 8\) and \(7, 4, 8\)",
        id="k_v_different_tokens",
    ),
    pytest.param(
        lambda a: _kv(heads=4, dim=4),
        ValueError,
        r"q and k must have the same head dim, got 8 and 4",
        id="head_dim_q_vs_k",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": torch.tensor([0, 3, 8])},
        ValueError,
        r"cu_seqlens_q must be a 1-D int32 tensor with >= 2 entries, got torch\.int64 of shape \(3,\)",
        id="cu_seqlens_int64",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_k": [0, 3, 8]},
        ValueError,
        r"cu_seqlens_k must be a 1-D int32 tensor with >= 2 entries, got list",
        id="cu_seqlens_not_a_tensor",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": i32([8])},
        ValueError,
        r"cu_seqlens_q must be a 1-D int32 tensor with >= 2 entries, got torch\.int32 of shape \(1,\)",
        id="cu_seqlens_one_entry",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_k": i32([0, 3, 8, 8])},
        ValueError,
        r"cu_seqlens_q \(3,\) and cu_seqlens_k \(4,\) must have the same length",
        id="cu_seqlens_q_k_different_length",
    ),
    pytest.param(
        lambda a: {"max_seqlen_q": -1},
        ValueError,
        r"max_seqlen_q must be >= 0, got -1",
        id="negative_max_seqlen",
    ),
    pytest.param(
        lambda a: {"max_seqlen_k": 5.0},
        TypeError,
        r"max_seqlen_k must be an int, got float",
        id="max_seqlen_float",
    ),
    pytest.param(
        lambda a: {"max_seqlen_q": True},
        TypeError,
        r"max_seqlen_q must be an int, got bool",
        id="max_seqlen_bool",
    ),
    pytest.param(
        lambda a: {"scale": "0.5"},
        TypeError,
        r"scale must be a float or None, got str",
        id="scale_not_a_number",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": i32([0, 3, 7])},
        ValueError,
        r"cu_seqlens_q must run from 0 to the token count 8, got 0\.\.7",
        id="cu_seqlens_not_ending_at_token_count_cpu_kernel",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_k": i32([1, 3, 9])},
        ValueError,
        r"cu_seqlens_k must stay within 0\.\.8 \(the key count\), got 1\.\.9",
        id="cu_seqlens_k_past_the_key_count_cpu_kernel",
    ),
    pytest.param(
        lambda a: {"cu_seqlens_q": i32([0, 6, 3, 8]), "cu_seqlens_k": i32([0, 6, 3, 8]), "max_seqlen_q": 8},
        ValueError,
        r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\] = 3 < 6",
        id="cu_seqlens_not_monotonic_cpu_kernel",
    ),
    pytest.param(
        lambda a: {"max_seqlen_q": 4},
        ValueError,
        r"document 1 has 5 tokens in cu_seqlens_q, more than its max_seqlen=4",
        id="document_longer_than_max_seqlen_cpu_kernel",
    ),
    pytest.param(
        lambda a: {"q": a["q"][:, :, :0], "k": a["k"][:, :, :0], "v": a["v"][:, :, :0]},
        ValueError,
        r"head dim",
        id="zero_head_dim",
    ),
]


@pytest.mark.parametrize(("overrides", "exc", "match"), VARLEN_CASES)
def test_bad_varlen_attn_argument_raises_naming_it_and_loses_nothing(
    overrides: Overrides, exc: type[Exception], match: str
) -> None:
    base = _varlen_args()
    reference = varlen_attn(**base)
    bad = {**base, **overrides(base)}
    w = Watched()
    for value in bad.values():
        if isinstance(value, torch.Tensor):
            w.watch(value)
    with pytest.raises(exc, match=match):
        varlen_attn(**bad)
    w.assert_unchanged()
    assert torch.equal(varlen_attn(**base), reference)


def test_zero_heads_do_not_crash_the_process() -> None:
    code = (
        "import torch\n"
        "from usp_graph import varlen_attn\n"
        "x = torch.randn(8, 0, 4)\n"
        "cu = torch.tensor([0, 3, 8], dtype=torch.int32)\n"
        "try:\n"
        "    print(tuple(varlen_attn(x, x, x, cu, cu, 5, 5).shape))\n"
        "except ValueError as e:\n"
        "    print('ValueError', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, f"process died with {result.returncode}: {result.stderr[-500:]}"


# ================================================================================================
# sdpa_to_usp / attention_mode


class SdpaInputs(Watched):
    """q, k, v (B=2, H=2, L=4, K=8) and metadata with documents [3, 1, 4] (none crosses a row)."""

    def __init__(self) -> None:
        super().__init__()
        g = gen(2)
        self.q, self.k, self.v = (self.watch(torch.randn(2, 2, 4, 8, generator=g)) for _ in range(3))
        self.meta = AttentionMetadata.from_lengths([3, 1, 4])
        self.watch(self.meta.cu_seqlens)


def sdpa_in_mode(meta: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    with attention_mode(meta):
        return F.scaled_dot_product_attention(*args, **kwargs)


def _random_bool_mask() -> torch.Tensor:
    mask = torch.rand(2, 1, 4, 4, generator=gen(3)) > 0.5
    mask[..., 0] = True  # every row sees a key, so plain SDPA would accept it too
    return mask


SdpaCall = Callable[[SdpaInputs], object]

SDPA_CASES: list[Any] = [
    pytest.param(
        lambda s: sdpa_in_mode(s.meta, s.q, s.k, s.v, dropout_p=0.1),
        ValueError,
        r"dropout_p=0\.1: usp_graph does not support dropout",
        id="dropout",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(s.meta, s.q, s.k, s.v, attn_mask=s.watch(_random_bool_mask())),
        ValueError,
        r"attn_mask of shape \(2, 1, 4, 4\) is not a causal, bidirectional or sliding-window mask within the "
        "documents of the metadata",
        id="random_bool_mask",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(None, s.q, s.k, s.v, attn_mask=s.watch(_random_bool_mask())),
        ValueError,
        r"attn_mask of shape \(2, 1, 4, 4\) is not a causal, bidirectional or sliding-window mask within its own "
        "documents",
        id="random_bool_mask_without_metadata",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            s.meta,
            s.q,
            s.k,
            s.v,
            attn_mask=s.watch(
                as_additive(document_causal_mask(s.meta, 2, 4)).masked_fill(
                    document_causal_mask(s.meta, 2, 4), 0.5
                )
            ),
        ),
        ValueError,
        r"attn_mask: a float mask is only rewritten when every entry is 0 or -inf",
        id="float_mask_not_0_or_minus_inf",
    ),
    pytest.param(
        lambda s: sdpa_to_usp(
            s.q, s.k, s.v, attn_mask=s.watch(document_causal_mask(s.meta, 2, 4).long()), metadata=s.meta
        ),
        ValueError,
        r"attn_mask must be bool or float, got torch\.int64",
        id="integer_mask",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            s.meta, s.q, s.k, s.v, attn_mask=s.watch(document_causal_mask(s.meta, 2, 4)), is_causal=True
        ),
        ValueError,
        r"attn_mask and is_causal=True were both given",
        id="mask_with_is_causal",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            s.meta, s.q, s.k, s.v, attn_mask=s.watch(torch.ones(2, 1, 4, 3, dtype=torch.bool))
        ),
        ValueError,
        r"attn_mask of shape \(2, 1, 4, 3\) does not broadcast",
        id="mask_shape_does_not_broadcast",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            None, s.q, s.k, s.v, attn_mask=s.watch(torch.ones(3, 4, 4, dtype=torch.bool).tril())
        ),
        ValueError,
        r"attn_mask of shape \(3, 4, 4\) does not broadcast",
        id="mask_head_dim_does_not_match_query_heads",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(AttentionMetadata.from_lengths([3, 3]), s.q, s.k, s.v, is_causal=True),
        ValueError,
        r"query of shape \(2, 2, 4, 8\) has 8 tokens \(batch \* length\) but the metadata describes 6",
        id="query_tokens_differ_from_metadata",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            s.meta, s.q, s.watch(torch.randn(2, 2, 5, 8)), s.watch(torch.randn(2, 2, 5, 8))
        ),
        ValueError,
        # keys of another length than the queries: cross-attention, which needs its own documents
        r"this SDPA call is cross-attention .*attention_mode\(metadata, kv=kv_metadata\)",
        id="key_tokens_differ_from_metadata",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            AttentionMetadata.from_lengths([3, 3]),
            s.q,
            s.k,
            s.v,
            attn_mask=s.watch(document_causal_mask(AttentionMetadata.from_lengths([4, 4]), 2, 4)),
        ),
        ValueError,
        r"query of shape \(2, 2, 4, 8\) has 8 tokens",
        id="mask_and_query_tokens_differ_from_metadata",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(s.meta, s.watch(s.q.unsqueeze(0)), s.k, s.v),
        ValueError,
        r"query must be \(B, H, L, K\) or \(B, L, K\) for usp_graph, got shape \(1, 2, 2, 4, 8\)",
        id="query_5d",
    ),
    pytest.param(
        lambda s: sdpa_to_usp(s.q[0, 0], s.k[0, 0], s.v[0, 0]),
        ValueError,
        r"query must be \(B, H, L, K\) or \(B, L, K\) for usp_graph, got shape \(4, 8\)",
        id="query_2d",
    ),
    pytest.param(
        lambda s: sdpa_in_mode({"cu_seqlens": s.meta.cu_seqlens}, s.q, s.k, s.v),
        TypeError,
        r"metadata must be a usp_graph\.AttentionMetadata or None, got dict",
        id="attention_mode_metadata_wrong_type",
    ),
    pytest.param(
        lambda s: sdpa_to_usp(s.q, s.k, s.v, metadata=s.meta.cu_seqlens),
        TypeError,
        r"metadata must be a usp_graph\.AttentionMetadata.*got Tensor",
        id="sdpa_to_usp_metadata_wrong_type",
    ),
    pytest.param(
        lambda s: sdpa_to_usp(
            s.q, s.k, s.v, attn_mask=s.watch(document_causal_mask(s.meta, 2, 4)), metadata=s.meta.cu_seqlens
        ),
        TypeError,
        r"metadata must be a usp_graph\.AttentionMetadata.*got Tensor",
        id="sdpa_to_usp_metadata_wrong_type_with_mask",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            None, s.q, s.watch(torch.randn(2, 2, 6, 8)), s.watch(torch.randn(2, 2, 6, 8)), is_causal=True
        ),
        ValueError,
        r"is_causal with query length 4 != key length 6",
        id="causal_query_key_lengths_differ_without_metadata",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(
            None,
            s.q,
            s.watch(torch.randn(2, 2, 6, 8)),
            s.watch(torch.randn(2, 2, 6, 8)),
            attn_mask=s.watch(torch.ones(4, 6, dtype=torch.bool)),
        ),
        ValueError,
        r"attn_mask with query length 4 != key length 6",
        id="mask_with_query_key_lengths_differ",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(s.meta, s.watch(torch.randn(2, 4, 4, 8)), s.k, s.v),
        ValueError,
        r"query has 4 heads but key/value have 2; pass enable_gqa=True",
        id="heads_differ_without_gqa",
    ),
    pytest.param(
        lambda s: sdpa_in_mode(s.meta, s.q, s.watch(s.k[:1]), s.watch(s.v[:1])),
        ValueError,
        r"query, key, value must share the batch size, got \(2, 2, 4, 8\), \(1, 2, 4, 8\)",
        id="batch_sizes_differ",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), SDPA_CASES)
def test_bad_sdpa_call_raises_naming_the_argument_and_loses_nothing(
    call: SdpaCall, exc: type[Exception], match: str
) -> None:
    s = SdpaInputs()
    plain = F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=True)
    routed = sdpa_in_mode(s.meta, s.q, s.k, s.v, is_causal=True)
    with pytest.raises(exc, match=match):
        call(s)
    s.assert_unchanged()
    # the mode was popped (plain SDPA is plain again) and a fresh mode still routes a valid call
    assert torch.equal(F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=True), plain)
    assert torch.equal(sdpa_in_mode(s.meta, s.q, s.k, s.v, is_causal=True), routed)


# ---- masks that are accepted --------------------------------------------------------------------


def test_document_causal_bool_mask_gives_same_result_as_is_causal_under_metadata() -> None:
    s = SdpaInputs()
    mask = document_causal_mask(s.meta, 2, 4)
    with attention_mode(s.meta):
        with_mask = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=True)
    assert torch.equal(with_mask, causal)


def test_document_causal_float_mask_gives_same_result_as_is_causal_under_metadata() -> None:
    s = SdpaInputs()
    mask = as_additive(document_causal_mask(s.meta, 2, 4))
    with attention_mode(s.meta):
        with_mask = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=True)
    assert torch.equal(with_mask, causal)


def test_accepted_document_causal_mask_matches_plain_sdpa_with_that_mask() -> None:
    s = SdpaInputs()
    mask = document_causal_mask(s.meta, 2, 4)
    reference = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)
    with attention_mode(s.meta):
        routed = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)
    torch.testing.assert_close(routed, reference)


def test_mask_is_not_silently_dropped_when_a_document_spans_two_rows() -> None:
    s = SdpaInputs()
    meta = AttentionMetadata.from_lengths([6, 2])  # document 0 = row 0 and the first half of row 1
    mask = document_causal_mask(meta, 2, 4)
    reference = F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)
    try:
        routed = sdpa_in_mode(meta, s.q, s.k, s.v, attn_mask=mask)
    except ValueError:
        return
    torch.testing.assert_close(routed, reference)


def test_zero_length_sequence_without_metadata_returns_empty_like_sdpa() -> None:
    x = torch.randn(2, 2, 0, 8)
    assert sdpa_in_mode(None, x, x, x).shape == (2, 2, 0, 8)
