"""Stage 2: traces -> popularity, affinity, training examples."""
