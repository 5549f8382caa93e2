"""LoRA adapters: PEFT files read and checked (adapter.py), held in an LRU (manager.py), and applied to a
step's rows grouped by adapter (batch.py)."""
