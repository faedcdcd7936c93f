"""Context parallelism (`context_parallel`): whole models on 2 and 4 real processes against one plain process."""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import hyper_parallel as hp
from hyper_parallel.parallel.context.ring import Visibility, block_forward, merge

SEQ, BATCH, VOCAB = 16, 2, 96


def _model(name: str, attn: str = "sdpa"):
    """Tiny Llama (4 heads) or Qwen3 (8 query heads over 4 key/value heads: GQA); no dropout."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
    config = (LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common) if name == "llama"
              else Qwen3Config(num_attention_heads=8, num_key_value_heads=4, head_dim=8, **common))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


def _batch(padded: bool):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 3] = labels[1, 7] = -100
    mask = torch.ones_like(ids)
    if padded:  # right padding of the second row, as tokenizers pad for training
        mask[1, -5:] = 0
        ids[1, -5:] = 0
        labels[1, -5:] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _check_model(mesh, name, method, padded, attn="sdpa", shard_tp=False):
    model = _model(name, attn)
    ref = copy.deepcopy(model)
    if shard_tp:
        hp.shard(model, "auto", mesh)
    hp.context_parallel(model, mesh, "cp", method)
    batch = _batch(padded)
    out = model(**batch)
    out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    where = f"{name}/{method}/padded={padded}/{attn}"
    assert torch.allclose(_full(out.logits), want.logits, atol=1e-5), where
    assert torch.allclose(_full(out.loss), want.loss, atol=1e-5), where
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(_full(p.grad), r.grad, atol=1e-5), f"{where}: grad of {n}"


def _every_method(rank, world):
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for name in ("llama", "qwen3"):
        for method in ("ring", "ulysses", "allgather"):
            _check_model(mesh, name, method, padded=method != "allgather" or name == "llama")
    _check_model(mesh, "llama", "ring", padded=False, attn="eager")
    return True


def test_every_method_on_two_ranks(dist2):
    dist2.run(_every_method)


def test_every_method_on_four_ranks(dist4):
    dist4.run(_every_method)
