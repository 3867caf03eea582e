"""Vision encoders and projectors of the multimodal families, and the image inputs they read.

  clip.py       llava-1.5: CLIP ViT (pre-layernorm, class embedding, quick_gelu) + the 2-layer projector
  qwen_vit.py   Qwen2.5-VL: Conv3d patch embedding, 2-D vision rope, window / full attention, patch merger
  inputs.py     images from paths, data: URLs and http(s) URLs, decoded with limits
  processor.py  the checkpoint's own image processor (transformers, PIL backend), placeholder expansion
  mrope.py      Qwen2.5-VL's three position streams (t, h, w) for the language model

Attention inside a tower is the runtime's varlen kernel with ``causal=False`` over per-image (llava) or
per-window (Qwen2.5-VL) segments, so ``--kernels reference`` swaps in its plain-torch twin as everywhere.
"""
