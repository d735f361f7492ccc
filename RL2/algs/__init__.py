"""Pure tensor functions of the algorithms, each citing its paper and stating its shapes."""
