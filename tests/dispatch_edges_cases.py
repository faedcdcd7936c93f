"""Cases of tests/test_dispatch_edges.py that also run on worker ranks (tests/harness.py imports this module by
name, so it holds no single-process fixtures), each checked against plain torch."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                        sdpa_mask, sliding_window_overlay)

import hyper_parallel as hp
from hyper_parallel import DTensor


# ---- functorch transforms ------------------------------------------------------------------
def _vmap_mask(attention_mask, block_ids, window, q_len, kv_len, wrap):
    """transformers' vmapped sdpa mask (the path `create_causal_mask` takes with an or/and mask function), with the
    captured tensors passed through `wrap` (identity for the plain reference, a DTensor maker otherwise)."""
    fn = causal_mask_function
    if window:
        fn = and_masks(fn, sliding_window_overlay(window))
    if block_ids is not None:
        fn = or_masks(fn, blockwise_overlay(wrap(block_ids)))
    return sdpa_mask(batch_size=attention_mask.shape[0], q_length=q_len, kv_length=kv_len, mask_function=fn,
                     attention_mask=wrap(attention_mask), allow_is_causal_skip=False, use_vmap=True)


def _mask_case(batch, q_len, pad, blocks, window, seed):
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch, q_len, dtype=torch.bool)
    for b in range(batch):
        attention_mask[b, :int(torch.randint(0, pad + 1, (1,), generator=g))] = False  # left padding
    block_ids = torch.randint(-1, 2, (batch, q_len), generator=g) if blocks else None
    return attention_mask, block_ids, window


def _check_vmap_mask(case, q_len, wrap):
    attention_mask, block_ids, window = case
    want = _vmap_mask(attention_mask, block_ids, window, q_len, q_len, lambda t: t)
    got = _vmap_mask(attention_mask, block_ids, window, q_len, q_len, wrap)
    # the mask leaves the transform as a plain tensor holding the global value (see _function_under_transform)
    assert type(got) is torch.Tensor and torch.equal(got, want), (got, want)


def _vmap_split(rank, world):
    """Captured DTensors split over the ranks (batch and sequence dims): the mask is gathered, equal everywhere."""
    L = hp.Layout((world,), ("tp",))
    for layout in (L("tp", "None"), L("None", "tp")):
        for blocks, window in ((False, 0), (True, 2)):
            case = _mask_case(world, 2 * world, 3, blocks, window, rank * 0 + 7)  # the same case on every rank
            _check_vmap_mask(case, 2 * world, lambda t, lay=layout: hp.distribute_tensor(t, lay, src_data_rank=None))
    w0, idx, c = torch.randn(2 * world), torch.tensor([0, 3, 1, 1]), torch.randn(4)
    wp = w0.clone().requires_grad_()
    with TransformGetItemToIndex():
        (torch.vmap(lambda i: wp[i] * 3)(idx) * c).sum().backward()
    w = hp.distribute_tensor(w0, L("tp"), src_data_rank=None).requires_grad_()
    with TransformGetItemToIndex():
        (torch.vmap(lambda i: w[i] * 3)(idx) * c).sum().backward()
    assert w.grad.dist_layout is w.dist_layout and torch.allclose(w.grad.full_tensor(), wp.grad)
    return True



# ---- format() of 0-d DTensors --------------------------------------------------------------
def _format_partial(rank, world):
    L = hp.Layout((world,), ("tp",))
    pending = DTensor.from_local(torch.tensor(float(rank + 1)), L().with_partial("tp"), shape=())
    assert f"n={pending}" == f"n={pending!r}"  # an eager message of a passing check: the repr, on every rank
    if rank == 0:  # rank-0-only logging with a spec: loud on the rank that formats, and nothing waits on the others
        with pytest.raises(ValueError, match="pending reduction"):
            f"{pending:.2f}"
    total = pending.full_tensor()  # every rank reduces, then formats (the ranks are still in step)
    return f"{hp.distribute_tensor(total, L(), src_data_rank=None):.1f}"



# ---- in-place writes into views the op made ------------------------------------------------
def _roc_bert_embeddings(x, w, b, t, p):
    """roc_bert's `map_inputs_layer` then `+=` of two embeddings, then a divide in place."""
    h = F.linear(x, w, b)
    h += t
    h += p
    h /= 2
    return (h * h).sum()


def _inplace_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in ((2, 3, 4), (5, 4), (5,), (2, 3, 5), (3, 5))]


def _inplace_split(rank, world):
    """The same with split inputs, so that the rule moves some of them: values and gradients, and a write into a
    view of a moved copy (a real one: `x.view(-1)` of a tensor split on its inner dim) stays loud."""
    L = hp.Layout((world,), ("tp",))
    plain = [v.clone().requires_grad_() for v in _inplace_case(3)]
    _roc_bert_embeddings(*plain).backward()
    layouts = [(L("tp", "None", "None"), L("None", "None"), L("None"), L("tp", "None", "None"), L("None", "None")),
               (L("None", "None", "tp"), L("None", "tp"), L("None"), L("None", "None", "None"), L("None", "tp")),
               (L("None", "None", "None"), L("tp", "None"), L("tp"), L("None", "None", "tp"), L("None", "None"))]
    for lays in layouts:
        dts = [hp.distribute_tensor(v.detach(), lay, src_data_rank=None).requires_grad_()
               for v, lay in zip(plain, lays)]
        loss = _roc_bert_embeddings(*dts)
        loss.backward()
        assert torch.allclose(loss.full_tensor(), _roc_bert_embeddings(*_inplace_case(3)), rtol=1e-5), lays
        for d, p in zip(dts, plain):
            assert torch.allclose(d.grad.full_tensor(), p.grad, atol=1e-5, rtol=1e-5), lays
    x = hp.distribute_tensor(torch.randn(2, 2 * world), L("None", "tp"), src_data_rank=None).requires_grad_()
    with pytest.raises(RuntimeError, match="redistributed copy"):
        (x * 1).view(-1).add_(1)
    return True
