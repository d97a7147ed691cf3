"""Synthetic clustered KV caches with a realistic attention structure (tests and benchmarks).

Keys are a mixture of Gaussians around ``centers`` directions plus one large shared offset (as in
real LLM keys), assigned in short runs so neighbouring tokens tend to share a component; values
have one mean per component. Queries point at a few components each, so a handful of clusters
carries most of the attention mass and the rest forms a long, flat tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SyntheticCache:
    k: torch.Tensor        # [B, Hkv, N, D]
    v: torch.Tensor        # [B, Hkv, N, D]
    centers: torch.Tensor  # [Hkv, C, D] key component means (without the shared offset)
    component: torch.Tensor  # [B, Hkv, N] int64 component of every token
    seed: int

    def queries(self, steps: int, num_heads: int, strength: float = 1.5, noise: float = 1.0,
                topics: int = 2, seed: int = 1) -> torch.Tensor:
        """``[steps, B, H, 1, D]`` queries.

        At each step the query heads sharing a KV head aim at the same ``topics`` key components
        (grouped heads are trained on one key space and tend to agree), each head with its own
        random mix of them, plus noise.
        """
        B, hkv, _, D = self.k.shape
        g = torch.Generator().manual_seed(self.seed * 1000 + seed)
        group = num_heads // hkv
        C = self.centers.shape[1]
        pick = torch.randint(0, C, (steps, B, hkv, topics), generator=g)
        cen = self.centers[torch.arange(hkv).view(1, 1, -1, 1), pick]  # [steps, B, Hkv, topics, D]
        mix = torch.rand(steps, B, hkv, group, topics, generator=g)
        mix = mix / mix.sum(-1, keepdim=True)
        aim = torch.einsum("sbhgt,sbhtd->sbhgd", mix, cen).reshape(steps, B, num_heads, D)
        q = strength * aim + noise * torch.randn(steps, B, num_heads, D, generator=g)
        return q.unsqueeze(-2)  # [steps, B, H, 1, D]


def synthetic_cache(n: int, num_kv_heads: int = 2, head_dim: int = 64, batch: int = 1,
                    centers: int = 48, noise: float = 0.5, offset: float = 3.0, run: int = 16,
                    seed: int = 0) -> SyntheticCache:
    """A clustered cache of ``n`` tokens (float32)."""
    g = torch.Generator().manual_seed(seed)
    D = head_dim
    cen = torch.randn(num_kv_heads, centers, D, generator=g)
    shared = offset * torch.randn(1, num_kv_heads, 1, D, generator=g)
    vcen = torch.randn(num_kv_heads, centers, D, generator=g)
    # Component of each token: runs of geometric length (mean `run`), per row and head.
    runs = n // run + 2
    comp = torch.randint(0, centers, (batch, num_kv_heads, runs), generator=g)
    # Geometric lengths by inverse CDF from this cache's own generator (torch.distributions would
    # draw from the global one, making a cache depend on whatever ran before it).
    u = torch.rand(batch * num_kv_heads * runs, generator=g).clamp_min(torch.finfo(torch.float32).tiny)
    lens = torch.floor(torch.log(u) / torch.log1p(torch.tensor(-1.0 / run))).long().clamp_min(1)
    z = torch.empty(batch, num_kv_heads, n, dtype=torch.int64)
    flat_len = lens.view(batch, num_kv_heads, runs)
    for b in range(batch):
        for h in range(num_kv_heads):
            ids = comp[b, h].repeat_interleave(flat_len[b, h])
            while ids.numel() < n:
                ids = torch.cat([ids, comp[b, h]])
            z[b, h] = ids[:n]
    hidx = torch.arange(num_kv_heads).view(1, -1, 1)
    k = cen[hidx, z] + shared + noise * torch.randn(batch, num_kv_heads, n, D, generator=g)
    v = vcen[hidx, z] + 0.5 * torch.randn(batch, num_kv_heads, n, D, generator=g)
    return SyntheticCache(k.float(), v.float(), cen, z, seed)
