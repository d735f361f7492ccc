"""SGLang servers as the rollout engine: `engine.py`, `server.py`, `http_client.py`, `weight_transfer.py`."""
