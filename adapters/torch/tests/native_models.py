"""The user's own models for the native-spec tests (test_native.py): small modules written as users write them,
Hugging Face models in small configs, and the mistakes a native spec must name in one line."""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


def encoder() -> nn.Module:
    """nn.TransformerEncoder over token embeddings, a next-token head."""
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 64)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)))

    return Model()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64, num_labels=4,
                                                    max_position_embeddings=16))


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                               num_labels=4))


def raises():
    raise RuntimeError("no weights here")


def not_a_module():
    return 42


class Exp(nn.Module):
    def forward(self, x):
        return x.exp()


def overflows() -> nn.Module:
    """exp of a large linear output: finite in float32, past float16's 65504 under autocast (its first inf)."""
    model = nn.Sequential(nn.Linear(16, 32), Exp(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(40)
    return model


def mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    return MobileNetV2ForImageClassification(MobileNetV2Config(image_size=16, depth_multiplier=0.35, num_labels=4))
