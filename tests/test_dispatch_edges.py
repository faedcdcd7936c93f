"""Paths where torch reaches a DTensor around the dispatcher's usual entry, each against plain torch.

- functorch transforms: transformers' vmapped attention masks index captured tensors through an autograd.Function
  (`TransformGetItemToIndex`), which torch turns into the `custom_function_call` higher-order op; a DTensor that
  `torch.vmap` returns reaches `__torch_dispatch__` as `aten.expand` (gemma3, shieldgemma2, t5gemma2, unlimited_ocr);
- `format()` of a 0-d DTensor (switch_transformers: `self[f"expert_{idx}"]`);
- in-place writes into a view that an op made of its own result (roc_bert: `F.linear(...)` with a bias on 3-d
  input is a view of its `addmm` result; `+=` into it touches no input).
Single-process tests run on both dispatch paths (the C twin and pure Python, `path` fixture of test_fastpath).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from hyper_parallel import DTensor
from tests.dispatch_edges_cases import (_check_vmap_mask, _format_partial, _inplace_case, _inplace_split,
                                        _mask_case, _roc_bert_embeddings, _vmap_split)
from tests.test_fastpath import path, rep  # noqa: F401  (the fixture runs each test on both dispatch paths)

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
    given = None


# ---- functorch transforms ------------------------------------------------------------------
@pytest.mark.parametrize("blocks,window", [(False, 0), (True, 0), (True, 2)])
def test_vmapped_attention_mask_over_captured_dtensors(path, blocks, window):
    _check_vmap_mask(_mask_case(2, 5, 2, blocks, window, 0), 5, rep)


def test_autograd_function_under_vmap_gives_gradients_to_a_captured_dtensor(path):
    w0, idx, c = torch.randn(5), torch.tensor([0, 3, 3, 1]), torch.randn(4)
    wp = w0.clone().requires_grad_()
    with TransformGetItemToIndex():
        want = torch.vmap(lambda i: wp[i] * 2)(idx)
    (want * c).sum().backward()
    w = rep(w0.clone()).requires_grad_()
    with TransformGetItemToIndex():
        got = torch.vmap(lambda i: w[i] * 2)(idx)
    (got * c).sum().backward()
    assert torch.equal(got, want.detach())
    assert type(w.grad) is DTensor and torch.equal(w.grad.full_tensor(), wp.grad)


def test_vmap_returning_an_unbatched_dtensor_broadcasts_it(path):
    w0 = torch.randn(5)
    w = rep(w0)
    with torch.no_grad():
        got = torch.vmap(lambda x: w * 2)(torch.ones(3, 2))
    assert type(got) is DTensor and torch.equal(got.full_tensor(), torch.vmap(lambda x: w0 * 2)(torch.ones(3, 2)))


def test_vmap_returning_a_dtensor_computed_from_batched_values_is_loud(path):
    w = rep(torch.randn(3))
    with torch.no_grad(), pytest.raises(RuntimeError, match="torch.vmap.*full_tensor"):
        torch.vmap(lambda x: w * x)(torch.ones(2, 3))


@pytest.mark.parametrize("world", [2, 4])
def test_vmapped_masks_over_split_dtensors(world, dist2, dist4):
    (dist2 if world == 2 else dist4).run(_vmap_split)


if given is not None:
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batch=st.integers(1, 3), q_len=st.integers(1, 6), pad=st.integers(0, 3), blocks=st.booleans(),
           window=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
    def test_property_vmapped_masks_match_plain(batch, q_len, pad, blocks, window, seed):
        _check_vmap_mask(_mask_case(batch, q_len, min(pad, q_len), blocks, window, seed), q_len, rep)


# ---- format() of 0-d DTensors --------------------------------------------------------------
@pytest.mark.parametrize("value,spec", [(torch.tensor(3), ""), (torch.tensor(3), "d"), (torch.tensor(3), ">4"),
                                        (torch.tensor(2.5), ".3f"), (torch.tensor(True), ""),
                                        (torch.tensor(-1.25, dtype=torch.float64), "e")])
def test_format_of_a_0d_dtensor_is_its_value_as_for_a_plain_tensor(value, spec):
    assert format(rep(value), spec) == format(value, spec)
    assert torch.Tensor.__format__(rep(value), spec) == format(value, spec)
    assert f"expert_{rep(value)}" == f"expert_{value}"


def test_format_of_other_dtensors_is_torchs_object_format():
    t = rep(torch.ones(2))
    assert format(t, "") == repr(t) == str(t)  # the DTensor's repr, as a plain tensor's is its repr
    with pytest.raises(TypeError):
        format(t, ".3f")
    with pytest.raises(TypeError):
        format(torch.ones(2), ".3f")


def test_module_key_from_a_0d_dtensor(path):
    """switch_transformers' routing loop: `for idx in hit: self[f"expert_{idx[0]}"]` over `nonzero()`."""
    experts = nn.ModuleDict({f"expert_{i}": nn.Identity() for i in range(4)})
    mask = torch.tensor([0, 2, 0, 1])
    want = [f"expert_{i[0]}" for i in torch.greater(mask, 0).nonzero()]
    with torch.no_grad():
        got = [f"expert_{i[0]}" for i in torch.greater(rep(mask), 0).nonzero()]
    assert got == want == ["expert_1", "expert_3"] and all(k in experts for k in got)


def test_format_of_a_pending_0d_dtensor_never_communicates(dist2):
    assert dist2.run(_format_partial) == ["3.0", "3.0"]


if given is not None:
    @settings(max_examples=40, deadline=None)
    @given(value=st.one_of(st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=False, width=32), st.booleans()),
           spec=st.sampled_from(["", ">8", "<3", "^9", "+", ".2f", ".3e", "g", "%", ",", "08.2f"]))
    def test_property_format_matches_plain(value, spec):
        plain = torch.tensor(value)
        try:
            want = format(plain, spec)
        except (ValueError, TypeError) as e:
            with pytest.raises(type(e)):
                format(rep(plain), spec)
        else:
            assert format(rep(plain), spec) == want


# ---- in-place writes into views the op made ------------------------------------------------
def test_inplace_into_a_view_of_an_ops_own_result(path):
    plain = [v.clone().requires_grad_() for v in _inplace_case()]
    _roc_bert_embeddings(*plain).backward()
    dts = [rep(v.clone()).requires_grad_() for v in _inplace_case()]
    loss = _roc_bert_embeddings(*dts)
    loss.backward()
    assert torch.allclose(loss.full_tensor(), _roc_bert_embeddings(*_inplace_case()))
    for d, p in zip(dts, plain):
        assert torch.allclose(d.grad.full_tensor(), p.grad, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_inplace_into_views_with_split_inputs(world, dist2, dist4):
    (dist2 if world == 2 else dist4).run(_inplace_split)


if given is not None:
    _VIEWS = {
        "linear+bias": lambda a, w: F.linear(a, w, w.sum(0)),
        "view": lambda a, w: a.view(-1, a.shape[-1]),
        "transpose": lambda a, w: a.transpose(0, 1),
        "slice": lambda a, w: a[:, 1:],
        "reshape of a product": lambda a, w: (a * 2).reshape(-1),
        "matmul": lambda a, w: a @ w.t(),
    }
    _WRITES = {"add_": lambda v: v.add_(1.5), "mul_": lambda v: v.mul_(-2), "iadd": lambda v: v.__iadd__(v * 0.5)}

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(chain=st.lists(st.tuples(st.sampled_from(sorted(_VIEWS)), st.sampled_from(sorted(_WRITES))),
                          min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
    def test_property_inplace_after_views_matches_plain(chain, seed):
        """Random chains (a view or an op whose result is a view of its own temporary, then an in-place write) on
        replicated DTensors that require grad, against plain torch: values, gradients, or the same error."""
        g = torch.Generator().manual_seed(seed)
        a0, w0 = torch.randn(2, 3, 4, generator=g), torch.randn(4, 4, generator=g)

        def run(a, w):
            h = a * 1  # a non-leaf: torch refuses in-place writes into views of leaves that require grad
            for view, write in chain:
                h = _WRITES[write](_VIEWS[view](h, w))
                if h.dim() < 3:
                    h = h.reshape(2, -1, 4) if h.numel() % 8 == 0 else h.reshape(1, 1, -1)[..., :4]
            return (h * h).sum()

        pa, pw = a0.clone().requires_grad_(), w0.clone().requires_grad_()
        try:
            want = run(pa, pw)
            want.backward()
        except RuntimeError as e:
            with pytest.raises(RuntimeError):
                run(rep(a0.clone()).requires_grad_(), rep(w0.clone()).requires_grad_())
            return
        da, dw = rep(a0.clone()).requires_grad_(), rep(w0.clone()).requires_grad_()
        got = run(da, dw)
        got.backward()
        assert torch.allclose(got.full_tensor(), want, rtol=1e-5)
        for d, p in ((da, pa), (dw, pw)):  # w is unused by chains without linear or matmul
            assert (d.grad is None) == (p.grad is None)
            assert p.grad is None or torch.allclose(d.grad.full_tensor(), p.grad, rtol=1e-4, atol=1e-5)
