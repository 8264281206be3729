"""EAGLE-3 heads (vLLM's `{"method": "eagle3", "model": PATH, "num_speculative_tokens": k}`), in the published format:
a directory with `config.json` (a Llama layer's sizes, `draft_vocab_size`, optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors holding `fc`, `midlayer.*` (one decoder layer whose
attention reads [token embedding; hidden] of twice the width, with `hidden_norm`), `norm`, `lm_head` over the draft
vocabulary and `d2t` (draft id -> target id offset); names prefixed `model.layers.0.` (vLLM's) are read too.

What the head sees: the target's hidden states entering three of its layers (2, L // 2, L - 3 unless the config names
them), captured by forward pre-hooks during every target forward (`ModelRunner.after_forward` files them by row and
position), so image, video and audio positions reach it as the target computed them; and the target's embedding of
each next token (a media position's next token is its placeholder's embedding, not the media row). Position i's input
is fc(aux_i) with the embedding of token i + 1; its output, normed, gives the token after that, and its pre-norm
hidden feeds the next draft position.

Per row, the head keeps its own K/V (one layer, a dense tensor per row: rows here are few, at most
disable_by_batch_size) for the positions it has consumed; each proposal first consumes the positions the target has
computed since (kept tokens only: their captured features), then drafts k tokens, then drops the drafted positions'
K/V. Positions the target never computed here (a prefix from the cache, a hand-off's prompt, a fork's prompt) have no
features: the head skips them and attends to less. Greedy on the draft vocabulary: a deterministic proposal, so
verification (spec/verify.py) keeps the target's output exact.
"""
from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from epd_models.halves import LanguageHalf

MAX_FEATURES = 512  # captured positions kept per row (3 x hidden each); the head skips older ones


def aux_layers(config: dict[str, Any], num_layers: int) -> list[int]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = list(ids) if ids else [2, num_layers // 2, num_layers - 3]
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads the hidden states entering 3 of the target's {num_layers} layers; "
                         f"its layer ids {ids} are not that")
    return ids


def check_head(target_dir: str | Path, path: str | Path) -> None:
    """ValueError unless `path` holds EAGLE-3 heads this target can feed (config only: no weight read)."""
    from epd_models.registry import load_config

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"EAGLE-3 heads {path}: cannot read {file.name}: {exc}") from None
    text = load_config(target_dir).get_text_config()
    if raw.get("hidden_size") != text.hidden_size:
        raise ValueError(f"EAGLE-3 heads {path}: hidden size {raw.get('hidden_size')} is not the target's "
                         f"{text.hidden_size}")
    aux_layers(raw, int(text.num_hidden_layers))
    if not list(Path(path).glob("*.safetensors")):
        raise ValueError(f"EAGLE-3 heads {path}: no .safetensors file")


class Eagle3Head(nn.Module):
    def __init__(self, path: str | Path, target: LanguageHalf):
        super().__init__()
        raw = json.loads((Path(path) / "config.json").read_text())
        text = target.config.get_text_config()
        self.cfg = cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")})
        h, target_h = cfg.hidden_size, int(raw.get("target_hidden_size") or text.hidden_size)
        if h != text.hidden_size:
            raise ValueError(f"EAGLE-3 head hidden size {h} is not the target's {text.hidden_size}")
        heads, kv = int(cfg.num_attention_heads or 1), int(cfg.num_key_value_heads or cfg.num_attention_heads or 1)
        self.head_dim = hd = int(getattr(cfg, "head_dim", None) or h // heads)
        self.heads, self.kv = heads, kv
        self.layers = aux_layers(raw, int(text.num_hidden_layers))
        self.fc = nn.Linear(3 * target_h, h, bias=False)
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(h, cfg.rms_norm_eps), LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(cfg)
        self._load(Path(path))
        self.to(target.device, target.dtype)

    def _load(self, path: Path) -> None:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state.update(load_file(file))
        renamed = {}
        for name, t in state.items():
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            name = name.replace("midlayer.self_attn.", "").replace("midlayer.mlp.", "mlp.").replace("midlayer.", "")
            renamed[name] = t
        renamed.pop("embed_tokens.weight", None)  # the target's embedding is used
        renamed.pop("t2d", None)
        if "d2t" in renamed:
            renamed["d2t"] = renamed["d2t"].long()
        missing, unexpected = self.load_state_dict(renamed, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.") and m != "d2t"]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 head {path}: missing {missing[:6]}, unexpected {unexpected[:6]}")

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int], cache: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of m positions of one row: (m, H) token embeddings and hidden inputs; `cache` [K, V] of
        (kv, n, hd), extended in place. Returns (logits over the draft vocabulary, pre-norm hidden), (m, ...)."""
        m = embeds.shape[0]
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = self.q_proj(x).view(m, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(m, self.kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(m, self.kv, self.head_dim).transpose(0, 1)
        cos, sin = self.rotary(x.unsqueeze(0), torch.tensor([positions], device=x.device))
        q, k = apply_rotary_pos_emb(q.unsqueeze(0), k.unsqueeze(0), cos, sin)
        q, k = q[0], k[0]
        cache[0] = torch.cat([cache[0], k], dim=1)
        cache[1] = torch.cat([cache[1], v], dim=1)
        n = cache[0].shape[1]
        mask = torch.ones(m, n, dtype=torch.bool, device=x.device).tril(n - m)
        rep = self.heads // self.kv
        out = F.scaled_dot_product_attention(q, cache[0].repeat_interleave(rep, 0), cache[1].repeat_interleave(rep, 0),
                                             attn_mask=mask)
        h = self.o_proj(out.transpose(0, 1).reshape(m, -1)) + residual
        h = self.mlp(self.post_attention_layernorm(h)) + h
        return self.lm_head(self.norm(h)), h


class Eagle3:
    """The head, the target's hidden states captured by row and position, and each row's head K/V."""

    def __init__(self, path: str | Path, target: LanguageHalf):
        self.target = target
        self.head = Eagle3Head(path, target).eval()
        self.vocab = int(target.module.lm_head.out_features)
        self._seen: list[torch.Tensor] = []
        self.aux: dict[Hashable, dict[int, torch.Tensor]] = {}  # row key -> position -> (3 * H,) features
        self.cache: dict[Hashable, tuple[list[torch.Tensor], int]] = {}  # row key -> ([K, V], next position)
        layers = target.module.language_model.layers
        for i in self.head.layers:
            layers[i].register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self._seen.append(hidden[0])

    def filed(self, layout: list[tuple[Hashable, int, int]]) -> None:
        """After a target forward: its captured states filed by row and position (ModelRunner.after_forward)."""
        seen, self._seen = self._seen, []
        if len(seen) != 3:
            return
        feats = torch.cat(seen, dim=-1)
        at = 0
        for key, start, num in layout:
            rows = self.aux.setdefault(key, {})
            first = max(0, num - MAX_FEATURES)  # a long prompt chunk: its last positions only
            kept = feats[at + first: at + num].clone()  # not views: the step's whole matrix would stay alive
            for j in range(num - first):
                rows[start + first + j] = kept[j]
            if len(rows) > MAX_FEATURES:  # a row not proposing for long (a large batch): its oldest go
                for p in sorted(rows)[: len(rows) - MAX_FEATURES]:
                    del rows[p]
            at += num

    def forget(self, running: set[Hashable]) -> None:
        """Rows that left the target's batch: their features and K/V go."""
        for key in [k for k in self.aux if k not in running] + [k for k in self.cache if k not in running]:
            self.aux.pop(key, None)
            self.cache.pop(key, None)

    def reset(self) -> None:
        self.aux.clear()
        self.cache.clear()
        self._seen = []

    @torch.inference_mode()
    def propose(self, want: dict[Hashable, tuple[np.ndarray, int]]) -> dict[Hashable, list[int]]:
        return {key: d for key, (history, k) in want.items() if (d := self._row(key, history, k))}

    def _row(self, key: Hashable, history: np.ndarray, k: int) -> list[int]:
        pending = len(history) - 1  # its position; the target has computed positions before it
        aux = self.aux.get(key, {})
        for p in [p for p in aux if p >= pending]:  # rejected positions' features (computed, not kept)
            del aux[p]
        kv, done = self.cache.get(key, (None, 0))
        if kv is None:
            empty = torch.empty(self.head.kv, 0, self.head.head_dim, device=self.target.device, dtype=self.target.dtype)
            kv = [empty, empty]
        positions = [p for p in sorted(aux) if done <= p < pending]
        if not positions:
            return []
        ids = torch.tensor([[max(int(history[p + 1]), 0) for p in positions]])
        embeds = self.target.embed(ids, [])[0]
        hidden = self.head.fc(torch.stack([aux.pop(p) for p in positions]))
        logits, h = self.head.step(embeds, hidden, positions, kv)
        self.cache[key] = (list(kv), pending)  # the drafted positions below extend `kv` only
        out: list[int] = []
        for j in range(k):
            token = int(torch.argmax(logits[-1]))
            token += int(self.head.d2t[token])
            if token >= self.vocab:
                break
            out.append(token)
            if j + 1 < k:
                logits, h = self.head.step(self.target.embed(torch.tensor([[token]]), [])[0], h[-1:],
                                           [pending + j], kv)
        return out
