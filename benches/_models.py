"""The small convolutional classifiers of the benchmarks' workers.

``_ddp_bench_worker.py``'s ``dominant`` model and
``_topk_convergence_worker.py``'s ``cnn`` task are both a stack of 3x3
convolutions followed by fully connected layers; :func:`conv_classifier`
builds either, module for module, in the order the two always had (so
their parameters and their initialization from the seed stay the same).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def conv_classifier(
    in_channels: int, convs: Sequence[tuple[int, int]], widths: Sequence[int]
) -> nn.Sequential:
    """3x3 convolutions (padding 1), then Linear layers, with a ReLU after every layer but the last.

    Args:
        in_channels: the input images' channels.
        convs: each convolution's output channels and stride, in order.
        widths: the flattened features the first Linear takes, then each
            Linear's output features, in order (the last is the classes).

    Returns:
        ``Conv2d, ReLU, ...``, ``Flatten``, ``Linear, ReLU, ..., Linear``.
    """
    layers: list[nn.Module] = []
    channels = in_channels
    for out, stride in convs:
        layers += [nn.Conv2d(channels, out, 3, stride=stride, padding=1), nn.ReLU()]
        channels = out
    layers.append(nn.Flatten())
    for k in range(len(widths) - 1):
        layers.append(nn.Linear(widths[k], widths[k + 1]))
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
