"""The pieces a ViT block and head are built from, with timm's parameter names so that timm's weights load by name:
norms, activations, the MLP (plain or gated), LayerScale, stochastic depth and the attention-pool head (SigLIP's MAP).

Each option is a plain name (``"layernorm"``, ``"gelu_tanh"``), checked once by the factory that builds it.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

__all__ = ["NORMS", "ACTIVATIONS", "make_norm", "make_act", "Mlp", "LayerScale", "DropPath", "AttentionPool"]

class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (its fused kernel) that an ONNX export writes out as its formula: opset 17 has no RMS norm."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.onnx.is_in_onnx_export():
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * self.weight if self.weight is not None else y


NORMS: Dict[str, Callable[[int, float], nn.Module]] = {
    "layernorm": lambda dim, eps: nn.LayerNorm(dim, eps=eps),
    "rmsnorm": lambda dim, eps: RMSNorm(dim, eps=eps),  # sapiens2, ViT-XP
}


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: OpenAI CLIP's approximation of GELU (its ``*_quickgelu`` models were trained with it)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: Dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # SigLIP
    "quick_gelu": QuickGELU,  # OpenAI CLIP
    "silu": nn.SiLU,  # SwiGLU (EVA-02, sapiens2)
}


def _choose(table: Dict[str, Callable], name: str, what: str):
    if name not in table:
        raise ValueError(f"{what}={name!r} is not one of {', '.join(table)}")
    return table[name]


def make_norm(name: str, dim: int, eps: float) -> nn.Module:
    """A normalisation layer by name (:data:`NORMS`); an unknown name is a one-line ``ValueError``."""
    return _choose(NORMS, name, "norm_layer")(dim, eps)


def make_act(name: str) -> nn.Module:
    """An activation by name (:data:`ACTIVATIONS`); an unknown name is a one-line ``ValueError``."""
    return _choose(ACTIVATIONS, name, "mlp_act")()


class Mlp(nn.Module):
    """``fc2(drop(norm(act(fc1(x)))))``, the transformer MLP with timm's parameter names. ``gated``: ``fc1`` gives twice
    ``hidden`` and the first half, activated, gates the second (GLU; SwiGLU with ``act="silu"``: EVA-02, sapiens2).
    ``norm``: a norm over the hidden features before ``fc2`` (EVA-02's sub-LN), ``norm_layer``/``eps`` its kind."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0, act: str = "gelu", gated: bool = False, norm: bool = False,
                 norm_layer: str = "layernorm", eps: float = 1e-6, out_dim: int | None = None) -> None:
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(dim, hidden * (2 if gated else 1))
        self.act = make_act(act)
        self.drop1 = nn.Dropout(drop)
        self.norm = make_norm(norm_layer, hidden, eps) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, out_dim or dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)
        if self.gated:
            gate, x = x.chunk(2, dim=-1)
            x = self.act(gate) * x
        else:
            x = self.act(x)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch (CaiT, Touvron et al. 2021; DeiT-III), timm's ``gamma``."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop a sample's whole residual branch with probability ``p`` while
    training, scaling the kept ones by ``1/(1-p)`` (as timm's ``DropPath``, without importing timm)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep.div_(1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class AttentionPool(nn.Module):
    """Multi-head attention pooling (MAP; Zhai et al. 2022, SigLIP's head, timm's ``AttentionPoolLatent``): a learned
    latent query attends to the tokens, then a residual MLP: ``(B, T, dim) -> (B, dim)``. No positions: it reads the
    tokens the blocks made, at any grid size."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, act: str = "gelu", norm_layer: str = "layernorm",
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = make_norm(norm_layer, dim, eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        q = rearrange(self.q(self.latent), "1 l (h d) -> 1 h l d", h=self.num_heads).expand(x.shape[0], -1, -1, -1)
        k, v = rearrange(self.kv(x), "b t (s h d) -> s b h t d", s=2, h=self.num_heads).unbind(0)
        x = self.proj(rearrange(F.scaled_dot_product_attention(q, k, v), "b h l d -> b l (h d)"))
        x = x + self.mlp(self.norm(x))
        return x[:, 0]
