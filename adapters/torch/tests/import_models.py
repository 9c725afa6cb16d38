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


# ---- what the spec cannot express: one of each kind ----------------------------------------------------------
def unsupported_module() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 2))


def unsupported_field() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, dilation=2), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


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
        return self.out(F.silu(self.fc(x)))


class Branches(nn.Module):
    """Two branches joined by a concatenation: not a chain with residual adds."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


class Crossing(nn.Module):
    """Adds whose branches cross (the second add takes a tensor from inside the first block): not a chain."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h) + x
        return self.out(self.c(y) + h)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: symbolic_trace cannot follow it
            return self.fc(x)
        return -self.fc(x)


not_a_module = 42
