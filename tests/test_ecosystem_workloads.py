"""Ecosystem workloads (transformers' GPT-2, Llama, BERT, ResNet) and the cut that makes them pipeline layers."""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from hetero_ray.perf.footprint import measure_footprint
from hetero_ray.workloads import Layered, Workload, WorkloadError, build_workload
from hetero_ray.workloads.ecosystem import cut_points
from hetero_ray.workloads.gpt import ByteWindows

LANGUAGE = {"n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 16, "corpus_bytes": 4096}
GROUP_RESNET = {"arch": "resnet18", "image_size": 16, "samples": 8, "norm": "group"}


def sequential() -> Workload:
    """A plain nn.Sequential regression, cut between its children."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return Workload(
        model=model,
        loss_fn=lambda m, batch: F.mse_loss(m(batch[0]), batch[1]),
        dataset=TensorDataset(torch.randn(8, 8), torch.randn(8, 4)),
        layered=Layered(layers=cut_points, inputs=itemgetter(0), targets=itemgetter(1), output_loss=F.mse_loss),
    )


def by_name(name: str, options: dict) -> Callable[[], Workload]:
    return lambda: build_workload(name, options)


# name: (factory, layers the structure gives: embedding + decoder/encoder layers + head, stem + 4 stages + classifier)
CASES = {
    "hf-gpt2": (by_name("hf-gpt2", LANGUAGE), 3 + 2),
    "hf-llama": (by_name("hf-llama", LANGUAGE), 3 + 2),
    "hf-bert": (by_name("hf-bert", LANGUAGE), 3 + 2),
    "resnet": (by_name("resnet", GROUP_RESNET), 1 + 4 + 1),
    "sequential": (sequential, 3),
}


def own_loss(workload: Workload, batch) -> torch.Tensor:
    """The model's own forward (transformers' for the ecosystem models) scored like the layers' output."""
    output = workload.model(batch[0])
    return workload.layered.output_loss(getattr(output, "logits", output), batch[1])


def composed(workload: Workload, x: torch.Tensor) -> torch.Tensor:
    for layer in workload.layered.layers(workload.model):
        x = layer(x)
    return x


def composed_loss(workload: Workload, batch) -> torch.Tensor:
    layered = workload.layered
    return layered.output_loss(composed(workload, layered.inputs(batch)), layered.targets(batch))


def loss_and_grads(workload: Workload, run: Callable[[], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    workload.model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in workload.model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_the_layers_compute_the_model(case: str) -> None:
    factory, n_layers = CASES[case]
    torch.manual_seed(0)
    workload = factory()
    layers = workload.layered.layers(workload.model)
    assert len(layers) == n_layers
    # The layers hold the model's own parameters, each once: no copies, no tie across layers.
    held = sorted(id(p) for layer in layers for p in layer.parameters())
    assert held == sorted(id(p) for p in workload.model.parameters())

    batch = default_collate([workload.dataset[i] for i in range(3)])
    expected, expected_grads = loss_and_grads(workload, lambda: own_loss(workload, batch))
    for run in (lambda: composed_loss(workload, batch), lambda: workload.loss_fn(workload.model, batch)):
        loss, grads = loss_and_grads(workload, run)
        assert loss == pytest.approx(expected, abs=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(("name", "causal"), [("hf-gpt2", True), ("hf-llama", True), ("hf-bert", False)])
def test_the_layers_attend_as_the_model_does(name: str, causal: bool) -> None:
    workload = build_workload(name, LANGUAGE)
    ids = workload.dataset[0][0][None]  # (1, T)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():
        before, after = composed(workload, ids), composed(workload, changed)
    # A decoder's earlier positions never see a later byte; BERT's see every byte.
    assert torch.equal(before[0, :-1], after[0, :-1]) == causal


@pytest.mark.parametrize("case", CASES)
def test_footprint_on_meta_sizes_every_layer(case: str) -> None:
    factory, n_layers = CASES[case]
    fp = measure_footprint(factory)
    params = sum(p.numel() for p in factory().model.parameters())
    assert len(fp.layers) == n_layers
    assert fp.param_count == sum(layer.params for layer in fp.layers) == params
    assert fp.flops_per_sample > 0


def test_batch_norm_resnet_is_batch_coupled_and_group_norm_is_not() -> None:
    batch_norm = measure_footprint(by_name("resnet", {**GROUP_RESNET, "norm": "batch"}))
    assert batch_norm.batch_coupled and all("BatchNorm2d" in name for name in batch_norm.batch_coupled)
    assert measure_footprint(by_name("resnet", GROUP_RESNET)).batch_coupled == ()


def test_bert_masks_every_kth_byte_and_scores_only_those() -> None:
    workload = build_workload("hf-bert", {**LANGUAGE, "mask_every": 4})
    windows = workload.dataset.windows
    assert isinstance(windows, ByteWindows)
    for i in range(3):
        inputs, targets = workload.dataset[i]
        masked = inputs == 256
        assert int(masked.sum()) == 16 // 4
        assert torch.equal(masked, (torch.arange(16) + i) % 4 == 0)
        assert torch.equal(targets[masked], windows[i][0][masked]) and bool((targets[~masked] == -100).all())


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("resnet", {"arch": "resnet7"}, "arch: unknown 'resnet7'.*use one of resnet18, resnet34, resnet50"),
        ("resnet", {"norm": "foo"}, "norm: unknown 'foo'; use one of batch, group"),
        ("resnet", {"num_classes": 2}, "num_classes: 2 is fewer than the images' 4 classes"),
        ("hf-gpt2", {"n_layers": 2}, "n_layers: unknown option \\(did you mean 'n_layer'\\?\\)"),
        ("hf-llama", {"n_embd": 30}, "n_embd \\(30\\) must be a multiple of n_head \\(4\\)"),
        ("hf-bert", {"mask_every": 5}, "mask_every: 5 must divide block_size \\(64\\)"),
        ("hf-bert", {"vocab_size": 256}, "vocab_size: 256 is fewer than the 257 byte tokens"),
    ],
)
def test_bad_options_are_one_clear_line(name: str, options: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as exc:
        build_workload(name, options)
    assert "\n" not in str(exc.value)


def test_a_model_without_blocks_is_refused() -> None:
    for model in (nn.Linear(2, 2), nn.Sequential()):
        with pytest.raises(ValueError, match="has no blocks to cut between"):
            cut_points(model)
