"""Compressed weight formats: LH12 (lossless 12-bit bf16, `lh12`) and the `.w12` model container."""
