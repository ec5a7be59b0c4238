"""Token trees for tree verification: static shapes (`shape.py`), per-row trees in jit (`tree.py`),
builders from a drafter's per-position distributions (`builders.py`: static, best-first, top-k), and
verification with the accepted path's commit (`verify.py`)."""
