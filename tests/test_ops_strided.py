"""as_strided on DTensors (Longformer / LED sliding-window chunking): whole inputs give exactly what one device
gives for the contiguous tensor the wrapper reports, with gradients; split inputs and offsets outside the tensor
raise on every rank."""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import DTensor
from tests.op_check import run_cases



def rep(t):
    """Replicated on the census layout (4 x 2, nothing split): no process group needed."""
    return DTensor.from_local(t, hp.Layout((4, 2), ("dp", "tp"))(*(["None"] * t.ndim)))


def chunk(x, w):
    """Longformer's `_chunk`: overlapping chunks of 2w with overlap w, its arguments computed from x.stride()."""
    x = x.view(x.size(0), x.size(1) // (2 * w), 2 * w, x.size(2))
    size = list(x.size())
    size[1] = size[1] * 2 - 1
    stride = list(x.stride())
    stride[1] = stride[1] // 2
    return x.as_strided(size=size, stride=stride)


def chunk_value(v, w):
    """LED / Longformer `_sliding_chunks_matmul_attn_probs_value`: a 0-d tensor among the sizes."""
    n, seq, d = v.shape
    count = torch.div(seq, w, rounding_mode="trunc") - 1
    padded = torch.nn.functional.pad(v, (0, 0, w, w), value=-1)
    s = padded.stride()
    return padded.as_strided(size=(n, count + 1, 3 * w, d), stride=(s[0], w * s[1], s[1], s[2]))


@pytest.mark.parametrize("transposed", [False, True])
def test_sliding_chunks_equal_plain_with_gradients(transposed):
    """A contiguous local is viewed as is; a non-contiguous one (a transpose, as Longformer's reshapes make) is
    viewed through a contiguous copy, the layout its wrapper reports: both equal one device on that tensor."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 3, 16, generator=g)
    arrange = (lambda t: (t * 1.0).transpose(0, 1)) if transposed else (lambda t: (t * 1.0).reshape(3, 8, 16))
    xr = x0.clone().requires_grad_()
    ref = chunk(arrange(xr).contiguous(), 2)
    (ref * ref).sum().backward()
    xd = rep(x0.clone()).requires_grad_()
    h = arrange(xd)
    assert h._local.is_contiguous() != transposed
    out = chunk(h, 2)
    assert type(out) is DTensor and tuple(out.shape) == tuple(ref.shape)
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=0, atol=0)
    (out * out).sum().backward()
    assert type(xd.grad) is DTensor
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, rtol=1e-6, atol=1e-6)


def test_non_contiguous_local_is_read_as_reported():
    x0 = torch.randn(6, 4)
    xt = rep(x0).t()                               # local strides (1, 4); the wrapper reports (6, 1)
    assert not xt._local.is_contiguous() and xt.stride() == (6, 1)
    out = xt.as_strided((3, 6), (6, 1), 6)
    torch.testing.assert_close(out.full_tensor(), x0.t().contiguous().as_strided((3, 6), (6, 1), 6))
    out = torch.as_strided(xt, (2, 2), (1, 6))
    torch.testing.assert_close(out.full_tensor(), torch.as_strided(x0.t().contiguous(), (2, 2), (1, 6)))


def test_zero_d_sizes_and_view_of_local():
    v0 = torch.randn(4, 8, 3)
    ref = chunk_value(v0, 2)
    out = chunk_value(rep(v0), 2)
    torch.testing.assert_close(out.full_tensor(), ref, rtol=0, atol=0)
    x = rep(torch.randn(4, 6))
    assert x.as_strided((2, 3), (6, 2))._local._base is x._local  # contiguous local: a view, no copy


def test_outside_the_tensor_is_loud():
    x = rep(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="outside the 6 elements"):
        x.as_strided((2, 4), (3, 1))
    with pytest.raises(RuntimeError, match="outside"):
        x.as_strided((2,), (1,), 5)


def test_write_through_a_copied_view_is_loud():
    x = rep(torch.randn(4, 6)).t()
    v = x.as_strided((2, 2), (4, 1))
    with pytest.raises(RuntimeError, match="redistributed"):
        v.add_(1.0)


# ---- 2 ranks: whole and pending-sum inputs equal plain torch; split inputs raise on every rank ----------------
def _cases_whole_and_partial(rank, world):
    x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1))
    whole = lambda mesh: [(("None",) * 3, None), (("None",) * 3, mesh.alias_name[-1])]  # noqa: E731
    cases = [("as_strided windows", lambda t: t.as_strided((4, 2, 4, 5), (30, 10, 5, 1)), [x], [whole], True),
             ("torch.as_strided offset", lambda t: torch.as_strided(t * 2, (5, 7), (11, 3), 4), [x], [whole], True)]
    return run_cases(cases, world)


def _split_raises(rank, world):
    mesh = hp.Layout((world,), ("tp",))
    x = hp.distribute_tensor(torch.randn(4, 6), mesh("tp", "None"), src_data_rank=None)
    try:
        x.as_strided((2, 6), (6, 1))
    except RuntimeError as e:
        return str(e)
    return None


def test_two_ranks(dist2):
    failures = [f for per_rank in dist2.run(_cases_whole_and_partial) for f in per_rank]
    assert not failures, "\n".join(failures[:3])
    errors = dist2.run(_split_raises)
    assert all(e is not None and "split it" in e and "unfold" in e for e in errors), errors


def _leading_split_cases(rank, world, cases):
    """as_strided of a tensor split on its leading dim (a batch split of Longformer's chunking), against plain
    torch: "ok" when equal (values and input gradients), "loud" when refused, else what differs."""
    mesh = hp.Layout((world,), ("dp",))
    out = []
    for shape, size, stride, offset, seed in cases:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        xr = x.clone().requires_grad_()
        xd = hp.distribute_tensor(x.clone(), mesh("dp", *["None"] * (len(shape) - 1)),
                                  src_data_rank=None).requires_grad_()
        try:
            ref = xr.as_strided(size, stride, offset)
        except RuntimeError:
            out.append("plain")
            continue
        try:
            got = xd.as_strided(size, stride, offset)
        except RuntimeError as e:
            out.append("loud" if "split it" in str(e) else f"error: {e}")
            continue
        g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
        (ref * g).sum().backward()
        (got * g).sum().backward()
        same = torch.equal(got.full_tensor(), ref) and torch.allclose(xd.grad.full_tensor(), xr.grad)
        out.append("ok" if same else f"differs: {shape} {size} {stride} {offset}")
    return out


def test_leading_split_windows(dist2):
    """Windows inside each sample run split (no gather); windows across samples stay loud, on every rank."""
    cases = [((4, 10, 3), (4, 4, 4, 3), (30, 6, 3, 1), 0, 1),   # Longformer-style overlapping chunks
             ((6, 8), (6, 3, 3), (8, 2, 1), 1, 2),             # with an offset inside the sample
             ((4, 10, 3), (4, torch.tensor(4), 4, 3), (30, 6, 3, 1), 0, 5),  # a size as a 0-d tensor (Longformer)
             ((4, 6), (2, 6), (6, 1), 0, 3),                    # fewer samples than the tensor: refused
             ((4, 6), (4, 6), (5, 1), 0, 4)]                    # samples overlap (stride 5 < 6): refused
    per_rank = dist2.run(_leading_split_cases, cases)
    assert per_rank[0] == per_rank[1] == ["ok", "ok", "ok", "loud", "loud"], per_rank


# ---- property: random views inside the tensor, on contiguous and transposed locals ------------------------------
try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
    given = None

if given is not None:
    @settings(max_examples=40, deadline=None)
    @given(rows=st.integers(1, 5), cols=st.integers(1, 5), transposed=st.booleans(),
           size=st.lists(st.integers(0, 4), min_size=1, max_size=3),
           stride=st.lists(st.integers(0, 6), min_size=3, max_size=3), offset=st.integers(0, 8),
           seed=st.integers(0, 100))
    def test_random_as_strided_equals_plain(rows, cols, transposed, size, stride, offset, seed):
        """Property: any as_strided inside the tensor's elements equals torch's on the contiguous tensor the
        wrapper reports (values and gradients); any reaching outside raises."""
        x0 = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        stride = stride[:len(size)]
        xr = x0.clone().requires_grad_()
        xd = rep(x0.clone()).requires_grad_()
        base_r, base_d = (xr.t(), xd.t()) if transposed else (xr * 1.0, xd * 1.0)
        try:
            ref = base_r.contiguous().as_strided(size, stride, offset)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="outside"):
                base_d.as_strided(size, stride, offset)
            return
        out = base_d.as_strided(size, stride, offset)
        torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=0, atol=0)
        wt = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
        (ref * wt).sum().backward()
        (out * rep(wt)).sum().backward()
        torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
