"""The connector's tensor plane (imports torch): embedding cache, producer, consumer and tensor framing."""
