"""The models ``bench training`` trains: a small MLP and CNN (a few large tensors),
and a GPT-style decoder (many tensors, as the models people train today have).

``tensors10``, ``tensors100`` and ``tensors1000``: 4 Mi float32 parameters (16 MiB of
gradients) split evenly into that many tensors, with a loss whose backward is one
multiply per element: the same bytes to reduce in ever more pieces, for the engine's CPU
per step against the number of tensors (``bench training --tensors``).

``transformer``: 12 pre-norm decoder blocks of width 256 (4 heads, 4x MLP), token
and position embeddings, a final norm and an untied output layer over a 4096-token
vocabulary: 150 parameter tensors, 11.6 M parameters, trained on synthetic tokens
(next-token prediction on 8 sequences of 64 per rank)."""
from __future__ import annotations

from typing import Any, Callable

TRAINED = ("mlp", "cnn", "transformer")
TENSOR_COUNTS = {"tensors10": 10, "tensors100": 100, "tensors1000": 1000}
MODELS = TRAINED + tuple(TENSOR_COUNTS)
BATCH = {"mlp": 64, "cnn": 32, "transformer": 8, **{name: 1 for name in TENSOR_COUNTS}}
TENSOR_ELEMENTS = 1 << 22
VOCAB, WIDTH, DEPTH, HEADS, CONTEXT = 4096, 256, 12, 4, 64


def build(name: str) -> tuple[Any, tuple[Any, Any]]:
    """(model, (inputs, targets)) with fixed seeds: the same on every rank."""
    import torch
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        return model, (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    if name == "cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10))
        return model, (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))
    if name in TENSOR_COUNTS:
        return _tensors(TENSOR_COUNTS[name]), (torch.ones(1), None)
    tokens = torch.randint(0, VOCAB, (BATCH["transformer"], CONTEXT + 1))
    return _decoder(), (tokens[:, :-1], tokens[:, 1:])


def loss(name: str, model: Any, data: tuple[Any, Any]) -> Any:
    import torch
    x, y = data
    out = model(x)
    if name in TENSOR_COUNTS:
        return out
    if name == "transformer":
        return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return torch.nn.functional.cross_entropy(out, y)


def _decoder() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
            heads = [t.view(batch, length, HEADS, WIDTH // HEADS).transpose(1, 2)
                     for t in (q, k, v)]
            attended = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, WIDTH))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
            self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            # Positions on the ids' device: the GPU benchmark trains this model on CUDA.
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))
    return Decoder()


def _tensors(count: int) -> Any:
    import torch
    from torch import nn

    class Tensors(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            per, extra = divmod(TENSOR_ELEMENTS, count)     # the first ``extra`` one longer
            self.pieces = nn.ParameterList(nn.Parameter(torch.randn(per + (i < extra)))
                                           for i in range(count))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum((p * x).sum() for p in self.pieces)

    return Tensors()


def training_step(name: str, model: Any, optimizer: Any, data: Any,
                  backward_hook: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """One training step of ``model`` on ``data``, ``backward_hook()`` between backward
    and the optimizer's step."""
    def step() -> None:
        optimizer.zero_grad()
        loss(name, model, data).backward()
        backward_hook()
        optimizer.step()
    return step
