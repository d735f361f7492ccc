"""From rows on disk to packed micro-batches: loading any table, tokenizing each trainer's rows with a
loss mask, train/test splits and the epoch order, and balanced packing."""
