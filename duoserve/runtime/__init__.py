"""Stage 5: model + predictor -> dual-phase offload inference. Not built yet."""
