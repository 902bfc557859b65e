"""fp8kv._ops.supported_values: the kernels' supported-value lists, read from the library."""

from __future__ import annotations

import pytest

from fp8kv._ops import supported_values

NAMES = ("cuda_head_sizes", "cuda_block_sizes", "cuda_sm90a_head_sizes", "cuda_sm90a_fp8_math_head_sizes",
         "cuda_sm90a_capability", "cuda_decode_table_seqs")


@pytest.mark.parametrize("name", NAMES)
def test_lists_are_increasing_positive_ints(name):
    values = supported_values(name)
    assert values and all(isinstance(v, int) and v >= 0 for v in values), values
    if name != "cuda_sm90a_capability":
        assert list(values) == sorted(set(values)) and values[0] > 0, values


def test_sm90a_kernel_has_a_subset_of_the_head_sizes():
    assert set(supported_values("cuda_sm90a_head_sizes")) <= set(supported_values("cuda_head_sizes"))
    assert set(supported_values("cuda_sm90a_fp8_math_head_sizes")) <= set(supported_values("cuda_sm90a_head_sizes"))


def test_block_sizes_are_powers_of_two():
    assert all(b & (b - 1) == 0 for b in supported_values("cuda_block_sizes"))


def test_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(RuntimeError, match=r"`name` must be one of " + ", ".join(NAMES) + r', got "head_sizes"'):
        supported_values("head_sizes")
