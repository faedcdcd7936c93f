"""Single process, no torch.distributed: layouts, validation errors, the census scenario."""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout, Partial, Replicate, Shard
from hyper_parallel.layout.chunks import chunk_sizes, piece

from tests.op_check import without_rule


def test_alias_and_placements_round_trip():
    L = Layout((4, 2), ("dp", "tp"))
    t = L("dp", "None")
    assert t.placements == (Shard(0), Replicate())
    assert L(Shard(0), Replicate()).for_ndim(2) is t
    both = L(("dp", "tp"), "None")
    assert both.tensor_map == ((0, 1), ())
    assert both.placements == (Shard(0), Shard(0))
    rev = L(("tp", "dp"), "None")
    assert rev.tensor_map == ((1, 0), ()) and rev.alias_entries() == (("tp", "dp"), "None")
    p = L("dp", "None").with_partial("tp", "sum")
    assert p.placements == (Shard(0), Partial("sum"))
    mesh = L.mesh
    assert Layout.from_placements(mesh, p.placements, 2) is p
    assert L("dp", "None") is L("dp", "None")  # interned


def test_placements_are_values():
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1)) and Shard(0) != Shard(1)
    assert Partial() == Partial("sum") != Partial("max")
    with pytest.raises(AttributeError):
        Shard(0).dim = 2
    with pytest.raises(ValueError):
        Partial("prod")


@pytest.mark.parametrize("bad, match", [
    (lambda L: L("xx", "None"), "unknown alias 'xx'"),
    (lambda L: L("dp", "dp"), "alias 'dp' is used twice"),
    (lambda L: L(("dp", "dp"), "None"), "used twice"),
    (lambda L: L(Shard(0)), "give one per mesh axis"),
    (lambda L: L("dp", "None").with_partial("dp"), "already shards"),
])
def test_bad_layouts(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(Layout((4, 2), ("dp", "tp")))


def test_bad_meshes():
    with pytest.raises(ValueError, match="rank_list has 3"):
        Layout((2, 2), ("dp", "tp"), rank_list=[0, 1, 2])
    with pytest.raises(ValueError, match="used twice"):
        Layout((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="has 2 axes but alias_name"):
        Layout((2, 2), ("dp",))


def test_a_mesh_axis_on_two_dims_is_refused_however_the_layout_is_made():
    base = Layout((2, 2), ("dp", "tp"))
    assert base("dp", "tp").with_map(((1,), (0,))).tensor_map == ((1,), (0,))   # each axis once: fine
    for tensor_map in (((0,), (0,)), ((0, 1), (1,)), ((), (1,), (1,))):
        with pytest.raises(ValueError, match="splits tensor dims"):
            base("dp", "tp").with_map(tensor_map)


def test_entry_count_must_match_rank():
    L = Layout((4, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="has 1 entries but the tensor has 2 dims"):
        DTensor.from_local(torch.ones(2, 2), L("None"))
    d = DTensor.from_local(torch.ones(2, 2), L("None", "None"))
    with pytest.raises(ValueError, match="3 entries"):
        d.redistribute(L("None", "None", "None"))
    with pytest.raises(ValueError, match="device matrix"):
        DTensor.from_local(torch.ones(2), L)


def test_chunk_math_matches_torch_chunk():
    for n in range(0, 13):
        for parts in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.arange(n).chunk(parts)] if n else []
            assert chunk_sizes(n, parts)[:len(sizes)] == sizes
            assert sum(chunk_sizes(n, parts)) == n
    assert piece(10, [(2, 1), (2, 0)]) == (5, 3)


def test_single_device_census_scenario():
    """The requirement's flow: a (4, 2) mesh on one process, "None" layouts, plain model code."""
    L = Layout((4, 2), ("dp", "tp"))
    ids = torch.randint(0, 10, (2, 5))
    x = DTensor.from_local(ids, L("None", "None"))
    assert x.shape == (2, 5) and len(x) == 2 and x.numel() == 10 and x.ndim == 2 and x.dim() == 2
    assert x.dtype == torch.long and x.device.type == "cpu" and x.layout == torch.strided
    emb = torch.randn(10, 4)
    y = (x + 1) * 2
    assert torch.equal(y.to_local(), (ids + 1) * 2)
    # plain tensors and scalars mix in as replicated values
    z = x.float() * torch.ones(5) + 0.5
    assert isinstance(z, DTensor) and torch.equal(z.full_tensor(), ids.float() + 0.5)
    del emb


def test_ops_needing_communication_fail_clearly_without_distributed():
    L = Layout((4, 2), ("dp", "tp"))
    x = DTensor.from_local(torch.ones(2, 2), L("dp", "None"))
    assert x.shape == (8, 2)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        x.full_tensor()


def test_missing_op_error_names_op_and_layouts():
    L = Layout((4, 2), ("dp", "tp"))
    x = DTensor.from_local(torch.ones(4, 4), L("None", "None"))
    with without_rule("torch.Tensor.unfold"):  # every op the models use has a rule: take one away
        with pytest.raises(hp.MissingOpError) as e:
            x.unfold(0, 2, 1)
        msg = str(e.value)
        assert "torch.Tensor.unfold" in msg and "('None', 'None')" in msg and "register_ops" in msg
        with hp.record_missing_ops() as rec:
            out = x.unfold(0, 2, 1)
    assert torch.equal(out.to_local(), torch.ones(4, 4).unfold(0, 2, 1))
    assert rec.counts["torch.Tensor.unfold"] == 1 and "test_layout.py" in rec.locations["torch.Tensor.unfold"]


def test_register_ops_and_duplicates(tmp_path):
    (tmp_path / "extra.yaml").write_text(
        "__default__:\n  rule: hyper_parallel.ops.elementwise.Elementwise\ntorch.Tensor.frac:\n")
    hp.register_ops(tmp_path)
    L = Layout((4, 2), ("dp", "tp"))
    x = DTensor.from_local(torch.tensor([1.5, 2.25]), L("None"))
    assert torch.equal(x.frac().to_local(), torch.tensor([0.5, 0.25]))
    (tmp_path / "dup.yaml").write_text("torch.Tensor.frac:\n  rule: hyper_parallel.ops.elementwise.Elementwise\n")
    with pytest.raises(ValueError, match="declared twice"):
        hp.register_ops(tmp_path / "dup.yaml")
    from hyper_parallel.dispatch import registry
    registry.unregister("torch.Tensor.frac")


def test_replicated_autograd_and_optimizer():
    L = Layout((4, 2), ("dp", "tp"))
    torch.manual_seed(0)
    w0, x0 = torch.randn(3, 3), torch.randn(3, 3)
    w = torch.nn.Parameter(DTensor.from_local(w0.clone(), L("None", "None")))
    assert isinstance(w, torch.nn.Parameter) and type(w) is DTensor and w.requires_grad and w.is_leaf
    y = (w * DTensor.from_local(x0, L("None", "None"))).exp()
    y.backward(torch.ones(3, 3))
    ref_w = w0.clone().requires_grad_()
    (ref_w * x0).exp().backward(torch.ones(3, 3))
    assert type(w.grad) is DTensor and w.grad.dist_layout is w.dist_layout
    assert torch.allclose(w.grad.to_local(), ref_w.grad)
    opt = torch.optim.SGD([w], lr=0.1)
    opt.step()
    assert torch.allclose(w.to_local(), w0 - 0.1 * ref_w.grad)


def test_generate_without_attention_mask():
    """generate() builds the mask itself (torch.isin on the ids): the requirement's flow with ids only."""
    from hyper_parallel.tools.models import build_model
    case = build_model("llama", seed=0)
    ids = case.inputs["input_ids"]
    want = case.model.generate(ids, max_new_tokens=3, do_sample=False)
    L = Layout((4, 2), ("dp", "tp"))
    got = case.model.generate(DTensor.from_local(ids, L("None", "None")), max_new_tokens=3, do_sample=False)
    assert torch.equal(got.to_local(), want)
