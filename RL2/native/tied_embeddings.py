"""A tied input embedding's gradient added into the output projection's, only at the batch's tokens.

With tied weights autograd sums two `[vocabulary, hidden]` gradients into the one weight: the output
projection's, dense, and the input embedding's, which only the batch's tokens' rows have. torch's dense
embedding backward writes those rows into a zeroed weight-sized tensor, then autograd adds the two into
a third: passes over often fresh memory, which on CPU page-faults too. With a sparse embedding gradient
autograd adds just the batch's rows into the projection's; the weight's gradient is dense as before, so
sharding, clipping and the optimizer see no difference. That holds only where the projection's gradient
always comes too (a loss through the logits): a sparse gradient alone would reach FSDP and the optimizer,
which take dense ones only; hence the conditions of `add_embedding_rows_into_tied_gradient`.
"""

import torch


def add_embedding_rows_into_tied_gradient(model: torch.nn.Module) -> bool:
    """Make a causal LM's tied input embedding produce sparse gradients; False (nothing changed) where
    the embedding is not an `nn.Embedding` tied to the output projection."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()  # outputs: None without a head
    if not isinstance(inputs, torch.nn.Embedding) or inputs.weight is not getattr(outputs, "weight", None):
        return False
    inputs.sparse = True
    return True
