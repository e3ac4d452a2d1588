"""Weight-sync bucketing: plans, pack/unpack round trips and checksums."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pjray.sync.buckets import (
    Bucket,
    BucketEntry,
    pack,
    plan_buckets,
    state_checksums,
    tensor_checksum,
    unpack,
)

F32, BF16 = torch.float32, torch.bfloat16


def test_plan_buckets_hand_example():
    params = [
        ("a", torch.Size([2, 2]), F32),  # 16 B
        ("b", torch.Size([3]), F32),  # 12 B -> 28 B with a, fits in 32
        ("c", torch.Size([10]), F32),  # 40 B > 32: a bucket of its own
        ("d", torch.Size([4]), BF16),  # dtype change: new bucket, 8 B
        ("e", torch.Size([2]), BF16),  # 4 B
    ]
    buckets = plan_buckets(params, bucket_bytes=32)
    a = BucketEntry("a", torch.Size([2, 2]), F32, offset=0, numel=4)
    b = BucketEntry("b", torch.Size([3]), F32, offset=4, numel=3)
    c = BucketEntry("c", torch.Size([10]), F32, offset=0, numel=10)
    d = BucketEntry("d", torch.Size([4]), BF16, offset=0, numel=4)
    e = BucketEntry("e", torch.Size([2]), BF16, offset=4, numel=2)
    assert buckets == [Bucket(F32, (a, b), 7), Bucket(F32, (c,), 10), Bucket(BF16, (d, e), 6)]
    assert [b.nbytes for b in buckets] == [28, 40, 12]


def test_nothing_joins_an_oversize_tensor():
    params = [
        ("small1", torch.Size([1]), F32),
        ("huge", torch.Size([100]), F32),
        ("small2", torch.Size([1]), F32),
    ]
    names = [[e.name for e in b.entries] for b in plan_buckets(params, bucket_bytes=16)]
    assert names == [["small1"], ["huge"], ["small2"]]


def test_plan_buckets_errors():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", torch.Size([1]), F32)], 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([("a", torch.Size([1]), F32), ("a", torch.Size([1]), F32)], 64)
    assert plan_buckets([], 64) == []


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(torch.Size)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64])


@st.composite
def param_lists(draw):
    n = draw(st.integers(0, 12))
    return [(f"layer{i}.weight", draw(shapes), draw(dtypes)) for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(params=param_lists(), bucket_bytes=st.integers(1, 300))
def test_plan_buckets_invariants(params, bucket_bytes):
    buckets = plan_buckets(params, bucket_bytes)
    flat = [e for b in buckets for e in b.entries]
    # Every parameter exactly once, in the original order, with its shape and dtype.
    assert [(e.name, e.shape, e.dtype) for e in flat] == params
    for b in buckets:
        assert b.entries, "no empty buckets"
        assert all(e.dtype == b.dtype for e in b.entries)
        assert b.nbytes <= bucket_bytes or len(b.entries) == 1
        offset = 0
        for e in b.entries:
            assert e.offset == offset and e.numel == e.shape.numel()
            offset += e.numel
        assert b.numel == offset


def _random_tensor(shape, dtype, g):
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, tuple(shape), generator=g)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def _bits(x):
    """A view that compares bit patterns, so -0.0 vs 0.0 or NaN payloads would not hide."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.view(ints[x.element_size()])


@settings(max_examples=150, deadline=None)
@given(
    params=param_lists(),
    bucket_bytes=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(params, bucket_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {name: _random_tensor(shape, dtype, g) for name, shape, dtype in params}
    seen = {}
    for bucket in plan_buckets(params, bucket_bytes):
        flat = pack(bucket, tensors)
        assert flat.shape == (bucket.numel,) and flat.dtype == bucket.dtype
        assert flat.is_contiguous()
        out = unpack(bucket, flat)
        assert list(out) == [e.name for e in bucket.entries]
        for name, view in out.items():
            assert view.shape == tensors[name].shape and view.dtype == tensors[name].dtype
            assert torch.equal(_bits(view), _bits(tensors[name]))
            if view.numel():  # views into the received buffer, not copies
                assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        seen.update(out)
    assert set(seen) == set(tensors)


def test_pack_checks_shape_dtype_and_presence():
    params = [("w", torch.Size([2, 3]), F32), ("b", torch.Size([3]), F32)]
    (bucket,) = plan_buckets(params, 1 << 20)
    good = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    assert pack(bucket, good).tolist() == [1.0] * 6 + [0.0] * 3
    with pytest.raises(ValueError, match="'w'"):
        pack(bucket, {**good, "w": torch.ones(3, 2)})
    with pytest.raises(ValueError, match="'b'"):
        pack(bucket, {**good, "b": torch.zeros(3, dtype=BF16)})
    with pytest.raises(KeyError, match="'b'"):
        pack(bucket, {"w": good["w"]})
    # Non-contiguous inputs pack by value.
    wt = torch.arange(6.0).reshape(3, 2).t()
    assert pack(bucket, {"w": wt, "b": good["b"]})[:6].tolist() == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]


def test_unpack_checks_the_buffer():
    (bucket,) = plan_buckets([("w", torch.Size([4]), F32)], 64)
    with pytest.raises(ValueError, match="bucket expects"):
        unpack(bucket, torch.zeros(5))
    with pytest.raises(ValueError, match="bucket expects"):
        unpack(bucket, torch.zeros(4, dtype=BF16))


def test_tensor_checksum_format():
    # The digest covers dtype, shape and the little-endian raw bytes.
    expected = hashlib.sha256(b"torch.float32|(2,)|" + struct.pack("<2f", 1.0, 2.0)).hexdigest()
    assert tensor_checksum(torch.tensor([1.0, 2.0])) == expected


def test_tensor_checksum_sensitivity():
    x = torch.randn(4, 5).to(BF16)
    assert tensor_checksum(x) == tensor_checksum(x.clone())
    # One flipped bit of one bfloat16 element changes the digest.
    y = x.clone()
    y.view(torch.int16)[0, 0] ^= 1
    assert tensor_checksum(x) != tensor_checksum(y)
    assert tensor_checksum(x) != tensor_checksum(x.reshape(5, 4))
    assert tensor_checksum(x) != tensor_checksum(x.float())
    # A transposed (non-contiguous) tensor hashes by its logical values.
    z = torch.arange(6.0).reshape(2, 3)
    assert tensor_checksum(z.t()) == tensor_checksum(z.t().contiguous())
    assert tensor_checksum(torch.ones((), dtype=BF16)) != tensor_checksum(torch.ones(1, dtype=BF16))


def test_state_checksums_from_dict_and_named_parameters():
    model = torch.nn.Linear(3, 2).to(BF16)
    from_params = state_checksums(model.named_parameters())
    from_dict = state_checksums(model.state_dict())
    assert from_params == from_dict
    assert set(from_params) == {"weight", "bias"}
    assert from_params["weight"] == tensor_checksum(model.weight)
