"""The cache's tensors are allocated generically from what each layer's spec declares (``cache_tensors``):
checked against the specs' own byte formulas (``bytes_per_token`` / ``bytes_per_sequence``, written apart
from the declarations), per-layer isolation, state copies that move every per-sequence tensor and no
per-token one, and a clear error for a layer the cache does not hold."""
import pytest
import torch

from runtime.model.layers.cache import PagedKV, StateCacheSpec, TokenCacheSpec, WindowCacheSpec
from runtime.model.layers.v4_attention import CompressedCacheSpec

SPECS = {
    0: StateCacheSpec(recurrent=(2, 4, 4), conv=(24, 3)),                 # KDA / Gated DeltaNet
    1: TokenCacheSpec(2, 8),                                             # GQA
    2: StateCacheSpec(recurrent=(2, 4, 4), conv=(24, 3)),                 # same spec as layer 0: one group
    3: WindowCacheSpec(2, 8, 5),                                         # sliding window
    4: TokenCacheSpec(1, 12, with_v=False),                              # MLA: latent + rotary key
    5: CompressedCacheSpec(8, 4, 4, 16, 6, True),                        # DeepSeek-V4 CSA
    6: CompressedCacheSpec(8, 4),                                        # DeepSeek-V4 sliding
    7: TokenCacheSpec(2, 8),
}


def make(dtype=torch.float32, blocks=5, block_size=8, slots=3, snaps=2):
    return PagedKV(SPECS, dtype, torch.device("cpu"), num_blocks=blocks, block_size=block_size, state_slots=slots,
                   snapshots=snaps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_match_the_specs_formulas(dtype):
    kv = make(dtype)
    per_tok = sum(s.bytes_per_token(dtype) for s in SPECS.values() if hasattr(s, "bytes_per_token"))
    per_seq = sum(s.bytes_per_sequence(dtype) for s in SPECS.values() if hasattr(s, "bytes_per_sequence"))
    assert kv.nbytes == 5 * 8 * per_tok + (3 + 2) * per_seq
    # equal specs share one allocation: 6 distinct specs, layers 0 / 2 and 1 / 7 grouped
    assert sorted(m for _, m, _ in kv.groups) == [[0, 2], [1, 7], [3], [4], [5], [6]]
    assert kv[0].recurrent.dtype == torch.float32 and kv[0].conv.dtype == dtype   # recurrent state stays float32
    assert kv[1].k.shape == (5 * 8, 2, 8) and kv[3].k.shape == (5, 5, 2, 8)
    assert kv[5].comp.shape == (5 * 8 // 4, 8) and kv[5].icomp.shape == (5 * 8 // 4, 6)
    with pytest.raises(AttributeError, match="no cache tensor 'v'"):
        kv[4].v                                                          # MLA caches no v


def test_layers_do_not_share_rows():
    kv = make()
    kv[0].recurrent.fill_(1.0)
    kv[1].k.fill_(2.0)
    assert kv[2].recurrent.abs().sum() == 0 and kv[7].k.abs().sum() == 0
    assert kv[0].recurrent.data_ptr() != kv[2].recurrent.data_ptr()


def test_copy_state_moves_every_per_sequence_tensor_and_no_per_token_one():
    kv = make()
    g = torch.Generator().manual_seed(0)
    slot_names = {i: set(c.slot_tensors()) for i, c in kv.layers.items()}
    assert slot_names[0] == {"recurrent", "conv"} and slot_names[3] == {"k", "v"} and not slot_names[1]
    assert slot_names[5] >= {"ring", "buf_kv", "ibuf_kv"} and "comp" not in slot_names[5]
    for c in kv.layers.values():
        for t in c.tensors.values():
            t.copy_(torch.randn(t.shape, generator=g))
    before = {(i, n): t.clone() for i, c in kv.layers.items() for n, t in c.tensors.items()}
    kv.copy_state(1, 4)                                                 # a running slot into a snapshot slot
    for i, c in kv.layers.items():
        for n, t in c.tensors.items():
            old = before[(i, n)]
            if n in slot_names[i]:
                assert torch.equal(t[4], old[1]) and torch.equal(t[[0, 1, 2, 3]], old[[0, 1, 2, 3]]), (i, n)
            else:
                assert torch.equal(t, old), (i, n)                      # per-token rows are the blocks'


def test_a_layer_it_does_not_hold_is_named():
    kv = PagedKV({2: TokenCacheSpec(1, 4)}, torch.float32, torch.device("cpu"), num_blocks=1)
    with pytest.raises(KeyError, match=r"layer 0 has no cache here \(this cache holds layers \[2\]\)"):
        kv[0]


def test_state_layers_need_a_slot_and_blocks_fit_the_rate():
    with pytest.raises(ValueError, match="at least one sequence slot"):
        PagedKV({0: SPECS[0]}, torch.float32, torch.device("cpu"), num_blocks=2)
    with pytest.raises(ValueError, match="rate 4 does not fit blocks of 6 tokens"):
        PagedKV({0: SPECS[5]}, torch.float32, torch.device("cpu"), num_blocks=2, block_size=6, state_slots=1)
    kv = PagedKV({0: TokenCacheSpec(1, 4)}, torch.float32, torch.device("cpu"), num_blocks=2, state_slots=4)
    assert kv.state_slots == 0                                           # nothing per sequence: no slot is kept
