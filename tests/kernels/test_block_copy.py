"""Block gather/scatter/copy-on-write move exactly the right rows, all layers in one launch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels import block_copy as bc  # noqa: E402
from kernels.kv_cache import allocate_layers  # noqa: E402
from kernels.paged_decode import make_inputs as decode_inputs  # noqa: E402
from kernels.paged_decode import paged_decode  # noqa: E402
from kernels.testing import interpreter  # noqa: E402

INTERP = interpreter()


@pytest.mark.parametrize("layers,rows,row_bytes,moved", [(1, 9, 48, 4), (3, 10, 4112, 5)])
def test_gather_scatter_copy_match_reference(layers, rows, row_bytes, moved, device):
    inputs = bc.make_inputs(rows, row_bytes, moved, num_layers=layers, device=device)
    pool, ids, mapping = inputs["pool"], inputs["block_ids"], inputs["block_mapping"]
    staging = bc.gather_blocks(pool, ids)
    assert torch.equal(staging, bc.gather_blocks_ref(pool, ids))
    want = pool.clone()
    bc.scatter_blocks_ref(want, ids, staging.flip(-2))
    bc.scatter_blocks(pool, ids, staging.flip(-2).contiguous())
    assert torch.equal(pool, want)
    bc.copy_blocks_ref(want, mapping)
    bc.copy_blocks(pool, mapping)
    assert torch.equal(pool, want)
    one_layer = pool[0]
    bc.copy_blocks(one_layer, mapping.flip(1)[:1].contiguous())  # 2-D pool: one layer
    assert torch.equal(one_layer[mapping[0, 0]], one_layer[mapping[0, 1]])


def test_swap_out_and_in_restores_a_cache(device):
    inputs = decode_inputs("kvquant4/5.0%", 2, 21, 1, 40, num_q_heads=4, block_size=8, device=device)
    cache = inputs["cache"]
    before = paged_decode(**inputs)
    used = inputs["block_tables"].flatten()
    host = torch.empty(len(used), cache.spec.row_bytes, dtype=torch.uint8, pin_memory=not INTERP)
    bc.swap_out(cache.pool, used, host, non_blocking=False)
    cache.pool.zero_()
    bc.swap_in(cache.pool, used.flip(0).contiguous(), host.flip(0).contiguous())
    assert torch.equal(paged_decode(**inputs), before)


def test_layered_pool_moves_every_layer(device):
    pool, caches = allocate_layers("int4/g32", 3, 6, 4, 2, 64, device)
    for layer, cache in enumerate(caches):
        cache.k.data.fill_(layer + 1)
    bc.copy_blocks(pool, torch.tensor([[1, 4]], device=device))
    assert all(bool((c.k.data[4] == i + 1).all()) for i, c in enumerate(caches))


def test_block_copy_rejects_bad_inputs(device):
    pool = torch.zeros(4, 32, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="pool must be uint8"):
        bc.gather_blocks(pool.float(), torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="row_bytes must be a multiple of 16, got 24"):
        bc.gather_blocks(pool[:, :24].contiguous(), torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="block_ids must be a 1-D int32/int64"):
        bc.gather_blocks(pool, torch.tensor([[1]], device=device))
    with pytest.raises(ValueError, match=r"block_mapping must be \[n, 2\]"):
        bc.copy_blocks(pool, torch.tensor([1, 2], device=device))
    with pytest.raises(ValueError, match=r"staging must be \[2, 32\]"):
        bc.scatter_blocks(pool, torch.tensor([0, 1], device=device), pool[:3].clone())
    with pytest.raises(ValueError, match="pool must be contiguous"):
        bc.gather_blocks(pool.t(), torch.tensor([1], device=device))
