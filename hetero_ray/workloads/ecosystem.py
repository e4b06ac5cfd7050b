"""Models from the ecosystem as workloads by name: Hugging Face transformers' GPT-2, Llama, BERT and ResNet.

Each is built from a config, never from a checkpoint: no weights, tokenizer or anything else comes from
the hub, so they run offline. The language models read the standard library's bytes as ``gpt`` does
(vocabulary 256); the ResNet classifies seeded synthetic images. Dropout is off so runs are deterministic.

``cut_points`` finds where any of them, or a plain ``nn.Sequential``, can be cut into pipeline layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hetero_ray.suggest import did_you_mean
from hetero_ray.workloads.base import Layered, Workload
from hetero_ray.workloads.cnn import CLASSES, QuadrantImages
from hetero_ray.workloads.gpt import ByteWindows, byte_cross_entropy, stdlib_corpus

try:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ResNetConfig,
        ResNetForImageClassification,
    )
except ImportError as exc:  # the message build_workload shows for these names
    raise ImportError(f"{exc}; the ecosystem workloads need: pip install 'hetero-ray[models]'") from exc

Tensor = torch.Tensor

# Settings every Hugging Face model here is built with.
HF_SETTINGS: dict[str, Any] = {
    # Pipeline layers pass no attention mask: SDPA then applies the causal mask itself (is_causal) for
    # decoders and none for BERT. Other implementations read a missing mask as "attend everywhere".
    "attn_implementation": "sdpa",
    # Tied input and output embeddings would be one parameter in the first and the last pipeline layer,
    # on two stages whose gradients nobody sums; untied, each stage owns what it updates.
    "tie_word_embeddings": False,
    # Training recomputes every position: a key/value cache would only hold memory.
    "use_cache": False,
}


def _hidden(output: Tensor | tuple[Tensor, ...]) -> Tensor:
    """The hidden state a block returns: transformers 4.x blocks return it first in a tuple, 5.x alone."""
    return output[0] if isinstance(output, tuple) else output


def _call(model: nn.Module, block: nn.Module, hidden: Tensor) -> Tensor:
    """A block that needs nothing beyond the hidden state (GPT-2's, BERT's, ResNet's, a Sequential's)."""
    return _hidden(block(hidden))


def _nothing_shared(model: nn.Module) -> list[nn.Module]:
    return []


@dataclass(frozen=True)
class Family:
    """How a family of models runs around its blocks: the only per-family code of a cut.

    ``embed(model, inputs)`` runs what is registered before the blocks and ``head(model, hidden)`` what
    is registered after them (``None``: nothing is); ``block(model, block, hidden)`` runs one block.
    ``shared(model)`` lists parameterless modules every block uses (Llama's rotary embedding): each
    block's layer holds them too, so they move to the block's device with it.
    """

    embed: Callable[[nn.Module, Tensor], Tensor] | None = None
    head: Callable[[nn.Module, Tensor], Tensor] | None = None
    block: Callable[[nn.Module, nn.Module, Tensor], Tensor] = _call
    shared: Callable[[nn.Module], list[nn.Module]] = _nothing_shared


class Piece(nn.Module):
    """One pipeline layer: ``run`` on one tensor, holding the model's own modules it runs (shared, not copied),
    so that its ``parameters()`` are theirs and ``.to(device)`` moves them."""

    def __init__(self, run: Callable[[Tensor], Tensor], holds: Sequence[nn.Module]):
        super().__init__()
        self.run = run
        self.holds = nn.ModuleList(holds)

    def forward(self, x: Tensor) -> Tensor:
        return self.run(x)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks a pipeline may cut between: an ``nn.Sequential``'s children, otherwise the
    children of the model's longest ``nn.ModuleList``, which is where transformers keeps a model's decoder
    or encoder layers (and a ResNet's stages)."""
    if isinstance(model, nn.Sequential):
        blocks = list(model)
    else:
        blocks = list(max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=[]))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no blocks to cut between: no nn.Sequential or nn.ModuleList")
    return blocks


def _outside(module: nn.Module, blocks: set[int]) -> list[nn.Module]:
    """The blocks and the largest subtrees holding none, in registration order."""
    found = []
    for child in module.children():
        if id(child) in blocks or not any(id(m) in blocks for m in child.modules()):
            found.append(child)
        else:
            found.extend(_outside(child, blocks))
    return found


# A stack whose blocks take and return the tensor and that holds nothing else: an nn.Sequential.
SEQUENTIAL = Family()


def cut_points(model: nn.Module, family: Family = SEQUENTIAL) -> list[nn.Module]:
    """``model`` as pipeline layers, each taking and returning one tensor: the modules registered before
    its blocks (run by ``family.embed``), each block, and the modules registered after (``family.head``).

    The layers hold the model's own modules, each once, so their parameters are the model's.
    """
    blocks = find_blocks(model)
    shared = family.shared(model)
    order = [m for m in _outside(model, {id(b) for b in blocks}) if all(m is not s for s in shared)]
    first, last = order.index(blocks[0]), order.index(blocks[-1])
    before, after = order[:first], order[last + 1 :]
    if (before and family.embed is None) or (after and family.head is None):
        raise ValueError(f"{type(model).__name__} has modules around its blocks that its family does not run")
    layers: list[nn.Module] = [Piece(partial(family.block, model, b), [b, *shared]) for b in blocks]
    if family.embed is not None:
        layers.insert(0, Piece(partial(family.embed, model), before))
    if family.head is not None:
        layers.append(Piece(partial(family.head, model), after))
    return layers


def _positions(hidden: Tensor) -> Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)


def _gpt2_embed(model: nn.Module, ids: Tensor) -> Tensor:
    t = model.transformer
    return t.drop(t.wte(ids) + t.wpe(_positions(ids)))


def _llama_block(model: nn.Module, block: nn.Module, hidden: Tensor) -> Tensor:
    # Rotary angles depend on positions only: each block recomputes them rather than receive a second tensor.
    positions = _positions(hidden)
    rotary = model.model.rotary_emb(hidden, positions)
    return _hidden(block(hidden, position_embeddings=rotary, position_ids=positions))


GPT2 = Family(embed=_gpt2_embed, head=lambda m, x: m.lm_head(m.transformer.ln_f(x)))
LLAMA = Family(
    embed=lambda m, ids: m.model.embed_tokens(ids),
    head=lambda m, x: m.lm_head(m.model.norm(x)),
    block=_llama_block,
    shared=lambda m: [m.model.rotary_emb],
)
BERT = Family(embed=lambda m, ids: m.bert.embeddings(input_ids=ids), head=lambda m, x: m.cls(x))
RESNET = Family(embed=lambda m, x: m.resnet.embedder(x), head=lambda m, x: m.classifier(m.resnet.pooler(x)))


def _workload(
    model: nn.Module, family: Family, dataset: Dataset, output_loss: Callable[[Tensor, Tensor], Tensor]
) -> Workload:
    """A transformers model on (input, target) batches, cut by ``family``, scored by ``output_loss``.

    Its loss runs the layers one after another rather than transformers' own forward, which equals it
    (tested) but reads the values of the position ids (packed sequences): the meta device that sizes a
    workload has none.
    """
    layered = Layered(
        layers=partial(cut_points, family=family),
        inputs=itemgetter(0),
        targets=itemgetter(1),
        output_loss=output_loss,
    )

    def loss_fn(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x = layered.inputs(batch)
        for layer in layered.layers(m):
            x = layer(x)
        return layered.output_loss(x, layered.targets(batch))

    return Workload(model=model, loss_fn=loss_fn, dataset=dataset, layered=layered)


def _check_sizes(n_embd: int, n_head: int, vocab_size: int, least_vocab: int) -> None:
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    if vocab_size < least_vocab:
        raise ValueError(f"vocab_size: {vocab_size} is fewer than the {least_vocab} byte tokens; use at least that")


def gpt2(
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    vocab_size: int = 256,
    corpus_bytes: int = 1_000_000,
) -> Workload:
    """transformers' GPT-2 of the given size predicting the next byte of the standard library's sources."""
    _check_sizes(n_embd, n_head, vocab_size, 256)
    config = GPT2Config(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=block_size,
        vocab_size=vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # Its defaults name GPT-2's own tokenizer's ids, outside a byte vocabulary; nothing here generates.
        bos_token_id=None,
        eos_token_id=None,
        **HF_SETTINGS,
    )
    dataset = ByteWindows(stdlib_corpus(corpus_bytes), block_size)
    return _workload(GPT2LMHeadModel(config), GPT2, dataset, byte_cross_entropy)


def llama(
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    vocab_size: int = 256,
    corpus_bytes: int = 1_000_000,
) -> Workload:
    """transformers' Llama of the given size (MLP 4 × ``n_embd``, one key/value head per query head)
    predicting the next byte of the standard library's sources."""
    _check_sizes(n_embd, n_head, vocab_size, 256)
    config = LlamaConfig(
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        max_position_embeddings=block_size,
        vocab_size=vocab_size,
        attention_dropout=0.0,
        **HF_SETTINGS,
    )
    dataset = ByteWindows(stdlib_corpus(corpus_bytes), block_size)
    return _workload(LlamaForCausalLM(config), LLAMA, dataset, byte_cross_entropy)


class MaskedBytes(Dataset):
    """Masked-byte windows for BERT: every ``mask_every``-th byte of a window, from offset ``i % mask_every``
    in window ``i``, becomes ``mask_id``; the target is the original byte there and -100 (ignored) elsewhere.

    Deterministic without a generator, and each window masks the same number of bytes (``block_size`` is a
    multiple of ``mask_every``), so the mean over a batch's masked bytes is the mean of its samples' losses.
    """

    def __init__(self, windows: ByteWindows, mask_every: int, mask_id: int):
        self.windows, self.mask_every, self.mask_id = windows, mask_every, mask_id

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        tokens = self.windows[i][0]
        masked = (torch.arange(len(tokens)) + i) % self.mask_every == 0
        return tokens.masked_fill(masked, self.mask_id), tokens.masked_fill(~masked, -100)


def bert(
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    vocab_size: int = 257,
    mask_every: int = 8,
    corpus_bytes: int = 1_000_000,
) -> Workload:
    """transformers' BERT of the given size as a masked language model on the standard library's bytes
    (``MaskedBytes``; token 256 is the mask, so the vocabulary is 257 bytes at least)."""
    _check_sizes(n_embd, n_head, vocab_size, 257)
    if mask_every < 1 or block_size % mask_every:
        raise ValueError(f"mask_every: {mask_every} must divide block_size ({block_size})")
    config = BertConfig(
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        max_position_embeddings=block_size,
        vocab_size=vocab_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **HF_SETTINGS,
    )
    dataset = MaskedBytes(ByteWindows(stdlib_corpus(corpus_bytes), block_size), mask_every, mask_id=256)
    model = BertForMaskedLM(config)
    # transformers 5 ties all of _tied_weights_keys or none: untying the embeddings left the output bias
    # apart from the one the decoder adds, and unused. Both are in the head, so tie them back.
    predictions = model.cls.predictions
    predictions.decoder.bias = predictions.bias
    return _workload(model, BERT, dataset, byte_cross_entropy)


# torchvision's ResNets as transformers configures them (the microsoft/resnet-* checkpoints' configs).
RESNET_ARCHS = {
    "resnet18": ("basic", [2, 2, 2, 2]),
    "resnet34": ("basic", [3, 4, 6, 3]),
    "resnet50": ("bottleneck", [3, 4, 6, 3]),
    "resnet101": ("bottleneck", [3, 4, 23, 3]),
    "resnet152": ("bottleneck", [3, 8, 36, 3]),
}
NORMS = ("batch", "group")
# Channel counts of every ResNet are multiples of 32, the group count of Wu and He's GroupNorm paper.
GROUPS = 32


def _group_norm(model: nn.Module) -> None:
    """Replace each ``BatchNorm2d`` by a ``GroupNorm`` over the same channels, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, nn.GroupNorm(GROUPS, child.num_features))


def resnet(
    *,
    arch: str = "resnet18",
    image_size: int = 32,
    num_classes: int = CLASSES,
    samples: int = 4096,
    norm: str = "batch",
) -> Workload:
    """transformers' ResNet ``arch`` classifying seeded 3-channel ``QuadrantImages`` (4 classes; a larger
    ``num_classes`` only widens the classifier).

    ``norm="group"`` replaces BatchNorm, whose statistics couple a batch's samples, by GroupNorm: only
    then may the model be pipelined. Cut into the stem, the four stages and the classifier.
    """
    if arch not in RESNET_ARCHS:
        raise ValueError(
            f"arch: unknown '{arch}'{did_you_mean(arch, RESNET_ARCHS)}; use one of {', '.join(RESNET_ARCHS)}"
        )
    if norm not in NORMS:
        raise ValueError(f"norm: unknown '{norm}'{did_you_mean(norm, NORMS)}; use one of {', '.join(NORMS)}")
    if num_classes < CLASSES:
        raise ValueError(f"num_classes: {num_classes} is fewer than the images' {CLASSES} classes")
    layer_type, depths = RESNET_ARCHS[arch]
    widths = [64, 128, 256, 512] if layer_type == "basic" else [256, 512, 1024, 2048]
    config = ResNetConfig(layer_type=layer_type, depths=depths, hidden_sizes=widths, num_labels=num_classes)
    model = ResNetForImageClassification(config)
    if norm == "group":
        _group_norm(model)
    return _workload(model, RESNET, QuadrantImages(samples, image_size, channels=3), F.cross_entropy)
