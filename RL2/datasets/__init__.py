"""From rows on disk to tokenized examples with a loss mask, train/test splits and the epoch order."""
