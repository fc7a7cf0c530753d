"""Remote collections built by hand on a trainer, as ``hybrid.compose`` builds them from a plan."""

from __future__ import annotations

from torch import nn

from hybrid.ps.client import (
    RemoteCollection,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    StepPipeline,
)


def remote_of(ebc, pipeline: StepPipeline, *, cid: str, num_servers: int, sharding: str = "row_wise",
              optimizer: dict, num_trainers: int = 1, trainer: int = 0, seed: int = 0, hot_rows: int = 0,
              **options) -> RemoteCollection:
    """A remote stand-in for ``ebc``'s tables (its shapes: it may be on meta) on ``pipeline``: a
    :class:`RemoteEmbeddingBagCollection` for an ``EmbeddingBagCollection``, a
    :class:`RemoteEmbeddingCollection` for an ``EmbeddingCollection``. Trainer 0 creates it, each
    server filling its rows as ``hybrid.init_tables(ebc, seed=seed)`` fills a local collection
    (the other trainers must wait for that, e.g. at a barrier, before they look up).
    ``hot_rows``: the trainer's hot-row cache (:mod:`hybrid.ps.client.cache`)."""
    config = RemoteCollection.config_from(ebc, cid=cid, num_servers=num_servers, sharding=sharding,
                                          optimizer=optimizer, num_trainers=num_trainers, init_seed=seed, **options)
    if hasattr(ebc, "embedding_bag_configs"):
        remote = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names,
                                              hot_rows=hot_rows)
    else:
        remote = RemoteEmbeddingCollection(config, pipeline=pipeline, server_names=pipeline.server_names,
                                           need_indices=ebc.need_indices(), hot_rows=hot_rows)
    if trainer == 0:
        remote.create_on_servers(init="seed")
    return remote


def remote_embedding(emb: nn.Embedding, pipeline: StepPipeline, *, cid: str, num_servers: int,
                     sharding: str = "row_wise", optimizer: dict, num_trainers: int = 1, trainer: int = 0,
                     seed: int = 0, **options) -> RemoteEmbedding:
    """A remote stand-in for a plain ``nn.Embedding`` (its table named after ``cid``, filled as
    ``hybrid.init_tables(emb, seed=seed, path=cid)`` fills a local one; trainer 0 creates it)."""
    local = RemoteEmbedding.as_collection(emb, cid=cid)
    config = RemoteCollection.config_from(local, cid=cid, num_servers=num_servers, sharding=sharding,
                                          optimizer=optimizer, num_trainers=num_trainers, init_seed=seed, **options)
    coll = RemoteEmbeddingCollection(config, pipeline=pipeline, server_names=pipeline.server_names)
    remote = RemoteEmbedding(coll, padding_idx=emb.padding_idx)
    if trainer == 0:
        coll.create_on_servers(init="seed")
        remote.zero_padding_row()
    return remote


def remote_bag(bag: nn.EmbeddingBag, pipeline: StepPipeline, *, cid: str, num_servers: int, optimizer: dict,
               **options) -> RemoteEmbeddingBag:
    """A remote stand-in for a plain ``nn.EmbeddingBag``, created with its weight (one trainer):
    given weights streamed to the servers, as for pretrained tables."""
    local = RemoteEmbeddingBag.as_collection(bag, cid=cid)
    config = RemoteCollection.config_from(local, cid=cid, num_servers=num_servers, optimizer=optimizer,
                                          num_trainers=1, **options)
    coll = RemoteEmbeddingBagCollection(config, pipeline=pipeline, server_names=pipeline.server_names)
    coll.create_on_servers(init="zeros")
    coll.write_tables({config.tables[0].name: bag.weight.detach()})
    return RemoteEmbeddingBag(coll, include_last_offset=bag.include_last_offset)
