"""Asks for torch's spec before importing it, as transformers does to see what is installed (``import transformers``
alone does not import torch), then trains one step."""

import importlib.util

assert importlib.util.find_spec("torch") is not None
import torch  # noqa: E402

x = torch.randn(256, 256, requires_grad=True)
(x @ x).sum().backward()
print(f"grad {x.grad.shape}")
