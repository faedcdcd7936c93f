"""Optimizer state for checkpoints: make a fresh optimizer's state exist so it can be loaded into."""
from __future__ import annotations

import torch


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the per-parameter state (exp_avg, ... laid out like the params) without changing a param.

    A fresh torch optimizer has no state until its first step, so `opt.state_dict()` has nothing to
    fill. This runs one step with zero gradients and lr=0 (parameters stay bit-identical), then
    clears the gradients; the state it creates is overwritten by `load`. No-op if state exists.
    Every parameter with requires_grad must have `.grad is None`.
    """
    if optimizer.state:
        return optimizer
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                if p.grad is not None:
                    raise ValueError("init_optimizer_state: gradients are already set; call it before training")
                p.grad = torch.zeros_like(p)
    saved_lr = []
    for group in optimizer.param_groups:
        saved_lr.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lr):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def apply_optimizer_state(optimizer: torch.optim.Optimizer, optim_state: dict) -> torch.optim.Optimizer:
    """Finish loading `optim_state` (a filled `optimizer.state_dict()`) into `optimizer`.

    `load` already filled the state tensors in place, since `state_dict()` hands out the optimizer's
    own tensors; what is left are the param-group hyperparameters (lr, betas, ...), set here. No
    tensor is copied or re-laid-out. If `optim_state` holds other tensor objects than the
    optimizer's own, this falls back to `optimizer.load_state_dict(optim_state)`.
    """
    groups = optim_state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the loaded state has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    own = len(ids) == len(params) and all(
        optimizer.state.get(params[ids.index(k)], {}).get(name) is value
        for k, st in optim_state["state"].items() for name, value in st.items() if isinstance(value, torch.Tensor))
    if not own:
        optimizer.load_state_dict(optim_state)
        return optimizer
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    return optimizer
