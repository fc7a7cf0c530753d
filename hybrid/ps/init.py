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

from hybrid import ops
from hybrid.ops.reference import fmix32, mul32  # noqa: F401 - the hash, also for the synthetic data

_M32 = 0xFFFFFFFF
CHUNK_ROWS = 1 << 22
"""Rows :func:`init_tables` fills at once (their ids: 32 MiB of int64 at most)."""


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
    ops.initial_rows_(out, rows, key=table_key(seed, name), bound=(1.0 / num_embeddings) ** 0.5)
    return out


def init_tables(ebc: torch.nn.Module, *, seed: int = 0, path: str | None = None) -> torch.nn.Module:
    """Fill every table of a local ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) with
    the values the parameter servers give it in a hybrid run with the same ``seed`` (compose's
    ``seed``): the one-process twin of a hybrid run's tables, bit for bit, whatever the sharding
    and the number of servers. Tables on the meta device are allocated on the CPU first. Returns
    ``ebc``. Public as ``hybrid.init_tables``.

    A plain ``nn.Embedding`` / ``nn.EmbeddingBag`` works too, given ``path``, its module path in
    the model (its table is named after it); its ``padding_idx`` row is zero, as on the servers."""
    import torch.nn as nn

    from hybrid.ps.config import single_table_name

    if isinstance(ebc, (nn.Embedding, nn.EmbeddingBag)):
        if path is None:
            raise ValueError(f"init_tables: a plain {type(ebc).__name__}'s table is named after its module path; "
                             f"pass path='<its path in the model>'")
        tables = [(single_table_name(path), ebc.num_embeddings, ebc.embedding_dim, ebc)]
    else:
        configs = ebc.embedding_bag_configs() if hasattr(ebc, "embedding_bag_configs") else ebc.embedding_configs()
        modules = ebc.embedding_bags if hasattr(ebc, "embedding_bags") else ebc.embeddings
        tables = [(c.name, c.num_embeddings, c.embedding_dim, modules[c.name]) for c in configs]
    with torch.no_grad():
        for name, num_embeddings, dim, module in tables:
            if module.weight.is_meta:
                module.to_empty(device="cpu")
            for start in range(0, num_embeddings, CHUNK_ROWS):
                rows = torch.arange(start, min(start + CHUNK_ROWS, num_embeddings))
                initial_rows(name, num_embeddings, dim, rows, seed=seed,
                             out=module.weight[start : start + rows.numel()])
            if getattr(module, "padding_idx", None) is not None:
                module.weight[module.padding_idx].zero_()
    return ebc
