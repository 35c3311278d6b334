"""Small-image AlexNet-, VGG-16- (with and without BatchNorm) and ResNet-18-style networks.

torchvision is not a dependency, so the reference architectures used by the demo, the benchmarks and
the tests live here (an example, not part of the installed ``sparsa`` package), sized for 32x32 (or
64x64) inputs: every ReLU is an ``nn.ReLU`` module so :func:`sparsa.adaptive.enable` can find it.

Example::

    >>> import torch
    >>> from examples.convnets import vgg16, resnet18, alexnet
    >>> [m(torch.randn(2, 3, 32, 32)).shape[-1] for m in (vgg16(), vgg16(batch_norm=True), resnet18(), alexnet())]
    [10, 10, 10, 10]
"""

from __future__ import annotations

from typing import List, Union

import torch
from torch import nn

__all__ = ["alexnet", "vgg16", "resnet18", "BasicBlock", "build"]

_VGG16: List[Union[int, str]] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def _init(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return model


def vgg16(
    num_classes: int = 10, batch_norm: bool = False, width: float = 1.0, in_channels: int = 3, image_size: int = 32
) -> nn.Sequential:
    """VGG-16 (13 3x3 convs, 5 max-pools, 3 Linear), optionally with BatchNorm; ``width`` scales channels."""
    layers: List[nn.Module] = []
    c = in_channels
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        o = max(8, int(round(v * width / 8)) * 8)
        layers.append(nn.Conv2d(c, o, 3, padding=1, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm2d(o))
        layers.append(nn.ReLU(inplace=True))
        c = o
    spatial = image_size // 32
    hidden = max(8, int(round(512 * width / 8)) * 8)
    layers += [
        nn.Flatten(),
        nn.Linear(c * spatial * spatial, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    ]
    return _init(nn.Sequential(*layers))


def alexnet(num_classes: int = 10, width: float = 1.0, in_channels: int = 3, image_size: int = 32) -> nn.Sequential:
    """AlexNet-style: 5 convs (5x5 then 3x3), 3 max-pools, 3 Linear; no BatchNorm."""

    def w(v: int) -> int:
        return max(8, int(round(v * width / 8)) * 8)

    c1, c2, c3, c4, c5 = w(64), w(192), w(384), w(256), w(256)
    spatial = image_size // 8
    feats = [
        nn.Conv2d(in_channels, c1, 5, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(c3, c4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(c4, c5, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    ]
    hidden = w(1024)
    head = [
        nn.Flatten(),
        nn.Linear(c5 * spatial * spatial, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    ]
    return _init(nn.Sequential(*feats, *head))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn (+ shortcut) -relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class _ResNet(nn.Module):
    def __init__(self, num_classes: int, width: float, in_channels: int):
        super().__init__()

        def w(v: int) -> int:
            return max(8, int(round(v * width / 8)) * 8)

        c = w(64)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        blocks = []
        for i, v in enumerate((64, 128, 256, 512)):
            o = w(v)
            for j in range(2):
                blocks.append(BasicBlock(c, o, 2 if (j == 0 and i > 0) else 1))
                c = o
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.layers(self.stem(x)))))


def resnet18(num_classes: int = 10, width: float = 1.0, in_channels: int = 3) -> nn.Module:
    """ResNet-18 for small images (3x3 stem, no stem pooling), BatchNorm throughout."""
    return _init(_ResNet(num_classes, width, in_channels))


def build(name: str, **kwargs) -> nn.Module:
    """Model by name: ``alexnet``, ``vgg16``, ``vgg16_bn``, ``resnet18``."""
    table = {
        "alexnet": alexnet,
        "vgg16": vgg16,
        "vgg16_bn": lambda **k: vgg16(batch_norm=True, **k),
        "resnet18": resnet18,
    }
    if name not in table:
        raise ValueError(f"name must be one of {sorted(table)}, got {name!r}")
    return table[name](**kwargs)
