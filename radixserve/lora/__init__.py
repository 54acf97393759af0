"""LoRA adapters served beside one base model: loading (PEFT format), the in-memory LRU, the per-step
batch of adapter rows and the delta each targeted projection adds (see lora_batch.py)."""
