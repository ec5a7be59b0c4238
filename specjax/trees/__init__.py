"""Token trees for tree verification: static shapes (`shape.py`), their tokens from a drafter's
per-position distributions, and greedy verification with the accepted path's commit (`verify.py`)."""
