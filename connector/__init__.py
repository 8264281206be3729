"""ZeroMQ encoder-cache (EC) connector: encoders save embeddings, decoders gather them by mm_hash.

Two planes, split so that a process without torch (the proxy, the scheduler) can follow the fleet's caches:

- `connector.control` (torch-free): wire framing, CURVE keys and security, the producer request client
  (`ProducerClient`: has/ping/snapshot), and the fleet cache index that subscribes to cache events.
- `connector.tensors` (imports torch): the byte-bounded embedding cache, the producer (serves tensors and
  publishes events), the consumer (gathers tensors), and tensor framing.

Headers are the msgspec Structs of `epd_contracts.ec`. This file imports nothing: import the module you need.
"""
