"""Expert parallel with images fed per rank (API §12): each "ep" rank feeds its own samples, their images' patch
rows and grids; the global batch's images are the ranks' images in the axis' order. Random images per sample
and grid sizes against one plain process on the concatenated batch; ranks whose shares differ in shape get the
same FeedError on every rank."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_multimodal_pp_ep import IMAGE, TOL, VEND, VSTART, _full, build

_GRIDS = [(1, 4, 4), (1, 4, 8), (1, 8, 4)]  # patch rows prod(grid); merged tokens prod(grid) / 4
_ROW = 3 * 2 * 4 * 4


def media_batch(samples: list, seq: int, seed: int) -> tuple[dict, torch.Tensor]:
    """(inputs, labels) of a batch whose sample i holds the images `samples[i]` (a list of grids), left-padded
    to `seq` tokens: ids, mask, the patch rows of every image concatenated in order, one grid row per image."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for images in samples:
        row = [int(t) for t in torch.randint(1, 100, (2,), generator=gen)]
        for grid in images:
            row += [VSTART] + [IMAGE] * (grid[1] * grid[2] // 4) + [VEND]
            grids.append(grid)
        row += [int(t) for t in torch.randint(1, 100, (3,), generator=gen)]
        assert len(row) <= seq, (len(row), seq)
        rows.append([0] * (seq - len(row)) + row)
    ids = torch.tensor(rows)
    mask = (torch.arange(seq) >= (seq - torch.tensor([[len([t for t in r if t]) ] for r in rows]))).long()
    pixels = torch.randn(sum(g[1] * g[2] for g in grids), _ROW, generator=gen)
    inputs = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).long(),
                  pixel_values=pixels, image_grid_thw=torch.tensor(grids, dtype=torch.long).reshape(-1, 3))
    labels = ids.clone()
    labels[(ids >= IMAGE) | (mask == 0)] = -100
    return inputs, labels


def _seq(shares: list) -> int:
    return max(5 + sum(g[1] * g[2] // 4 + 2 for g in images) for share in shares for images in share)


def _ep_step(rank, world, shares, seed):
    """Worker: this rank feeds shares[rank] under expert_parallel; loss and full gradients (or the error)."""
    import hyper_parallel as hp
    from hyper_parallel.parallel.feed import FeedError
    mesh = hp.init_device_mesh("cpu", (world,), ("ep",))
    model, _, _ = build("qwen3_vl_moe", layers=2)
    hp.expert_parallel(model, mesh, "ep")
    inputs, labels = media_batch(shares[rank], _seq(shares), seed + rank)
    try:
        loss = model(**inputs, labels=labels).loss
    except FeedError as e:
        return "FeedError", str(e)
    loss.backward()
    return _full(loss).item(), {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()
                                if p.grad is not None}


def _one_process(shares: list, seed: int):
    model, _, _ = build("qwen3_vl_moe", layers=2)
    parts = [media_batch(share, _seq(shares), seed + r) for r, share in enumerate(shares)]
    inputs = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
    loss = model(**inputs, labels=torch.cat([p[1] for p in parts])).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _shape_key(share: list) -> tuple:
    grids = [g for images in share for g in images]
    return len(share), len(grids), sum(g[1] * g[2] for g in grids)


images_per_sample = st.lists(st.sampled_from(_GRIDS), min_size=0, max_size=2)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(share=st.lists(images_per_sample, min_size=1, max_size=2).filter(lambda s: any(s)),
       order=st.permutations([0, 1, 2, 3]), mismatch=st.booleans(), seed=st.integers(0, 2**16))
def test_ep2_images_per_rank_property(dist2, share, order, mismatch, seed):
    """Rank 1 feeds rank 0's images reshuffled over its samples (same shapes, other grids per sample), or with
    `mismatch` one image more: equal to one process on the concatenated batch, or FeedError on both ranks."""
    flat = [g for images in share for g in images]
    flat = [flat[i] for i in order if i < len(flat)]
    other = [[] for _ in share]
    for i, g in enumerate(flat):
        other[(i * 7 + order[0]) % len(share)].append(g)
    if mismatch:
        other[0] = other[0] + [_GRIDS[0]]
    shares = [share, other]
    results = dist2.run(_ep_step, shares, seed)
    if _shape_key(share) != _shape_key(other):
        assert all(r[0] == "FeedError" and "different shapes over 'ep'" in r[1] for r in results), results
        return
    want_loss, want_grads = _one_process(shares, seed)
    for rank, (loss, grads) in enumerate(results):
        assert loss == pytest.approx(want_loss, abs=1e-5), (rank, loss, want_loss)
        assert set(grads) == set(want_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
