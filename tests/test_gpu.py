"""The single-card scenario on a CUDA GPU (run by scripts/gpu_check.sh): world-size-1 meshes, the census,
fused AdamW, sdpa's CUDA kernels, bf16 compute; always against the same computation on plain CUDA tensors.

Without a GPU these tests skip (reason: no CUDA device); with HP_REQUIRE_CUDA=1 (set by gpu_check.sh) a
missing GPU is a failure instead, so the check cannot pass by skipping.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp

if not torch.cuda.is_available():
    if os.environ.get("HP_REQUIRE_CUDA") == "1":
        raise RuntimeError(f"HP_REQUIRE_CUDA=1 but torch {torch.__version__} sees no CUDA device "
                           f"(torch.version.cuda={torch.version.cuda}): install the CUDA wheel of torch")
    pytestmark = pytest.mark.skip(reason="no CUDA device")

DEV = "cuda"


def _one_rank(t: torch.Tensor, dims: tuple = ()) -> hp.DTensor:
    """`t` as a DTensor on a 1-rank mesh, split on `dims` (a split over one rank: the decision path)."""
    layout = hp.Layout((1,), ("x",))
    names = ["x" if d in dims else "None" for d in range(t.ndim)]
    return hp.distribute_tensor(t, layout(*names))


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_and_grads_on_a_one_rank_mesh_equal_plain(dtype):
    """linear, layer norm, softmax, sdpa (flash / efficient kernels on CUDA), cross entropy, and their grads."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(2, 4, 16, 32, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(32, 32, device=DEV, dtype=dtype, generator=g)
    target = torch.randint(0, 32, (2 * 4 * 16,), device=DEV, generator=g)

    def run(x, w):
        h = F.layer_norm(F.linear(x, w), (32,))
        a = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return F.cross_entropy(a.reshape(-1, 32).float(), target)

    plain = [t.clone().requires_grad_() for t in (x, w)]
    ours = [_one_rank(t.clone(), dims).requires_grad_() for t, dims in ((x, (0,)), (w, ()))]
    want, got = run(*plain), run(*ours)
    want.backward()
    got.backward()
    assert torch.equal(_full(got), want)
    for p, o in zip(plain, ours):
        assert torch.equal(_full(o.grad), p.grad)


def test_cuda_fused_adamw_on_dtensor_params_equals_plain():
    torch.manual_seed(0)
    plain = [torch.randn(16, 8, device=DEV, requires_grad=True) for _ in range(3)]
    ours = [torch.nn.Parameter(_one_rank(p.detach().clone(), (0,))) for p in plain]
    opts = [torch.optim.AdamW(ps, lr=1e-2, fused=True) for ps in (plain, ours)]
    for step in range(3):
        grads = [torch.randn_like(p) for p in plain]
        for p, o, g in zip(plain, ours, grads):
            p.grad = g.clone()
            o.grad = _one_rank(g.clone(), (0,))
        for opt in opts:
            opt.step()
    for p, o in zip(plain, ours):
        assert torch.equal(_full(o).detach(), p.detach())


def test_cuda_single_card_census_equals_plain():
    """The requirement's single-card flow (inputs and parameters as DTensors replicated on a mesh) on CUDA."""
    from hyper_parallel.tools.census import run_census
    with torch.device(DEV):
        report = run_census(["llama", "qwen3", "qwen3_moe", "bert"], "all", max_new_tokens=3, record=False)
    bad = [f"{r.model}/{r.mode}: {r.error.splitlines()[-1] if r.error else r.detail}" for r in report.runs
           if not r.ok]
    assert len(report.runs) == 8 and not bad, bad


def test_cuda_bf16_training_step_on_a_one_rank_mesh_equals_plain():
    """A tiny Llama in bf16 on CUDA: forward, backward and a fused AdamW step, replicated DTensor params."""
    from tests.test_workflow import tiny
    rows = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3)).to(DEV)
    plain = tiny("llama").to(DEV, torch.bfloat16)
    from hyper_parallel.tools.census import distribute_parameters
    ours = distribute_parameters(tiny("llama").to(DEV, torch.bfloat16), _one_rank)
    losses = []
    for model in (plain, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        opt.step()
        losses.append(_full(loss).item())
    assert losses[0] == losses[1]
    for (n, p), (_, o) in zip(plain.named_parameters(), ours.named_parameters()):
        assert torch.equal(_full(o).detach(), p.detach()), n


def test_cuda_bf16_policy_equals_bf16_parameters():
    """hsdp's bf16 mixed precision on one GPU: compute in bf16 from fp32 masters, as the model in bf16."""
    from tests.test_hsdp_mixed import bf16_policy_equals_bf16_parameters
    bf16_policy_equals_bf16_parameters(DEV, "level3")
