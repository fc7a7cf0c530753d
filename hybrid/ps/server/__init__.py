"""Server side of the parameter servers: table shards, row-sparse optimizers, row memory, and the
entry points trainers call (:mod:`hybrid.ps.server.service`)."""
