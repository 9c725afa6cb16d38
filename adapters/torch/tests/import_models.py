"""PyTorch modules for the importer's tests (test_import_torch.py): the models that map, and one per kind of thing
the spec cannot express. The CLI names them as adapters/torch/tests/import_models.py:NAME."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def small_convnet() -> nn.Module:
    """The README's seed model (models/small_convnet.yaml): four 3x3 conv/ReLU/2x2 max-pool blocks, a 2x2 average
    pool, flatten, Linear(?, 1), sigmoid. At 3x64x96 the flatten sees [64, 1, 2]: its C, H, W order is not H, W, C."""
    blocks = []
    for cin, cout in ((3, 32), (32, 32), (32, 64), (64, 64)):
        blocks += [nn.Conv2d(cin, cout, 3), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*blocks, nn.AvgPool2d(2), nn.Flatten(), nn.Linear(64 * 1 * 2, 1), nn.Sigmoid())


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input, or its projection (a strided 1x1 conv and bn), then relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        # a strided conv pads nothing: PyTorch's padding=1 at stride 2 is not TensorFlow's 'same'
        self.conv1 = nn.Conv2d(cin, cout, 3 if stride == 1 else stride, stride, 1 if stride == 1 else 0, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, momentum=0.2, eps=1e-3)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding="same", bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            out += self.downsample(x)  # fx records operator.add
        else:
            out = out + x
        return torch.relu(out)


class ResNetMini(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class MLP(nn.Module):
    """Dropout and BatchNorm1d, functional activations, a LayerNorm and the tanh GELU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.bn = nn.BatchNorm1d(128)
        self.drop1 = nn.Dropout(0.3)
        self.fc2 = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(64, eps=1e-5)
        self.act = nn.GELU(approximate="tanh")
        self.drop2 = nn.Dropout(0.2)
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = self.drop1(F.relu(self.bn(self.fc1(x))))
        x = self.drop2(self.act(self.norm(self.fc2(x))))
        return F.softmax(self.out(x), dim=-1)


class ConvFlattenNorm(nn.Module):
    """A flatten by x.view(x.size(0), -1), then a BatchNorm1d and a tanh on the flat C, H, W features before the
    Linear: the norm's features are permuted too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.pool = nn.MaxPool2d(3, 1, 1)  # stride 1, odd window, padding k // 2: TensorFlow's 'same'
        self.avg = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.bn = nn.BatchNorm1d(4 * 5 * 6)
        self.fc = nn.Linear(4 * 5 * 6, 3)

    def forward(self, x):
        x = self.avg(self.pool(self.conv(x)))
        x = x.view(x.size(0), -1)
        return self.fc(torch.tanh(self.bn(x)))


class TokenBag(nn.Module):
    """Token ids into an embedding, a LayerNorm, a dense and GELU per position, the mean over positions, a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        x = F.gelu(self.fc(self.norm(self.embed(ids))))
        return self.head(x.mean(dim=1))


class Branches(nn.Module):
    """Two branches joined by a concatenation: the spec's named tensors and concat."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


class Crossing(nn.Module):
    """Adds whose branches cross (the second add takes a tensor from inside the first block): not a chain with
    residual adds, a graph of named tensors."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h) + x
        return self.out(self.c(y) + h)


class GatedConvNet(nn.Module):
    """A MobileNet/EfficientNet-style graph in plain torch: a ZeroPad2d before a stride-2 conv, a depthwise and a
    dilated conv, ReLU6, SiLU and Hardswish, a squeeze-and-excite gate (mean over H, W kept as [N, C, 1, 1], two 1x1
    convs, a sigmoid, a product), a concatenation of channels, global average pooling and a head."""

    def __init__(self):
        super().__init__()
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.stem = nn.Conv2d(3, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU6()
        self.depthwise = nn.Conv2d(8, 16, 3, padding=1, groups=8, bias=False)  # multiplier 2
        self.silu = nn.SiLU()
        self.squeeze = nn.Conv2d(16, 4, 1)
        self.excite = nn.Conv2d(4, 16, 1)
        self.dilated = nn.Conv2d(8, 4, 3, padding=2, dilation=2)
        self.hswish = nn.Hardswish()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(20, 3)

    def forward(self, x):
        x = self.act(self.bn(self.stem(self.pad(x))))
        expanded = self.silu(self.depthwise(x))
        gate = torch.sigmoid(self.excite(F.silu(self.squeeze(expanded.mean((2, 3), keepdim=True)))))
        gated = expanded * gate
        wide = self.hswish(self.dilated(x))
        joined = torch.cat([gated, wide], dim=1)
        return self.head(torch.flatten(self.pool(joined), 1))


class PatchEncoder(nn.Module):
    """A ViT without a class token: 4x4 patches (a Conv2d of kernel = stride = 4, flattened and transposed), a learned
    position table added, two pre-norm nn.TransformerEncoder layers (GELU), the mean over patches, a norm, a head."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 4, stride=4)
        self.position = nn.Parameter(torch.randn(1, 16, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.encoder(x).mean(dim=1)))


class CausalSelfAttention(nn.Module):
    """Separate q, k, v projections without biases, heads by view and transpose, torch's SDPA (is_causal, or an
    explicit additive mask of -inf above the diagonal) with dropout 0.05 on the probabilities in training, the heads
    merged and projected, then a dropout of 0.1 (an attribute named `dropout` that is not the attention's)."""

    def __init__(self, dim: int = 32, heads: int = 4, explicit_mask: bool = False):
        super().__init__()
        self.heads, self.explicit_mask = heads, explicit_mask
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        rate = 0.05 if self.training else 0.0
        if self.explicit_mask:
            mask = torch.full((t, t), float("-inf")).triu(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=rate)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=rate)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(n, t, d)))


class LlamaStyleRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: epsilon inside the root, the weight after, a 16-bit input normalised in float32
    (Llama's own casts to float32 whatever the input, a float64 one too: here at least float32, so that the float64
    check compares the math, not that cast)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class TinyCausalLM(nn.Module):
    """Token and position embeddings (an nn.Embedding of torch.arange), a pre-norm block of CausalSelfAttention and
    a SwiGLU feed-forward (silu(gate(x)) * up(x), Llama's, after a Llama-style RMSNorm), a final nn.RMSNorm and a
    head."""

    def __init__(self, vocab: int = 50, dim: int = 32, explicit_mask: bool = False):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(24, dim)
        self.norm1, self.norm2, self.norm = nn.LayerNorm(dim), LlamaStyleRMSNorm(dim), nn.RMSNorm(dim, eps=1e-5)
        self.attention = CausalSelfAttention(dim, 4, explicit_mask)
        self.gate, self.up, self.down = nn.Linear(dim, 48), nn.Linear(dim, 48), nn.Linear(48, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(self.norm(x))


def tiny_causal_lm_masked() -> nn.Module:
    return TinyCausalLM(explicit_mask=True)


class RotaryAttention(nn.Module):
    """Grouped-query attention with rotary position embeddings written as GPT-J writes them: on [N, T, H, Dh] before
    the heads are transposed, each head's dimensions 2i and 2i + 1 turned together ("interleaved"), the tables
    computed in float64 from `base` (here 500) and taken in q's dtype; the key/value heads given to SDPA as they are
    (enable_gqa). `pairing` "half" turns i with i + Dh/2 (Hugging Face's rotate_half); "mixed" has half's frequencies
    and interleaved's pairs, and `scale` divides the positions (a linearly scaled rope): neither is the spec's."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 1, base: float = 500.0,
                 pairing: str = "interleaved", scale: float = 1.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.base, self.pairing, self.scale = base, pairing, scale
        self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k, self.v = (nn.Linear(dim, kv_heads * self.head_dim, bias=False) for _ in range(2))

    def tables(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, Dh] (broadcast over the heads)."""
        dh = self.head_dim
        inverse = 1.0 / self.base ** (torch.arange(dh // 2, dtype=torch.float64) * 2 / dh)
        angles = torch.arange(length, dtype=torch.float64)[:, None] / self.scale * inverse
        angles = angles.repeat_interleave(2, -1) if self.pairing == "interleaved" else torch.cat([angles, angles], -1)
        return angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype)

    def turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.pairing == "half":
            half = self.head_dim // 2
            partner = torch.cat([-x[..., half:], x[..., :half]], -1)
        else:
            partner = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
        return x * cos + partner * sin

    def forward(self, x):
        n, t, d = x.shape
        cos, sin = self.tables(t, x.dtype)
        q = self.turn(self.q(x).view(n, t, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = self.turn(self.k(x).view(n, t, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.v(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(n, t, d))


class RotaryLM(nn.Module):
    """Token embeddings, a pre-norm block of RotaryAttention (no position table: the rotation places the tokens), a
    head."""

    def __init__(self, vocab: int = 40, dim: int = 32, **rotary):
        super().__init__()
        self.tokens, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.attention = RotaryAttention(dim, **rotary)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.tokens(ids)
        x = x + self.attention(self.norm(x))
        return self.head(x)


def rotary_half() -> nn.Module:
    return RotaryLM(pairing="half", base=10000.0, kv_heads=2)


def rotary_mixed() -> nn.Module:
    return RotaryLM(pairing="mixed")


def rotary_scaled() -> nn.Module:
    return RotaryLM(scale=2.0)


def gptj() -> nn.Module:
    """Hugging Face GPT-J in small: rotary in the interleaved pairing (rotate_every_two, on [N, T, H, Dh]), its
    tables a float32 buffer computed at construction, attention and MLP in parallel from one LayerNorm."""
    from transformers import GPTJConfig, GPTJForCausalLM

    return GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, rotary_dim=8,
                                      bos_token_id=0, eos_token_id=0))


class FunctionalOps(nn.Module):
    """Functional calls on the model's own parameters: F.max_pool2d, F.avg_pool2d (count_include_pad=False), a flatten
    of C, H, W features into F.linear, F.layer_norm and F.dropout, beside an AdaptiveMaxPool2d branch; their sum into
    a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.weight, self.bias = nn.Parameter(torch.randn(6, 4 * 4 * 4) * 0.1), nn.Parameter(torch.zeros(6))
        self.gamma, self.beta = nn.Parameter(torch.ones(6)), nn.Parameter(torch.zeros(6))
        self.amax, self.fc, self.head = nn.AdaptiveMaxPool2d(1), nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        y = F.avg_pool2d(F.max_pool2d(self.conv(x), 2), 3, 1, 1, count_include_pad=False)
        h = F.layer_norm(F.linear(torch.flatten(y, 1), self.weight, self.bias), (6,), self.gamma, self.beta, 1e-5)
        return self.head(F.dropout(h, 0.2, self.training) + self.fc(torch.flatten(self.amax(y), 1)))


# ---- what the spec cannot express: one of each kind ----------------------------------------------------------
def unsupported_module() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ELU(), nn.Linear(8, 2))


def unsupported_field() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 2))


def unsupported_padding() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def unsupported_avgpool() -> nn.Module:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Flatten(), nn.Linear(3 * 8 * 8, 2))  # count_include_pad=True


class UnsupportedFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.exp(self.fc(x)))


class ConcatHeight(nn.Module):
    """Two conv branches stacked along the height (dim 2 of NCHW): the spec concatenates channels only."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.out = nn.Linear(4 * 16 * 8, 2)

    def forward(self, x):
        return self.out(torch.flatten(torch.cat([self.a(x), self.b(x)], dim=2), 1))


class Scaled(nn.Module):
    """x * 2: a product with a constant, which no spec layer computes."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.fc(x) * 2)


class PaddingMasked(nn.Module):
    """Attention whose mask comes from the token ids (padding): the spec's attention masks nothing or the future."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        y, _ = self.attention(x, x, x, key_padding_mask=ids == 0, need_weights=False)
        return self.head(x + y)


class WrittenOut(nn.Module):
    """nn.MultiheadAttention asked for its weights: torch computes the attention as matmuls and a softmax, not SDPA."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.attention(x, x, x)[0])


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: neither torch.export nor symbolic_trace follows it
            return self.fc(x)
        return -self.fc(x)


not_a_module = 42
