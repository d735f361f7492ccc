"""SGLang servers as the rollout engine: launch and control (`engine.py`, `server.py`), requests
(`http_client.py`) and weight transfer (`weight_transfer.py`)."""
