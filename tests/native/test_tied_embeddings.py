"""A tied embedding's rows added into the output projection's gradient: the same dense gradient as
torch's dense embedding backward, where the conditions hold, and nothing changed elsewhere."""

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from RL2.batch import SequenceBatch
from RL2.models.chunked_logps import token_logps
from RL2.models.logps import packed_logps
from RL2.native.tied_embeddings import add_embedding_rows_into_tied_gradient
from RL2.packing import pack, train_weights
from tests.helpers.tiny import make_tiny_qwen
from tests.unit.test_fsdp_worker import examples, local, worker


def gradients(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits[0, :-1]
    # Repeated tokens: rows of the embedding's gradient that sum several positions.
    (token_logps(logits, ids[0, 1:]) * torch.linspace(-1, 1, ids.shape[1] - 1)).sum().backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_tied_gradient_equals_the_dense_embedding_backward(tiny_model_path):
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    expected = gradients(model, ids)
    assert add_embedding_rows_into_tied_gradient(model) and model.get_input_embeddings().sparse
    got = gradients(model, ids)
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert grad.layout == torch.strided and grad.is_contiguous(), name
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-12, msg=name)


def test_untied_or_headless_models_are_left_alone(tiny_model_path, tmp_path):
    untied = AutoModelForCausalLM.from_pretrained(make_tiny_qwen(tmp_path / "qwen"), dtype=torch.float32)
    assert not add_embedding_rows_into_tied_gradient(untied) and not untied.get_input_embeddings().sparse
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    assert not add_embedding_rows_into_tied_gradient(critic) and not critic.get_input_embeddings().sparse


def test_fsdp_worker_gradient_of_the_tied_weight_equals_plain_torch(tiny_model_path, one_rank):
    """The trained worker's tied weight (sharded by FSDP) gets the gradient of a plain HF model with torch's
    dense embedding backward, on the same packed batch."""
    w = worker(tiny_model_path)
    assert w.model.get_input_embeddings().sparse
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = SequenceBatch.from_examples(examples())
    for mb in pack(batch, 0, 1, 4096, train_weights(batch, "token")):
        w.backward(-(packed_logps(w.model, mb) * mb.loss_weights).sum())
        for example, weight, mask in zip(examples(), mb.unpack(mb.loss_weights), mb.unpack(mb.loss_mask)):
            ids = torch.tensor([example["input_ids"]])
            lp = torch.log_softmax(reference(input_ids=ids[:, :-1]).logits[0].float(), -1)
            (-(lp.gather(-1, ids[0, 1:, None])[:, 0] * mask * weight).sum()).backward()
    grad = local(w.model.get_input_embeddings().weight.grad)
    assert grad.layout == torch.strided
    torch.testing.assert_close(grad, reference.get_input_embeddings().weight.grad, atol=1e-6, rtol=1e-5)
