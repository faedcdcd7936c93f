"""Tensor-parallel plans found by structure, for what a model's own `tp_plan` leaves out (API §16).

transformers' plans are often empty or partial: Qwen3-VL's names only the embedding and the head, no model
names its vision or audio tower. `plan="auto"` adds, below the model's own entries, a Megatron plan for
every module that looks like one of these (by its children's names and shapes, not by class name):

- attention: Linear children q/k/v (`q_proj`/`k_proj`/`v_proj`, `query`/`key`/`value`) and an output
  projection (`o_proj`/`out_proj`/`proj`/`o`): q, k, v column-parallel, the output row-parallel, so that each
  rank computes whole heads. When the key/value heads do not divide over the ranks but the query heads do,
  k and v are replicated and q / o split (Megatron and vLLM do the same): the shapes a model sees are
  global, so its head counts need no change, and each rank's query heads meet the key/value heads they use.
  When the query heads do not divide, the attention stays replicated (the reason is recorded);
- a fused q/k/v projection (`qkv`, `qkv_proj`, `Wqkv`, `query_key_value`, `c_attn`) stays replicated with
  its output projection: a plain split of its rows would cut across q, k and v (the model reshapes it to
  (..., 3, heads, head_dim)), and a per-head split is not a layout one tensor dim can hold;
- MLP: `gate_proj`/`up_proj` -> `down_proj`, `w1`/`w3` -> `w2`, `fc1` -> `fc2`, `linear_fc1` -> `linear_fc2`,
  or a Sequential of exactly two Linear layers (a projector / merger): first column-parallel, last
  row-parallel, where the hidden size divides.

Values never depend on the choice (DTensor gives single-device semantics whatever the layout); the plan
only decides what each rank holds and computes. `notes` say what was left replicated and why (`summary`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .plan import path_matches

Q_NAMES, K_NAMES, V_NAMES = ("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")
O_NAMES = ("o_proj", "out_proj", "proj", "o")
FUSED_QKV = ("qkv", "qkv_proj", "Wqkv", "query_key_value", "c_attn")
MLP_PAIRS = ((("gate_proj", "up_proj"), "down_proj"), (("w1", "w3"), "w2"), (("up_proj",), "down_proj"),
             (("fc1",), "fc2"), (("linear_fc1",), "linear_fc2"))


@dataclass
class StructurePlan:
    """Style entries by full module path, and what was left replicated and why (module path -> reason)."""

    styles: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = module._modules.get(name)
    return child if isinstance(child, nn.Linear) else None


def _first(module: nn.Module, names) -> tuple[str, nn.Linear] | tuple[None, None]:
    for n in names:
        child = _linear(module, n)
        if child is not None:
            return n, child
    return None, None


def _head_dim(module: nn.Module, q_out: int) -> int | None:
    """The attention's head size: its own `head_dim`, else its config's, else width / number of heads."""
    config = getattr(module, "config", None)
    for source in (module, config):
        hd = getattr(source, "head_dim", None)
        if isinstance(hd, int) and hd > 0:
            return hd
    for source in (module, config):
        for attr in ("num_heads", "num_attention_heads", "n_heads"):
            n = getattr(source, attr, None)
            if isinstance(n, int) and n > 0 and q_out % n == 0:
                return q_out // n
    return None


def _attention(path: str, module: nn.Module, tp: int, out: StructurePlan) -> bool:
    qn, q = _first(module, Q_NAMES)
    kn, k = _first(module, K_NAMES)
    vn, v = _first(module, V_NAMES)
    on, o = _first(module, O_NAMES)
    if q is None or k is None or v is None or o is None:
        return False
    hd = _head_dim(module, q.out_features)
    if hd is None or q.out_features % hd or k.out_features % hd:
        out.notes[path] = "attention left replicated: its head size is not known (no head_dim / num_heads)"
        return True
    heads, kv_heads = q.out_features // hd, k.out_features // hd
    if heads % tp:
        out.notes[path] = (f"attention left replicated: its {heads} query heads do not divide over {tp} "
                           f"tensor-parallel ranks")
        return True
    full = f"{path}." if path else ""
    out.styles[full + qn] = "colwise"
    out.styles[full + on] = "rowwise"
    if kv_heads % tp == 0 and v.out_features % tp == 0:
        out.styles[full + kn] = out.styles[full + vn] = "colwise"
    else:
        out.notes[path] = (f"{kn}/{vn} replicated: {kv_heads} key/value heads do not divide over {tp} ranks "
                           f"(query heads {heads} split, as Megatron does)")
    return True


def _mlp(path: str, module: nn.Module, tp: int, out: StructurePlan) -> bool:
    full = f"{path}." if path else ""
    for ins, down_name in MLP_PAIRS:
        down = _linear(module, down_name)
        ups = [_linear(module, n) for n in ins]
        if down is None or any(u is None for u in ups):
            continue
        if any(u.out_features != down.in_features for u in ups):
            continue
        if down.in_features % tp:
            out.notes[path] = f"MLP left replicated: its hidden size {down.in_features} does not divide over {tp} ranks"
            return True
        for n in ins:
            out.styles[full + n] = "colwise"
        out.styles[full + down_name] = "rowwise"
        return True
    if isinstance(module, nn.Sequential):
        linears = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Linear)]
        if len(linears) == 2 and len(module) <= 3 and linears[0][1].out_features == linears[1][1].in_features:
            (un, up), (dn, _) = linears
            if up.out_features % tp:
                out.notes[path] = f"projector left replicated: its hidden size {up.out_features} does not divide over {tp} ranks"
                return True
            out.styles[full + un], out.styles[full + dn] = "colwise", "rowwise"
            return True
    return False


def structure_plan(model: nn.Module, tp: int, covered: dict | None = None) -> StructurePlan:
    """The by-structure plan of `model` for `tp` ranks, leaving out modules that `covered` (the model's own
    style plan: path pattern -> style) already names, or that lie inside them (experts modules)."""
    out = StructurePlan()
    covered = covered or {}
    prefix = getattr(model, "base_model_prefix", "")
    patterns = list(covered) + ([f"{prefix}.{k}" for k in covered] if prefix else [])

    def taken(path: str) -> bool:
        parts = path.split(".")
        return any(path_matches(p, ".".join(parts[:i])) for p in patterns for i in range(1, len(parts) + 1))

    for path, module in model.named_modules():
        if not module._modules or taken(path):
            continue
        fused = next((n for n in FUSED_QKV if _linear(module, n) is not None), None)
        if fused is not None and _first(module, O_NAMES)[1] is not None:
            out.notes[path] = (f"attention left replicated: its fused {fused} projection would be split across "
                               f"q, k and v by a row split (the model reshapes it to (..., 3, heads, head_dim))")
            continue
        if _attention(path, module, tp, out):
            continue
        _mlp(path, module, tp, out)
    # an entry the model's own plan names (e.g. its q_proj under a covered layer pattern) stays the model's
    out.styles = {k: v for k, v in out.styles.items() if not taken(k)}
    return out


__all__ = ["StructurePlan", "structure_plan"]
