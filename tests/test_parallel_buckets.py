"""Bucket planning is pure data: reverse order, a small first bucket, one dtype per bucket."""

from __future__ import annotations

import pytest
import torch

from disttrain.parallel.ddp.buckets import Bucket, build_buckets, plan_buckets

F32, F64 = "f32", "f64"


def test_buckets_fill_in_reverse_registration_order_with_a_small_first_bucket():
    sizes = [100, 10, 300, 30, 50, 5]  # conv1.w conv1.b conv2.w conv2.b fc.w fc.b
    plan = plan_buckets(sizes, [F32] * 6, first_cap=40, cap=320)
    # reversed: fc.b 5, fc.w 50 (55 ≥ 40: close) | conv2.b 30, conv2.w 300 (≥ 320) | rest
    assert plan == [[5, 4], [3, 2], [1, 0]]


def test_a_parameter_larger_than_the_cap_closes_its_bucket_alone():
    plan = plan_buckets([10, 1000, 10], [F32] * 3, first_cap=5, cap=50)
    assert plan == [[2], [1], [0]]


def test_each_dtype_gets_its_own_buckets():
    plan = plan_buckets([8, 8, 8, 8], [F32, F64, F32, F64], first_cap=100, cap=100)
    assert sorted(map(sorted, plan)) == [[0, 2], [1, 3]]
    assert plan[0] == [3, 1]  # the bucket whose first gradient comes first leads


def test_everything_fits_in_one_bucket_under_the_default_caps():
    assert plan_buckets([4] * 7, [F32] * 7, 1 << 20, 25 << 20) == [[6, 5, 4, 3, 2, 1, 0]]


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets([1], [F32], 0, 10)
    with pytest.raises(ValueError, match="differ in length"):
        plan_buckets([1, 2], [F32], 1, 10)


def test_bucket_views_alias_the_flat_buffer():
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(5, dtype=torch.float64)]
    buckets = build_buckets(params, first_cap_bytes=1, cap_bytes=1 << 20)
    assert [b.param_indices for b in buckets] == [[2], [1], [0]]
    b = buckets[2]
    assert isinstance(b, Bucket) and b.flat.numel() == 6 and b.views[0].shape == (2, 3)
    b.views[0][1, 2] = 7.0
    assert b.flat[5] == 7.0 and b.nbytes == 24
