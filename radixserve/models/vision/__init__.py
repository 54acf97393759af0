"""Vision encoders and projectors for multimodal models (LLaVA-1.5: CLIP ViT tower + MLP projector).

Plain torch modules: no engine plumbing here, so they can be tested against transformers in isolation."""
