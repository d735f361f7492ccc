"""Pure tensor functions of the algorithms: advantages, policy and value losses, loss averaging, KL
estimators, preference losses and reward shaping. Each cites its paper and states its shapes."""
