"""Stage 4: traces + predictor -> accuracy report. Not built yet."""
