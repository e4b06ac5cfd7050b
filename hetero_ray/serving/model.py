"""A trained model back from a hetero-ray checkpoint, and its next-token answers. Imports torch, never Ray.

A checkpoint written by the training loop (``train/loop.py::_report``) holds the weights (``model.pt``), the
optimiser state, and ``state.json`` whose plan names the workload it trained (``{"name", "options"}``): that
name and those options rebuild the very module the weights belong to, so a checkpoint is served with nothing
but its directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetero_ray.train.checkpoint import MODEL_FILE, STATE_FILE, CorruptCheckpoint, verify
from hetero_ray.workloads.base import Workload, WorkloadError, build_workload

BYTE_VOCAB = 256


class ServeError(ValueError):
    """A checkpoint, workload, request or cluster that cannot be served; the message is one line."""


def _load(path: str | Path) -> tuple[Workload, dict, int]:
    directory = Path(path)
    if not directory.is_dir():
        raise ServeError(f"--checkpoint: {directory} is not a checkpoint directory (no such directory)")
    try:
        manifest = verify(directory)
    except CorruptCheckpoint as exc:
        raise ServeError(f"--checkpoint: {exc}") from None
    missing = [n for n in (MODEL_FILE, STATE_FILE) if n not in manifest.files]
    if missing:
        raise ServeError(f"--checkpoint: {directory} holds no {missing[0]}; not a hetero-ray training checkpoint")
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        workload = (state.get("plan") or {}).get("workload")
    except (ValueError, AttributeError) as exc:
        raise ServeError(f"--checkpoint: {directory / STATE_FILE}: unreadable ({exc})") from None
    if not isinstance(workload, Mapping) or not isinstance(workload.get("name"), str):
        raise ServeError(
            f"--checkpoint: {directory / STATE_FILE}: its plan names no workload (a checkpoint from before plans "
            "kept it), so the model it holds cannot be rebuilt"
        )
    spec = {"name": workload["name"], "options": dict(workload.get("options") or {})}
    try:
        built = build_workload(spec["name"], spec["options"])
    except WorkloadError as exc:
        raise ServeError(f"--checkpoint: {exc}") from None
    try:
        weights = torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True)
        built.model.load_state_dict(weights)
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ServeError(
            f"--checkpoint: {directory / MODEL_FILE} does not fit workload {spec['name']!r}: {first}"
        ) from None
    built.model.eval()
    return built, spec, manifest.step


def load_checkpoint_model(path: str | Path) -> tuple[torch.nn.Module, dict, int]:
    """(model in eval mode, its workload ``{"name", "options"}``, the step it was saved at) from a verified
    checkpoint directory; ``ServeError`` (one line) for a bad path, a damaged checkpoint or one whose plan names
    no workload."""
    built, spec, step = _load(path)
    return built.model, spec, step


@dataclass(frozen=True)
class Answer:
    """The most likely next token after a request's tokens, and its probability."""

    token: int
    probability: float


class Predictor:
    """Next-token answers of a model mapping (B, T) int64 token ids to (B, T, V) logits.

    ``context`` is the longest sequence the model takes (the length of its training inputs); a longer request
    keeps its last ``context`` tokens (left truncation), as generation with a fixed window does.
    """

    def __init__(self, model: torch.nn.Module, workload: dict, step: int, *, context: int, vocab: int):
        self.model, self.workload, self.step = model, workload, step
        self.context, self.vocab = context, vocab
        self.device = next(model.parameters()).device

    @property
    def byte_level(self) -> bool:
        return self.vocab == BYTE_VOCAB

    def tokens(self, body: Any) -> list[int]:
        """A request body's tokens: ``{"text": str}`` (byte-level models: its UTF-8 bytes) or ``{"tokens": [int]}``;
        ``ServeError`` naming what is wrong otherwise."""
        if not isinstance(body, Mapping) or ("text" in body) == ("tokens" in body):
            raise ServeError('send a JSON object with either "text" (a string) or "tokens" (a list of token ids)')
        if "text" in body:
            if not isinstance(body["text"], str):
                raise ServeError('"text" must be a string')
            if not self.byte_level:
                raise ServeError(
                    f'"text" needs a byte-level model (vocabulary 256); this one has {self.vocab}: send "tokens"'
                )
            tokens = list(body["text"].encode("utf-8"))
        else:
            tokens = body["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ServeError('"tokens" must be a list of integers')
            bad = [t for t in tokens if not 0 <= t < self.vocab]
            if bad:
                raise ServeError(f'"tokens": {bad[0]} is outside the vocabulary [0, {self.vocab})')
        if not tokens:
            raise ServeError("an empty request has no next token: send at least one token (or character)")
        return tokens

    @torch.inference_mode()
    def predict(self, requests: Sequence[Sequence[int]]) -> list[Answer]:
        """The answer to each request, in order, from batched forwards.

        Requests are grouped by their (truncated) length and each group runs as one (B, T) batch: no padding
        enters any row, so a request's answer is the one it gets alone, whatever it is batched with (a causal
        model would allow right-padding, but not every (B, T) → (B, T, V) model is causal).
        """
        windows = [list(r)[-self.context :] for r in requests]
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            groups.setdefault(len(w), []).append(i)
        answers: list[Answer | None] = [None] * len(windows)
        for rows in groups.values():
            batch = torch.tensor([windows[i] for i in rows], dtype=torch.long, device=self.device)
            probs = torch.softmax(self.model(batch)[:, -1, :].float(), dim=-1)
            best = probs.max(dim=-1)
            for j, i in enumerate(rows):
                answers[i] = Answer(token=int(best.indices[j]), probability=float(best.values[j]))
        return answers  # type: ignore[return-value]


def _context_length(built: Workload, name: str) -> int:
    """The training input length of a token workload: its dataset's first sample (a 1-D integer tensor, or a tuple
    whose first item is one)."""
    try:
        sample = built.dataset[0]
    except (IndexError, KeyError, TypeError) as exc:
        raise ServeError(f"workload {name!r}: its dataset gives no sample to size requests by ({exc})") from None
    x = sample[0] if isinstance(sample, (tuple, list)) else sample
    if not (isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point() and len(x) > 0):
        kind = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ServeError(
            f"workload {name!r}: serving answers next-token requests, for models that map (B, T) token ids to "
            f"(B, T, V) logits; its inputs are {kind}, not token ids"
        )
    return len(x)


def load_predictor(path: str | Path, device: str | torch.device = "cpu") -> Predictor:
    """A ``Predictor`` for the checkpoint at ``path``; ``ServeError`` if its model is not a next-token model."""
    built, spec, step = _load(path)
    context = _context_length(built, spec["name"])
    model = built.model.to(device)
    probe = torch.zeros((1, context), dtype=torch.long, device=device)
    try:
        with torch.inference_mode():
            out = model(probe)
    except Exception as exc:  # any failure means: not a token model
        raise ServeError(f"workload {spec['name']!r}: its model does not take (B, T) token ids ({exc})") from None
    if not (isinstance(out, torch.Tensor) and out.dim() == 3 and tuple(out.shape[:2]) == (1, context)):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ServeError(
            f"workload {spec['name']!r}: serving needs a model mapping (B, T) token ids to (B, T, V) logits; "
            f"for (1, {context}) it returns {shape}"
        )
    return Predictor(model, spec, step, context=context, vocab=int(out.shape[-1]))
