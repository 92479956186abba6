"""The training step the harness runs on each batch: a fixed cost or a small real torch model.

``sleep`` emulates a GPU step (the host CPU is free for the loader meanwhile); ``busy`` burns real
CPU for the step time (a CPU-bound trainer competing with the loader); ``model`` runs forward,
backward and an SGD update of a small ResNet-like conv net written in plain torch (no
torchvision). Each step exposes ``grads()``, the buffer the rank all-reduces after computing,
as DDP does.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

STEP_KINDS = ("sleep", "busy", "model")


def batch_images(batch: Any) -> torch.Tensor | None:
    """The image tensor of a batch from any adapter (dict with ``image``, or (images, labels))."""
    if isinstance(batch, dict):
        value = batch.get("image")
        return value if isinstance(value, torch.Tensor) else None
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch (first tensor's leading dim, or a list's length)."""
    images = batch_images(batch)
    if images is not None:
        return int(images.shape[0])
    if isinstance(batch, dict):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
            if isinstance(value, list):
                return len(value)
    if isinstance(batch, (list, tuple)):
        return len(batch)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


class SleepStep:
    """A fixed-cost step that leaves the CPU idle, as the host does while a GPU computes."""

    def __init__(self, step_ms: float, sync_numel: int = 1024) -> None:
        self.seconds = step_ms / 1e3
        self._grads = torch.zeros(sync_numel)

    def __call__(self, batch: Any) -> None:
        time.sleep(self.seconds)

    def grads(self) -> torch.Tensor:
        return self._grads


class BusyStep(SleepStep):
    """A fixed-cost step that keeps one core busy with real arithmetic until its time is up."""

    def __init__(self, step_ms: float, sync_numel: int = 1024) -> None:
        super().__init__(step_ms, sync_numel)
        self._a = torch.randn(64, 64)

    def __call__(self, batch: Any) -> None:
        deadline = time.perf_counter() + self.seconds
        a = self._a
        while time.perf_counter() < deadline:
            a = torch.tanh(a @ self._a)
        self._grads[0] = float(a[0, 0])


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """A ResNet-like classifier (stem, three residual stages, pooled linear head)."""

    def __init__(self, classes: int = 1000, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(
            _Block(width, width, 1), _Block(width, 2 * width, 2), _Block(2 * width, 4 * width, 2)
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ModelStep:
    """Forward, backward and SGD update of :class:`TinyResNet` on the batch's images."""

    def __init__(self, classes: int = 1000, width: int = 16, device: str = "cpu", seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = TinyResNet(classes, width).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.classes = classes
        self._flat = torch.zeros(sum(p.numel() for p in self.model.parameters()), device=self.device)

    def __call__(self, batch: Any) -> None:
        images = batch_images(batch)
        if images is None:
            raise TypeError("the 'model' step needs batches with an image tensor (N, 3, H, W)")
        images = images.to(self.device, non_blocking=True).float()
        labels = _labels(batch, images.shape[0], self.classes).to(self.device)
        self.opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in self.model.parameters()], out=self._flat)
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def grads(self) -> torch.Tensor:
        return self._flat


def _labels(batch: Any, n: int, classes: int) -> torch.Tensor:
    value = None
    if isinstance(batch, dict):
        value = batch.get("label")
    elif isinstance(batch, (list, tuple)) and len(batch) > 1:
        value = batch[1]
    if isinstance(value, torch.Tensor) and value.shape[:1] == (n,):
        return value.long().remainder(classes)
    return torch.zeros(n, dtype=torch.long)


def make_step(
    kind: str, step_ms: float, device: str = "cpu", seed: int = 0
) -> SleepStep | BusyStep | ModelStep:
    """The step of the given kind (one of :data:`STEP_KINDS`)."""
    if kind == "sleep":
        return SleepStep(step_ms)
    if kind == "busy":
        return BusyStep(step_ms)
    if kind == "model":
        return ModelStep(device=device, seed=seed)
    raise ValueError(f"unknown step kind {kind!r}; choose one of {', '.join(STEP_KINDS)}")
