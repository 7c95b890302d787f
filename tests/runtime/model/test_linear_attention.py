"""The linear-attention layers (runtime/model/linear_attention.py) against transformers' own layer modules.

References: ``KimiLinearDeltaAttention`` (kimi_linear) and ``Qwen3NextGatedDeltaNet`` (qwen3_next), instantiated
directly from tiny configs. transformers runs its torch fallbacks, forced by this folder's conftest (torch_fallbacks)
also where the ``fla`` / ``causal_conv1d`` packages are installed
(chunk_kimi_delta_attention / recurrent_kimi_delta_attention, torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule, causal_conv1d_fn / causal_conv1d_update), which is what these tests compare with.
Everything is float32 on CPU and tiny."""
import pytest
import torch

from helpers import require

transformers = require("transformers", "the test-only reference")

from runtime.model.linear_attention import (  # noqa: E402
    GatedDeltaNet,
    GatedDeltaNetConfig,
    KDAConfig,
    KimiDeltaAttention,
    LinearAttentionState,
    gdn_state_bytes,
    kda_state_bytes,
    state_bytes,
)

HIDDEN, PROMPT = 64, 37  # 37: not a multiple of the chunk size (and > 2 chunks of 16 below)
LONG = 70                # > one chunk of 64: transformers' own chunk loop carries a state too


# ----------------------------------------------------------------------------------------------------------------
# Reference modules with random weights
# ----------------------------------------------------------------------------------------------------------------

def _kimi_module(seed=0):
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    hf_cfg = KimiLinearConfig(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
                              layer_types=["linear_attention"], mlp_layer_types=["dense"], rms_norm_eps=1e-5,
                              num_local_experts=4, num_experts_per_tok=2, pad_token_id=None, bos_token_id=None,
                              eos_token_id=None)
    torch.manual_seed(seed)
    mod = mk.KimiLinearDeltaAttention(hf_cfg, layer_idx=0).float().eval()
    H, K = 2, 16
    with torch.no_grad():
        fg = mod.forget_gate
        # A_log / dt_bias are torch.empty in __init__ (set by _init_weights only in a full model): give moderate decays
        # (exp(g) ~ 0.5..0.99) so the state carries across chunk boundaries and the test sees it.
        fg.A_log.copy_(torch.empty(1, 1, H, 1).uniform_(0.05, 1.0).log())
        fg.dt_bias.copy_(torch.randn(H * K) * 0.5 - 2.0)
        mod.o_norm.weight.copy_(1.0 + 0.2 * torch.randn(K))
        mod.conv1d.weight.mul_(2.0)  # default init is +-1/sqrt(W): make the conv matter
    cfg = KDAConfig(hidden_size=HIDDEN, num_heads=H, head_dim=K, conv_kernel_size=4, rms_norm_eps=1e-5)
    return hf_cfg, mod, cfg


def _qwen_module(seed=0):
    from transformers.models.qwen3_next import modeling_qwen3_next as mq
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    hf_cfg = Qwen3NextConfig(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention"], rms_norm_eps=1e-6, num_experts=4,
                             num_experts_per_tok=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    mod = mq.Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).float().eval()
    Hv, Dv = 4, 8
    with torch.no_grad():
        mod.A_log.copy_(torch.empty(Hv).uniform_(0.05, 1.0).log())
        mod.dt_bias.copy_(torch.randn(Hv) * 0.5 - 2.0)
        mod.norm.weight.copy_(1.0 + 0.2 * torch.randn(Dv))
        mod.conv1d.weight.mul_(2.0)
    cfg = GatedDeltaNetConfig(hidden_size=HIDDEN, num_k_heads=2, num_v_heads=Hv, head_k_dim=16, head_v_dim=Dv,
                              conv_kernel_size=4, rms_norm_eps=1e-6)
    return hf_cfg, mod, cfg


def _ours(kind, mod, cfg):
    weights = {n: t.detach().clone() for n, t in mod.state_dict().items()}
    return (KimiDeltaAttention if kind == "kda" else GatedDeltaNet)(cfg, weights), weights


def _kimi_released_names(weights, qkv_dim):
    """transformers' module names -> the released Kimi-Linear checkpoint names (the reverse of its conversion
    mapping: forget-gate tensors at the top level, one conv per q / k / v)."""
    out = {}
    for n, t in weights.items():
        if n.startswith("forget_gate."):
            out[n[len("forget_gate."):]] = t
        elif n == "conv1d.weight":
            for i, p in enumerate("qkv"):
                out[f"{p}_conv1d.weight"] = t[i * qkv_dim:(i + 1) * qkv_dim]
        else:
            out[n] = t
    return out


KINDS = ["kda", "gdn"]


def _setup(kind, seed=0):
    hf_cfg, mod, cfg = (_kimi_module if kind == "kda" else _qwen_module)(seed)
    layer, weights = _ours(kind, mod, cfg)
    torch.manual_seed(100 + seed)
    x = torch.randn(LONG, HIDDEN)
    return hf_cfg, mod, cfg, layer, weights, x


# ----------------------------------------------------------------------------------------------------------------
# Against transformers
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [PROMPT, LONG])
def test_prefill_matches_transformers(kind, n):
    import dataclasses

    _, mod, cfg, layer, weights, x = _setup(kind)
    xp = x[:n]
    with torch.no_grad():
        ref = mod(xp[None])[0]                      # no cache: transformers' chunked torch path over the prompt
    assert ref.abs().mean() > 1e-2                  # the comparison is not between near-zero tensors
    # chunk 16: several chunks and a short last one on our side, whatever transformers' chunking
    small = (KimiDeltaAttention if kind == "kda" else GatedDeltaNet)(dataclasses.replace(cfg, chunk_size=16), weights)
    for lay, mode in ((layer, "chunked"), (small, "chunked"), (layer, "recurrent")):
        y, _ = lay(xp, mode=mode)
        err = (y - ref).abs().max().item()
        assert err < 1e-4, (kind, mode, lay.cfg.chunk_size, err)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_after_prefill_matches_transformers(kind):
    from transformers.cache_utils import DynamicCache

    hf_cfg, mod, cfg, layer, _, x = _setup(kind)
    with torch.no_grad():
        cache = DynamicCache(config=hf_cfg)
        mod(x[None, :PROMPT], cache=cache)              # prefill fills the conv / recurrent states
        ref_step = mod(x[None, PROMPT:PROMPT + 1], cache=cache)[0]  # single-token path: causal_conv1d_update + recurrent rule
        ref_full = mod(x[None, :PROMPT + 1])[0, -1:]    # and the same token from a cache-less full pass
    _, st = layer(x[:PROMPT])                           # our chunked prefill
    y, st2 = layer(x[PROMPT:PROMPT + 1], st)            # our recurrent step from its state
    assert (y - ref_step).abs().max().item() < 1e-4
    assert (y - ref_full).abs().max().item() < 1e-4
    # the states themselves: transformers keeps W conv inputs per channel, we keep the last W-1
    rec = cache.layers[0].recurrent_states[0][0]
    conv = cache.layers[0].conv_states[0][0]
    assert (st2.recurrent - rec).abs().max().item() < 1e-4
    assert torch.allclose(st2.conv, conv[:, 1:], atol=1e-6)


def test_kda_released_checkpoint_names():
    _, mod, cfg, layer, weights, x = _setup("kda")
    released = _kimi_released_names(weights, cfg.qkv_dim)
    assert "q_conv1d.weight" in released and "A_log" in released and "conv1d.weight" not in released
    y1, s1 = layer(x[:PROMPT])
    y2, s2 = KimiDeltaAttention(cfg, released)(x[:PROMPT])
    assert torch.equal(y1, y2) and torch.equal(s1.recurrent, s2.recurrent) and torch.equal(s1.conv, s2.conv)


def test_gdn_qwen35_unfused_layout():
    """The same layer with the Qwen3.5 projection layout (in_proj_qkv / z / b / a, flat) built from the Qwen3-Next
    grouped one must give the same output."""
    _, mod, cfg, layer, weights, x = _setup("gdn")
    Hk, Hv, Dk, Dv, D = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.hidden_size
    r = Hv // Hk
    qkvz = weights["in_proj_qkvz.weight"].reshape(Hk, 2 * Dk + 2 * r * Dv, D)
    wq, wk, wv, wz = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
    wb, wa = weights["in_proj_ba.weight"].reshape(Hk, 2 * r, D).split([r, r], dim=1)
    flat = {n: t for n, t in weights.items() if not n.startswith("in_proj")}
    flat["in_proj_qkv.weight"] = torch.cat([wq.reshape(-1, D), wk.reshape(-1, D), wv.reshape(-1, D)])
    flat["in_proj_z.weight"] = wz.reshape(-1, D)
    flat["in_proj_b.weight"] = wb.reshape(-1, D)
    flat["in_proj_a.weight"] = wa.reshape(-1, D)
    y1, _ = layer(x[:PROMPT])
    y2, _ = GatedDeltaNet(cfg, flat)(x[:PROMPT])
    assert torch.allclose(y1, y2, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Forms and state carrying (our code against itself)
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_chunked_equals_recurrent_and_splits_compose(kind):
    _, _, cfg, _, weights, x = _setup(kind)
    import dataclasses
    small = dataclasses.replace(cfg, chunk_size=16)     # 37 tokens = 16 + 16 + 5: three chunks, a short last one
    layer = (KimiDeltaAttention if kind == "kda" else GatedDeltaNet)(small, weights)
    xp = x[:PROMPT]
    y_c, s_c = layer(xp, mode="chunked")
    y_r, s_r = layer(xp, mode="recurrent")
    assert (y_c - y_r).abs().max().item() < 1e-5
    assert (s_c.recurrent - s_r.recurrent).abs().max().item() < 1e-5
    assert torch.equal(s_c.conv, s_r.conv)
    # token by token, each call with mode auto (-> recurrent for one token)
    st, ys = None, []
    for t in range(PROMPT):
        y, st = layer(xp[t:t + 1], st)
        ys.append(y)
    assert (torch.cat(ys) - y_c).abs().max().item() < 1e-5
    # chunked prefill split in two calls (cut inside a chunk, and shorter than the conv kernel) with the state carried
    for cut in (21, 2):
        y1, s1 = layer(xp[:cut], mode="chunked")
        y2, s2 = layer(xp[cut:], s1, mode="chunked")
        assert (torch.cat([y1, y2]) - y_c).abs().max().item() < 1e-5
        assert (s2.recurrent - s_c.recurrent).abs().max().item() < 1e-5
        assert torch.equal(s2.conv, s_c.conv)


@pytest.mark.parametrize("kind", KINDS)
def test_state_is_not_mutated(kind):
    _, _, _, layer, _, x = _setup(kind)
    _, st = layer(x[:5])
    rec, conv = st.recurrent.clone(), st.conv.clone()
    layer(x[5:9], st)
    layer(x[5:6], st)
    assert torch.equal(st.recurrent, rec) and torch.equal(st.conv, conv)


def test_strong_decay_is_finite():
    """Large A and dt: per-chunk cumulative log decays reach -1e3; the chunked form must stay finite and agree."""
    _, mod, cfg, _, weights, x = _setup("kda")
    weights = dict(weights)
    weights["forget_gate.dt_bias"] = torch.full_like(weights["forget_gate.dt_bias"], 4.0)
    weights["forget_gate.A_log"] = torch.full_like(weights["forget_gate.A_log"], 16.0).log()
    layer = KimiDeltaAttention(cfg, weights)
    y_c, s_c = layer(x[:PROMPT], mode="chunked")
    y_r, _ = layer(x[:PROMPT], mode="recurrent")
    assert torch.isfinite(y_c).all() and torch.isfinite(s_c.recurrent).all()
    assert (y_c - y_r).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Validation and sizes
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_missing_weight_names_the_tensor(kind):
    _, _, cfg, _, weights, _ = _setup(kind)
    cls = KimiDeltaAttention if kind == "kda" else GatedDeltaNet
    w = {n: t for n, t in weights.items() if n != "conv1d.weight"}
    name = "q_conv1d.weight" if kind == "kda" else "conv1d.weight"   # KDA then looks for the released names
    with pytest.raises(ValueError, match=name):
        cls(cfg, w)
    w = {n: t for n, t in weights.items() if n != "o_proj.weight" and n != "out_proj.weight"}
    with pytest.raises(ValueError, match="o_proj.weight" if kind == "kda" else "out_proj.weight"):
        cls(cfg, w)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_shape_names_tensor_and_shapes(kind):
    _, _, cfg, _, weights, _ = _setup(kind)
    cls = KimiDeltaAttention if kind == "kda" else GatedDeltaNet
    name = "b_proj.weight" if kind == "kda" else "in_proj_ba.weight"
    good = tuple(weights[name].shape)
    w = dict(weights)
    w[name] = torch.zeros(good[0] + 1, good[1])
    with pytest.raises(ValueError) as e:
        cls(cfg, w)
    msg = str(e.value)
    assert name in msg and str((good[0] + 1, good[1])) in msg and str(good) in msg


@pytest.mark.parametrize("kind", KINDS)
def test_bad_state_and_input_rejected(kind):
    _, _, _, layer, _, x = _setup(kind)
    _, st = layer(x[:3])
    with pytest.raises(ValueError, match="state.conv"):
        layer(x[3:4], LinearAttentionState(recurrent=st.recurrent, conv=st.conv[:, 1:]))
    with pytest.raises(ValueError, match="tokens"):
        layer(x[None, :3])
    with pytest.raises(ValueError, match="mode"):
        layer(x[:3], mode="parallel")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_match_returned_state(kind, dtype):
    _, _, cfg, layer, _, x = _setup(kind)
    _, st = layer(x[:3].to(dtype))
    assert st.recurrent.dtype == torch.float32 and st.conv.dtype == dtype
    nbytes = st.recurrent.numel() * st.recurrent.element_size() + st.conv.numel() * st.conv.element_size()
    fn = kda_state_bytes if kind == "kda" else gdn_state_bytes
    assert fn(cfg, dtype) == nbytes == st.nbytes() == state_bytes(cfg, dtype)
    assert layer.init_state(dtype).nbytes() == nbytes
