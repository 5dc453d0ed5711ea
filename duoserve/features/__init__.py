"""Stage 2: traces -> popularity, affinity, training examples (plain numpy and torch, no Lightning)."""
