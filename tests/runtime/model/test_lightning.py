"""MiniMax's lightning attention (runtime/model/lightning_attention.py) against its definition and transformers' own
module, and the released MiniMax config names.

The definition, per head h: S_t = exp(-s_h) S_{t-1} + k_t^T v_t, o_t = q_t S_t, with q, k, v = SiLU(x W_qkv) split
per head, then one RMSNorm (eps 1e-6) over all heads' outputs, a sigmoid gate of the input and out_proj; s_h =
(2^(-8/H))^(h+1) (1 - i / (L - 1 + 1e-5) + 1e-5) for layer i of L. Written out below in float64, token by token."""
import pytest
import torch

from conftest import hf_config
from helpers import require
from runtime.model.config import MoEConfig
from runtime.model.lightning_attention import CHUNK, LightningAttention, LightningConfig
from runtime.model.linear_attention import LinearAttentionState

transformers = require("transformers", "the test-only reference")

H, D, HID = 4, 8, 32


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3            # noqa: E731
    return {"qkv_proj.weight": r(3 * H * D, HID), "output_gate.weight": r(H * D, HID),
            "norm.weight": 1 + r(H * D), "out_proj.weight": r(HID, H * D)}


def _oracle(w, x, layer, layers, eps=1e-6):
    """The definition in float64, one token at a time. x: [T, hidden] -> y [T, hidden], S [H, D, D]."""
    w = {k: v.double() for k, v in w.items()}
    x = x.double()
    s = torch.tensor([(2 ** (-8 / H)) ** (h + 1) * (1 - layer / (layers - 1 + 1e-5) + 1e-5) for h in range(H)],
                     dtype=torch.float64)
    S = torch.zeros(H, D, D, dtype=torch.float64)
    ys = []
    for t in range(x.shape[0]):
        qkv = torch.nn.functional.silu(w["qkv_proj.weight"] @ x[t]).reshape(H, 3 * D)
        q, k, v = qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:]
        S = torch.exp(-s)[:, None, None] * S + k[:, :, None] * v[:, None, :]
        o = torch.einsum("hk,hkv->hv", q, S).reshape(-1)
        o = w["norm.weight"] * o / torch.sqrt((o * o).mean() + eps)
        ys.append(w["out_proj.weight"] @ (torch.sigmoid(w["output_gate.weight"] @ x[t]) * o))
    return torch.stack(ys), S


@pytest.mark.parametrize("layer", [0, 2])
def test_prefill_in_chunks_and_decode_follow_the_definition(layer):
    """150 tokens (three of the prefill's blocks of CHUNK) fed as 70 + 79 tokens, the state carried, then one decode
    token batched with a fresh sequence's: against the definition."""
    cfg = LightningConfig(hidden_size=HID, num_heads=H, head_dim=D, layer_index=layer, num_layers=3)
    w = _weights()
    layer_ = LightningAttention(cfg, w)
    x = torch.randn(150, HID, generator=torch.Generator().manual_seed(1))
    assert x.shape[0] > 2 * CHUNK
    want, S_want = _oracle(w, x, layer, 3)
    y1, st = layer_(x[:70])
    y2, st = layer_(x[70:149], st)
    R = torch.stack([st.recurrent, torch.zeros(H, D, D)])                   # R: [2, H, D, D]
    y3, S, _ = layer_.step(torch.stack([x[149], x[0]]), R, torch.zeros(2, 0, 0))
    got = torch.cat([y1, y2, y3[:1]])
    assert (got.double() - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert (S[0].double() - S_want).abs().max().item() < 1e-4 * S_want.abs().max().item()
    assert (y3[1].double() - want[0]).abs().max().item() < 1e-4 * want.abs().max().item()   # a fresh state: token 0


def test_equals_transformers_lightning_attention():
    """transformers' MiniMaxLightningAttention, its block form (blocks of 16) on 100 tokens, then its recurrent
    form on two more from the state it cached: ours with the same weights."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention
    c = hf_config("minimax")
    c.hidden_size, c.num_attention_heads, c.head_dim, c.block_size = HID, H, D, 16
    ref = MiniMaxLightningAttention(c, layer_idx=1).eval()
    w = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ours = LightningAttention(LightningConfig(hidden_size=HID, num_heads=H, head_dim=D, layer_index=1,
                                              num_layers=c.num_hidden_layers), w)
    x = torch.randn(1, 102, HID, generator=torch.Generator().manual_seed(2))
    cache = MiniMaxCache()
    with torch.no_grad():
        want = [ref(x[:, :100], None, None, cache=cache)[0]]
        want += [ref(x[:, t:t + 1], None, None, cache=cache)[0] for t in (100, 101)]
    want = torch.cat(want, 1)[0]
    y, st = ours(x[0, :100])
    ys = [y]
    R = st.recurrent[None]
    for t in (100, 101):
        y, R, _ = ours.step(x[0, t:t + 1], R, torch.zeros(1, 0, 0))
        ys.append(y)
    got = torch.cat(ys)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    assert torch.allclose(R[0], cache.get_linear_cache(1)[0], rtol=1e-4, atol=1e-5)


def test_released_config_names_read_as_transformers_names():
    """The release's attn_type_list (0 lightning, 1 softmax) and layernorm_*_alpha / _beta read as transformers'
    layer_types and *_factor fields; a pre-norm release (postnorm false) is refused by name."""
    d = hf_config("minimax").to_dict()
    released = {k: v for k, v in d.items() if k != "layer_types" and not k.endswith("_factor")}
    released.update(attn_type_list=[0, 1, 0], postnorm=True, layernorm_full_attention_alpha=1.5,
                    layernorm_full_attention_beta=0.8, layernorm_linear_attention_alpha=1.3,
                    layernorm_linear_attention_beta=0.9, layernorm_mlp_alpha=1.2, layernorm_mlp_beta=0.7)
    a, b = MoEConfig.from_dict(d), MoEConfig.from_dict(released)
    assert a == b and a.linear_layers == [0, 2] and a.residual_scales["ffn"] == (1.2, 0.7)
    with pytest.raises(ValueError, match="postnorm"):
        MoEConfig.from_dict({**released, "postnorm": False})


def test_state_shape_is_checked():
    layer_ = LightningAttention(LightningConfig(hidden_size=HID, num_heads=H, head_dim=D, layer_index=0,
                                                num_layers=2), _weights())
    with pytest.raises(ValueError, match="state must be"):
        layer_(torch.randn(3, HID), LinearAttentionState(torch.zeros(H, D, D + 1), torch.zeros(0, 0)))
    with pytest.raises(ValueError, match="missing tensor 'norm.weight'"):
        LightningAttention(layer_.cfg, {k: v for k, v in _weights().items() if k != "norm.weight"})
