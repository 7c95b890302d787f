"""Block Attention Residuals (Block AttnRes, arXiv 2603.15031; Kimi K3's residual stream).

A plain residual stream adds every sublayer's output with weight 1: the input of sublayer l is
``x_0 + o_1 + ... + o_{l-1}``. AttnRes replaces the fixed sum with softmax attention over depth, and
the block variant attends over a few block summaries instead of every earlier output:

* sources: ``b_0`` = the token embedding, ``b_1 .. b_n`` = the sums of the sublayer outputs of each
  completed block of layers, and ``p`` = the sum of the outputs so far in the current block (left
  out while it is empty);
* sublayer l (every attention and every MLP / MoE sublayer has its own) holds a learned
  pseudo-query ``w_l`` [hidden]; its input is ``h_l = sum_i a_i v_i`` with
  ``a = softmax_i(w_l . RMSNorm(v_i))`` over the sources ``v_i`` (RMSNorm without a weight, so a
  source's magnitude does not decide its share), per token;
* the sublayer's output ``o_l = f_l(h_l)`` (pre-norm inside ``f_l`` as usual) is added to ``p``; at
  the end of a block ``p`` becomes the next ``b`` and starts empty again;
* after the last layer one more pseudo-query gives the final hidden state.

A zero pseudo-query weighs every source equally (the paper's initialisation). The attention runs
over depth within one token, so it adds nothing per sequence to the KV / state caches; a forward
holds ``n + 2`` hidden-sized tensors per token instead of one.

Config (a tiered-moe extension of the Kimi-Linear format, for the K3-shaped synthetic checkpoint):
``attn_res_block_layers`` = layers per block (0: a plain residual stream). Tensors:
``model.layers.N.attn_res.attn_query`` / ``.mlp_query`` [hidden], ``model.attn_res.final_query`` [hidden].
"""
from __future__ import annotations

import torch


def depth_attention(sources: list, query: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: S tensors [tokens, hidden]; query: [hidden]. Returns sum_i softmax_i(q . RMSNorm(v_i)) v_i."""
    if len(sources) == 1:
        return sources[0]                                                # softmax over one source is 1
    v = torch.stack(sources)                                             # v: [S, tokens, hidden]
    vf = v.float()
    k = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)         # keys: RMSNorm without a weight
    a = (k @ query.float()).softmax(0)                                   # a: [S, tokens], over depth
    return (a.unsqueeze(-1) * vf).sum(0).to(v.dtype)


class BlockAttnRes:
    """The residual stream of one forward: ``input(query)`` gives the next sublayer's input,
    ``add(out)`` takes its output, ``end_block()`` closes a block of layers."""

    def __init__(self, x: torch.Tensor, eps: float) -> None:
        self.blocks = [x]                  # b_0 = embeddings, then completed block sums
        self.partial: "torch.Tensor | None" = None
        self.eps = eps

    def input(self, query: torch.Tensor) -> torch.Tensor:
        return depth_attention(self.blocks + ([] if self.partial is None else [self.partial]), query, self.eps)

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def end_block(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
