"""Stage 3: examples -> predictor (Lightning), exported as a self-contained artifact (``duoserve.predictor``)."""
