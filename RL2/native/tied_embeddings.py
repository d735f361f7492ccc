"""A tied input embedding's gradient added into the output projection's, only at the batch's tokens, instead of
through a zeroed weight-sized tensor and a third one for the sum (docs/cpu.md, "Tied embeddings"). The weight's
gradient stays dense, so sharding, clipping and the optimizer see no difference."""

import torch


def add_embedding_rows_into_tied_gradient(model: torch.nn.Module) -> bool:
    """Sparse gradients for a tied `nn.Embedding` input; False (nothing changed) elsewhere. Only for a loss through the
    logits: a sparse gradient without the projection's would reach FSDP and the optimizer, which take dense ones."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()  # outputs: None without a head
    if not isinstance(inputs, torch.nn.Embedding) or inputs.weight is not getattr(outputs, "weight", None):
        return False
    inputs.sparse = True
    return True
