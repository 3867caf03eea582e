"""Paged KV cache: ``block_manager`` (plain Python bookkeeping) and ``kv_pool`` (the torch tensors).

Import the modules directly; this package imports nothing so the scheduler stays free of torch.
"""
