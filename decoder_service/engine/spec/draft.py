"""The draft-model proposer (vLLM's `{"model": PATH, "num_speculative_tokens": k}`): a smaller checkpoint of a family
this decoder serves, with the target's tokenizer, proposes k tokens per row by greedy decoding on its own paged
pool (its own `ModelRunner`, on the engine thread, before the target's step).

What the draft sees: the prompt's text tokens and the sequence's output. Image, video and audio embeddings are the
target's (encoded for its hidden size), so the draft's prompt has every media placeholder replaced by token 0: it
proposes from the text around the media. Its greedy choice is a deterministic proposal, so verification's rule
(spec/verify.py) keeps the target's output exactly as without speculation, whatever the draft proposes.

Each row's draft K/V follows the target's accepted tokens: the tokens the draft has fed are kept per row; at the next
proposal the row's length goes back to where they and the sequence's text last agree (drafts the target rejected
are dropped without copies), the tokens since then are fed in one segment (a verification-shaped query of several
positions, whose last logits give the first draft), then k - 1 batched one-token steps give the rest. A row new to
the draft prefills its text first, at most PREFILL_TOKENS a step over all such rows (no proposals for it until it
is done). Rows that left the target's batch leave the draft's.
"""
from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.outputs import SchedulerOutput
from decoder_service.engine.spec.ngram import MASKED
from decoder_service.engine.work import Prompt
from epd_models.halves import LanguageHalf

if TYPE_CHECKING:
    from decoder_service.engine.sequence import Sequence

PREFILL_TOKENS = 2048  # the draft's prompt positions prefilled per step, over its rows still prefilling
Want = dict[Hashable, tuple["Sequence", np.ndarray, int]]  # row key -> (its sequence, its text so far, tokens wanted)


def check_draft(target_dir: str | Path, draft_dir: str | Path) -> None:
    """ValueError unless the draft checkpoint's tokenizer is the target's (same vocabulary, same ids)."""
    from transformers import AutoTokenizer

    target, draft = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"the draft model {draft_dir} does not have the target's tokenizer ({len(draft)} tokens "
                         f"against {len(target)}, or the same tokens under other ids): its proposals would be "
                         "other tokens")


class DraftModel:
    """A draft language model with its own pool; `propose` is one step's proposals for many rows."""

    def __init__(self, path: str | Path, target: LanguageHalf, max_slots: int, max_len: int, block_size: int,
                 num_blocks: int, decode_kernel: Any = None):
        self.lm = LanguageHalf(path, dtype=target.dtype, device=target.device)
        self.vocab = min(int(self.lm.module.lm_head.out_features), int(target.module.lm_head.out_features))
        self.runner = ModelRunner(self.lm, max_slots, max_len, chunk=1 << 30, prefix_block=block_size,
                                  num_blocks=num_blocks)
        self.runner.use_decode_kernel(decode_kernel)  # the target's: the same device and choice
        self.fed: dict[Hashable, list[int]] = {}  # row key -> the tokens whose K/V its draft row holds

    def propose(self, want: Want, running: set[Hashable]) -> dict[Hashable, list[int]]:
        for key in [k for k in self.fed if k not in running]:  # rows that left the target's batch
            self._drop(key)
        texts = {key: [0 if t == MASKED else int(t) for t in history] for key, (_, history, _) in want.items()}
        started = self._start(texts)
        first = started | self._catch_up({k: t for k, t in texts.items() if k not in started})
        drafts = {key: [tok] for key, tok in first.items()}
        for _ in range(1, max((k for _, _, k in want.values()), default=0)):
            active = {key: d[-1] for key, d in drafts.items() if len(d) < want[key][2] and d[-1] < self.vocab
                      and self.runner.rows[key].length + 1 < self.runner.max_len}
            if not active or self.runner.blocks_to_grow(active) > self.runner.num_free_blocks:
                break
            self.runner.grow(active)
            logits = self.runner.decode(active)
            for key, token in active.items():
                self.fed[key].append(token)
                drafts[key].append(int(torch.argmax(logits[key])))
        return {key: [t for t in d if t < self.vocab] for key, d in drafts.items()}

    def close(self) -> None:
        for key in list(self.fed):
            self._drop(key)

    def _start(self, texts: dict[Hashable, list[int]]) -> dict[Hashable, int]:
        """Rows new to the draft take a row for their text (within free rows and blocks); the draft prefills at most
        PREFILL_TOKENS a step, so a long prompt never stalls the target's step. A row whose prefill ends on this
        step's text gives its first draft token; one whose text grew meanwhile catches up next step."""
        for key, text in texts.items():
            if key in self.fed or self.runner.num_free_slots < 1 or len(text) + 1 >= self.runner.max_len:
                continue
            if self.runner.blocks_to_admit(len(text), 1, None) > self.runner.num_free_blocks:
                continue
            self.runner.add(key, Prompt(torch.tensor([text]), []))
            self.fed[key] = list(text)
        if not self.runner.num_prefill_tokens_left:
            return {}
        logits = self.runner.prefill(PREFILL_TOKENS)
        return {key: int(torch.argmax(lg)) for key, lg in logits.items() if self.fed.get(key) == texts.get(key)}

    def _catch_up(self, texts: dict[Hashable, list[int]]) -> dict[Hashable, int]:
        """Rows the draft holds: back to where its tokens and the text agree, the rest fed in one forward."""
        feed: dict[Hashable, int] = {}
        more: dict[Hashable, list[int]] = {}
        for key, text in texts.items():
            fed = self.fed.get(key)
            if fed is None or not self.runner.rows[key].prefilled:
                continue
            same = min(_common(fed, text), len(text) - 1)  # the pending token at least is fed
            row = self.runner.rows[key]
            if same < row.target or self.runner.blocks_to_cover(key, len(text)) > self.runner.num_free_blocks:
                self._drop(key)  # cannot happen for a live row (its text only grows); or no blocks: none this step
                continue
            row.length = same
            self.runner.cover(key, len(text))
            self.fed[key] = list(text)
            feed[key], more[key] = text[same], text[same + 1:]
        if not feed:
            return {}
        out = self.runner.run(SchedulerOutput(decode=feed, prefill_budget=0,
                                              drafts={k: m for k, m in more.items() if m}))
        firsts = {key: int(torch.argmax(out.logits[key])) for key in feed if key in out.logits}
        firsts |= {key: int(torch.argmax(logits[-1])) for key, (logits, _) in out.verify.items()}
        for key in feed:
            if key not in firsts:  # its forward failed: it starts again next time
                self._drop(key)
        return firsts

    def _drop(self, key: Hashable) -> None:
        self.runner.remove(key)
        self.fed.pop(key, None)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n
