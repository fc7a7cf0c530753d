"""Embedding tables on parameter servers.

- :mod:`hybrid.ps.config`, :mod:`hybrid.ps.sharding`, :mod:`hybrid.ps.init`: what trainers and
  servers agree on -- a collection's tables, layout, optimizer, initial values;
- :mod:`hybrid.ps.protocol`: the messages between them (one definition, versioned);
- :mod:`hybrid.ps.transport`: how messages travel (RPC; shared memory on one host);
- :mod:`hybrid.ps.client`: code that runs on trainers;
- :mod:`hybrid.ps.server`: code that runs on servers.
"""
