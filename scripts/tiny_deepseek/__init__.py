"""Helpers of ``scripts/train_tiny_deepseek.py``: the offline corpus, the MTP module, configs and export."""
