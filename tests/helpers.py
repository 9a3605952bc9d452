"""Small helpers shared by the test modules."""
from typing import Sequence

import torch
from torch import Tensor


def max_rel_err(a: Tensor, b: Tensor) -> float:
    """``max |a - b| / max |b|`` (a scale-free error that does not blow up near zeros)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_close_rel(outs: Sequence[Tensor], refs: Sequence[Tensor], tol: float = 1e-5) -> None:
    assert len(outs) == len(refs), (len(outs), len(refs))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape, f'output {i}: {tuple(o.shape)} vs {tuple(r.shape)}'
        err = max_rel_err(o, r)
        assert err <= tol, f'output {i}: relative error {err:.3g} > {tol:g}'


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norms included) random values so parity tests see all weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ('norm' in name or name.endswith('bias')):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith(
                    'weight') else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module
