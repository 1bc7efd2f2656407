"""Other people's models, rebuilt here from their public descriptions, to test glasslm against.

Each class follows one codebase's published structure closely enough that its `state_dict()`
has that codebase's names and shapes, and its forward pass that codebase's maths. They share no
code with glasslm (plain torch.nn only), so a conversion bug cannot cancel out.

  Seed000GPT       ARENA's GPT-2 in TransformerLens naming (seeds/000)
  Seed001GPT       "Transformers in a Nutshell" GPT (seeds/001), pre-norm as its text says
  Seed002Decoder   decoder-only "Vaswani" tutorial model (seeds/002)
  CS336LM          CS336 assignment 1 TransformerLM (seeds/003)
  Seed004Model     tiny-transformer (seeds/004), heads built as its text describes
  NanoGPT          nanoGPT's model.py GPT
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def causal(T: int) -> torch.Tensor:
    return torch.tril(torch.ones(T, T, dtype=torch.bool))


# --- seed 000: ARENA / TransformerLens --------------------------------------------------------

class _TLLayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / (var + 1e-5).sqrt() * self.w + self.b


class _TLAttention(nn.Module):
    def __init__(self, n, d, h, std):
        super().__init__()
        for x in "QKV":
            setattr(self, f"W_{x}", nn.Parameter(torch.randn(n, d, h) * std))
            setattr(self, f"b_{x}", nn.Parameter(torch.zeros(n, h)))
        self.W_O, self.b_O = nn.Parameter(torch.randn(n, h, d) * std), nn.Parameter(torch.zeros(d))
        self.register_buffer("IGNORE", torch.tensor(-1e5))

    def forward(self, x):
        q = torch.einsum("bsd,ndh->bnsh", x, self.W_Q) + self.b_Q[:, None]
        k = torch.einsum("bsd,ndh->bnsh", x, self.W_K) + self.b_K[:, None]
        v = torch.einsum("bsd,ndh->bnsh", x, self.W_V) + self.b_V[:, None]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~causal(x.shape[1]), self.IGNORE)
        z = scores.softmax(-1) @ v  # (b, n, s, h)
        return torch.einsum("bnsh,nhd->bsd", z, self.W_O) + self.b_O


class _TLMLP(nn.Module):
    def __init__(self, d, m, std):
        super().__init__()
        self.W_in, self.b_in = nn.Parameter(torch.randn(d, m) * std), nn.Parameter(torch.zeros(m))
        self.W_out, self.b_out = nn.Parameter(torch.randn(m, d) * std), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = x @ self.W_in + self.b_in
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))  # gelu_new
        return h @ self.W_out + self.b_out


class _TLBlock(nn.Module):
    def __init__(self, n, d, h, m, std):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = _TLLayerNorm(d), _TLAttention(n, d, h, std), _TLLayerNorm(d), _TLMLP(d, m, std)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Holder(nn.Module):
    def __init__(self, **params):
        super().__init__()
        for name, p in params.items():
            setattr(self, name, p)


class Seed000GPT(nn.Module):
    """Embed, PosEmbed, blocks, ln_final, Unembed (W_U, b_U): TransformerLens parameter names."""

    def __init__(self, d_vocab, n_ctx, d_model, n_layers, n_heads, std=0.02):
        super().__init__()
        h = d_model // n_heads
        self.embed = _Holder(W_E=nn.Parameter(torch.randn(d_vocab, d_model) * std))
        self.pos_embed = _Holder(W_pos=nn.Parameter(torch.randn(n_ctx, d_model) * std))
        self.blocks = nn.ModuleList(_TLBlock(n_heads, d_model, h, 4 * d_model, std) for _ in range(n_layers))
        self.ln_final = _TLLayerNorm(d_model)
        self.unembed = _Holder(W_U=nn.Parameter(torch.randn(d_model, d_vocab) * std),
                               b_U=nn.Parameter(torch.zeros(d_vocab), requires_grad=False))

    def forward(self, tokens):
        x = self.embed.W_E[tokens] + self.pos_embed.W_pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_final(x) @ self.unembed.W_U + self.unembed.b_U


# --- seed 001: GPT with three dropout rates, trained with Lightning -----------------------------

class _S1Attention(nn.Module):
    def __init__(self, d, n, T):
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.res_proj = nn.Linear(d, d, bias=False)
        self.attn_dropout, self.res_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)))
        self.num_heads = n

    def forward(self, x):
        b, s, d = x.shape
        hd = d // self.num_heads
        q, k, v = (m(x).reshape(b, s, self.num_heads, hd).transpose(1, 2) for m in (self.W_Q, self.W_K, self.W_V))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(hd))
        scores = scores.masked_fill(self.mask[:s, :s] == 0, float("-inf"))
        out = self.attn_dropout(F.softmax(scores, dim=-1)) @ v
        return self.res_dropout(self.res_proj(out.transpose(1, 2).reshape(b, s, d)))


class _S1MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.hidden, self.gelu, self.res_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        self.res_dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.res_dropout(self.res_proj(self.gelu(self.hidden(x))))


class _S1Block(nn.Module):
    def __init__(self, d, n, T):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), _S1Attention(d, n, T), nn.LayerNorm(d), _S1MLP(d)

    def forward(self, x):  # pre-norm, as the tutorial's text describes
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Seed001GPT(nn.Module):
    def __init__(self, vocab_size, max_seq_len, emb_size, num_blocks, num_heads):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, emb_size)
        self.pos_emb = nn.Embedding(max_seq_len, emb_size)
        self.emb_dropout = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[_S1Block(emb_size, num_heads, max_seq_len) for _ in range(num_blocks)])
        self.ln = nn.LayerNorm(emb_size)
        self.head = nn.Linear(emb_size, vocab_size, bias=False)
        self.pos_idxs = nn.Parameter(torch.arange(0, max_seq_len), requires_grad=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("res_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * num_blocks))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, x):
        seq = self.emb_dropout(self.tok_emb(x) + self.pos_emb(self.pos_idxs[: x.shape[1]]))
        return self.head(self.ln(self.blocks(seq)))


# --- seed 002: decoder-only "Attention Is All You Need" tutorial --------------------------------

class _S2LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.eps, self.alpha, self.bias = eps, nn.Parameter(torch.ones(features)), nn.Parameter(torch.zeros(features))

    def forward(self, x):
        return self.alpha * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps) + self.bias


class _S2Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.d_k = h, d // h
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (m(x).view(b, s, self.h, self.d_k).transpose(1, 2) for m in (self.w_q, self.w_k, self.w_v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~causal(s), -1e9)
        out = self.dropout(scores.softmax(-1)) @ v
        return self.w_o(out.transpose(1, 2).contiguous().view(b, s, d))


class _S2FeedForward(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.linear_1, self.dropout, self.linear_2 = nn.Linear(d, d_ff), nn.Dropout(0.1), nn.Linear(d_ff, d)

    def forward(self, x):
        return self.linear_2(self.dropout(torch.relu(self.linear_1(x))))


class _S2Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.dropout, self.norm = nn.Dropout(0.1), _S2LayerNorm(d)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class _S2Block(nn.Module):
    def __init__(self, d, h, d_ff):
        super().__init__()
        self.self_attention_block, self.feed_forward_block = _S2Attention(d, h), _S2FeedForward(d, d_ff)
        self.residual_connections = nn.ModuleList(_S2Residual(d) for _ in range(2))

    def forward(self, x):
        x = self.residual_connections[0](x, self.self_attention_block)
        return self.residual_connections[1](x, self.feed_forward_block)


class Seed002Decoder(nn.Module):
    def __init__(self, vocab_size, seq_len, d_model, N, h, d_ff):
        super().__init__()
        self.d_model = d_model
        self.word_embedding = _Holder(embedding=nn.Embedding(vocab_size, d_model))
        pe = torch.zeros(seq_len, d_model)
        position = torch.arange(seq_len).float().unsqueeze(1)
        div_term = 1 / torch.tensor(10000.0) ** (torch.arange(0, d_model, 2).float() / d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div_term), torch.cos(position * div_term)
        self.position_embedding = _Holder(dropout=nn.Dropout(0.1))
        self.position_embedding.register_buffer("pe", pe.unsqueeze(0))
        self.decoder = _Holder(layers=nn.ModuleList(_S2Block(d_model, h, d_ff) for _ in range(N)),
                               norm=_S2LayerNorm(d_model))
        self.projection_layer = _Holder(proj=nn.Linear(d_model, vocab_size))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, tokens):
        x = self.word_embedding.embedding(tokens) * math.sqrt(self.d_model)
        x = self.position_embedding.dropout(x + self.position_embedding.pe[:, : tokens.shape[1]])
        for layer in self.decoder.layers:
            x = layer(x)
        return self.projection_layer.proj(self.decoder.norm(x))


# --- seed 003: CS336 assignment 1 ---------------------------------------------------------------

class _CSLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), 0, std, -3 * std, 3 * std))

    def forward(self, x):
        return x @ self.weight.T


class _CSRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _cs_rope(x, positions, theta):
    """Rotate each adjacent pair (x[2k], x[2k+1]) by position * theta^(-2k/d)."""
    d = x.shape[-1]
    freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angle = positions[:, None].float() * freq  # (seq, d/2)
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


class _CSAttention(nn.Module):
    def __init__(self, d, n, theta):
        super().__init__()
        self.n, self.theta = n, theta
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (_CSLinear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.n, d // self.n).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(s)
        q, k = _cs_rope(q, pos, self.theta), _cs_rope(k, pos, self.theta)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d // self.n)).masked_fill(~causal(s), float("-inf"))
        return self.output_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))


class _CSSwiGLU(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.w1, self.w2, self.w3 = _CSLinear(d, d_ff), _CSLinear(d_ff, d), _CSLinear(d, d_ff)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class _CSBlock(nn.Module):
    def __init__(self, d, n, d_ff, theta):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.ffn = _CSRMSNorm(d), _CSAttention(d, n, theta), _CSRMSNorm(d), _CSSwiGLU(d, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class CS336LM(nn.Module):
    def __init__(self, vocab_size, d_model, num_layers, num_heads, d_ff, rope_theta=10000.0):
        super().__init__()
        self.token_embeddings = _Holder(weight=nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model), 0, 1, -3, 3)))
        self.layers = nn.ModuleList(_CSBlock(d_model, num_heads, d_ff, rope_theta) for _ in range(num_layers))
        self.ln_final, self.lm_head = _CSRMSNorm(d_model), _CSLinear(d_model, vocab_size)

    def forward(self, tokens):
        x = self.token_embeddings.weight[tokens]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


# --- seed 004: tiny-transformer -------------------------------------------------------------

class _S4Head(nn.Module):
    def __init__(self, embeds_size, block_size, head_size):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(embeds_size, head_size, bias=False) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(C))  # C: the embedding size, not the head size
        scores = scores.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return self.dropout(F.softmax(scores, dim=-1)) @ v


class _S4MultiHead(nn.Module):
    def __init__(self, embeds_size, block_size, num_heads, head_size):
        super().__init__()
        self.multihead = nn.ModuleList(_S4Head(embeds_size, block_size, head_size) for _ in range(num_heads))
        self.output_linear, self.dropout = nn.Linear(embeds_size, embeds_size), nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.output_linear(torch.cat([h(x) for h in self.multihead], dim=-1)))


class _S4Block(nn.Module):
    def __init__(self, embeds_size, block_size, num_heads, drop_prob):
        super().__init__()
        self.n_heads = _S4MultiHead(embeds_size, block_size, num_heads, embeds_size // num_heads)
        self.ffn = nn.Sequential(nn.Linear(embeds_size, 4 * embeds_size), nn.ReLU(),
                                 nn.Linear(4 * embeds_size, embeds_size), nn.Dropout(drop_prob))
        self.ln1, self.ln2 = nn.LayerNorm(embeds_size), nn.LayerNorm(embeds_size)

    def forward(self, x):
        x = x + self.n_heads(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class Seed004Model(nn.Module):
    def __init__(self, vocab_size=65, block_size=256, embeds_size=195, num_heads=5, num_layers=5, drop_prob=0.15):
        super().__init__()
        self.block_size = block_size
        self.stack = nn.ModuleDict(dict(
            tok_embs=nn.Embedding(vocab_size, embeds_size), pos_embs=nn.Embedding(block_size, embeds_size),
            dropout=nn.Dropout(drop_prob),
            blocks=nn.Sequential(*[_S4Block(embeds_size, block_size, num_heads, drop_prob) for _ in range(num_layers)]),
            ln=nn.LayerNorm(embeds_size), lm_head=nn.Linear(embeds_size, vocab_size)))

    def forward(self, seq):
        x = self.stack.tok_embs(seq) + self.stack.pos_embs(torch.arange(seq.shape[1]))
        return self.stack.lm_head(self.stack.ln(self.stack.blocks(self.stack.dropout(x))))

    @torch.no_grad()
    def autocomplete_greedy(self, seq, n):
        """The tutorial's autocomplete with argmax in place of sampling: recompute on the last block_size."""
        for _ in range(n):
            logits = self(seq[:, -self.block_size:])[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        return seq


# --- nanoGPT --------------------------------------------------------------------------------

class _NGLayerNorm(nn.Module):
    def __init__(self, d, bias):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _NGAttention(nn.Module):
    def __init__(self, d, n, bias):
        super().__init__()
        self.c_attn, self.c_proj, self.n = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias), n

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.n, d // self.n).transpose(1, 2) for t in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class _NGBlock(nn.Module):
    def __init__(self, d, n, bias):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = _NGLayerNorm(d, bias), _NGAttention(d, n, bias), _NGLayerNorm(d, bias)
        self.mlp = _Holder(c_fc=nn.Linear(d, 4 * d, bias=bias), gelu=nn.GELU(), c_proj=nn.Linear(4 * d, d, bias=bias))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(self.mlp.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout=0.0):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(_NGBlock(n_embd, n_head, bias) for _ in range(n_layer)), ln_f=_NGLayerNorm(n_embd, bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def randomize_(model: nn.Module, scale: float = 0.1) -> nn.Module:
    """Give every bias and norm gain a random value, so a bias or gain that goes missing shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point and p.dim() == 1:
                p.add_(torch.randn_like(p) * scale)
    return model
