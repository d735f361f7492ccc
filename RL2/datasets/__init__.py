"""From rows on disk to tokenized examples: loading any table, tokenizing each trainer's rows with a
loss mask, train/test splits and the epoch order (packing them into micro-batches: `RL2.packing`)."""
