"""This step's proposals: which decoding rows verify drafts, and their blocks.

`Speculator.drafts` runs in `Scheduler.schedule` once every decoding row has the block its next position needs: for
each row (none while more than `disable_by_batch_size` sequences are running or waiting), the proposer's tokens, cut so the verification
fits what the request may still emit (max_tokens), the context (max_model_len) and the free blocks (a row never
preempts another for its drafts: a step short of blocks proposes less). The blocks the drafts' positions need are
taken now; positions rejected later are just not counted in the row's length (their K/V is overwritten by the next
step, never copied), and a block past the accepted ones stays the row's for its next tokens.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from decoder_service.engine.spec.config import SpecConfig
from decoder_service.engine.spec.ngram import propose, text_history
from decoder_service.engine.spec.stats import SpecStats

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import ModelRunner
    from decoder_service.engine.rows import RowTable
    from decoder_service.engine.sequence import Job, Sequence
    from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
_MEDIA_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                     "audio_token_id", "audio_token_index")


def media_token_ids(config: object) -> set[int]:
    """The placeholder ids a family writes for image, video and audio rows (its config's, and its text config's)."""
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    ids = {getattr(c, k, None) for c in configs for k in _MEDIA_TOKEN_KEYS}
    return {int(i) for i in ids if isinstance(i, int) and i >= 0}


class Speculator:
    """The n-gram proposer over each sequence's text so far, and the counts /metrics reads."""

    def __init__(self, cfg: SpecConfig, config: object):
        self.cfg = cfg
        self.media = media_token_ids(config)
        self.stats = SpecStats(cfg.num_speculative_tokens)
        self._prompts: weakref.WeakKeyDictionary[Job, np.ndarray] = weakref.WeakKeyDictionary()

    def drafts(self, feed: dict[Hashable, int], running: dict[int, Sequence], rows: RowTable, free_blocks: int,
               load: int = 0) -> dict[Hashable, list[int]]:
        """Each decoding row's drafts (none proposed: no entry), their blocks taken out of `free_blocks`. None at all
        while more than disable_by_batch_size sequences are in the engine (`load`: running, prefilling, waiting or
        preempted; at least the decoding rows), as vLLM counts its requests."""
        cfg = self.cfg
        if not feed or max(load, len(feed)) > cfg.disable_by_batch_size:
            return {}
        want: dict[Hashable, tuple[Sequence, int]] = {}
        for key in feed:
            seq, row = running[key], rows.rows[key]  # type: ignore[index]  # engine keys are ints
            k = min(cfg.num_speculative_tokens, rows.max_len - 1 - row.length)
            if seq.max_tokens is not None:  # a verification emits up to k + 1 tokens
                k = min(k, seq.max_tokens - seq.num_generated - 1)
            if k > 0:
                want[key] = (seq, k)
        out: dict[Hashable, list[int]] = {}
        for key, draft in self.propose_all(want, set(running)).items():
            length = rows.rows[key].length
            draft = draft[: want[key][1]]
            while draft and rows.blocks_to_cover(key, length + len(draft) + 1) > free_blocks:
                draft = draft[:-1]
            if draft:
                free_blocks -= rows.cover(key, length + len(draft) + 1)
                out[key] = draft
        return out

    def propose_all(self, want: dict[Hashable, tuple[Sequence, int]], running: set[Hashable]
                    ) -> dict[Hashable, list[int]]:
        """Each row's proposal of up to k tokens (`want`: row key -> (sequence, k))."""
        return {key: self.propose(seq, k) for key, (seq, k) in want.items()}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow the sequence's pending one: the n-gram lookup over its text so far."""
        return propose(self.history(seq), k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min)

    def history(self, seq: Sequence) -> np.ndarray:
        """The sequence's text so far: its prompt's text tokens (media masked), then its output."""
        return np.concatenate([self._prompt(seq.job), np.asarray(seq.generated, dtype=np.int64)])

    def close(self) -> None:
        """Nothing held (a draft model's rows are)."""

    def _prompt(self, job: Job) -> np.ndarray:
        history = self._prompts.get(job)
        if history is None:
            history = self._prompts[job] = text_history(job.prompt.input_ids[0].tolist(), self.media)
        return history


class DraftSpeculator(Speculator):
    """Proposals from a draft model (spec/draft.py) instead of the n-gram lookup."""

    def __init__(self, cfg: SpecConfig, target: LanguageHalf, max_slots: int, max_len: int, block_size: int,
                 num_blocks: int, decode_kernel: Any = None):
        super().__init__(cfg, target.config)
        from decoder_service.engine.spec.draft import DraftModel  # loads a model: only when one is asked for
        from epd_models.resolve import resolve_model

        self.draft = DraftModel(resolve_model(cfg.model), target, max_slots, max_len, block_size, num_blocks,
                                decode_kernel)

    def propose_all(self, want: dict[Hashable, tuple[Sequence, int]], running: set[Hashable]
                    ) -> dict[Hashable, list[int]]:
        try:
            return self.draft.propose({key: (seq, self.history(seq), k) for key, (seq, k) in want.items()}, running)
        except Exception:  # noqa: BLE001 - the draft's fault costs this step its proposals, never a request
            logger.exception("the draft model failed to propose; its rows start again")
            self.draft.close()
            return {}

    def close(self) -> None:
        self.draft.close()


class Eagle3Speculator(Speculator):
    """Proposals from EAGLE-3 heads (spec/eagle3.py), fed by the target's hidden states of every forward."""

    def __init__(self, cfg: SpecConfig, target: LanguageHalf, runner: ModelRunner):
        super().__init__(cfg, target.config)
        from decoder_service.engine.spec.eagle3 import Eagle3  # reads a checkpoint: only when one is asked for
        from epd_models.resolve import resolve_model

        self.eagle = Eagle3(resolve_model(cfg.model), target)
        runner.after_forward = self.eagle.filed
        if runner.graphs is not None:  # a replayed graph runs no hooks: every step eager
            logger.info("EAGLE-3 reads the target's hidden states of every step: CUDA graphs off")
            runner.graphs = None

    def drafts(self, feed: dict[Hashable, int], running: dict[int, Sequence], rows: RowTable, free_blocks: int,
               load: int = 0) -> dict[Hashable, list[int]]:
        self.eagle.forget(set(running))
        return super().drafts(feed, running, rows, free_blocks, load)

    def propose_all(self, want: dict[Hashable, tuple[Sequence, int]], running: set[Hashable]
                    ) -> dict[Hashable, list[int]]:
        try:
            return self.eagle.propose({key: (self.history(seq), k) for key, (seq, k) in want.items()})
        except Exception:  # noqa: BLE001 - the head's fault costs this step its proposals, never a request
            logger.exception("the EAGLE-3 head failed to propose; its rows start again")
            self.eagle.reset()
            return {}


def make_speculator(cfg: SpecConfig, target: LanguageHalf, runner: ModelRunner, num_blocks: int) -> Speculator:
    """The n-gram proposer, a draft model's (its pool: as many blocks as the target's, at most what max_slots rows
    of max_len need) or EAGLE-3 heads'."""
    if cfg.method == "ngram":
        return Speculator(cfg, target.config)
    if cfg.method == "eagle3":
        return Eagle3Speculator(cfg, target, runner)
    blocks = min(num_blocks, runner.max_slots * -(-runner.max_len // runner.block_size) + 1)
    return DraftSpeculator(cfg, target, runner.max_slots, runner.max_len, runner.block_size, blocks,
                           runner.cache.decode_kernel)
