"""What a decoder's routes share (`app.state.decoder`): its config, connector, metrics and, once loaded, its engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.handoff import HandoffEndpoints
from decoder_service.metrics import DecoderMetrics
from decoder_service.shell import Engine
from epd_common.errors import APIError
from epd_contracts.embeddings import ImageFeatures


@dataclass
class DecoderState:
    """Everything the routes share (`app.state.decoder`); the engine exists once the LM is loaded."""

    cfg: DecoderConfig
    consumer: ECConsumer
    metrics: DecoderMetrics
    engine: Engine | None = None
    embedding_check: EmbeddingCheck | None = None
    identity: dict[str, object] = field(default_factory=dict)
    refused: str | None = None  # why it would not start (a KVPlanError: the budget cannot hold what was asked)
    handoff: HandoffEndpoints = field(default_factory=HandoffEndpoints)  # its K/V endpoints for its --role

    def check_embedding(self, out: ImageFeatures) -> str | None:
        """The consumer's check of every gathered embedding (gathers only run once the LM is loaded)."""
        assert self.embedding_check is not None, "the LM is not loaded yet"
        return self.embedding_check(out)

    def ready_engine(self) -> Engine:
        """The engine, or a 503 while it loads or once it cannot make progress."""
        if self.engine is None:
            raise APIError(503, "decoder is loading", code="not_ready")
        if (problem := self.engine.problem()) is not None:  # cheap: a few attribute reads
            raise APIError(503, problem[1], code=problem[0])
        return self.engine
