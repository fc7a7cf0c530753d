"""Initial table values that depend only on (seed, table, row id), never on the layout.

A server creates its shard of a table and fills each row it holds with
:func:`initial_rows` of that row's global id; a single process filling a plain
``EmbeddingBagCollection`` with :func:`init_tables` (``hybrid.init_tables``) gets bit-identical
rows. So table-wise, row-wise, one or many servers, and the plain model all start from the same
tables, and no table ever has to exist on a trainer to be copied to the servers.

Each value is TorchRec's default init -- uniform in ``[-sqrt(1/rows), sqrt(1/rows))`` -- drawn
from a counter-based generator: element ``(row, col)`` of table ``name`` is a fixed 32-bit hash
of ``(seed, crc32(name), row, col)`` (the lowbias32 finalizer, chained over the 32-bit halves),
whose top 24 bits give the uniform float. No state, no order: any subset of rows can be made
anywhere, in any order, in bounded chunks.
"""

from __future__ import annotations

import zlib

import torch

_M32 = 0xFFFFFFFF
CHUNK_ELEMENTS = 1 << 22
"""Elements computed at once (bounded temporary memory: a few int64 tensors of this size)."""


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)``, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """The lowbias32 finalizer of ``h`` in ``[0, 2**32)``: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def table_key(seed: int, name: str) -> int:
    """The 32-bit key of one table's values."""
    mixed = fmix32(torch.tensor([(seed & _M32) ^ zlib.crc32(name.encode())], dtype=torch.int64))
    return int(fmix32(mixed ^ ((seed >> 32) & _M32))[0])


def initial_rows(name: str, num_embeddings: int, dim: int, rows: torch.Tensor, *, seed: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The initial values of global rows ``rows`` (int64, any order) of table ``name``
    (``num_embeddings`` x ``dim``): ``[len(rows), dim]`` float32 (into ``out`` if given, which
    may be of another float dtype: the values are rounded into it)."""
    rows = rows.to(torch.int64).reshape(-1)
    out = torch.empty(rows.numel(), dim) if out is None else out
    key = table_key(seed, name)
    bound = (1.0 / num_embeddings) ** 0.5
    cols = torch.arange(dim, dtype=torch.int64)
    step = max(1, CHUNK_ELEMENTS // max(dim, 1))
    for start in range(0, rows.numel(), step):
        r = rows[start : start + step].unsqueeze(1)
        h = fmix32((r & _M32) ^ key)
        h = fmix32(h ^ ((r >> 32) & _M32))
        h = fmix32(h ^ cols)
        u = (h >> 8).to(torch.float32) * (2.0 / (1 << 24)) - 1.0  # [-1, 1), exact in float32
        out[start : start + step] = u * bound
    return out


def init_tables(ebc: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """Fill every table of a local ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) with
    the values the parameter servers give it in a hybrid run with the same ``seed`` (compose's
    ``seed``): the one-process twin of a hybrid run's tables, bit for bit, whatever the sharding
    and the number of servers. Tables on the meta device are allocated on the CPU first. Returns
    ``ebc``. Public as ``hybrid.init_tables``."""
    configs = ebc.embedding_bag_configs() if hasattr(ebc, "embedding_bag_configs") else ebc.embedding_configs()
    modules = ebc.embedding_bags if hasattr(ebc, "embedding_bags") else ebc.embeddings
    with torch.no_grad():
        for c in configs:
            module = modules[c.name]
            if module.weight.is_meta:
                module.to_empty(device="cpu")
            initial_rows(c.name, c.num_embeddings, c.embedding_dim, torch.arange(c.num_embeddings), seed=seed,
                         out=module.weight)
    return ebc
