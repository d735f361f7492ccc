"""Activation checkpointing of every decoder layer or every n-th: the gradients of a model that keeps
everything, less memory kept for the backward the more layers recompute, and the switch's wiring."""

import warnings

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from RL2.config import ConfigError, parse_config
from RL2.config.schema import ModelConfig, SFTConfig
from RL2.models.checkpointing import enable_activation_checkpointing
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker
from tests.helpers.tiny import make_tiny_model

LAYERS = 4


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def loss_grads_and_kept_bytes(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The loss, its gradients and the bytes autograd keeps for the backward outside checkpointed layers
    (a checkpointed layer keeps its tensors through its own hooks, which take precedence over these)."""
    kept = 0

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], kept


def test_every_n_th_layer_recomputes_and_the_gradients_stay_those_of_the_whole_graph():
    reference_loss, reference_grads, kept_without = loss_grads_and_kept_bytes(llama())
    kept = {}
    for every in (1, 2, 3):
        model = llama()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the switch's current name, not the deprecated one
            enable_activation_checkpointing(model, every)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [i % every == 0 for i in range(LAYERS)]
        loss, grads, kept[every] = loss_grads_and_kept_bytes(model)
        assert torch.equal(loss, reference_loss)
        for grad, expected in zip(grads, reference_grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    # 4 layers: all of them recompute, then 2 (layers 0 and 2), then 2 (layers 0 and 3), then none.
    assert kept[1] < kept[2] == kept[3] < kept_without
    # Each layer keeps the same activations: two checkpointed layers save half of what four do.
    assert kept_without - kept[2] == pytest.approx((kept_without - kept[1]) / 2, rel=0.02)


def test_the_worker_checkpoints_every_n_th_layer_with_the_gradients_of_no_checkpointing(tmp_path, one_rank):
    path = make_tiny_model(tmp_path / "model", layers=LAYERS)

    def gradients(**overrides) -> tuple[list[bool], list[torch.Tensor]]:
        cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"model_name": path, "dtype": "float32"} | overrides)
        w = FSDPWorker(cfg, ParallelDims(1), torch.device("cpu"), total_steps=1)
        flags = [layer.gradient_checkpointing for layer in w.model.model.layers]
        ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(2))
        w.backward(w.model(input_ids=ids, labels=ids).loss)
        return flags, [p.grad.full_tensor().clone() for p in w.model.parameters()]

    flags, expected = gradients()
    assert not any(flags)
    flags, grads = gradients(enable_gradient_checkpointing=True, checkpoint_every_n_layers=2)
    assert flags == [True, False, True, False]
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-7)


def test_checkpoint_every_n_layers_below_one_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"actor.checkpoint_every_n_layers=0; set 1 to recompute every decoder layer"):
        parse_config(SFTConfig, "sft", ["actor.checkpoint_every_n_layers=0"])
