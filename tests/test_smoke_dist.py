import torch

import hyper_parallel as hp


def _linear_colwise(rank, world):
    L = hp.Layout((world,), ("tp",))
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    dx = hp.distribute_tensor(x, L("None", "None"))
    dw = hp.distribute_tensor(w, L("tp", "None"))
    y = dx * 2 + dx
    assert torch.allclose(y.full_tensor(), x * 3)
    dxs = hp.distribute_tensor(x, L("tp", "None"))
    z = (dxs + dx).exp()
    assert z.dist_layout == L("tp", "None"), z.dist_layout
    assert torch.allclose(z.full_tensor(), (x + x).exp())
    assert dw.to_local().shape == (6 // world, 8)
    return True


def test_smoke(dist2):
    assert dist2.run(_linear_colwise) == [True, True]


def _plain_grad_in_split_op(rank, world):
    L = hp.Layout((world,), ("tp",))
    torch.manual_seed(0)
    x0, w0 = torch.randn(3, 8), torch.randn(6, 8)
    x = x0.clone().requires_grad_()
    w = hp.distribute_tensor(w0, L("tp", "None"))
    torch.nn.functional.linear(x, w).full_tensor().sum().backward()
    ref = x0.clone().requires_grad_()
    torch.nn.functional.linear(ref, w0).sum().backward()
    assert torch.allclose(x.grad, ref.grad, atol=1e-5), (x.grad, ref.grad)
    return True


def test_plain_tensor_gradient_is_reduced(dist2):
    dist2.run(_plain_grad_in_split_op)


def _masked_row_write(rank, world):
    """x[mask, :] = rows with x split on the masked dims (Qwen-VL merges image embeddings this way)."""
    L = hp.Layout((world,), ("dp",))
    torch.manual_seed(0)
    x0 = torch.randn(4, 5, 3)
    mask = torch.rand(4, 5) > 0.5
    rows0 = torch.randn(int(mask.sum()), 3)
    rows = hp.distribute_tensor(rows0, L("None", "None")).requires_grad_()
    x = hp.distribute_tensor(x0, L("dp", "None", "None")) * 1.0
    x[hp.distribute_tensor(mask, L("dp", "None")), :] = rows
    (x * x).backward(hp.distribute_tensor(torch.ones(4, 5, 3), L("dp", "None", "None")))
    ref_rows = rows0.clone().requires_grad_()
    ref = x0.clone()
    ref[mask, :] = ref_rows
    (ref * ref).sum().backward()
    assert torch.equal(x.full_tensor(), ref.detach())
    assert torch.allclose(rows.grad.full_tensor(), ref_rows.grad, atol=1e-6)
    return True


def test_masked_row_write_on_split_dims(dist2):
    dist2.run(_masked_row_write)


def _write_through_view(rank, world):
    """k = x.new_empty(..); k[..., :n].copy_(y): the base gets y's history (DeepSeek-V3's expand_kv)."""
    L = hp.Layout((world,), ("dp",))
    torch.manual_seed(0)
    y0, r0 = torch.randn(4, 3), torch.randn(4, 2)
    y = hp.distribute_tensor(y0, L("dp", "None")).requires_grad_()
    k = (y * 2).new_empty(4, 5)
    assert k.dist_layout is y.dist_layout, k.dist_layout  # the kept batch size keeps its split: no gather below
    k[..., :3].copy_(y * 2)
    k[..., 3:].copy_(hp.distribute_tensor(r0, L("dp", "None")))
    (k * k).backward(hp.distribute_tensor(torch.ones(4, 5), L("dp", "None")))
    ref_y = y0.clone().requires_grad_()
    ref = torch.cat([ref_y * 2, r0], dim=-1)
    (ref * ref).sum().backward()
    assert torch.allclose(k.full_tensor(), ref.detach())
    assert torch.allclose(y.grad.full_tensor(), ref_y.grad, atol=1e-6)
    # a view taken of a gathered copy (a basic index along the split dim) is written back into the original
    x = hp.distribute_tensor(torch.zeros(4, 6), L("None", "dp"))
    x[..., :3].copy_(torch.ones(4, 3))
    ref = torch.zeros(4, 6)
    ref[..., :3] = 1
    assert torch.equal(x.full_tensor(), ref)
    with torch.no_grad():  # the same without grad (the C fast path's case)
        v = x[..., :3]
        v.add_(1)
        ref[..., :3] += 1
        assert torch.equal(x.full_tensor(), ref)
        try:  # a view of that view has no record of where it came from: loud, not lost
            v[:, 1:].add_(1)
        except RuntimeError as e:
            assert "would not reach the original" in str(e)
        else:
            raise AssertionError("a write into a view of a view of a redistributed copy must be refused")
    return True


def test_write_through_view_gives_base_history(dist2):
    dist2.run(_write_through_view)
